"""FsdpModule: the mixin ``fully_shard`` attaches to a module, and the hooks that drive it.

Per module and step::

    pre_forward   unshard (or find it prefetched), wait for its event, prefetch the next module
    post_forward  swap the sharded parameters back and release the unsharded storage
    pre_backward  unshard again (the root kept its storage), prefetch the next in backward order
    post_backward once every trainable parameter has its gradient: reshard, then reduce

[Note: when a module's gradients are reduced]
The trigger is the seed's: the last post-accumulate-grad hook of the module's trainable
parameters. A parameter that got no gradient on this rank (a routed expert, an unused branch)
would stall that trigger, so two fallbacks exist, both at a point every rank reaches in the same
order: the backward of the module's inputs (just after the module's own backward), and the end of
autograd for modules without such inputs. A missing gradient then counts as zero, and the
reduction still runs on every rank, in the same order, so no collective can mismatch.
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
from mfsdp.runtime.gather_slots import GatherSlots
from mfsdp.runtime.geometry import ShardGeometry
from mfsdp.runtime.parameter_group import FsdpParameterGroup
from mfsdp.runtime.ownership import (
    check_parameter_locations,
    collect_backward_order,
    collect_owned_parameters,
    group_parameters,
)
from mfsdp.runtime.registry import GROUP_OF_SHARDED, OWNER_OF_PARAMETER

_CPU_READY = object()  # unshard "event" on devices without streams: the work is already done


class ModulePhase(enum.Enum):
    IDLE = "idle"  # between passes; sharded (the root may keep its storage until backward)
    FORWARD = "forward"  # between pre_forward and post_forward
    BACKWARD = "backward"  # between pre_backward and post_backward (recompute forwards included)


_TRANSITIONS = {
    ModulePhase.IDLE: {ModulePhase.FORWARD, ModulePhase.BACKWARD},
    ModulePhase.FORWARD: {ModulePhase.IDLE},
    ModulePhase.BACKWARD: {ModulePhase.IDLE},
}


class _PostBackwardFallback(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs right after the module's own backward."""

    @staticmethod
    def forward(ctx, module_ref, *tensors):
        ctx.module_ref = module_ref
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        module = ctx.module_ref()
        if module is not None:
            module._on_inputs_backward()
        return (None,) + grads


