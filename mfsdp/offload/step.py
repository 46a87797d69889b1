"""``OffloadedStep``: the host step of one bound optimizer's offloaded groups, wiring the host
state, the staging ring and the speculation to the runtime's gradient hook and to the grouped step."""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from mfsdp.offload.host import HostGroup, HostState, unpin
from mfsdp.offload.policy import OffloadPolicy, host_bytes, units_to_offload
from mfsdp.offload.speculation import Speculation
from mfsdp.offload.staging import StagingRing
from mfsdp.runtime.module import fsdp_modules


def choose_groups(model: nn.Module, groups: Sequence, policy: OffloadPolicy) -> list:
    """The parameter groups ``policy`` offloads among ``groups`` (the optimizer's), unit by unit."""
    own = {id(g) for g in groups}
    units = [(name, [g for g in m.parameter_groups if id(g) in own and g.requires_grad])
             for name, m in fsdp_modules(model)]
    units = [(name, gs) for name, gs in units if gs]
    if policy.units is not None:
        by_name = dict(units)
        missing = [u for u in policy.units if u not in by_name]
        if missing:
            raise ValueError(f"OffloadPolicy.units: {missing} are not units with trainable parameters of "
                             f"this optimizer; the units are {[name for name, _ in units]}")
        chosen = [by_name[u] for u in dict.fromkeys(policy.units)]
    else:
        chosen = units_to_offload([gs for _, gs in units], 1.0 if policy.fraction is None else policy.fraction)
    return [g for gs in chosen for g in gs]


class OffloadedStep:
    """The host step of ``groups``, bound to ``optimizer``. ``entries(optimizer)``: id(group) ->
    [(index of a param group, the group's parameters in it)], the grouped step's narrowing."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence, policy: OffloadPolicy,
                 entries: Callable[[torch.optim.Optimizer], dict]) -> None:
        self.groups, self.policy = list(groups), policy
        self._ids = {id(g) for g in self.groups}
        mains = [g.main.tensor for g in self.groups]
        device = mains[0].device if mains else torch.device("cpu")
        self._cuda = device.type == "cuda"
        # On CUDA the offloaded groups are refreshed by their next unshard (after ``weights_ready``),
        # not at the end of ``step``.
        self.defers_refresh = self._cuda
        # Page-locked buffers, unregistered when this object goes (before their memory is freed).
        pinned: Optional[list] = [] if policy.pin_memory and self._cuda else None
        if pinned is not None:
            weakref.finalize(self, unpin, pinned)
        self.host = HostState(optimizer, device, pinned)
        self.ring = StagingRing(max((m.numel() for m in mains), default=0), mains[0].dtype if mains else None,
                                policy.staging_buffers, device, pinned)
        self.speculation = Speculation(optimizer, self.host, self.ring, policy.threads, policy.overlap == "step")
        self.counts = self.speculation.counts
        self._optimizer, self._entries = weakref.ref(optimizer), entries
        optimizer.register_load_state_dict_post_hook(self._after_load)
        # A state dict taken between backward and ``step`` sees no speculated state.
        optimizer.register_state_dict_pre_hook(lambda opt: (self.discard(), self.speculation.drain(), self.wait_weights()))
        if policy.overlap != "none":
            ref = weakref.ref(self)
            for group in self.groups:
                group.gradient_final_hooks.append(lambda g, stream: (e := ref()) is not None and e.gradient_final(g, stream))

    def owns(self, group) -> bool:
        return id(group) in self._ids

    def host_nbytes(self) -> dict:
        """Host bytes held now, by use (the keys of ``planned_host_bytes``)."""
        self.speculation.drain()
        return {**self.host.nbytes(), "staging": self.ring.nbytes()}

    def planned_host_bytes(self, states_per_weight: int = 2) -> dict:
        """``policy.host_bytes`` of these groups, with ``states_per_weight`` optimizer states the size
        of each master weight (AdamW: 2), as the planner counts them."""
        shards = [g.main.tensor.numel() * g.main.tensor.element_size() for g in self.groups]
        return host_bytes(shards, states_per_weight * sum(shards), self.policy.overlap, self.policy.staging_buffers)

    def _current(self, group) -> HostGroup:
        """The group's host record, its master read again where the device's weights moved since
        it was last equal to them (a load, an init, an edit), after the worker's tasks."""
        host = self.host.of(group)
        if host.epoch != group.weights_epoch:
            self.speculation.drain()
            self.host.reread(group)
        return host

    def gradient_final(self, group, stream: Optional[torch.Stream] = None) -> None:
        """The runtime's hook: ``group``'s last-microbatch reduction was issued on ``stream`` (None:
        it has finished). A group staged since the last step (one more last-microbatch backward)
        is undone first."""
        optimizer = self._optimizer()  # None once it is gone, before this object is collected
        entries = None if optimizer is None else self._entries(optimizer).get(id(group))
        if not entries or not group.requires_grad:
            return
        self.speculation.cancel(group)
        self.speculation.stage(group, self._current(group), entries, stream, in_backward=True)

    def before_step(self) -> None:
        """At the start of ``step``, before the step's own marks move the epochs it compares: the
        jobs are validated, and every master whose group was written on the device since is read."""
        self.wait_weights()
        self.speculation.validate()
        for group in self.groups:
            if group.requires_grad:
                self._current(group)

    def step_group(self, optimizer: torch.optim.Optimizer, group, entries) -> None:
        """Step ``group`` on the host; ``entries``: the group's, as ``entries(optimizer)`` gives them."""
        host = self.host.of(group)
        stream = torch.cuda.current_stream(group.main.tensor.device) if self._cuda else None
        self.speculation.complete(group, host, entries, stream)
        for _, params in entries:
            for p in params:
                self.host.expose(optimizer, p, host)
        self.host.commit(group)
        self.speculation.back_up(group, host)

    def wait_weights(self) -> None:
        """Make the current stream wait for the last step's copies up (before reading an offloaded
        group's main weights other than through the runtime's refresh or gather)."""
        self.host.wait_weights()

    def discard(self) -> None:
        """Undo every staged or speculated group (``zero_grad`` before ``step``, a load)."""
        self.speculation.discard()

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        self.discard()
        self.speculation.drain()
        self.host.load(optimizer, self.groups)


_ENGINES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OffloadedStep]" = weakref.WeakKeyDictionary()


def bind(model: nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence, policy: OffloadPolicy,
         entries: Callable[[torch.optim.Optimizer], dict]) -> OffloadedStep:
    """The host step of the groups ``policy`` chooses among the optimizer's ``groups``."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload must be an mfsdp.OffloadPolicy, got {type(policy).__name__}")
    engine = OffloadedStep(optimizer, choose_groups(model, groups, policy), policy, entries)
    ref = weakref.ref(engine)
    model.register_state_dict_pre_hook(lambda *_: (e := ref()) is not None and e.wait_weights())
    # A load writes the main weights: after any copy up still in flight, never under it.
    model.register_load_state_dict_pre_hook(lambda *_: (e := ref()) is not None and e.wait_weights())
    _ENGINES[optimizer] = engine
    return engine


def offload_of(optimizer: torch.optim.Optimizer) -> Optional[OffloadedStep]:
    """The host step bound to ``optimizer`` by ``fully_shard_optimizer(..., offload=...)``, if any."""
    return _ENGINES.get(optimizer)
