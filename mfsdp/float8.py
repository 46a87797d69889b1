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
fixed number of kernels (fused multi-tensor copies and one scale pass over a staging buffer of at
most ``ENCODE_STAGING_NUMEL`` elements at a time), and moves them in its one coalesced all-gather. Scales computed after the optimizer step (``precompute_fp8_scales``) replace that
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
import functools
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat
from mfsdp.runtime import collectives, gather_codec

__all__ = ["convert_to_float8", "enable_fp8_all_gather", "precompute_fp8_scales", "precompute_fp8_scales_after",
           "Float8GatherCodec", "RECIPES"]

RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 recipes offered by ``convert_to_float8`` (FP8 all-gather needs tensorwise)."""

ENCODE_STAGING_NUMEL = 1 << 25
"""Elements of a group's float8 weights cast per pass (8 bytes each of transient memory: the fp32
staging and its per-element scales); a group of fewer elements casts in one pass."""


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
        self._repeat_counts: dict = {}

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
            start = 0
            for stop in _passes([s.numel() for s in sources], ENCODE_STAGING_NUMEL):
                self._cast(sources[start:stop], blocks[start:stop], scales[start:stop])
                start = stop
        self._scales = scales

    def _cast(self, sources, blocks, scales) -> None:
        """torchao's saturated cast ``(w.to(compute).float() * scale).clamp(-max, max).to(float8)``
        of every source into its block, with a fixed number of kernels: the weights are staged end
        to end in fp32 (one fused copy, two when the compute dtype rounds them first), multiplied by
        their scales repeated per element, clamped, and cast out in one fused copy."""
        sizes = [s.numel() for s in sources]
        total, device = sum(sizes), sources[0].device
        staged = torch.empty(total, dtype=torch.float32, device=device)
        if self.compute_dtype not in (sources[0].dtype, torch.float32):  # fp32 main weights of a bf16
            # model: rounded to bf16 first, as torchao sees them
            rounded = torch.empty(total, dtype=self.compute_dtype, device=device)
            _compat.foreach_copy_(list(rounded.split(sizes)), list(sources))
            staged.copy_(rounded)
            del rounded
        else:
            _compat.foreach_copy_(list(staged.split(sizes)), list(sources))
        staged.mul_(scales.repeat_interleave(self._repeats(sizes, device), output_size=total))
        limit = torch.finfo(self.wire_dtype).max
        staged.clamp_(-limit, limit)
        _compat.foreach_copy_(list(blocks), list(staged.split(sizes)))

    def _repeats(self, sizes: list, device) -> torch.Tensor:
        """The element counts as a device tensor, made once per shape (no host copy per gather)."""
        key = (tuple(sizes), device)
        if key not in self._repeat_counts:
            self._repeat_counts[key] = torch.tensor(sizes, dtype=torch.int64, device=device)
        return self._repeat_counts[key]

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


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", fp8_all_gather: bool = True,
                      for_fsdp2: bool = False, module_filter_fn=float8_filter) -> int:
    """Convert ``model``'s linears (``module_filter_fn``) to torchao float8 training with one of
    ``RECIPES``, and with ``fp8_all_gather`` (tensorwise only) tag their weights for mfsdp's FP8
    all-gather (``enable_fp8_all_gather``), or with ``for_fsdp2`` set torchao's own
    ``enable_fsdp_float8_all_gather`` for ``torch.distributed.fsdp.fully_shard`` instead. Call
    before sharding (and before ``torch.compile``); returns the number of float8 linears."""
    if recipe not in RECIPES:
        raise ValueError(f"mfsdp.float8: unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if fp8_all_gather and recipe != "tensorwise":
        raise ValueError(f"mfsdp.float8: FP8 all-gather needs the tensorwise recipe, not {recipe!r} "
                         "(rowwise weights are gathered in the compute dtype)")
    _torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather and for_fsdp2:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    count = sum(isinstance(m, _torchao()["Float8Linear"]) for m in model.modules())
    if fp8_all_gather and not for_fsdp2:
        enable_fp8_all_gather(model)
    return count


def precompute_fp8_scales_after(optimizer: torch.optim.Optimizer, module: nn.Module):
    """Run ``precompute_fp8_scales(module)`` after every ``optimizer.step()``; returns the hook's
    handle, or None (and registers nothing) where no group under ``module`` gathers in FP8."""
    if not _fp8_groups(module):
        return None
    return optimizer.register_step_post_hook(lambda *_: precompute_fp8_scales(module))


def _fp8_groups(module: nn.Module) -> dict[tuple, list]:
    """The parameter groups under ``module`` that gather FP8 weights, by their data-parallel groups."""
    from mfsdp.runtime.module import FsdpModule

    batches: dict[tuple, list] = {}
    for m in module.modules():
        if isinstance(m, FsdpModule):
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
