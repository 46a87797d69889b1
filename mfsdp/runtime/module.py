"""FsdpModule: the mixin ``fully_shard`` attaches to a module, and what its hooks drive.

Per module and step::

    pre_forward   the forward walk reaches the module: unshard (or find it prefetched), wait for its
                  event, prefetch the next modules
    post_forward  swap the sharded parameters back and release the unsharded storage
    pre_backward  a hook on the module's outputs: the backward walk may advance to its ENTER step
    inputs' grad  the backward of the module's inputs: the walk may advance to its EXIT step
                  (reshard, then reduce)

Hooks only say how far the walk may go; the walk itself (``FsdpContext``, ``schedule``) performs
the steps of every module before that point in a static order, so what each rank issues does not
depend on which modules ran there. Per-parameter gradient hooks record nothing but the misuse of a
gradient that arrives after its module was reduced.

The mixin keeps the phase, the one record of whether the module is unsharded (its unshard event, a
kept gather's epochs) and the driving of its groups. Beside it: ``hooks`` (registering the hooks and
marking a forward's inputs and outputs), ``conversion`` (``_apply`` and state-dict loads keep the
shards), ``ownership`` (which parameters it takes and how they group, ``_take_ownership`` here builds
the groups from them) and ``build_context`` below.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from mfsdp import _compat
from mfsdp.communication import CommunicationPolicy
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.placement import Placements
from mfsdp.runtime.context import FsdpContext
from mfsdp.runtime.conversion import apply_keeping_shards
from mfsdp.runtime.errors import ORDER_HELP
from mfsdp.runtime.gather_slots import GatherSlots
from mfsdp.runtime.geometry import ShardGeometry
from mfsdp.runtime.hooks import hook_inputs, hook_outputs, register_hooks
from mfsdp.runtime.ownership import check_parameter_locations, gathers_in_backward, unit_groups
from mfsdp.runtime.parameter_group import FsdpParameterGroup
from mfsdp.runtime.registry import GROUP_OF_SHARDED, OWNER_OF_PARAMETER
from mfsdp.runtime.schedule import Schedule, StepKind

_CPU_READY = object()  # unshard "event" on devices without streams: the work is already done


class ModulePhase(enum.Enum):
    """A module's phase; every transition goes from IDLE or back to it (``_set_phase``)."""

    IDLE = "idle"  # between passes; sharded (the root may keep its storage until backward)
    FORWARD = "forward"  # between pre_forward and post_forward
    BACKWARD = "backward"  # between the ENTER and EXIT steps of the backward walk (recompute included)


