"""Binding torch optimizers to the main-weight shards.

Elementwise optimizers (SGD, Adam, AdamW: foreach or fused) step directly on the sharded DTensor
parameters. What mfsdp adds around ``step()``:

* before: gradients kept in another dtype than the main weights (``main_grads_dtype``) are
  upcast, one fused cast per group, because torch's optimizers want matching dtypes. The sharded
  parameters of such groups accept a ``.grad`` of any dtype (``grad_dtype = None``, set by the
  parameter group), so torch's state-dict helpers can attach main-dtype zeros to a fresh optimizer;
* after: the compute weights are re-derived from the main weights once per group (one fused cast,
  plus the all-gather that rebuilds replicated weights for ZeRO-1/2).

Plain optimizers that were not bound still work where no upcast is needed: a global step hook
marks their groups stale and the next unshard refreshes them on the all-gather stream.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from mfsdp.runtime.registry import GROUP_OF_SHARDED

_BOUND_OPTIMIZERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _groups_of(optimizer: torch.optim.Optimizer) -> list:
    groups, seen = [], set()
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            group = GROUP_OF_SHARDED.get(p)
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
    return groups


def _mark_stale_after_step(optimizer, args, kwargs) -> None:
    if optimizer in _BOUND_OPTIMIZERS:
        return
    for group in _groups_of(optimizer):
        group.needs_refresh = True


register_optimizer_step_post_hook(_mark_stale_after_step)


def _free_gradients_on_zero_grad(optimizer: torch.optim.Optimizer, groups: list) -> None:
    """``zero_grad(set_to_none=True)`` frees the gradient buffers right away.

    Otherwise they would stay allocated until the next forward (where the root frees them), and
    the bytes between the step and that forward would be the step's peak. torch has no zero_grad
    hook, so the bound optimizer's method is wrapped on the instance.
    """
    zero_grad = optimizer.zero_grad

    def zero_grad_and_free(set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)
        if set_to_none:
            for group in groups:
                if group.requires_grad:
                    group.release_unused_gradient_memory()

    optimizer.zero_grad = zero_grad_and_free


def fully_shard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Register an already-built optimizer with a sharded model; returns the same optimizer.

    The optimizer keeps its param groups and their settings. Build it on ``model.parameters()``
    after ``fully_shard``, so it holds the sharded main weights.
    """
    groups = _groups_of(optimizer)
    if not groups:
        raise ValueError(
            "the optimizer holds no mfsdp-sharded parameters; build it on model.parameters() after "
            "fully_shard(model, ...)"
        )
    if optimizer in _BOUND_OPTIMIZERS:
        return optimizer
    upcast_groups = [g for g in groups if g.requires_grad and g.dtypes.grads != g.dtypes.main]
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []

    def pre_step(opt, args, kwargs):
        for group in upcast_groups:
            main_dtype, fused = group.dtypes.main, None
            for i, p in enumerate(group.sharded_params):
                grad = p.grad
                if grad is None or grad.dtype == main_dtype:
                    continue  # nothing to step, or already in the optimizer's dtype (state-dict init)
                if fused is None:
                    fused = _upcast_main_grad(group)
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if fused and _shares_storage(local, group.main_grad.tensor):
                    upcast = fused[i]  # the runtime's gradient: a view of the one fused cast
                else:  # a gradient the user attached: cast on its own
                    upcast = local.to(main_dtype)
                swapped.append((p, grad))
                p.grad = DTensor.from_local(upcast, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())

    def post_step(opt, args, kwargs):
        while swapped:
            p, original = swapped.pop()
            p.grad = original
        with torch.profiler.record_function("mfsdp::refresh_model_weights"):
            for group in groups:
                group.refresh_model_weights()
                group.needs_refresh = False

    optimizer.register_step_pre_hook(pre_step)
    optimizer.register_step_post_hook(post_step)
    _free_gradients_on_zero_grad(optimizer, groups)
    _BOUND_OPTIMIZERS.add(optimizer)
    return optimizer


def _upcast_main_grad(group) -> list:
    """The group's main gradient cast to the main dtype (one fused cast), as per-parameter shard
    views; empty when the main gradient holds no storage (nothing the runtime exposed is live)."""
    if group.main_grad is None or not group.main_grad.is_allocated:
        return []
    upcast = group.main_grad.tensor.to(group.dtypes.main)
    layout, geometry = group.layout, group.geometry
    return layout.shards(layout.regions(upcast, geometry.num_shards), geometry.shard_index)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
