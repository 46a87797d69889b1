"""FP8 training with torchao's float8 linears under ``mfsdp.fully_shard``, with FP8 all-gather.

Recipe (torchao >= 0.17)::

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    mfsdp.float8.enable_fp8_all_gather(model)          # after the conversion, before fully_shard
    for block in model.blocks:                         # groups of float8 weights only (see below)
        mfsdp.fully_shard(block.attention, mesh); mfsdp.fully_shard(block.mlp, mesh)
        mfsdp.fully_shard(block, mesh)
    mfsdp.fully_shard(model, mesh)
    ...
    loss.backward(); optim.step()
    mfsdp.float8.precompute_fp8_scales(model)          # optional: one all-reduce for all weights

Without ``enable_fp8_all_gather`` a float8 linear works under mfsdp as any linear does: its
weight is gathered in the compute dtype and torchao casts it (every recipe, rowwise included).

With it, each float8 weight's group gathers FP8 bytes: before the gather every rank casts its shard
with the scale torchao's tensorwise recipe computes for the *whole* weight, and the forward gets a
``Float8TrainingTensor`` over the gathered bytes, which ``Float8Linear`` uses as is (forward and
grad-input GEMMs) instead of casting again. Gradients are untouched (compute dtype, usual
reduction). Compared with torchao's FSDP2 integration (``WeightWithDynamicFloat8CastTensor``,
whose ``fsdp_pre_all_gather`` reduces one amax per weight): a group reduces the amaxes of all its
weights in one fused kernel and one all-reduce(MAX), and moves them in its one coalesced
all-gather. Scales computed after the optimizer step (``precompute_fp8_scales``) replace that
all-reduce too; they are used only while the main weights are unchanged since (their version
counter), so a forgotten call costs speed, never correctness.

Numerics match torchao's tensorwise cast bit for bit: the amax of the compute-dtype weight (with
fp32 main weights, the fp32 amax rounded to the compute dtype: rounding is monotone, so that is the
amax of the rounded weight), torchao's ``amax_to_scale``, then the compute-dtype weight upcast to
fp32, times the scale, saturated to the float8 range.

Limits: a parameter group is gathered in one encoding, so float8 weights must not share a
``fully_shard`` with other parameters of their dtype (norms, embeddings): ``fully_shard`` raises
and names them. Tensorwise dynamic weight scaling only (torchao's FSDP2 FP8 all-gather has the
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

__all__ = ["enable_fp8_all_gather", "precompute_fp8_scales", "Float8GatherCodec"]


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
        self.precomputed = None  # (scales, main-weights version they were computed for)
        self.amax_reductions = 0  # scale all-reduces issued at gather time (precomputed scales skip them)
        self._scales = None  # of the last encode, attached by decode

    def wrap(self, index: int, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        ao = _torchao()
        scale = torch.ones((), dtype=torch.float32, device=view.device)  # the first decode sets it
        weight = ao["Float8TrainingTensor"](view, scale, self.compute_dtype, self.specs[index].linear_mm_config,
                                            ao["GemmInputRole"].WEIGHT)
        return nn.Parameter(weight, requires_grad=param.requires_grad)

    def repoint(self, param: nn.Parameter, view: torch.Tensor) -> None:
        param._data = view

    def scales(self, sources: Sequence[torch.Tensor], groups: Sequence) -> torch.Tensor:
        """Tensorwise scales of the whole weights whose shards are ``sources`` (split over ``groups``):
        one fused amax kernel and one all-reduce(MAX) per group of ranks, for all members."""
        amax = torch.stack(_compat.foreach_amax(sources)).to(self.compute_dtype).float()
        collectives.all_reduce_max(amax, groups)
        return _torchao()["amax_to_scale"](amax, self.wire_dtype, self.round_pow2)

    def encode(self, sources, blocks, groups, version: int) -> None:
        if self.precomputed is not None and self.precomputed[1] == version:
            scales = self.precomputed[0]
        else:
            scales = self.scales(sources, groups)
            self.amax_reductions += 1
        limit = torch.finfo(self.wire_dtype).max
        with torch.no_grad():
            for source, block, scale in zip(sources, blocks, scales.unbind()):
                scaled = source.to(self.compute_dtype).to(torch.float32) * scale
                block.copy_(scaled.clamp_(-limit, limit))  # saturated, as torchao casts
        self._scales = scales

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


@torch.no_grad()
def precompute_fp8_scales(module: nn.Module) -> int:
    """Compute the scales of every FP8-gathered weight under ``module`` from the main weights, with one
    all-reduce(MAX) per set of data-parallel groups, so the gathers skip theirs (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``). Call after the optimizer step; returns the number
    of parameter groups updated."""
    from mfsdp.runtime.module import FsdpModule

    batches: dict[tuple, list] = {}
    for m in module.modules():
        if isinstance(m, FsdpModule):
            for group in m.parameter_groups:
                if isinstance(group.codec, Float8GatherCodec):
                    key = tuple(id(pg) for pg in group.geometry.groups)
                    batches.setdefault(key, []).append(group)
    for groups in batches.values():
        g = groups[0].geometry
        sources = [group.layout.regions(group.main.tensor, g.num_shards) for group in groups]
        amax = torch.cat([torch.stack(_compat.foreach_amax(s)).to(group.codec.compute_dtype).float()
                          for s, group in zip(sources, groups)])
        collectives.all_reduce_max(amax, g.groups)
        for group, part in zip(groups, amax.split([len(s) for s in sources])):
            codec = group.codec
            codec.precomputed = (_torchao()["amax_to_scale"](part, codec.wire_dtype, codec.round_pow2),
                                 group.main.tensor._version)
    return sum(len(groups) for groups in batches.values())