class FsdpModule:
    """Mixin attached to modules managed by mfsdp (see ``fully_shard``)."""

    def __init__(self, mesh: DeviceMesh, placements: Placements, mixed_precision_policy: MixedPrecisionPolicy,
                 use_symm_mem: bool = False, communication_policy: Optional[CommunicationPolicy] = None) -> None:
        # Runs on an already-built module whose class now mixes this in: no nn.Module.__init__.
        self._name: Optional[str] = None
        self._context: Optional[FsdpContext] = None
        self._fsdp_parent: Optional[weakref.ref] = None
        self._phase = ModulePhase.IDLE
        self._unshard_event: Any = None
        self._calls: list[int] = []  # per visit (``schedule.Visit``): calls whose inputs' backward is to come
        self._use_symm_mem = use_symm_mem
        self._communication_policy = communication_policy or CommunicationPolicy()
        # CommunicationPolicy.keep_gathered: the weights epochs of the kept gather (None: none kept)
        self._kept_epochs: Optional[tuple] = None
        self._parameter_groups = _take_ownership(self, ShardGeometry(mesh, placements), mixed_precision_policy)
        register_hooks(self)

    # ----------------------------------------------------------------------------- properties
    @property
    def context(self) -> FsdpContext:
        """Return the initialized runtime context."""
        if self._context is None:
            raise RuntimeError(f"{type(self).__name__} has no FsdpContext yet: run a forward of its root first")
        return self._context

    @property
    def name(self) -> str:
        """This module's name relative to its root ("" for the root)."""
        return self._name if self._name is not None else type(self).__name__

    @property
    def parameter_groups(self) -> tuple[FsdpParameterGroup, ...]:
        """Parameter groups owned by this FsdpModule."""
        return self._parameter_groups

    @property
    def phase(self) -> ModulePhase:
        return self._phase

    def is_idle(self) -> bool:
        return self._phase is ModulePhase.IDLE

    def is_unsharded(self) -> bool:
        """Whether this module's unshard was issued (prefetched or gathered) and not yet undone; a
        kept gather (``keeps_gathered``) of weights written since does not count."""
        return self._unshard_event is not None and not self._kept_is_stale()

    def keeps_gathered(self) -> bool:
        """Whether this module's gathered weights stay until the weights change
        (``CommunicationPolicy.keep_gathered``)."""
        return self._communication_policy.keep_gathered

    def _kept_is_stale(self) -> bool:
        """A kept gather whose source was written since (a step, a load, ``refresh_model_weights``).
        The groups' epochs, not their full ``weights_token``: this runs at every unshard and reshard
        of the step, and a token reads two version counters per parameter (64 us a block)."""
        return self._kept_epochs is not None and self._kept_epochs != self._weights_epochs()

    def _weights_epochs(self) -> tuple:
        return tuple(group.weights_epoch for group in self._parameter_groups)

    def fsdp_parent(self) -> Optional["FsdpModule"]:
        """The nearest FSDP module above this one (None for a root)."""
        return self._fsdp_parent() if self._fsdp_parent is not None else None

    def is_root(self) -> bool:
        """Whether this module is the outermost FsdpModule in its context (before the context is
        built: has no FSDP parent). The one rule; ``fsdp_roots`` finds the roots by it."""
        if self._context is not None:
            return self._context.root_module is self
        return self._fsdp_parent is None

    def refresh_model_weights(self) -> None:
        """Re-derive the compute weights from the main weights now (after editing them in place).

        Optimizer steps and ``load_state_dict`` trigger this by themselves.
        """
        for group in self._parameter_groups:
            group.weights_written()
            group.refresh_if_stale()

    def _apply(self, fn, recurse: bool = True):
        """``to_empty``, ``to``, ``cuda``, ``float``... on a sharded module: buffers convert as usual;
        mfsdp's parameters keep their shards (``conversion``)."""
        units = [m for _, m in fsdp_modules(self)] if recurse else [self]
        groups = [g for m in units for g in m._parameter_groups]
        return apply_keeping_shards(self, fn, recurse, groups, super()._apply)

    def _set_phase(self, phase: ModulePhase) -> None:
        if (phase is ModulePhase.IDLE) == (self._phase is ModulePhase.IDLE):  # IDLE <-> FORWARD, BACKWARD
            raise RuntimeError(f"mfsdp: illegal phase transition {self._phase.name} -> {phase.name} in {self.name}")
        self._phase = phase

    def _nvtx_label(self, phase: str) -> str:
        return f"mfsdp::{phase} {self.name or 'root'}"

    # -------------------------------------------------------------------------------- forward
    def pre_forward(self, args=(), kwargs=None):
        """Unshard for forward compute (the walk prefetches the next modules)."""
        ctx = build_context(self)
        with record_function(self._nvtx_label("pre_forward")):
            if _compat.backward_is_running():  # a checkpoint's recompute: backward needs the weights
                self.pre_backward()
                self._use_for_compute()
                return args, kwargs
            if self.is_root():
                ctx.begin_forward()
            self._set_phase(ModulePhase.FORWARD)
            visit = ctx.forward_reached(self)
            self._use_for_compute()
            if visit is not None or not self._calls:
                del self._calls[visit or 0:]
                self._calls.append(0)
            if torch.is_grad_enabled():
                # Every call counts; only calls whose inputs need grad can report their backward,
                # so the EXIT signal fires only when all calls of this visit have reported.
                self._calls[-1] += 1
                args, kwargs = hook_inputs(self, args, kwargs or {})
        return args, kwargs

    def post_forward(self, output):
        """Return parameters to their sharded resting state after forward compute."""
        ctx = self.context
        with record_function(self._nvtx_label("post_forward")):
            if _compat.backward_is_running():  # recompute: backward needs the weights next
                return output
            self._set_phase(ModulePhase.IDLE)
            self._use_sharded_params()
            training = torch.is_grad_enabled()
            if training:
                hook_outputs(self, output)
            if self.is_root():
                ctx.end_forward()
            if not (training and self.is_root()):  # the root keeps its storage for backward
                self.reshard()
        return output

    # ------------------------------------------------------------------------------- backward
    def pre_backward(self) -> None:
        """A gradient reached this module's outputs (or its recompute began): the backward walk may
        enter it."""
        if self._phase is not ModulePhase.BACKWARD and not self.context.backward_reached(StepKind.ENTER, self):
            raise RuntimeError(
                f"mfsdp: {self.name or 'the root'} started its backward after the backward schedule had "
                f"passed it (its gradients were already reduced, as zeros, in this backward). {ORDER_HELP}")

    def _on_inputs_backward(self) -> None:
        if self._calls:
            self._calls[-1] = max(0, self._calls[-1] - 1)
        if not (self._calls and self._calls[-1]) and self._phase is ModulePhase.BACKWARD:
            self.context.backward_reached(StepKind.EXIT, self)

    def enter_backward(self, ran: bool) -> None:
        """The walk's ENTER step: unshard (and, where this rank runs the backward, make the
        unsharded parameters current). A module this rank skipped is only gathered."""
        with record_function(self._nvtx_label("pre_backward")):
            if ran:
                self._set_phase(ModulePhase.BACKWARD)
            if ran and self.gathers_in_backward:
                self._use_for_compute()
            elif self.gathers_in_backward:
                self.unshard()

    def exit_backward(self, reduce: bool = True) -> None:
        """The walk's EXIT step: reshard, then reduce (a missing gradient counts as zero). A visit's
        EXIT (``reduce=False``) leaves the gradients in ``.grad`` for the module's last EXIT."""
        with record_function(self._nvtx_label("post_backward")):
            if self._phase is ModulePhase.BACKWARD:
                self._set_phase(ModulePhase.IDLE)
            if self._calls:
                self._calls.pop()
            self._use_sharded_params()
            self.reshard()  # free first: the reduction allocates
            if reduce:
                self._reduce_gradient_groups()

    def _reduce_gradient_groups(self) -> None:
        """Pack gradients and immediately launch their reductions."""
        groups = [g for g in self._parameter_groups if g.requires_grad]
        if not groups:
            return
        ctx = self.context
        with record_function(self._nvtx_label("reduce_gradients")):
            nbytes = sum(g.reducer.reduction_nbytes for g in groups)
            ctx.pending_reductions.release(ctx.current_stream(), nbytes)
            keep_alive: list = []
            for group in groups:
                keep_alive.extend(group.reduce_gradients(ctx.is_last_microbatch, ctx.reduce_scatter_stream,
                                                         ctx.tag_check.record_for(ctx.schedule.exit_position[id(self)])))
            ctx.pending_reductions.track(ctx.reduce_scatter_stream, keep_alive, nbytes)

    # ------------------------------------------------------------------------ unshard/reshard
    def unshard(self, prefetch: bool = False) -> bool:
        """Unshard this module's parameter groups on the all-gather stream; False if a prefetch
        was declined.

        A set ``_unshard_event`` means already unsharded or prefetched: no-op. Otherwise the event
        is recorded after the gather, so compute waits for exactly this module's data. A prefetch
        whose gather slot is still busy is declined; the module then gathers just in time (the slot
        states are the same on every rank at the same point of the walk, so is the decision).
        """
        if self._unshard_event is not None:
            if not self._kept_is_stale():
                return True  # gathered already, or kept from an earlier gather of these weights
            self._release()  # kept, but the weights changed since: gather afresh
        if prefetch and not all(group.can_unshard() for group in self._parameter_groups):
            return False
        stream = self.context.allgather_stream
        with record_function(self._nvtx_label("unshard")):
            for group in self._parameter_groups:
                group.refresh_if_stale(stream)
                group.unshard(stream)
            self._unshard_event = stream.record_event() if stream is not None else _CPU_READY
            if self.keeps_gathered():
                self._kept_epochs = self._weights_epochs()
        return True

    def _use_for_compute(self) -> None:
        """Unshard (or find it unsharded), make compute wait for exactly this module's gather, and
        put the unsharded parameters into the module."""
        self.unshard()
        if self._unshard_event is not _CPU_READY:
            self.context.current_stream().wait_event(self._unshard_event)
        for group in self._parameter_groups:
            group.use_unsharded_params()

    def reshard(self) -> None:
        """Release unsharded storage once compute is done; the next user gathers afresh. A module
        that keeps its gather (``keeps_gathered``) releases it only once the weights have changed."""
        if self._unshard_event is None or (self._kept_epochs is not None and not self._kept_is_stale()):
            return
        self._release()

    def _release(self) -> None:
        ctx = self.context
        stream = ctx.allgather_stream
        with record_function(self._nvtx_label("reshard")):
            if stream is not None:
                stream.wait_stream(ctx.current_stream())
            for group in self._parameter_groups:
                group.reshard(stream)
        self._unshard_event = None
        self._kept_epochs = None

    def _use_sharded_params(self) -> None:
        for group in self._parameter_groups:
            group.use_sharded_params()


