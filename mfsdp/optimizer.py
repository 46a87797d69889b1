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

[Note: the next forward's first gathers during the step]
The next forward starts with the root's gather (the embedding, often the largest group) and its
prefetch; issued by the forward, nothing hides them. With ``prefetch_across_step`` the bound step
runs in two calls of the optimizer's body: first the parameters of those first modules, whose
weights are then cast and gathered on the all-gather stream, then every other parameter, whose
update overlaps the gathers. The hooks around ``step`` still run once, and since torch's
elementwise optimizers update each parameter from its own gradient and state, two calls equal one
(the staging is limited to those classes). Cost: the early modules' full weights are held from the
step on, which is where the forward would have put them a moment later.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mfsdp import _compat
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


def _mark_stale_before_step(optimizer, args, kwargs) -> None:
    """Before the body, so that every post hook (``precompute_fp8_scales_after``) sees the new epoch."""
    if optimizer in _BOUND_OPTIMIZERS:
        return
    for group in _groups_of(optimizer):
        group.weights_written()


register_optimizer_step_pre_hook(_mark_stale_before_step)


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
    early = _EarlyUpdate(model, optimizer, groups)

    def pre_step(opt, args, kwargs):
        for group in groups:  # first: every post hook, in any order, sees the weights as written
            group.weights_written()
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
        early.run(opt, args, kwargs, pre_hook)

    def post_step(opt, args, kwargs):
        refreshed = early.finish()
        while swapped:
            p, original = swapped.pop()
            p.grad = original
        _refresh([g for g in groups if id(g) not in refreshed])

    pre_hook = optimizer.register_step_pre_hook(pre_step)
    optimizer.register_step_post_hook(post_step)
    _free_gradients_on_zero_grad(optimizer, groups)
    _BOUND_OPTIMIZERS.add(optimizer)
    return optimizer


def _refresh(groups) -> None:
    with torch.profiler.record_function("mfsdp::refresh_model_weights"):
        for group in groups:
            group.refresh_if_stale()


# Their step updates each parameter from its own gradient and state alone (no global norm, no
# shared counter), so stepping the parameters in two calls equals stepping them in one.
_PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                             torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                             torch.optim.Adadelta)


class _EarlyUpdate:
    """One bound optimizer's first stage (see the note above): the parameters of the modules the
    next forward gathers first are updated inside the step's pre hook, then their compute weights
    are refreshed and gathered on the all-gather stream (ZeRO-1/2 refresh by a gather too); the
    body then sees only the other parameters' gradients, and ``finish`` puts the hidden ones back."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, groups: list) -> None:
        self._model = weakref.ref(model)  # weak: the optimizer's hooks hold this object
        self._own = {id(g) for g in groups}
        self._body = _compat.optimizer_step_body(optimizer) if type(optimizer) in _PER_PARAMETER_OPTIMIZERS else None
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._refreshed: set[int] = set()
        self._found: Optional[list] = None
        self._split_key: Optional[tuple] = None
        self._split_params: tuple[list, list] = ([], [])

    def _contexts(self) -> list:
        """The contexts of the FSDP roots in the model (built by its first forward; then kept)."""
        from mfsdp.runtime.module import fsdp_roots

        if self._found is None:
            model, seen = self._model(), {}
            for root in fsdp_roots(model) if model is not None else ():
                if root._context is not None:
                    seen[id(root._context)] = root._context
            self._found = list(seen.values()) or None
        return [ctx for ctx in self._found or () if ctx.prefetch_across_step]

    def run(self, optimizer, args, kwargs, handle) -> None:
        """In the step's pre hook, when it is the last one (a later hook may still edit gradients)."""
        self._refreshed = set()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self._body is None or closure is not None or not _compat.is_last_step_pre_hook(optimizer, handle):
            return
        contexts = self._contexts()
        if not contexts:
            return  # no forward yet, or the policy is off
        first = [(ctx, ctx.first_forward_modules()) for ctx in contexts]
        early = [g for _, modules in first for m in modules for g in m.parameter_groups if id(g) in self._own]
        early_params, later_params = self._split(optimizer, early)
        with torch.profiler.record_function("mfsdp::optimizer_step_first_modules"):
            later = _hide(later_params)
            try:
                self._body(*args, **kwargs)
            finally:
                _restore(later)
        # The early groups, stale since the pre hook, are refreshed by their unshard, on the
        # all-gather stream, beside the rest.
        self._refreshed = {id(g) for g in early}
        for ctx, modules in first:
            ctx.gather_for_next_forward(modules)
        self._hidden = _hide(early_params)

    def _split(self, optimizer, early) -> tuple[list, list]:
        """The optimizer's parameters of the ``early`` groups, and all the others; kept until the
        optimizer's param groups change (``add_param_group``)."""
        key = tuple(len(pg["params"]) for pg in optimizer.param_groups)
        if self._split_key != key:
            ids = {id(p) for g in early if g.requires_grad for p in g.sharded_params}
            params = [p for pg in optimizer.param_groups for p in pg["params"]]
            self._split_key = key
            self._split_params = ([p for p in params if id(p) in ids], [p for p in params if id(p) not in ids])
        return self._split_params

    def finish(self) -> set[int]:
        """In the post hook: the hidden gradients return; the groups already refreshed."""
        _restore(self._hidden)
        self._hidden = []
        return self._refreshed


def _hide(params) -> list:
    """Detach the gradients of ``params`` (the step skips a parameter without one); returns what
    ``_restore`` puts back."""
    hidden = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    return hidden


def _restore(hidden) -> None:
    for p, grad in hidden:
        p.grad = grad


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
