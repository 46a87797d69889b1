"""FP8 training with torchao's float8 linears under ``mfsdp.fully_shard``, with FP8 all-gather.

Recipe (torchao >= 0.17)::

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    mfsdp.float8.enable_fp8_all_gather(model)          # after the conversion, before fully_shard
    for block in model.layers:                         # as for bf16: one unit, one gather per block
        mfsdp.fully_shard(block, mesh)
    mfsdp.fully_shard(model, mesh)
    ...
    loss.backward(); optim.step()
    mfsdp.float8.precompute_fp8_scales(model)          # optional: one all-reduce for all weights

(``convert_to_float8`` does the first two lines with torchtitan's choice of linears, and
``precompute_fp8_scales_after(optimizer, model)`` the last one after every step.)

Without ``enable_fp8_all_gather`` a float8 linear works under mfsdp as any linear does: its
weight is gathered in the compute dtype and torchao casts it (every recipe, rowwise included).

With it, each float8 weight travels as FP8 bytes in its group's gather (beside the group's other
parameters, e.g. the block's norms, in the compute dtype, all in one coalesced launch): before the
gather every rank casts its shard with the scale torchao's tensorwise recipe computes for the
*whole* weight, and the forward gets a
``Float8TrainingTensor`` over the gathered bytes, which ``Float8Linear`` uses as is (forward and
grad-input GEMMs) instead of casting again. Gradients are untouched (compute dtype, usual
reduction). Compared with torchao's FSDP2 integration (``WeightWithDynamicFloat8CastTensor``,
whose ``fsdp_pre_all_gather`` reduces one amax and casts once per weight): a group reduces the
amaxes of all its float8 weights in one fused kernel and one all-reduce(MAX), casts them all with a
fixed number of kernels (two fused multi-tensor copies around one broadcast multiply over a
staging of whole rows, at most ``ENCODE_STAGING_NUMEL`` elements at a time), and moves them in its one coalesced all-gather. Scales computed after the optimizer step (``precompute_fp8_scales``) replace that
all-reduce too; they are used only while the group's ``weights_epoch`` is the one they were
computed at (a step, a load or an init bumps it), so a forgotten call costs speed, never correctness.

Numerics match torchao's tensorwise cast bit for bit: the amax of the compute-dtype weight (with
fp32 main weights, the fp32 amax rounded to the compute dtype: rounding is monotone, so that is the
amax of the rounded weight), torchao's ``amax_to_scale``, then the compute-dtype weight upcast to
fp32, times the scale, saturated to the float8 range.

Limits: one group gathers one float8 dtype and scale setting (``fully_shard`` raises otherwise).
Tensorwise dynamic weight scaling only (torchao's FSDP2 FP8 all-gather has the
same limit; rowwise recipes keep bf16 gathers). No tensor parallelism for tagged weights, and only
placements that gather parameters (ZeRO-3, HSDP, HFSDP).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat, kernels
from mfsdp.runtime import collectives, gather_codec

__all__ = ["convert_to_float8", "enable_fp8_all_gather", "precompute_fp8_scales", "precompute_fp8_scales_after",
           "Float8GatherCodec", "RECIPES"]

RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 recipes offered by ``convert_to_float8`` (FP8 all-gather needs tensorwise)."""

UNUSED_EXTENSIONS = ("_C_mxfp8", "_C_cutlass_90a")
"""torchao's compiled extensions that mfsdp never calls (MX formats, SM90 CUTLASS kernels). torchao warns
"Failed to load ..." on every import (its own, or transformers') where one cannot load: on CPU, or a
wheel built for another Python. Those two lines are dropped at its logger from ``import mfsdp`` on;
every other torchao warning stays."""


def _keep_torchao_record(record: logging.LogRecord) -> bool:
    """False (drop it) for torchao's warning that one of ``UNUSED_EXTENSIONS`` failed to load."""
    message = record.getMessage()
    return not (message.startswith("Failed to load") and any(name in message for name in UNUSED_EXTENSIONS))


logging.getLogger("torchao").addFilter(_keep_torchao_record)

ENCODE_STAGING_NUMEL = 1 << 26
"""Elements of a group's float8 weights cast per pass (3 bytes each of transient memory: the
compute-dtype staging and the float8 rows); a group of fewer elements casts in one pass."""