def _take_ownership(module: FsdpModule, geometry: ShardGeometry,
                    mixed_precision_policy: MixedPrecisionPolicy) -> tuple[FsdpParameterGroup, ...]:
    """The parameter groups of the parameters under ``module`` that no FSDP descendant owns, each
    registered with its owner; the descendants learn their FSDP parent."""
    owned, children, grouped = unit_groups(module, FsdpModule, mixed_precision_policy)
    module.gathers_in_backward = gathers_in_backward(module, owned)
    for child in children:
        child._fsdp_parent = weakref.ref(module)
    groups = []
    for params, aliases, dtypes in grouped:
        label = f"{type(module).__name__}[{params[0].dtype}, requires_grad={params[0].requires_grad}]"
        groups.append(FsdpParameterGroup(params, aliases, geometry, dtypes, label, module._communication_policy))
    for group in groups:
        for orig, sharded in zip(group.params, group.sharded_params):
            OWNER_OF_PARAMETER[orig] = module
            OWNER_OF_PARAMETER[sharded] = module
            GROUP_OF_SHARDED[sharded] = group
    return tuple(groups)


def fsdp_modules(module: nn.Module) -> list[tuple[str, FsdpModule]]:
    """The FSDP modules under ``module`` (itself included), named relative to it, in registration
    pre-order: the one walk that finds a tree's units."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FsdpModule)]


def fsdp_roots(module: nn.Module) -> list[FsdpModule]:
    """The FSDP roots under ``module`` (``FsdpModule.is_root``)."""
    return [m for _, m in fsdp_modules(module) if m.is_root()]


def build_context(root: FsdpModule) -> FsdpContext:
    """Build the context of the FSDP tree under ``root`` on its first forward (or first ``microbatch``
    scope); later calls return it.

    fully_shard is applied bottom-up, so children exist before their eventual root. The root is
    therefore resolved lazily, on the first forward through the outermost FsdpModule, and shares one
    context with every FSDP descendant. Rejected alternatives: eager contexts per fully_shard call
    (transient child contexts, and every parent re-walks its descendants: quadratic), and an is_root
    flag on every module (per-module state that must be kept consistent with the final hierarchy).
    """
    if root._context is not None:
        return root._context
    parent = root.fsdp_parent()
    if parent is not None:
        raise RuntimeError(
            f"{type(root).__name__} ran forward before its FSDP root {type(parent).__name__} ever "
            "did; run the root module's forward (it calls this one), not a sharded child directly"
        )
    modules = fsdp_modules(root)
    device = next((g.params[0].device for _, m in modules for g in m.parameter_groups), None)
    if device is None:
        raise RuntimeError(f"{type(root).__name__}: no parameters under this FSDP root")
    for name, module in modules:
        if module._context is not None:
            raise RuntimeError(
                f"FSDP module {name!r} already ran forward as its own root before {type(root).__name__} "
                "was sharded; shard bottom-up and only then run the model")
        if module is not root and module.fsdp_parent() is None:
            raise RuntimeError(f"FSDP module {name!r} has no FSDP parent under {type(root).__name__}; "
                               "apply fully_shard bottom-up, the root last")
    parent_of = {id(m): m.fsdp_parent() for _, m in modules[1:]}
    policy = root._communication_policy
    ctx = FsdpContext(device, root, Schedule([m for _, m in modules], parent_of), policy)
    for name, module in modules:
        module._context, module._name = ctx, name
        for group in module.parameter_groups:
            group.issue.name = name or "<root>"
            if group.requires_grad:
                group.reducer.set_tags(*ctx.schedule.reduction_tags(module, name))
    check_parameter_locations(root, FsdpModule)
    if policy.double_buffer:
        # The root keeps its weights from forward into backward, so it never shares a slot.
        # A module that keeps its gather would hold its slot for the whole step: it keeps its own buffer.
        gathered = [g for _, m in modules if m is not root and not m.keeps_gathered()
                    for g in m.parameter_groups if g.gather_key() is not None]
        ctx.gather_slots = GatherSlots.build(gathered, ctx.prefetch_depth, register=root._use_symm_mem)
    return ctx
