"""Gather codecs: a parameter group that all-gathers some of its weights in another encoding than
the compute dtype (FP8 weights with their scales, see ``mfsdp.float8``).

The runtime stays ignorant of the encoding. Before ``fully_shard``, a caller tags parameters with
a *spec* (``tag``); the group that ends up owning them asks the spec's class for a codec
(``encoded_gather``), and from then on its gathers go through an ``EncodedGather``:

* the unsharded buffer is bytes (uint8, ``flat_buffer.ByteLayout``): a tagged member's region is a
  view in the codec's ``wire_dtype``, an untagged member's (a norm's scale beside float8 linears) a
  view in the compute dtype; the compute parameters of tagged members are what ``wrap`` builds over
  their gathered views (once; ``repoint`` moves them to another buffer), the others are plain views;
* before the first gather, ``encode`` writes this rank's encoded shards of the tagged members
  straight into their blocks of the gather output (and may issue small collectives over the groups
  the shard is split over, e.g. an amax all-reduce); untagged members are cast there in one fused
  copy (or gathered from their source as they are, when no cast is needed);
* every member then travels as bytes in the group's one coalesced all-gather;
* after the gather, ``decode`` finishes the tagged compute parameters (e.g. attaches the scales).

Gradients are untouched: they arrive in the compute dtype as usual. A group gathers through at most
one codec, so every tagged parameter of a group must carry a spec of the same class. A group with no
tagged parameter has no ``EncodedGather`` and gathers exactly as before (no extra kernels, views or
allocations).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat
from mfsdp.mixed_precision import ResolvedDtypes
from mfsdp.runtime.collectives import own_blocks
from mfsdp.runtime.flat_buffer import ByteLayout, FlatLayout
from mfsdp.runtime.registry import IdentityWeakMap


class GatherCodec:
    """What a group calls on its gather path; see the module docstring."""

    wire_dtype: torch.dtype

    def wrap(self, index: int, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        """The compute parameter for tagged member ``index`` (its position among the group's tagged
        parameters, the order of the specs given to ``CodecSpec.build``) over ``view`` (its
        gathered bytes)."""
        raise NotImplementedError

    def repoint(self, param: nn.Parameter, view: torch.Tensor) -> None:
        """Make ``param`` (built by ``wrap``) read ``view`` from now on (a gather slot)."""
        raise NotImplementedError

    def encode(self, sources: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor], groups: Sequence,
               weights_epoch: int) -> None:
        """Write the encoding of ``sources`` (this rank's 1-D regions of the tagged members, split over
        ``groups``) into ``blocks`` (this rank's blocks of the gather output). ``weights_epoch`` (the
        group's) changes whenever the main weights are written: a step, a load, an init."""
        raise NotImplementedError

    def decode(self, params: Sequence[nn.Parameter]) -> None:
        """After the gather: finish the compute parameters of the tagged members."""
        raise NotImplementedError

    def staging_nbytes(self, sizes: Sequence[int], source_dtype: torch.dtype) -> int:
        """Transient bytes ``encode`` holds at its high point over tagged members of ``sizes`` elements
        (this rank's sources, of ``source_dtype``): what ``mfsdp.memory`` plans for it."""
        return 0


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


def encoded_gather(params: Sequence[nn.Parameter], dtypes: ResolvedDtypes, layout: FlatLayout,
                   label: str, param_level: int = 1) -> Optional["EncodedGather"]:
    """How a group made of ``params`` gathers through a codec: None where no parameter is tagged.
    Refused, by the one rule that ``mfsdp.memory`` plans with too, where the placement keeps the
    parameters replicated at rest (``param_level`` 0) or they are tensor-parallel DTensors."""
    specs = [spec_of(p) for p in params]
    tagged = [i for i, s in enumerate(specs) if s is not None]
    if not tagged:
        return None
    kinds = {type(specs[i]) for i in tagged}
    if len(kinds) > 1:
        raise ValueError(
            f"mfsdp: parameter group {label} mixes parameters gathered through {sorted(k.__name__ for k in kinds)}; "
            "a group gathers through one codec. Give them separate fully_shard calls")
    codec = specs[tagged[0]].build([specs[i] for i in tagged], dtypes, label)
    if param_level == 0 or any(isinstance(p, DTensor) for p in params):
        raise NotImplementedError(
            f"mfsdp: parameter group {label} asks for an encoded all-gather ({type(codec).__name__}: FP8 "
            "all-gather for float8 weights), which needs parameters that are sharded at rest and gathered for "
            "compute (ZeRO-3, HSDP, HFSDP) and are not tensor-parallel DTensors; these placements keep them "
            f"{'replicated' if param_level == 0 else 'as DTensors'}. Use such a placement or leave the "
            "parameters untagged")
    return EncodedGather(codec, tagged, layout, dtypes.compute)


class EncodedGather:
    """The gather path of a group with tagged parameters (see the module docstring): a byte buffer
    whose tagged members travel encoded and the others in the compute dtype, in one launch."""

    def __init__(self, codec: GatherCodec, tagged: Sequence[int], layout: FlatLayout,
                 compute_dtype: torch.dtype) -> None:
        self.codec = codec
        self.tagged = tuple(tagged)  # member indices gathered through the codec
        self._position = {i: k for k, i in enumerate(self.tagged)}
        self.plain = tuple(i for i in range(len(layout.members)) if i not in self._position)
        self.layout = ByteLayout(layout, [codec.wire_dtype if i in self._position else compute_dtype
                                          for i in range(len(layout.members))])
        # (outputs, sources, blocks, byte views of the gather's outputs and inputs, cast members) of
        # the last gather: the unsharded buffer's are made once per binding, not at every gather
        self._blocks = None

    def wraps(self, index: int) -> bool:
        return index in self._position

    def wrap(self, index: int, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        return self.codec.wrap(self._position[index], param, view)

    def encode(self, sources: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], group, groups: Sequence,
               weights_epoch: int, persistent: bool) -> tuple[list, list]:
        """Write this rank's shard of every member into its block of ``outputs`` (the tagged ones
        encoded, the others cast), ready for the gather over ``group``; ``groups`` and ``weights_epoch``
        as in ``GatherCodec.encode``. Returns the (outputs, inputs) of that gather, as bytes, and
        keeps them for the next call when ``persistent`` (``outputs`` are the unsharded buffer's,
        not a temporary of a multi-level gather)."""
        cached = self._blocks
        if cached is not None and cached[0] is outputs and cached[1] is sources:
            blocks, out_bytes, in_bytes, cast = cached[2:]
        else:
            blocks = own_blocks(outputs, [s.numel() for s in sources], group)
            cast = [i for i in self.plain if sources[i].dtype != outputs[i].dtype]
            ins = [blocks[i] if i in self._position or i in cast else sources[i] for i in range(len(sources))]
            out_bytes, in_bytes = as_bytes(outputs), as_bytes(ins)
            self._blocks = (outputs, sources, blocks, out_bytes, in_bytes, cast) if persistent else None
        self.codec.encode([sources[i] for i in self.tagged], [blocks[i] for i in self.tagged], groups, weights_epoch)
        if cast:
            _compat.foreach_copy_([blocks[i] for i in cast], [sources[i] for i in cast])
        return out_bytes, in_bytes

    def decode(self, params: Sequence[nn.Parameter]) -> None:
        self.codec.decode([params[i] for i in self.tagged])


def as_bytes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each (contiguous, 1-D) tensor's bytes: a gather only moves bytes, and one dtype lets members
    of several dtypes share a coalesced launch on every backend (gloo has no float8 type)."""
    return [t.view(torch.uint8) for t in tensors]