ENCODE_ROW = 2048
"""Elements per row of the encode's staging: each member's shard is padded to whole rows, so one
broadcast multiply applies every member's scale (a row holds one member). Wider rows mean a
smaller row index and more padding (under ``ENCODE_ROW`` elements per member)."""


def _torchao():
    """torchao's float8 training pieces, or an ImportError that says what to install."""
    try:
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        from torchao.float8.float8_utils import amax_to_scale
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError as exc:
        raise ImportError(
            "mfsdp.float8 needs torchao's float8 training (pip install torchao==0.17.0; older releases "
            f"skip their extensions on torch >= 2.11): {exc}") from exc
    return dict(ScalingGranularity=ScalingGranularity, ScalingType=ScalingType, Float8Linear=Float8Linear,
                Float8TrainingTensor=Float8TrainingTensor, GemmInputRole=GemmInputRole,
                amax_to_scale=amax_to_scale, Wrapped=WeightWithDynamicFloat8CastTensor)


@dataclasses.dataclass(frozen=True)
class _Float8WeightSpec(gather_codec.CodecSpec):
    """A float8 linear's weight: gathered in ``float8_dtype`` with a tensorwise scale."""

    linear_mm_config: Any
    float8_dtype: torch.dtype
    round_scales_to_power_of_2: bool

    @classmethod
    def build(cls, specs: Sequence["_Float8WeightSpec"], dtypes, label: str) -> "Float8GatherCodec":
        kinds = {(s.float8_dtype, s.round_scales_to_power_of_2) for s in specs}
        if len(kinds) > 1:
            raise ValueError(f"mfsdp.float8: parameter group {label} holds float8 weights with different "
                             f"(float8 dtype, power-of-2 scales) settings {sorted(map(str, kinds))}; one group "
                             "gathers one float8 dtype. Shard them under separate fully_shard calls")
        return Float8GatherCodec(list(specs), dtypes.compute)


@functools.lru_cache(maxsize=None)
def _spec(linear_mm_config, float8_dtype, round_pow2) -> _Float8WeightSpec:
    return _Float8WeightSpec(linear_mm_config, float8_dtype, round_pow2)  # cached: the tags hold it weakly


