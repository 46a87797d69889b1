"""Gather codecs: a parameter group that all-gathers its weights in another encoding than the
compute dtype (FP8 weights with their scales, see ``mfsdp.float8``).

The runtime stays ignorant of the encoding. Before ``fully_shard``, a caller tags parameters with
a *spec* (``tag``); the group that ends up owning them asks the spec's class for a codec
(``codec_for``), and from then on:

* the unsharded buffer has the codec's ``wire_dtype``, and the compute parameters are what
  ``wrap`` builds over their gathered views (once; ``repoint`` moves them to another buffer);
* before the first gather, ``encode`` writes this rank's encoded shard straight into its block of
  the gather output (and may issue small collectives over the groups the shard is split over, e.g.
  an amax all-reduce);
* after the gather, ``decode`` finishes the compute parameters (e.g. attaches the scales).

Gradients are untouched: they arrive in the compute dtype as usual. A group gathers in one
encoding, so every parameter of a tagged group must carry a spec of the same class.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from mfsdp.mixed_precision import ResolvedDtypes
from mfsdp.runtime.registry import IdentityWeakMap


class GatherCodec:
    """What a group calls on its gather path; see the module docstring."""

    wire_dtype: torch.dtype

    def wrap(self, index: int, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        """The compute parameter for member ``index`` over ``view`` (its gathered bytes)."""
        raise NotImplementedError

    def repoint(self, param: nn.Parameter, view: torch.Tensor) -> None:
        """Make ``param`` (built by ``wrap``) read ``view`` from now on (a gather slot)."""
        raise NotImplementedError

    def encode(self, sources: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor], groups: Sequence,
               version: int) -> None:
        """Write the encoding of ``sources`` (this rank's 1-D member regions, split over ``groups``)
        into ``blocks`` (this rank's blocks of the gather output). ``version`` changes whenever
        the main weights change (their version counter)."""
        raise NotImplementedError

    def decode(self, params: Sequence[nn.Parameter]) -> None:
        """After the gather: finish the compute parameters."""
        raise NotImplementedError


class CodecSpec:
    """Per-parameter request for a codec; the class decides how a group's specs become one."""

    @classmethod
    def build(cls, specs: Sequence["CodecSpec"], dtypes: ResolvedDtypes, label: str) -> GatherCodec:
        raise NotImplementedError


# Parameter -> its spec. Held weakly (specs are kept alive by whoever tagged the parameter).
_SPEC_OF_PARAMETER = IdentityWeakMap()


def tag(param: nn.Parameter, spec: CodecSpec) -> None:
    """Request that ``param`` be gathered through ``spec``'s codec once it is sharded."""
    _SPEC_OF_PARAMETER[param] = spec


def spec_of(param: nn.Parameter) -> Optional[CodecSpec]:
    return _SPEC_OF_PARAMETER.get(param)


def codec_for(params: Sequence[nn.Parameter], dtypes: ResolvedDtypes, label: str) -> Optional[GatherCodec]:
    """The codec of a group made of ``params``: None where no parameter is tagged."""
    specs = [spec_of(p) for p in params]
    tagged = [s for s in specs if s is not None]
    if not tagged:
        return None
    kinds = {type(s) for s in tagged}
    untagged = [tuple(p.shape) for p, s in zip(params, specs) if s is None]
    if untagged or len(kinds) > 1:
        raise ValueError(
            f"mfsdp: parameter group {label} mixes parameters gathered through {sorted(k.__name__ for k in kinds)} "
            f"with {len(untagged)} parameter(s) gathered as they are (shapes {untagged}); a group is gathered "
            "in one encoding. Give those parameters their own fully_shard (e.g. shard the modules holding "
            "the float8 linears separately from norms and embeddings), or do not tag them")
    return tagged[0].build(tagged, dtypes, label)
