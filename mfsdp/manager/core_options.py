"""What each ``MegatronFSDPConfig`` field becomes in the core: placements, precision and
communication policies, unit modules and activation checkpointing. Pure functions of the config
and the mesh sizes, so each mapping is testable without a model or a process group."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mfsdp
from mfsdp.manager.config import MegatronFSDPConfig
from mfsdp.manager.context_parallel import DP_SHARD_CP
from mfsdp.mesh import DP_SHARD, MeshSizes, resolve_placements


# ---------------------------------------------------------------------------------- placements
def dp_placements(zero_dp_strategy: int, sizes: MeshSizes, outer_dp_sharding_strategy: int = 0) -> mfsdp.Placements:
    """The placements a Megatron strategy stands for on a manager mesh of ``sizes``: the integer front
    of ``MegatronFSDPConfig.placements``. 0..2 are DDP, ZeRO-1, ZeRO-2 over dp_shard; 3 is HSDP (HFSDP
    with ``outer_dp_sharding_strategy=1``), which :func:`mesh_placements` makes ZeRO-3 on one replica."""
    name = ("ddp", "zero1", "zero2", ("hsdp", "hfsdp")[outer_dp_sharding_strategy])[zero_dp_strategy]
    return mesh_placements(resolve_placements(name, shard_axis=DP_SHARD), sizes, f"zero_dp_strategy={zero_dp_strategy}")


def mesh_placements(placements: mfsdp.Placements, sizes: MeshSizes, given: str = "") -> mfsdp.Placements:
    """``placements`` over ``(dp_shard,)`` or ``(dp_replicate, dp_shard)`` as ``fully_shard`` takes
    them on a manager mesh of ``sizes`` (``given``: how the config said it, for the error).

    One replica (dp_replicate of size 1): a two-dim placement is its dp_shard part, ZeRO-3. cp > 1:
    dp_shard stands for the flattened dp_shard x cp dim (``dp_shard_cp``, which the manager creates),
    so gradients are averaged over every rank that saw different tokens.
    """
    p, given = placements, given or f"placements={placements.name}"
    if len(p.dp_axes) == 2 and sizes.dp_replicate == 1:
        p = mfsdp.Placements(p.dp_axes[1:], p.parameter[1:], p.gradient[1:], p.optimizer[1:])
    elif len(p.dp_axes) == 1 and sizes.dp_replicate > 1:
        raise NotImplementedError(
            f"{given} with dp_replicate_size={sizes.dp_replicate}: mfsdp has no placement that replicates across "
            "dp_replicate while sharding only within dp_shard (over dp_shard alone, the replicas would never "
            "average their gradients). Use zero_dp_strategy=3 or two-dim placements (HSDP, HFSDP, or ZeRO-3 over "
            f"both: Placements.hsdp, hfsdp, fully_sharded), or dp_replicate_size=1 with {given} over all "
            "data-parallel ranks")
    axes = tuple(DP_SHARD_CP if sizes.cp > 1 and a == DP_SHARD else a for a in p.dp_axes)
    return mfsdp.Placements(axes, p.parameter, p.gradient, p.optimizer)


def precision_policy(config: MegatronFSDPConfig) -> mfsdp.MixedPrecisionPolicy:
    """``preserve_fp32_weights`` -> fp32 main weights; ``grad_reduce_in_fp32`` -> fp32 grads and reduction."""
    return mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32 if config.preserve_fp32_weights else None,
                                      main_grads_dtype=torch.float32 if config.grad_reduce_in_fp32 else None)


def communication_policy(config: MegatronFSDPConfig, sizes: MeshSizes) -> mfsdp.CommunicationPolicy:
    """The core communication policy the flags stand for.

    ``overlap_grad_reduce`` / ``overlap_param_gather``: the core has one switch, so either False
    makes all communication synchronous (no side streams, no prefetch). ``disable_bucketing``: one
    collective per parameter. ``fsdp_double_buffer``: persistent gather buffers in alternation.
    ``calculate_per_token_loss``: gradients are summed over the
    data-parallel ranks, i.e. the core's average divided by 1/dp. ``check_for_nan_in_grad`` /
    ``report_nan_in_param_grad``: the core's NaN/Inf check at the end of backward
    (``check_finite_gradients``), which raises on every rank.
    """
    return mfsdp.CommunicationPolicy(overlap=config.overlap_grad_reduce and config.overlap_param_gather,
                                     coalesce=not config.disable_bucketing, double_buffer=config.fsdp_double_buffer,
                                     gradient_divide_factor=1.0 / sizes.dp if config.calculate_per_token_loss else 1.0,
                                     check_finite_gradients=config.check_for_nan_in_grad
                                     or config.report_nan_in_param_grad)


# -------------------------------------------------------------------------------- unit modules
def _resolve_class(spec):
    if isinstance(spec, type):
        return spec
    if "." in spec:
        module_name, _, cls_name = spec.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"megatron_fsdp_unit_modules: cannot import {spec!r} ({exc})") from exc
    return spec


def resolve_unit_modules(model: nn.Module, specs=None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every unit module below the root, children before parents.

    ``specs`` are class names, import paths or classes; None means ``model._no_split_modules``.
    """
    if specs is None:
        specs = getattr(model, "_no_split_modules", None)
        if not specs:
            raise ValueError(
                f"{type(model).__name__} has no _no_split_modules to pick shard units from; set "
                "MegatronFSDPConfig.megatron_fsdp_unit_modules (e.g. ['LlamaDecoderLayer'])")
        source = f"{type(model).__name__}._no_split_modules"
    else:
        source = "megatron_fsdp_unit_modules"
    wanted = [_resolve_class(s) for s in specs]
    classes = tuple(w for w in wanted if isinstance(w, type))
    names = {w for w in wanted if isinstance(w, str)}
    units = [(n, m) for n, m in model.named_modules()
             if n and (isinstance(m, classes) or type(m).__name__ in names)]
    if not units:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"{source}={list(specs)} matches no submodule of {type(model).__name__}; its module classes "
            f"are {present}")
    return units[::-1]  # reversed pre-order: every child comes before its parents


def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant), keeping the FSDP hooks outside."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