class FsdpModule:
    """Mixin attached to modules managed by mfsdp (see ``fully_shard``)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Placements,
        mixed_precision_policy: MixedPrecisionPolicy,
        use_symm_mem: bool = False,
        communication_policy: Optional[CommunicationPolicy] = None,
    ) -> None:
        # Runs on an already-built module whose class now mixes this in: no nn.Module.__init__.
        self._name: Optional[str] = None
        self._context: Optional[FsdpContext] = None
        self._fsdp_parent: Optional[weakref.ref] = None
        self._phase = ModulePhase.IDLE
        self._unshard_event: Any = None
        self._ready_grad_parameters: set[int] = set()
        self._backward_pending = False
        self._inputs_hooked = 0
        self._use_symm_mem = use_symm_mem
        self._communication_policy = communication_policy or CommunicationPolicy()
        owned, children = collect_owned_parameters(self, FsdpModule)
        for child in children:
            child._fsdp_parent = weakref.ref(self)
        geometry = ShardGeometry(mesh, placements)
        groups = []
        for params, aliases in group_parameters(owned):
            dtypes = mixed_precision_policy.resolve(params[0].dtype)
            label = f"{type(self).__name__}[{params[0].dtype}, requires_grad={params[0].requires_grad}]"
            groups.append(FsdpParameterGroup(params, aliases, geometry, dtypes, label, self._communication_policy))
        self._parameter_groups: tuple[FsdpParameterGroup, ...] = tuple(groups)
        for group in groups:
            for orig, sharded in zip(group.params, group.sharded_params):
                OWNER_OF_PARAMETER[orig] = self
                OWNER_OF_PARAMETER[sharded] = self
                GROUP_OF_SHARDED[sharded] = group
        self._num_trainable_parameters = sum(len(g.params) for g in groups if g.requires_grad)
        self._register_hooks()

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

    def is_root(self) -> bool:
        """Whether this module is the outermost FsdpModule in its context."""
        if self._context is not None:
            return self._context.root_module is self
        return self._fsdp_parent is None

    def refresh_model_weights(self) -> None:
        """Re-derive the compute weights from the main weights now (after editing them in place).

        Optimizer steps and ``load_state_dict`` trigger this by themselves.
        """
        for group in self._parameter_groups:
            group.refresh_model_weights()
            group.needs_refresh = False

    def _set_phase(self, phase: ModulePhase) -> None:
        if phase not in _TRANSITIONS[self._phase]:
            raise RuntimeError(f"mfsdp: illegal phase transition {self._phase.name} -> {phase.name} in {self.name}")
        self._phase = phase

    def _nvtx_label(self, phase: str) -> str:
        return f"mfsdp::{phase} {self.name or 'root'}"

    # ---------------------------------------------------------------------------------- hooks
    def _register_hooks(self) -> None:
        ref = weakref.ref(self)

        @torch.compiler.disable
        def pre_hook(module, args, kwargs):
            return module.pre_forward(args, kwargs)

        @torch.compiler.disable
        def post_hook(module, args, output):
            return module.post_forward(output)

        def load_hook(module, incompatible_keys):
            module._after_load_state_dict()

        self.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
        self.register_forward_hook(post_hook)
        self.register_load_state_dict_post_hook(load_hook)
        for group in self._parameter_groups:
            if group.requires_grad:
                for param in group.params:
                    param.register_post_accumulate_grad_hook(self._make_grad_hook(ref))

    @staticmethod
    def _make_grad_hook(ref):
        @torch.compiler.disable
        def hook(param: nn.Parameter) -> None:
            module = ref()
            if module is None:
                return
            module.context.register_post_backward_final_callback()
            module._ready_grad_parameters.add(id(param))
            if module._backward_pending and len(module._ready_grad_parameters) == module._num_trainable_parameters:
                module.post_backward()

        return hook

    def _after_load_state_dict(self) -> None:
        for group in self._parameter_groups:
            for sharded, aliases in zip(group.sharded_params, group.aliases):
                for module, name in aliases:
                    if module._parameters.get(name) is not sharded:
                        raise RuntimeError(
                            f"load_state_dict replaced mfsdp's sharded parameter {name!r} of {self.name}"
                            " (assign=True?); load with assign=False so values are copied into the shards"
                        )
            group.needs_refresh = True

    # -------------------------------------------------------------------------------- forward
    def pre_forward(self, args=(), kwargs=None):
        """Prepare full parameters for forward compute and prefetch the next FsdpModule.

        While this module computes, the next module's all-gather is already queued on the
        all-gather stream, so AG(i+1) overlaps F(i).
        """
        if self._context is None:
            self._lazy_init_context()
        ctx = self.context
        recompute = _compat.backward_is_running()
        with record_function(self._nvtx_label("pre_forward")):
            if recompute:
                if self._phase is ModulePhase.IDLE:  # reentrant checkpoint: backward starts here
                    self._enter_backward()
                    self._backward_pending = True
                    self._ready_grad_parameters.clear()
                self._unshard_parameter_groups()
                self._wait_for_unshard()
                self._use_unsharded_params()
                return args, kwargs
            if self.is_root():
                ctx.begin_forward()
            self._set_phase(ModulePhase.FORWARD)
            self._ready_grad_parameters.clear()
            self._unshard_parameter_groups()
            self._wait_for_unshard()
            self._prefetch(ctx.forward_order)
            self._use_unsharded_params()
            if torch.is_grad_enabled():
                # Every call counts; only calls whose inputs need grad can report their backward,
                # so the fallback fires only when all calls of this forward have reported. Frozen
                # modules are hooked too: it is where their backward ends and their weights free.
                self._inputs_hooked += 1
                args, kwargs = self._hook_inputs(args, kwargs or {})
        return args, kwargs

    def post_forward(self, output):
        """Return parameters to their sharded resting state after forward compute."""
        ctx = self.context
        with record_function(self._nvtx_label("post_forward")):
            if _compat.backward_is_running():  # recompute: backward needs the weights next
                self._hook_outputs(output)
                return output
            self._set_phase(ModulePhase.IDLE)
            self._use_sharded_params()
            training = torch.is_grad_enabled()
            if training:
                self._backward_pending = self._backward_pending or self._num_trainable_parameters > 0
                self._hook_outputs(output)
            if not (training and self.is_root()):  # the root keeps its storage for backward
                self._reshard_parameter_groups()
            if self.is_root():
                for module in ctx.forward_order:  # prefetched but never run
                    if module is not self and module._phase is ModulePhase.IDLE:
                        module._reshard_parameter_groups()
        return output

    def _hook_inputs(self, args, kwargs):
        flat, spec = _compat.tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        outs = _PostBackwardFallback.apply(weakref.ref(self), *[flat[i] for i in positions])
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i, t in zip(positions, outs):
            flat[i] = t
        return _compat.tree_unflatten(flat, spec)

    def _hook_outputs(self, output) -> None:
        ref = weakref.ref(self)

        @torch.compiler.disable
        def hook(grad):
            module = ref()
            if module is not None:
                module.pre_backward()
            return grad

        flat, _ = _compat.tree_flatten(output)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    # ------------------------------------------------------------------------------- backward
    def pre_backward(self) -> None:
        """Prepare full parameters and prefetch the next FsdpModule in backward order."""
        if self._phase is ModulePhase.BACKWARD:
            return
        with record_function(self._nvtx_label("pre_backward")):
            self._enter_backward()
            self._unshard_parameter_groups()
            self._wait_for_unshard()
            self._prefetch(self.context.backward_order)
            self._use_unsharded_params()

    def _prefetch(self, order) -> None:
        """Queue the gathers of the next ``prefetch_depth`` modules in ``order``."""
        for distance in range(1, self.context.prefetch_depth + 1):
            following = order.next_after(self, distance)
            if following is None:
                break
            following._unshard_parameter_groups(prefetch=True)

    def _enter_backward(self) -> None:
        self.context.register_post_backward_final_callback()
        self._set_phase(ModulePhase.BACKWARD)

    def post_backward(self) -> None:
        """Reduce gradients and return parameters to their sharded resting state."""
        with record_function(self._nvtx_label("post_backward")):
            if self._phase is ModulePhase.BACKWARD:
                self._set_phase(ModulePhase.IDLE)
            self._use_sharded_params()
            self._reshard_parameter_groups()  # free first: the reduction allocates
            if self._backward_pending:
                self._backward_pending = False
                self._reduce_gradient_groups()

    def _on_inputs_backward(self) -> None:
        self._inputs_hooked = max(0, self._inputs_hooked - 1)
        if self._inputs_hooked == 0 and (self._backward_pending or self._phase is ModulePhase.BACKWARD):
            self.post_backward()  # some parameter got no gradient on this rank, or none is trainable

    def _finish_backward(self) -> None:
        """Final-callback fallback: reduce what no hook reduced, reshard what is left."""
        self._inputs_hooked = 0
        if self._backward_pending or self._phase is ModulePhase.BACKWARD:
            self.post_backward()
        elif self._unshard_event is not None and self._phase is ModulePhase.IDLE:
            self._reshard_parameter_groups()

    def _reduce_gradient_groups(self) -> None:
        """Pack gradients and immediately launch their reductions."""
        ctx = self.context
        with record_function(self._nvtx_label("reduce_gradients")):
            groups = [g for g in self._parameter_groups if g.requires_grad]
            nbytes = sum(g.reduction_nbytes for g in groups)
            ctx.release_finished_reductions(nbytes)
            keep_alive: list = []
            for group in groups:
                keep_alive.extend(group.reduce_gradients(ctx.is_last_microbatch, ctx.reduce_scatter_stream))
            ctx.track_reduction(keep_alive, nbytes)

    # ------------------------------------------------------------------------ unshard/reshard
    def _unshard_parameter_groups(self, prefetch: bool = False) -> None:
        """Unshard this module's parameter groups on the all-gather stream.

        A set ``_unshard_event`` means already unsharded or prefetched: no-op. Otherwise the event
        is recorded after the gather, so compute waits for exactly this module's data. A prefetch
        whose gather slot is still busy is skipped; the module then gathers just in time.
        """
        if self._unshard_event is not None:
            return
        if prefetch and not all(group.can_unshard() for group in self._parameter_groups):
            return
        stream = self.context.allgather_stream
        with record_function(self._nvtx_label("unshard")):
            for group in self._parameter_groups:
                if group.needs_refresh:
                    group.refresh_model_weights(stream)
                    group.needs_refresh = False
                group.unshard(stream)
            self._unshard_event = stream.record_event() if stream is not None else _CPU_READY

    def _wait_for_unshard(self) -> None:
        event = self._unshard_event
        if event is not None and event is not _CPU_READY:
            self.context.current_stream().wait_event(event)

    def _reshard_parameter_groups(self) -> None:
        """Release unsharded storage once compute is done; the next user gathers afresh."""
        if self._unshard_event is None:
            return
        ctx = self.context
        stream = ctx.allgather_stream
        with record_function(self._nvtx_label("reshard")):
            if stream is not None:
                stream.wait_stream(ctx.current_stream())
            for group in self._parameter_groups:
                group.reshard(stream)
        self._unshard_event = None

    def _use_unsharded_params(self) -> None:
        for group in self._parameter_groups:
            group.use_unsharded_params()

    def _use_sharded_params(self) -> None:
        for group in self._parameter_groups:
            group.use_sharded_params()

    # ------------------------------------------------------------------------------ lazy root
    def _lazy_init_context(self) -> None:
        """Initialize one shared runtime context for this FSDP root subtree.

        fully_shard is applied bottom-up, so children exist before their eventual root. The root
        is therefore resolved lazily, on the first forward through the outermost FsdpModule, and
        shares one context with every FSDP descendant. Rejected alternatives: eager contexts per
        fully_shard call (transient child contexts, and every parent re-walks its descendants:
        quadratic), and an is_root flag on every module (per-module state that must be kept
        consistent with the final hierarchy).
        """
        parent = self._fsdp_parent() if self._fsdp_parent is not None else None
        if parent is not None:
            raise RuntimeError(
                f"{type(self).__name__} ran forward before its FSDP root {type(parent).__name__} ever "
                "did; run the root module's forward (it calls this one), not a sharded child directly"
            )
        modules = [(n, m) for n, m in self.named_modules() if isinstance(m, FsdpModule)]
        device = next((g.params[0].device for _, m in modules for g in m._parameter_groups), None)
        if device is None:
            raise RuntimeError(f"{type(self).__name__}: no parameters under this FSDP root")
        ctx = FsdpContext(device, self, self._communication_policy)
        for name, module in modules:
            if module._context is not None:
                raise RuntimeError(
                    f"FSDP module {name!r} already ran forward as its own root before {type(self).__name__} "
                    "was sharded; shard bottom-up and only then run the model"
                )
            module._context, module._name = ctx, name
            ctx.forward_order.append(module)
        collect_backward_order(self, ctx.backward_order, FsdpModule)
        check_parameter_locations(self, FsdpModule)
        if self._communication_policy.double_buffer:
            # The root keeps its weights from forward into backward, so it never shares a slot.
            gathered = [g for m in ctx.forward_order if m is not self for g in m._parameter_groups
                        if g.gather_key() is not None]
            ctx.gather_slots = GatherSlots.build(gathered, ctx.prefetch_depth, register=self._use_symm_mem)