class Float8GatherCodec(gather_codec.GatherCodec):
    """Gathers a group of float8-linear weights as float8 bytes with torchao tensorwise scales."""

    def __init__(self, specs: list[_Float8WeightSpec], compute_dtype: torch.dtype) -> None:
        self.specs = specs
        self.wire_dtype = specs[0].float8_dtype
        self.round_pow2 = specs[0].round_scales_to_power_of_2
        self.compute_dtype = compute_dtype
        self.precomputed = None  # (scales, the group's weights_epoch they were computed for)
        self.amax_reductions = 0  # scale all-reduces issued at gather time (precomputed scales skip them)
        self._scales = None  # of the last encode, attached by decode
        self._row_index: dict = {}  # (member sizes, device) -> (first rows, row-to-member index)
        self._fused = None  # the fused encode's device tables, made on its first use

    def wrap(self, index: int, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        ao = _torchao()
        scale = torch.ones((), dtype=torch.float32, device=view.device)  # the first decode sets it
        weight = ao["Float8TrainingTensor"](view, scale, self.compute_dtype, self.specs[index].linear_mm_config,
                                            ao["GemmInputRole"].WEIGHT)
        return nn.Parameter(weight, requires_grad=param.requires_grad)

    def repoint(self, param: nn.Parameter, view: torch.Tensor) -> None:
        param._data = view

    def scales(self, sources: Sequence[torch.Tensor], groups: Sequence) -> torch.Tensor:
        """Tensorwise scales of the whole weights whose shards are ``sources`` (split over ``groups``)."""
        return tensorwise_scales([self], [sources], groups)[0]

    def encode(self, sources, blocks, groups, weights_epoch: int) -> None:
        if self.precomputed is not None and self.precomputed[1] == weights_epoch:
            scales = self.precomputed[0]
        else:
            scales = self.scales(sources, groups)
            self.amax_reductions += 1
        with torch.no_grad():
            if not self._cast_fused(sources, blocks, scales):
                start = 0
                for stop in _passes([s.numel() for s in sources], ENCODE_STAGING_NUMEL):
                    self._cast_staged(sources[start:stop], blocks[start:stop], scales[start:stop])
                    start = stop
        self._scales = scales

    def _cast_fused(self, sources, blocks, scales) -> bool:
        """The whole encode in one kernel, with no staging (``mfsdp.kernels``), where the device
        has it and the views allow it; False otherwise."""
        device = sources[0].device
        if not kernels.available(device.type):
            return False
        if self._fused is None:
            self._fused = kernels.FusedEncode()
        rows, row_member = self._rows([s.numel() for s in sources], device)
        return self._fused.run(sources, blocks, scales, rows, row_member, ENCODE_ROW, self.compute_dtype)

    def _cast_staged(self, sources, blocks, scales) -> None:
        """torchao's saturated cast ``(w.to(compute).float() * scale).clamp(-max, max).to(float8)``
        of every source into its block, in four kernels whatever the number of weights:

        1. one fused copy stages the sources in the compute dtype (rounding fp32 main weights as
           torchao sees them), each padded to whole rows of ``ENCODE_ROW`` elements;
        2. one gather gives every row its member's scale (a cached row-to-member index: per row,
           not per element, so it costs nothing next to the weights);
        3. one broadcast multiply, computed in fp32 and stored as float8 (``out=``): the clamp is
           implied, since ``|w| <= amax`` makes ``|w| * (max / amax)`` at most ``max`` plus one fp32
           rounding, which the float8 conversion rounds to ``max`` (the scale is torchao's
           ``amax_to_scale``, rounded down where it rounds to powers of two);
        4. one fused copy moves the rows' valid elements into the blocks.

        It reads the weights once and moves about 7 bytes per element besides (fp32 main weights:
        4 read, 2 + 2 staged, 1 + 1 + 1 encoded), where a per-element scale index costs 12 bytes and
        a kernel per member costs a launch each."""
        sizes = [s.numel() for s in sources]
        rows, row_member = self._rows(sizes, sources[0].device)
        device, total_rows = sources[0].device, row_member.numel()
        staged = torch.empty((total_rows, ENCODE_ROW), dtype=self.staged_dtype(sources[0].dtype), device=device)
        _compat.foreach_copy_(_row_views(staged, rows, sizes), list(sources))
        encoded = torch.empty((total_rows, ENCODE_ROW), dtype=self.wire_dtype, device=device)
        torch.mul(staged, scales.index_select(0, row_member).unsqueeze(1), out=encoded)
        del staged
        _compat.foreach_copy_(list(blocks), _row_views(encoded, rows, sizes))

    def staged_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """The dtype ``_cast_staged`` stages sources of ``source_dtype`` in: the compute dtype, where torchao
        rounds the weight first, else the source's own."""
        return self.compute_dtype if self.compute_dtype != torch.float32 else source_dtype

    def staging_nbytes(self, sizes: Sequence[int], source_dtype: torch.dtype) -> int:
        """Transient bytes of the largest ``_cast_staged`` pass (``_passes``) over members of ``sizes``
        elements at its high point, the multiply: the staged rows, their fp32 scales and the float8 rows."""
        ends, width = _passes(sizes, ENCODE_STAGING_NUMEL), self.staged_dtype(source_dtype).itemsize + 1
        rows = [sum(-(-n // ENCODE_ROW) for n in sizes[start:stop]) for start, stop in zip([0, *ends], ends)]
        return max(r * ENCODE_ROW * width + r * 4 for r in rows)

    def _rows(self, sizes: list, device) -> tuple[list, torch.Tensor]:
        """Each member's first row in the staging, and every row's member as a device index, made
        once per shape (no host copy per gather)."""
        key = (tuple(sizes), device)
        if key not in self._row_index:
            counts = [-(-n // ENCODE_ROW) for n in sizes]
            starts = [sum(counts[:k]) for k in range(len(counts))]
            members = torch.arange(len(sizes)).repeat_interleave(torch.tensor(counts))
            self._row_index[key] = (starts, members.to(device))
        return self._row_index[key]

    def decode(self, params) -> None:
        for param, scale in zip(params, self._scales.unbind()):
            param._scale = scale  # a fresh tensor: what autograd saved keeps its own scale


def enable_fp8_all_gather(module: nn.Module) -> int:
    """Tag the weights of ``module``'s torchao ``Float8Linear`` layers for FP8 all-gather; returns how
    many. Call after ``convert_to_float8_training`` and before ``fully_shard``. A weight torchao
    wrapped for FSDP2 (``enable_fsdp_float8_all_gather=True``) is unwrapped: mfsdp gathers it."""
    ao = _torchao()
    dynamic, tensorwise = ao["ScalingType"].DYNAMIC, ao["ScalingGranularity"].TENSORWISE
    count = 0
    for name, m in module.named_modules():
        if not isinstance(m, ao["Float8Linear"]):
            continue
        c = m.config
        for field in ("cast_config_weight", "cast_config_weight_for_grad_input"):
            cast = getattr(c, field)
            if cast.scaling_type is not dynamic or cast.scaling_granularity is not tensorwise:
                raise ValueError(
                    f"mfsdp.float8: {name or type(m).__name__} has {field}={cast.short_str()}; FP8 all-gather needs "
                    "dynamic tensorwise weight scaling (the 'tensorwise' recipe), since one gathered float8 "
                    "weight serves both GEMMs. Rowwise recipes train under mfsdp without "
                    "enable_fp8_all_gather (weights gathered in bf16, as torchtitan does)")
        weight = m.weight
        if isinstance(weight, DTensor):
            raise NotImplementedError(f"mfsdp.float8: {name}.weight is a DTensor (tensor parallel); FP8 "
                                      "all-gather supports plain float8 weights only")
        if isinstance(weight, ao["Wrapped"]):  # torchao's FSDP2 wrapper: mfsdp does its job
            m.weight = weight = nn.Parameter(weight._tensor, requires_grad=weight.requires_grad)
        gather_codec.tag(weight, _spec(m.linear_mm_config, c.cast_config_weight.target_dtype,
                                       c.round_scales_to_power_of_2))
        count += 1
    if not count:
        raise ValueError(f"mfsdp.float8.enable_fp8_all_gather: {type(module).__name__} has no torchao Float8Linear; "
                         "convert it first with torchao.float8.convert_to_float8_training")
    return count


def _row_views(rows2d: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
    """The 1-D view of each member's elements in a staging of whole rows (member ``k`` starts at
    row ``starts[k]``; the tail of its last row is padding)."""
    flat = rows2d.view(-1)
    width = rows2d.shape[1]
    return [flat[start * width:start * width + n] for start, n in zip(starts, sizes)]


def _passes(sizes: Sequence[int], budget: int) -> list[int]:
    """End indices of consecutive runs of ``sizes`` summing to at most ``budget`` (a larger size
    gets a run of its own)."""
    ends, total = [], 0
    for i, size in enumerate(sizes):
        if total and total + size > budget:
            ends.append(i)
            total = 0
        total += size
    return ends + [len(sizes)]


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """torchtitan's choice of linears to train in float8: every ``nn.Linear`` whose dimensions are
    multiples of 16 (``torch._scaled_mm``'s requirement), except the output head."""
    return (isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] not in ("output", "lm_head")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def float8_linears(model: nn.Module, skip: tuple[str, ...] = (), module_filter_fn=float8_filter) -> list[str]:
    """The names of ``model``'s linears that train in float8: those ``module_filter_fn`` takes, less
    those whose name matches a ``skip`` pattern (``fnmatch``, on the full name, e.g.
    ``layers.0.*`` or ``*.feed_forward.w2``), which stay in the compute dtype. A pattern that matches
    none of the linears the filter takes is an error (a misspelt name would otherwise leave every
    layer in float8 without a word), and so is a skip that leaves none."""
    taken = [fqn for fqn, m in model.named_modules() if module_filter_fn(m, fqn)]
    chosen = [fqn for fqn in taken if not any(fnmatch.fnmatchcase(fqn, p) for p in skip)]
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(fqn, pattern) for fqn in taken):
            example = ", ".join(taken[:3] + taken[-1:]) if taken else "none"
            raise ValueError(f"mfsdp.float8: the skip pattern {pattern!r} matches none of the float8 "
                             f"linears (their names: {example}, ...; the head is never float8); fix the "
                             "pattern or drop it")
    if skip and not chosen:
        raise ValueError(f"mfsdp.float8: the skip patterns {', '.join(skip)} leave no linear in float8; "
                         "train without float8 instead")
    return chosen


def check_recipe(recipe: str, fp8_all_gather: bool) -> None:
    """ValueError unless ``recipe`` is one of ``RECIPES``, and tensorwise with ``fp8_all_gather``."""
    if recipe not in RECIPES:
        raise ValueError(f"mfsdp.float8: unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if fp8_all_gather and recipe != "tensorwise":
        raise ValueError(f"mfsdp.float8: FP8 all-gather needs the tensorwise recipe, not {recipe!r} "
                         "(rowwise weights are gathered in the compute dtype)")


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", fp8_all_gather: bool = True,
                      for_fsdp2: bool = False, module_filter_fn=float8_filter, skip: tuple[str, ...] = ()) -> int:
    """Convert ``model``'s linears (``module_filter_fn``, less the ``skip`` patterns: ``float8_linears``)
    to torchao float8 training with one of ``RECIPES``, and with ``fp8_all_gather`` (tensorwise only)
    tag their weights for mfsdp's FP8 all-gather (``enable_fp8_all_gather``), or with ``for_fsdp2``
    set torchao's own ``enable_fsdp_float8_all_gather`` for ``torch.distributed.fsdp.fully_shard``
    instead. Call before sharding (and before ``torch.compile``); returns the number of float8 linears."""
    check_recipe(recipe, fp8_all_gather)
    _torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set(float8_linears(model, tuple(skip), module_filter_fn=module_filter_fn))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather and for_fsdp2:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    if fp8_all_gather and not for_fsdp2:
        enable_fp8_all_gather(model)
    return len(chosen)


def precompute_fp8_scales_after(optimizer: torch.optim.Optimizer, module: nn.Module):
    """Run ``precompute_fp8_scales(module)`` after every ``optimizer.step()``; returns the hook's
    handle, or None (and registers nothing) where no group under ``module`` gathers in FP8."""
    if not _fp8_groups(module):
        return None
    return optimizer.register_step_post_hook(lambda *_: precompute_fp8_scales(module))


def _fp8_groups(module: nn.Module) -> dict[tuple, list]:
    """The parameter groups under ``module`` that gather FP8 weights, by their data-parallel groups."""
    from mfsdp.runtime.module import fsdp_modules

    batches: dict[tuple, list] = {}
    for _, m in fsdp_modules(module):
        for group in m.parameter_groups:
            if isinstance(group.codec, Float8GatherCodec):
                batches.setdefault(tuple(id(pg) for pg in group.geometry.groups), []).append(group)
    return batches


@torch.no_grad()
def precompute_fp8_scales(module: nn.Module) -> int:
    """Compute the scales of every FP8-gathered weight under ``module`` from the main weights, with one
    all-reduce(MAX) per set of data-parallel groups, so the gathers skip theirs (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``). Call after the optimizer step; returns the number
    of parameter groups updated."""
    batches = _fp8_groups(module)
    for groups in batches.values():
        for group in groups:  # an offloaded group's weights may still be on their way up
            group.wait_for_weights(keep=True)
        g = groups[0].geometry
        sources = [[regions[i] for i in group.encoded.tagged]
                   for group in groups for regions in [group.layout.regions(group.main.tensor, g.num_shards)]]
        scales = tensorwise_scales([group.codec for group in groups], sources, g.groups)
        for group, part in zip(groups, scales):
            group.codec.precomputed = (part, group.weights_epoch)
    return sum(len(groups) for groups in batches.values())


def tensorwise_scales(codecs: Sequence[Float8GatherCodec], sources: Sequence[Sequence[torch.Tensor]],
                      groups: Sequence) -> list[torch.Tensor]:
    """torchao's tensorwise scales of the whole weights whose shards are ``sources[k]`` (codec ``k``'s
    members, all split over ``groups``): one fused amax kernel for all of them, each amax rounded to its
    codec's compute dtype as torchao sees the weight, one all-reduce(MAX) per group of ranks."""
    counts = [len(s) for s in sources]
    amax = torch.stack(_compat.foreach_amax([t for s in sources for t in s]))
    dtypes = [codec.compute_dtype for codec in codecs]
    amax = amax.to(dtypes[0]).float() if len(set(dtypes)) == 1 else torch.cat(
        [part.to(dtype).float() for part, dtype in zip(amax.split(counts), dtypes)])
    collectives.all_reduce_max(amax, groups)
    to_scale = _torchao()["amax_to_scale"]
    return [to_scale(part, codec.wire_dtype, codec.round_pow2) for part, codec in zip(amax.split(counts), codecs)]
