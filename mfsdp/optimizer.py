"""Binding torch optimizers to the main-weight shards.

Elementwise optimizers (SGD, Adam, AdamW: foreach or fused) step directly on the sharded DTensor
parameters. What mfsdp adds around ``step()``:

* the step runs group by group: the optimizer's body is called on a few consecutive parameter
  groups at a time, on their parameters only (one foreach or fused launch set per call). Gradients
  kept in another dtype than the main weights (``main_grads_dtype``, bf16 in ``mfsdp train``) are
  upcast to the main dtype (one fused cast of each group's main gradient) just before the call and
  freed right after it, because torch's optimizers want matching dtypes. The step's extra memory
  is therefore the largest group's fp32 gradient (plus, for foreach AdamW, its one group-sized
  temporary), or ``STEP_CALL_BYTES`` if that is more, not the model's: ``step_transient_bytes`` is
  the rule, and the planner calls it. A call takes as many groups as fit those bytes
  (``step_batches``): all of them where no group has a transient (fused AdamW on main-dtype
  gradients), two blocks beside an embedding-sized group otherwise; the price is that many calls
  instead of one (a dozen launches each). The sharded parameters of such groups accept a ``.grad``
  of any dtype (``grad_dtype = None``, set by the parameter group), so torch's state-dict helpers
  can attach main-dtype zeros to a fresh optimizer;
* after: the compute weights are re-derived from the main weights once per group (one fused cast,
  plus the all-gather that rebuilds replicated weights for ZeRO-1/2).

Stepping in several calls equals stepping in one only for optimizers that update each parameter
from its own gradient and state (torch's elementwise classes, ``_PER_PARAMETER_OPTIMIZERS``), and
only when nothing runs between mfsdp's pre hook and the body: with another class, a closure, or a
pre hook registered after binding (it may still edit the gradients), the step keeps the one-call
form, with every group's gradients upcast at once (the whole model's fp32 gradients as transient).

Plain optimizers that were not bound still work where no upcast is needed: a global step hook
marks their groups stale and the next unshard refreshes them on the all-gather stream.

[Note: the next forward's first gathers during the step]
The next forward starts with the root's gather (the embedding, often the largest group) and its
prefetch; issued by the forward, nothing hides them. With ``prefetch_across_step`` the groups of
those first modules step first, then their weights are cast and gathered on the all-gather stream,
then every other group steps, its update overlapping the gathers. The hooks around ``step`` still
run once. Cost: the early modules' full weights are held from the step on, which is where the
forward would have put them a moment later.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mfsdp import _compat, kernels
from mfsdp.flat_adamw import FlatAdamW
from mfsdp.offload import OffloadedStep, OffloadPolicy, bind, offload_of
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


def _free_gradients_on_zero_grad(optimizer: torch.optim.Optimizer, groups: list,
                                 offloaded: Optional[OffloadedStep] = None) -> None:
    """``zero_grad(set_to_none=True)`` frees the gradient buffers right away.

    Otherwise they would stay allocated until the next forward (where the root frees them), and
    the bytes between the step and that forward would be the step's peak. torch has no zero_grad
    hook, so the bound optimizer's method is wrapped on the instance.
    """
    zero_grad = optimizer.zero_grad

    def zero_grad_and_free(set_to_none: bool = True) -> None:
        if offloaded is not None:
            offloaded.discard()  # a group staged or speculated in backward and not stepped
        zero_grad(set_to_none=set_to_none)
        if set_to_none:
            for group in groups:
                if group.requires_grad:
                    group.reducer.release_unused_memory()

    optimizer.zero_grad = zero_grad_and_free


def fully_shard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                          offload: Optional[OffloadPolicy] = None,
                          flat_adamw: bool = False) -> torch.optim.Optimizer:
    """Register an already-built optimizer with a sharded model; returns the same optimizer.

    The optimizer keeps its param groups and their settings. Build it on ``model.parameters()``
    after ``fully_shard``, so it holds the sharded main weights. ``offload``: step the units it
    chooses on the host, their master weights and states in host memory (``mfsdp.offload``); it
    needs an elementwise torch optimizer (the group-by-group step). ``flat_adamw``: step
    ``torch.optim.AdamW`` one pass per parameter group over its flat buffers (``mfsdp.flat_adamw``).
    """
    groups = _groups_of(optimizer)
    if not groups:
        raise ValueError(
            "the optimizer holds no mfsdp-sharded parameters; build it on model.parameters() after "
            "fully_shard(model, ...)"
        )
    if optimizer in _BOUND_OPTIMIZERS:
        if offload is not None and offload_of(optimizer) is None:
            raise ValueError("this optimizer is already bound without offload; bind it once, with offload")
        return optimizer
    upcast_groups = [g for g in groups if _upcasts(g)]
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    grouped = _GroupedStep(model, optimizer, groups, offload, flat_adamw)

    def pre_step(opt, args, kwargs):
        if grouped.offloaded is not None:
            grouped.offloaded.before_step()  # before the epochs move: it compares them
        for group in groups:  # first: every post hook, in any order, sees the weights as written
            group.weights_written()
        if not grouped.run(opt, args, kwargs, pre_hook):  # the one-call form: every group upcast at once
            if grouped.offloaded is not None:
                raise RuntimeError("an offloaded optimizer steps group by group: no closure, and no step "
                                   "pre hook registered after fully_shard_optimizer")
            for group in upcast_groups:
                swapped.extend(_upcast_gradients(group))

    def post_step(opt, args, kwargs):
        refreshed = grouped.finish()
        _restore(swapped)
        swapped.clear()
        _refresh([g for g in groups if id(g) not in refreshed])

    pre_hook = optimizer.register_step_pre_hook(pre_step)
    optimizer.register_step_post_hook(post_step)
    _free_gradients_on_zero_grad(optimizer, groups, grouped.offloaded)
    _BOUND_OPTIMIZERS.add(optimizer)
    return optimizer


STEP_CALL_BYTES = 64 << 20
"""A call of the optimizer's body takes consecutive groups while their transient fits the largest
group's or this, whichever is more (``step_batches``). Below it a call's host time costs more than
its memory is worth: a call is a dozen foreach launches
(``benchmarks/results/2026-12-01_cpu_host_ab_session4.md``)."""


def step_batches(step_bytes: list[int]) -> list[list[int]]:
    """Consecutive groups stepped by one call of the optimizer's body, as index lists:
    ``step_bytes`` are the groups' transient bytes (``step_transient_bytes``), and a call takes as
    many as fit the largest one's or ``STEP_CALL_BYTES``: all of them where no group has a
    transient (fused AdamW on main-dtype gradients), two blocks beside an embedding-sized group."""
    budget, batches, held = max([*step_bytes, STEP_CALL_BYTES]), [], 0
    for i, nbytes in enumerate(step_bytes):
        if batches and held + nbytes <= budget:
            batches[-1].append(i)
            held += nbytes
        else:
            batches.append([i])
            held = nbytes
    return batches


def step_transient_bytes(groups, foreach_temporary: bool, flat: bool = False) -> int:
    """The bound step's extra bytes at its peak: the largest of one call's (``step_batches``), since
    each call's are freed before the next one steps. ``groups``: (bytes of the group's optimizer
    shard in the main dtype, whether its gradients are upcast to that dtype) for each group with
    gradients, in step order. A group's bytes: its upcast gradient, plus ``foreach_temporary``
    (foreach AdamW keeps one shard-sized temporary per call; fused keeps none); none at all where
    the groups step ``flat`` (``mfsdp.flat_adamw`` reads the gradients in their own dtype, in
    place). The planner predicts the step with it."""
    if flat:
        return 0
    sizes = [group_step_bytes(nbytes, upcast, foreach_temporary) for nbytes, upcast in groups]
    return max((sum(sizes[i] for i in batch) for batch in step_batches(sizes)), default=0)


def group_step_bytes(nbytes: int, upcast: bool, foreach_temporary: bool) -> int:
    """One group's transient in a step: its upcast gradient and foreach's temporary, each the size
    ``nbytes`` of its optimizer shard in the main dtype."""
    return nbytes * (upcast + foreach_temporary)


def _upcasts(group) -> bool:
    return group.requires_grad and group.dtypes.grads != group.dtypes.main


def _upcast_gradients(group) -> list:
    """Give the group's parameters their gradients in the main dtype; returns what ``_restore``
    puts back (dropping the upcast copy). The runtime's gradients are views of one fused cast of
    the main gradient; a gradient the user attached is cast on its own."""
    main_dtype, fused, swapped = group.dtypes.main, None, []
    for i, p in enumerate(group.sharded_params):
        grad = p.grad
        if grad is None or grad.dtype == main_dtype:
            continue  # nothing to step, or already in the optimizer's dtype (state-dict init)
        if fused is None:
            fused = _upcast_main_grad(group)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if fused and _shares_storage(local, group.reducer.main_grad.tensor):
            upcast = fused[i]  # the runtime's gradient: a view of the one fused cast
        else:  # a gradient the user attached: cast on its own
            upcast = local.to(main_dtype)
        swapped.append((p, grad))
        p.grad = DTensor.from_local(upcast, p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    return swapped


def _refresh(groups) -> None:
    with torch.profiler.record_function("mfsdp::refresh_model_weights"):
        for group in groups:
            group.refresh_if_stale()


# Their step updates each parameter from its own gradient and state alone (no global norm, no
# shared counter), so stepping the parameters in several calls equals stepping them in one.
_PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                             torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                             torch.optim.Adadelta)


class _GroupedStep:
    """One bound optimizer's step, group by group (see the notes above), inside the step's pre
    hook: each group's parameters are stepped by one call of the optimizer's body that sees only
    them (its param groups narrowed to them), with its gradients upcast just before and freed just
    after; the groups of the modules the next forward gathers first step first, then those
    modules' compute weights are refreshed and gathered on the all-gather stream (ZeRO-1/2
    refresh by a gather too) while the other groups step. Then the gradients of every stepped
    parameter are hidden, so that torch's own call of the body steps only the parameters no group
    owns (a plain parameter added with ``add_param_group``); ``finish`` puts them back."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, groups: list,
                 offload: Optional[OffloadPolicy] = None, flat_adamw: bool = False) -> None:
        self._model = weakref.ref(model)  # weak: the optimizer's hooks hold this object
        self._groups = groups
        self._own = {id(g) for g in groups}
        self._body = _compat.optimizer_step_body(optimizer) if type(optimizer) in _PER_PARAMETER_OPTIMIZERS else None
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._refreshed: set[int] = set()
        self._found: Optional[list] = None
        self._params_key: Optional[tuple] = None
        self._by_group: dict[int, list[tuple[int, list]]] = {}
        # Each group's transient (``step_batches``' input), fixed by the group and the optimizer's kernel.
        foreach_temporary = not optimizer.defaults.get("fused")
        self._step_bytes = {id(g): group_step_bytes(g.main.tensor.numel() * g.main.tensor.element_size(),
                                                    _upcasts(g), foreach_temporary) for g in groups}
        self.offloaded: Optional[OffloadedStep] = None  # the groups stepped on the host
        self.flat = FlatAdamW(optimizer) if flat_adamw and self._body is not None and FlatAdamW.supports(optimizer) \
            else None
        if offload is not None:
            if self._body is None:
                raise ValueError(f"offload needs one of torch's elementwise optimizers "
                                 f"({', '.join(c.__name__ for c in _PER_PARAMETER_OPTIMIZERS)}), got "
                                 f"{type(optimizer).__name__}")
            self.offloaded = bind(model, optimizer, groups, offload, self.params_of)

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

    def run(self, optimizer, args, kwargs, handle) -> bool:
        """In the step's pre hook; whether it stepped the groups (False: the one-call form, when
        the class is not known to be per-parameter, a closure is given, or a later pre hook may
        still edit the gradients)."""
        self._refreshed = set()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self._body is None or closure is not None or not _compat.is_last_step_pre_hook(optimizer, handle):
            return False
        params_of = self.params_of(optimizer)
        first = [(ctx, ctx.first_forward_modules()) for ctx in self._contexts()]  # none before a forward
        early = list({id(g): g for _, modules in first for m in modules for g in m.parameter_groups
                      if id(g) in self._own}.values())
        early_ids = {id(g) for g in early}
        if early:
            with torch.profiler.record_function("mfsdp::optimizer_step_first_modules"):
                self._step_groups(optimizer, early, params_of, args, kwargs)
            # The early groups, stale since the pre hook, are refreshed by their unshard, on the
            # all-gather stream, beside the rest.
            self._refreshed = early_ids
            for ctx, modules in first:
                ctx.gather_for_next_forward(modules)
        with torch.profiler.record_function("mfsdp::optimizer_step_groups"):
            self._step_groups(optimizer, [g for g in self._groups if id(g) not in early_ids], params_of, args, kwargs)
        self._hidden = _hide(p for entries in params_of.values() for _, params in entries for p in params)
        if self.offloaded is not None and self.offloaded.defers_refresh:
            # Refreshed by their next unshard, on the all-gather stream, after their copy up.
            self._refreshed |= {id(g) for g in self.offloaded.groups}
        return True

    def _step_groups(self, optimizer, groups, params_of, args, kwargs) -> None:
        """Step ``groups`` in order: the offloaded ones on the host, the others in ``step_batches``."""
        stepped = [g for g in groups if params_of.get(id(g)) and g.requires_grad]
        on_host = self.offloaded.owns if self.offloaded is not None else (lambda group: False)
        if self.flat is not None:  # one pass over each eligible group's flat buffers
            stepped = [g for g in stepped if not self._stepped_flat(g, params_of[id(g)], on_host(g))]
        for host, run in itertools.groupby(stepped, key=on_host):
            run = list(run)
            if host:
                for group in run:
                    self.offloaded.step_group(optimizer, group, params_of[id(group)])
                continue
            for batch in step_batches([self._step_bytes[id(g)] for g in run]):
                self._call_body(optimizer, [run[i] for i in batch], params_of, args, kwargs)

    def _stepped_flat(self, group, entries, on_host: bool) -> bool:
        """Whether ``group`` was stepped flat; if not, torch's body steps it next."""
        if not on_host and self.flat.can_step(group, entries) and self.flat.step(group, entries):
            return True
        self.flat.stepped_by_torch(group)
        return False

    def _call_body(self, optimizer, groups, params_of, args, kwargs) -> None:
        """One call of the body on the parameters of ``groups``; their upcast gradients die with it."""
        everything = optimizer.param_groups
        swapped = [pair for g in groups if _upcasts(g) for pair in _upcast_gradients(g)]
        merged: dict[int, list] = {}
        for group in groups:
            for i, params in params_of[id(group)]:
                merged.setdefault(i, []).extend(params)
        # Fresh dicts each step: a scheduler's writes to the param groups (lr) are read live.
        optimizer.param_groups = [{**everything[i], "params": params} for i, params in sorted(merged.items())]
        try:
            self._body(*args, **kwargs)
        finally:
            optimizer.param_groups = everything
            _restore(swapped)

    def params_of(self, optimizer) -> dict[int, list[tuple[int, list]]]:
        """id(group) -> [(index of an optimizer param group, its parameters in the group)]; kept
        until the optimizer's param groups change (``add_param_group``)."""
        key = tuple(len(pg["params"]) for pg in optimizer.param_groups)
        if self._params_key != key:
            params_of: dict[int, list[tuple[int, list]]] = {}
            for i, pg in enumerate(optimizer.param_groups):
                by_group: dict[int, list] = {}
                for p in pg["params"]:
                    group = GROUP_OF_SHARDED.get(p)
                    if group is not None and id(group) in self._own:
                        by_group.setdefault(id(group), []).append(p)
                for gid, params in by_group.items():
                    params_of.setdefault(gid, []).append((i, params))
            self._params_key, self._by_group = key, params_of
        return self._by_group

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
    main_grad = group.reducer.main_grad
    if main_grad is None or not main_grad.is_allocated:
        return []
    flat = main_grad.tensor
    # At copy bandwidth on CUDA (``mfsdp.kernels``: ``Tensor.to`` widens unvectorized), the same bits.
    upcast = kernels.to_fp32(flat) if group.dtypes.main == torch.float32 else flat.to(group.dtypes.main)
    layout, geometry = group.layout, group.geometry
    return layout.shards(layout.regions(upcast, geometry.num_shards), geometry.shard_index)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
