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
from mfsdp.manager.mesh import MeshSizes


# ---------------------------------------------------------------------------------- placements
def dp_placements(zero_dp_strategy: int, sizes: MeshSizes, outer_dp_sharding_strategy: int = 0) -> mfsdp.Placements:
    """The mfsdp placements a strategy stands for on a manager mesh of ``sizes``.

    Parameters shard over dp_shard (over the flattened ``dp_shard_cp`` dim when cp > 1, which the
    manager creates) and replicate over dp_replicate.
    """
    s = zero_dp_strategy
    shard = DP_SHARD_CP if sizes.cp > 1 else "dp_shard"
    if sizes.dp_replicate > 1:
        if s != 3:
            raise NotImplementedError(
                f"zero_dp_strategy={s} with dp_replicate_size={sizes.dp_replicate}: mfsdp has no placement that "
                "replicates across dp_replicate while sharding only optimizer state/gradients within dp_shard. "
                "Use zero_dp_strategy=3 (HSDP, or HFSDP with outer_dp_sharding_strategy=1), or "
                f"dp_replicate_size=1 with zero_dp_strategy={s} over all data-parallel ranks (with nothing "
                "sharded, a separate replicate axis saves nothing)")
        if outer_dp_sharding_strategy == 1:
            return mfsdp.Placements.hfsdp("dp_replicate", shard)
        return mfsdp.Placements.hsdp("dp_replicate", shard)
    return (mfsdp.Placements.ddp, mfsdp.Placements.zero1, mfsdp.Placements.zero2, mfsdp.Placements.zero3)[s](shard)


def precision_policy(config: MegatronFSDPConfig) -> mfsdp.MixedPrecisionPolicy:
    """``preserve_fp32_weights`` -> fp32 main weights; ``grad_reduce_in_fp32`` -> fp32 grads and reduction."""
    return mfsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32 if config.preserve_fp32_weights else None,
        main_grads_dtype=torch.float32 if config.grad_reduce_in_fp32 else None,
    )


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
    factor = 1.0
    if config.calculate_per_token_loss and sizes.dp > 1:
        factor = 1.0 / sizes.dp
    return mfsdp.CommunicationPolicy(
        overlap=config.overlap_grad_reduce and config.overlap_param_gather,
        coalesce=not config.disable_bucketing,
        double_buffer=config.fsdp_double_buffer,
        gradient_divide_factor=factor,
        check_finite_gradients=config.checks_gradients,
    )


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


def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant), keeping the FSDP hooks outside."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
