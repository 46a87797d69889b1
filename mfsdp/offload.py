"""Optimizer offload: the master weights and optimizer states of chosen units live on the host.

``fully_shard_optimizer(model, optimizer, offload=OffloadPolicy(...))`` picks parameter groups
(whole units: a fraction counted from the units whose gradients finish first in backward, or
units by name). For each of them this rank keeps, in host memory:

* the fp32 master weights of its optimizer shard, one flat buffer laid out like the group's
  ``main`` buffer (page-locked on CUDA, exactly its bytes);
* the optimizer states, created and updated by a CPU optimizer of the user's class and
  hyper-parameters (torch's fused CPU kernel where the class has one, foreach otherwise);
* with ``overlap="step"``, a backup of both (the state before the speculative step, below);

and ``staging_buffers`` staging buffers (a ring, pinned once), each the size of the largest
offloaded group's shard in the main dtype, that the offloaded groups' gradients pass through in
turn. Nothing else is copied: no pinned copy of the whole model's parameters or gradients.

The seam in the runtime is ``FsdpParameterGroup.gradient_final_hooks``: called once the group's
last-microbatch reduction is issued, with the stream it was issued on (None on CPU, where it has
finished). With ``overlap`` other than "none" it calls ``OffloadedStep.gradient_final``, which
records an event on that stream and queues the group: its copy down into a free staging buffer
(on CUDA on a side stream that first waits for the event, ``non_blocking``; a bf16 gradient is
cast on the device first) is issued as soon as a buffer is free, by whichever thread frees it.
With ``overlap="step"`` the group's CPU step is queued too, on one worker thread (the fused
kernel spreads over torch's intra-op threads, ``threads`` of them): it waits for its copy, steps
the host master and states, and frees its staging buffer, while backward goes on. Accumulation
needs nothing more: only the last microbatch's reduction calls the hook.

``optimizer.step()`` (the bound optimizer's group-by-group step, ``mfsdp.optimizer._GroupedStep``)
then reaches each offloaded group in ``step_group``: it waits for the group's CPU step, checks
it (below), and copies the updated master weights up into the group's ``main`` buffer on the side
stream, recording an event in the group's ``weights_ready``: the group's next refresh or gather
(the next forward's unshard, on the all-gather stream) waits for that event only, so the copies
of the last blocks overlap the forward of the first ones. The group's weights are then marked
written (``_weights_written``, the one place that touches the group's staleness marks). The
other groups step on the device as before. A state-dict read of the model or the optimizer waits
for every copy up first; a direct read of a parameter's shard between ``step`` and the next
forward must call ``wait_weights()``. A group that was not staged in backward (``overlap`` "none",
or a backward that did not call the hook) is staged and stepped right there, serialized.

[Note: exact global-norm clipping, speculate and validate]
The global norm is known only when the last unit (the embedding) has reduced, after every
offloaded unit's gradient is final: a step that waited for it could not overlap backward. So
with ``overlap="step"`` the CPU step is speculative: it runs on the gradient as reduced, and
``step()`` validates it against what the gradient is when ``step`` is called. The step is kept
only if, for every parameter of the group, the gradient is the same tensor as at the hook with
the same bits (``fingerprint``, one int64 sum of its bit patterns per parameter, compared on the
host in one read: an in-place write on a DTensor's local shard bumps no version counter that
could say it; a clip that scaled, a user's edit, a grad scaler's unscale each move the sum), the
same parameters have a gradient (the runtime drops the gradients of parameters unused everywhere
after the reductions), and the optimizer's hyper-parameters (lr) are unchanged. Otherwise the host
master and states are restored from the backup, the gradient is staged again and the group steps
from it, serialized: an unclipped update never gets through.
``zero_grad`` (and a new last-microbatch backward, and a load) before ``step`` restores a
speculated group the same way, so a step skipped after a NaN check leaves no trace.

A group whose gradient changed after backward (a clip that bit) does not speculate in the next
backward: a clip that bites once tends to bite again (early training), and each redo costs the
wasted step, a restore and a backup (about 24 bytes of host traffic per parameter on top of the
step's 28). Its gradient still streams down in backward and is copied again in ``step`` only if
it changed again; once a step's gradient comes through unchanged, the group speculates again.

torch's ``clip_grads_with_norm_`` multiplies in place even when the coefficient is clamped to 1;
that leaves every bit, so the fingerprint keeps the speculation. A clip that bites (the norm above
the bound) redoes every offloaded group in ``step()``, serialized: exact, and as slow as
``overlap="none"`` for that step.

The price of speculation: a second host copy of the offloaded groups' master weights and states
(12 bytes per parameter for AdamW, host memory only), refreshed on the worker thread right after
each commit, that is during the next forward, where that thread is idle. ``overlap="copy"``
drops the backup and the speculation: the gradients still stream down during backward, the CPU
steps run in ``step()`` (after any clip, on the final gradient), one after the other, each copy
up overlapping the next step; exposed is the whole CPU step.

Also still on the device: the fp32 ``main`` buffer of an offloaded group (the runtime gathers and
refreshes from it), so the device saves the optimizer states' bytes (8 per parameter for Adam),
not the master weights'. Dropping the device's master needs the runtime to keep only compute
weights for such groups.

State dicts: the CPU optimizer's states are exposed in the user optimizer's ``state`` as DTensors
of the device parameter's mesh, placements and global shape whose local shards are the host
tensors themselves, so ``optimizer.state_dict()``, ``get_optimizer_state_dict`` and DCP see the
same entries as for a group stepped on the device (DCP reshards them on load like any DTensor).
A load (``load_state_dict``, which torch casts to the parameter's device) is moved back into host
tensors by a post hook; the device copies it made are then dropped.

The host master is re-read from the device's ``main`` whenever the group's ``weights_epoch`` moved
since the last write here (a model state-dict load, an init, ``refresh_model_weights`` after an
edit): checked when the group is staged and at the start of every step, before the step's marks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Which units' optimizer step runs on the host (``fully_shard_optimizer(..., offload=...)``).

    Give ``fraction`` or ``units``, not both; with neither, every unit is offloaded."""

    fraction: Optional[float] = None
    """Share of the units (FSDP modules holding trainable parameters of the optimizer) to offload,
    in (0, 1], counted from the units whose gradients finish first in backward: the last blocks and
    a separately sharded head first, the root (embedding) last. Rounded up to whole units; the
    order is the reverse of the modules' registration order (``model.named_modules()``)."""
    units: Optional[tuple[str, ...]] = None
    """Names of the units to offload, as ``model.named_modules()`` names them ("" is the root)."""
    pin_memory: bool = True
    """Page-lock the host master weights and the staging buffer (fast, asynchronous copies).
    Ignored where the parameters are not on CUDA."""
    threads: Optional[int] = None
    """CPU threads for the host step (``torch.set_num_threads`` around it, restored after);
    None keeps torch's setting."""
    overlap: str = "step"
    """When the offloaded groups' work runs (see the module's notes): "step": each group's gradient
    copy and a speculative CPU step start when its last-microbatch reduction is issued, during
    backward, and ``step()`` validates them (exact; host memory for a backup of the master weights
    and states); "copy": the gradients stream down during backward, the CPU steps run in
    ``step()``; "none": everything in ``step()``, group after group (the serialized version)."""
    staging_buffers: int = 2
    """Staging buffers in the ring the gradients pass through (each the largest offloaded group's
    shard in the main dtype); more lets copies run further ahead of the CPU steps."""

    def __post_init__(self) -> None:
        if self.fraction is not None and self.units is not None:
            raise ValueError("OffloadPolicy: give fraction or units, not both")
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                    or not 0.0 < float(self.fraction) <= 1.0:
                raise ValueError(f"OffloadPolicy.fraction must be in (0, 1], got {self.fraction!r}")
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.units is not None:
            if isinstance(self.units, str):
                raise ValueError("OffloadPolicy.units is a sequence of module names, not one string")
            units = tuple(self.units)
            if not units or not all(isinstance(u, str) for u in units):
                raise ValueError(f"OffloadPolicy.units must be a non-empty sequence of module names, "
                                 f"got {self.units!r}")
            object.__setattr__(self, "units", units)
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"OffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"OffloadPolicy.threads must be a positive int or None, got {self.threads!r}")
        if self.overlap not in OVERLAP_CHOICES:
            raise ValueError(f"OffloadPolicy.overlap must be one of {OVERLAP_CHOICES}, got {self.overlap!r}")
        if isinstance(self.staging_buffers, bool) or not isinstance(self.staging_buffers, int) \
                or self.staging_buffers < 1:
            raise ValueError(f"OffloadPolicy.staging_buffers must be a positive int, got {self.staging_buffers!r}")


OVERLAP_CHOICES = ("step", "copy", "none")


# ---------------------------------------------------------------------------- the group's side
# Everything this module reads or writes on a parameter group goes through these few helpers.

def _weights_written(group) -> None:
    """The group's main weights were written (by the host step's copy up)."""
    group.weights_written()


def _weights_ready(group, event) -> None:
    """The group's main weights are being written on the device until ``event``: its next refresh
    or gather waits for it."""
    group.weights_ready = event


def _main_flat(group) -> torch.Tensor:
    return group.main.tensor


def _shard_views(group, flat: torch.Tensor) -> list[torch.Tensor]:
    """Per-parameter views of ``flat`` (laid out like the group's ``main``), shaped like the
    local shards of ``group.sharded_params``."""
    layout, geometry = group.layout, group.geometry
    return layout.shards(layout.regions(flat, geometry.num_shards), geometry.shard_index)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------- choosing units

def choose_groups(model: nn.Module, groups: Sequence, policy: OffloadPolicy) -> list:
    """The parameter groups ``policy`` offloads among ``groups`` (the optimizer's), unit by unit."""
    from mfsdp.runtime.module import fsdp_modules

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
        fraction = 1.0 if policy.fraction is None else policy.fraction
        count = min(len(units), math.ceil(fraction * len(units) - 1e-9))
        chosen = [gs for _, gs in reversed(units)][:count]
    return [g for gs in chosen for g in gs]


def _construct(cls: type, params, settings: dict) -> torch.optim.Optimizer:
    """``cls(params, **settings)`` with the settings its constructor takes (AdamW's defaults also
    hold ``decoupled_weight_decay``, which only the param groups carry)."""
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
        settings = {k: v for k, v in settings.items() if k in accepted}
    return cls(params, **settings)


def _cpu_flags(cls: type, defaults: dict) -> dict:
    """The kernel flags of the host optimizer: fused on CPU where the class has such a kernel
    (probed by building one), else foreach; never capturable or differentiable."""
    flags = {k: False for k in ("capturable", "differentiable") if k in defaults}
    if "fused" in defaults:
        try:
            probe = torch.zeros(1)
            _construct(cls, [probe], {**defaults, **flags, "foreach": None, "fused": True})
            return {**flags, "fused": True, "foreach": None}
        except (RuntimeError, ValueError, TypeError):
            pass
    if "foreach" in defaults:
        flags["foreach"] = True
    if "fused" in defaults:
        flags["fused"] = None
    return flags


# ---------------------------------------------------------------------------- the mechanism

class _Done:
    """The handle of a copy that has already completed (CPU)."""

    def synchronize(self) -> None:
        pass


def copy_gradient_down(sources: Sequence[Optional[torch.Tensor]], destinations: Sequence[torch.Tensor],
                       stream: Optional[torch.Stream], after: Optional[torch.Event] = None):
    """Copy each present gradient (a local shard) into its staging view; returns a handle whose
    ``synchronize()`` waits for the copies (a CUDA event recorded after them, on ``stream``).

    On CUDA ``stream`` first waits for ``after`` (the event the reduction was issued before) or,
    without one, for the caller's current stream. A gradient kept in another dtype (bf16 main
    gradients) is cast on the device first, one parameter at a time on ``stream``: a
    device-to-host copy that also converts would go through a pageable host temporary. The casts'
    memory returns to ``stream``'s pool, where later work is ordered after these copies."""
    if stream is None:
        for src, dst in zip(sources, destinations):
            if src is not None:
                dst.copy_(src)
        return _Done()
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # the gradients are written
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):  # also from the worker thread
        for src, dst in zip(sources, destinations):
            if src is not None:
                src.record_stream(stream)  # read here; the caller may free it once the event is done
                dst.copy_(src if src.dtype == dst.dtype else src.to(dst.dtype), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _host_buffer(numel: int, dtype: torch.dtype, pinned: Optional[list]) -> torch.Tensor:
    """A flat host tensor; page-locked (exactly its bytes) and appended to ``pinned`` when given."""
    t = torch.empty(numel, dtype=dtype, device="cpu")
    if pinned is not None:
        _compat.pin_host_memory(t)
        pinned.append(t)
    return t


def _unpin(pinned: list) -> None:
    for t in pinned:
        _compat.unpin_host_memory(t)
    pinned.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _HostGroup:
    """One offloaded group's host side: the master weights and the CPU optimizer's parameters
    (views of them), the epoch of the group's weights the master was last equal to, the event of
    its last copy up, and (speculation only) the backup of master and states."""

    def __init__(self, group, pinned: Optional[list]) -> None:
        main = _main_flat(group)
        self.master = _host_buffer(main.numel(), main.dtype, pinned)
        self.params = [v for v in _shard_views(group, self.master)]
        self.index = {id(p): j for j, p in enumerate(group.sharded_params)}
        self.epoch: Optional[int] = None  # not yet read from the device
        self.exposed: list[Optional[tuple]] = [None] * len(self.params)
        self.copied_up: Optional[torch.Event] = None  # the master may be written once it is done
        self.backup_master: Optional[torch.Tensor] = None
        self.backup_states: list[Optional[dict]] = [None] * len(self.params)
        self.backed_up = False  # the backup equals master and states
        self.speculate = True  # its next backward steps it speculatively (see the note on clipping)


def _hyper(settings: list, entries) -> list:
    """``settings`` (the optimizer's param group of each of ``entries``) in a comparable form (a
    tensor setting by identity and version)."""
    out = []
    for group_settings, (i, params) in zip(settings, entries):
        items = tuple(sorted((k, ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v)
                             for k, v in group_settings.items() if k != "params"))
        out.append((i, items, tuple(id(p) for p in params)))
    return out


def _grads(group) -> list:
    """The gradient of each parameter of ``group`` (None where it has none)."""
    return [p.grad for p in group.sharded_params]


_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """A 1-d int64 tensor on the tensors' device: for each, the sum of its elements' bit patterns
    read as signed integers (see the module's notes: any scaling by a factor other than 1 moves
    every changed element's pattern the same way, so it changes the sum). None if no tensor."""
    sums = [_local(t).detach().reshape(-1).view(_AS_INTEGERS[t.element_size()]).sum(dtype=torch.int64)
            for t in tensors if t is not None]
    return torch.stack(sums) if sums else None


class _Job:
    """One offloaded group's step in flight: its gradient as read at the hook, the staging buffer
    it was copied into, and (speculation) the CPU step's future."""

    def __init__(self, group, host: _HostGroup, entries, settings: list, event) -> None:
        self.group, self.host, self.entries, self.settings, self.event = group, host, entries, settings, event
        self.epoch = group.weights_epoch
        self.grads = _grads(group)
        self.sources = [None if g is None else _local(g) for g in self.grads]
        self.present = [g is not None for g in self.grads]
        self.fingerprint: Optional[torch.Tensor] = None  # taken where the gradient is final
        self.hyper = _hyper(settings, entries)
        self.slot: Optional[int] = None
        self.handle = None
        self.copied = threading.Event()  # set once the copy down is issued
        self.future: Optional[concurrent.futures.Future] = None
        self.stepped = False  # the host master and states hold this job's step


class OffloadedStep:
    """The host step of the offloaded groups of one bound optimizer (see the module's notes)."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence, policy: OffloadPolicy) -> None:
        self.groups = list(groups)
        self.policy = policy
        self._ids = {id(g) for g in self.groups}
        device = _main_flat(self.groups[0]).device if self.groups else torch.device("cpu")
        self._cuda = device.type == "cuda"
        # Page-locked buffers, unregistered when this object goes (before their memory is freed).
        self._pinned: Optional[list] = [] if policy.pin_memory and self._cuda else None
        if self._pinned is not None:
            weakref.finalize(self, _unpin, self._pinned)
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # copies down
        self._up = torch.cuda.Stream(device) if self._cuda else None  # copies up, beside the ones down
        self._optimizer = weakref.ref(optimizer)
        self._cls = type(optimizer)
        self._flags = _cpu_flags(self._cls, optimizer.defaults)
        self._host: dict[int, _HostGroup] = {}
        self._slots: list[torch.Tensor] = []
        self._free: list[int] = []
        self._lock = threading.Lock()  # the staging ring and its queue
        # The CPU optimizer's param groups and states: one group steps, saves or restores at a time
        # (the worker's speculation beside the step's redo of another group).
        self._cpu_lock = threading.RLock()
        self._waiting: list[_Job] = []  # staged, their copy not yet issued (no free buffer)
        self._jobs: dict[int, _Job] = {}  # id(group) -> the group's job since its hook
        self._pending_up: list = []  # the events of the last step's copies up
        self.counts = {"kept": 0, "redone": 0, "dropped": 0, "serialized": 0}
        """Group steps so far: speculated and kept; speculated and undone (redone in ``step``, or
        dropped by ``zero_grad``); queued for speculation but dropped before it started; stepped in
        ``step`` (not speculated)."""
        threads = policy.threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mfsdp-offload",
            initializer=None if threads is None else torch.set_num_threads, initargs=() if threads is None else (threads,))
        weakref.finalize(self, self._pool.shutdown, wait=False)
        self._cpu_optimizer: Optional[torch.optim.Optimizer] = None
        self.copy_down: Callable = copy_gradient_down
        """The copy of a group's gradient into a staging buffer (a seam for tests)."""
        self.entries_of: Callable = lambda group: None
        """id of the group -> [(param group index, parameters)]: set by the grouped step."""
        optimizer.register_load_state_dict_post_hook(lambda opt: self._after_load(opt))
        # A state dict taken between backward and ``step`` sees no speculated state.
        optimizer.register_state_dict_pre_hook(lambda opt: (self.discard(), self._drain(), self.wait_weights()))
        if policy.overlap != "none":
            ref = weakref.ref(self)
            for group in self.groups:
                group.gradient_final_hooks.append(lambda g, stream: (e := ref()) is not None and e.gradient_final(g, stream))

    @property
    def defers_refresh(self) -> bool:
        """On CUDA the offloaded groups are refreshed by their next unshard (after ``weights_ready``),
        not at the end of ``step``."""
        return self._cuda

    def owns(self, group) -> bool:
        return id(group) in self._ids

    # ------------------------------------------------------------------ host memory
    def host_nbytes(self) -> dict:
        """Host bytes held: the master weights, the optimizer states, the staging ring, the backup."""
        self._drain()
        states = 0
        cpu = self._cpu_optimizer
        if cpu is not None:
            for host in self._host.values():
                for p in host.params:
                    states += sum(_nbytes(v) for v in cpu.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        master = sum(_nbytes(h.master) for h in self._host.values())
        backup = sum((0 if h.backup_master is None else _nbytes(h.backup_master))
                     + sum(_nbytes(v) for s in h.backup_states if s for v in s.values() if isinstance(v, torch.Tensor))
                     for h in self._host.values())
        return {"master": master, "states": states, "staging": sum(_nbytes(t) for t in self._slots), "backup": backup}

    def _host_of(self, group) -> _HostGroup:
        host = self._host.get(id(group))
        if host is None:
            host = self._host[id(group)] = _HostGroup(group, self._pinned)
        if host.epoch != group.weights_epoch:  # written since on the device (a load, an init, an edit)
            self._drain()
            host.master.copy_(_main_flat(group))  # synchronous: the master is read right after
            host.epoch = group.weights_epoch
            host.backed_up = False
        return host

    def _slot_views(self, group, slot: int) -> list[torch.Tensor]:
        main = _main_flat(group)
        assert main.dtype == self._slots[slot].dtype, (main.dtype, self._slots[slot].dtype)
        return _shard_views(group, self._slots[slot][: main.numel()])

    def _cpu(self) -> torch.optim.Optimizer:
        if self._cpu_optimizer is None:
            optimizer = self._optimizer()
            self._cpu_optimizer = _construct(self._cls, [torch.zeros(1)], {**optimizer.defaults, **self._flags})
        return self._cpu_optimizer

    # ------------------------------------------------------------------ staging
    def gradient_final(self, group, stream: Optional[torch.Stream] = None) -> None:
        """The seam: ``group``'s last-microbatch reduction was issued on ``stream`` (None: it has
        finished); queue its copy down and, with ``overlap="step"``, its speculative CPU step. A
        group already staged since the last step (one more last-microbatch backward) is undone
        first."""
        entries = self.entries_of(group)
        if not entries or not group.requires_grad:
            return
        self._cancel(group)
        host = self._host_of(group)
        self._cpu()  # made here, not on the worker
        optimizer = self._optimizer()
        event = None
        job = _Job(group, host, entries, [dict(optimizer.param_groups[i]) for i, _ in entries], None)
        if stream is not None:
            with torch.cuda.stream(stream):
                job.fingerprint = fingerprint(job.grads)
                job.event = torch.cuda.Event()
                job.event.record(stream)
        else:
            job.fingerprint = fingerprint(job.grads)
        self._jobs[id(group)] = job
        with self._lock:
            self._waiting.append(job)
        self._pump()
        if self.policy.overlap == "step" and host.speculate:
            job.future = self._pool.submit(self._speculate, job)

    def _pump(self) -> None:
        """Issue the copies of waiting jobs, in order, while staging buffers are free."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                if not self._free and len(self._slots) < self.policy.staging_buffers:
                    numel = max(_main_flat(g).numel() for g in self.groups)
                    self._slots.append(_host_buffer(numel, _main_flat(self.groups[0]).dtype, self._pinned))
                    self._free.append(len(self._slots) - 1)
                if not self._free:
                    return
                job = self._waiting.pop(0)
                job.slot = self._free.pop(0)
            job.handle = self.copy_down(job.sources, self._slot_views(job.group, job.slot), self._stream, job.event)
            job.copied.set()

    def _release(self, job: _Job) -> None:
        if job.slot is not None:
            with self._lock:
                self._free.append(job.slot)
            job.slot = None
        self._pump()

    def _drain(self) -> None:
        """Wait for every queued host task (steps, backups)."""
        done = self._pool.submit(lambda: None)
        done.result()

    # ------------------------------------------------------------------ the CPU side
    def _run(self, job: _Job) -> None:
        """Wait for the job's copy, step the host master and states with it, free its buffer."""
        host = job.host
        job.copied.wait()
        job.handle.synchronize()
        if host.copied_up is not None:
            host.copied_up.synchronize()  # the last copy up has read the master
        grads = self._slot_views(job.group, job.slot)
        cpu = self._cpu()
        try:
            with self._cpu_lock:
                cpu_groups = []
                for (i, params), settings in zip(job.entries, job.settings):
                    hp = []
                    for p in params:
                        j = host.index[id(p)]
                        host.params[j].grad = grads[j] if job.present[j] else None
                        hp.append(host.params[j])
                    cpu_groups.append({**settings, **self._flags, "params": hp})
                cpu.param_groups = cpu_groups
                job.stepped = True
                try:
                    with torch.no_grad():
                        cpu.step()
                finally:
                    for p in host.params:
                        p.grad = None
        finally:
            self._release(job)

    def _speculate(self, job: _Job) -> None:  # on the worker thread
        if not job.host.backed_up:
            self._save(job.host)
        self._run(job)

    def _save(self, host: _HostGroup) -> None:
        """The backup of the host master and states (in place after the first time)."""
        if host.copied_up is not None:
            host.copied_up.synchronize()
        with self._cpu_lock:
            self._save_locked(host)

    def _save_locked(self, host: _HostGroup) -> None:
        if host.backup_master is None:
            host.backup_master = torch.empty_like(host.master)
        host.backup_master.copy_(host.master)
        cpu = self._cpu()
        for j, p in enumerate(host.params):
            state, old = cpu.state.get(p), host.backup_states[j]
            if not state:
                host.backup_states[j] = None
                continue
            saved = {}
            for k, v in state.items():
                if not isinstance(v, torch.Tensor):
                    saved[k] = v
                elif old is not None and isinstance(old.get(k), torch.Tensor) and old[k].shape == v.shape \
                        and old[k].dtype == v.dtype:
                    saved[k] = old[k].copy_(v)
                else:
                    saved[k] = v.clone()
            host.backup_states[j] = saved
        host.backed_up = True

    def _restore(self, host: _HostGroup) -> None:
        """Undo a speculative step: master and states back to the backup (in place: exposed states
        stay the same tensors)."""
        with self._cpu_lock:
            self._restore_locked(host)

    def _restore_locked(self, host: _HostGroup) -> None:
        host.master.copy_(host.backup_master)
        cpu = self._cpu()
        for j, p in enumerate(host.params):
            saved = host.backup_states[j]
            if saved is None:
                cpu.state.pop(p, None)
                host.exposed[j] = None
                continue
            state = cpu.state.setdefault(p, {})
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor) and state[k].shape == v.shape:
                    state[k].copy_(v)
                else:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v

    def _settle(self, job: _Job) -> None:
        """Wait for the job's host task; it has then stepped or not started its copy's wait."""
        if job.future is not None:
            job.future.result()

    def _cancel(self, group) -> None:
        """Drop the group's job: its step undone, its buffer freed."""
        job = self._jobs.pop(id(group), None)
        if job is None:
            return
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
        if job.future is not None and job.future.cancel():
            self.counts["dropped"] += 1
        elif job.future is not None:  # it has started: let it finish
            try:
                job.future.result()
            except Exception:  # noqa: BLE001 - undone below either way
                pass
        if job.handle is not None:
            job.handle.synchronize()
        if job.stepped:
            self._restore(job.host)
            self.counts["redone"] += 1
        self._release(job)

    def discard(self) -> None:
        """Undo every staged or speculated group (``zero_grad`` before ``step``, a load)."""
        for gid in list(self._jobs):
            self._cancel(self._jobs[gid].group)

    def _changed(self) -> set:
        """The ids of the groups whose staged gradient or settings are no longer what ``step``
        would use (see the module's notes): one fingerprint of every staged gradient, compared
        on the host in one read."""
        changed, compared, now = set(), [], []
        groups = self._optimizer().param_groups
        for gid, job in self._jobs.items():
            current = _grads(job.group)
            if any(a is not b for a, b in zip(job.grads, current)) \
                    or job.hyper != _hyper([groups[i] for i, _ in job.entries], job.entries):
                changed.add(gid)
            elif job.fingerprint is not None:
                compared.append(gid)
                now.append(fingerprint(current))
        if compared:
            old = torch.cat([self._jobs[gid].fingerprint for gid in compared])
            sizes = [len(f) for f in now]
            differ = torch.stack([d.any() for d in (old != torch.cat(now)).split(sizes)]).tolist()
            changed.update(gid for gid, d in zip(compared, differ) if d)
        return changed

    def _holding_buffer(self, but: _Job) -> Optional[_Job]:
        """A job staged but not stepped and not queued on the worker, holding a buffer."""
        return next((j for j in self._jobs.values() if j is not but and j.slot is not None
                     and not j.stepped and j.future is None), None)

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        """At the start of ``step``, before the step's own marks: the groups staged in backward
        whose gradient, settings or weights changed since are undone (restaged in ``step_group``),
        and the master of every group written on the device since is read back (see the module's
        notes)."""
        self.wait_weights()
        self._pending_up = []
        changed = self._changed() if self._jobs else set()
        for group in self.groups:
            if not group.requires_grad:
                continue
            job = self._jobs.get(id(group))
            if job is not None:
                # A gradient changed after backward (a clip that bit) predicts the next step's: do
                # not speculate in the next backward until one comes through unchanged.
                self._host[id(group)].speculate = id(group) not in changed
                if job.epoch != group.weights_epoch or id(group) in changed:
                    self._cancel(group)
            self._host_of(group)

    def step_group(self, optimizer: torch.optim.Optimizer, group, entries) -> None:
        """Step ``group`` on the host; ``entries``: [(index of a param group of ``optimizer``, the
        group's parameters in it)], as the grouped step narrows them."""
        host = self._host[id(group)]
        job = self._jobs.get(id(group))
        if job is not None:
            self._settle(job)  # its speculative step, checked in ``before_step``
        else:
            job = self._stage_now(group, optimizer, entries)
        self.counts["kept" if job.stepped and job.future is not None else "serialized"] += 1
        if not job.stepped:
            with _threads(self.policy.threads):
                while not job.copied.is_set() and (ahead := self._holding_buffer(job)) is not None:
                    self._run(ahead)  # staged earlier, it holds a buffer this one waits for
                self._run(job)
        del self._jobs[id(group)]
        for _, params in entries:
            for p in params:
                self._expose(optimizer, p, host, host.index[id(p)])
        self._copy_up(group, host)
        _weights_written(group)
        host.epoch = group.weights_epoch
        if self.policy.overlap == "step":
            host.backed_up = False
            if host.speculate:  # else the next speculation saves it first
                self._pool.submit(self._save, host)  # during the next forward

    def _stage_now(self, group, optimizer, entries) -> _Job:
        """Stage a group in ``step`` (not speculated): its gradient as it is now."""
        job = _Job(group, self._host[id(group)], entries, [dict(optimizer.param_groups[i]) for i, _ in entries], None)
        if self._cuda:  # the copy may be issued from the worker thread: it waits for this point
            job.event = torch.cuda.current_stream(_main_flat(group).device).record_event()
        self._jobs[id(group)] = job
        with self._lock:
            self._waiting.append(job)
        self._pump()
        return job

    def _copy_up(self, group, host: _HostGroup) -> None:
        main = _main_flat(group)
        if self._stream is None:
            main.copy_(host.master)
            return
        self._up.wait_stream(torch.cuda.current_stream(main.device))  # nothing still reads the old weights
        with torch.cuda.stream(self._up):
            main.copy_(host.master, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._up)
        host.copied_up = event
        _weights_ready(group, event)
        self._pending_up.append(event)

    def wait_weights(self) -> None:
        """Make the current stream wait for the last step's copies up (before reading an offloaded
        group's main weights other than through the runtime's refresh or gather)."""
        if self._cuda:
            current = torch.cuda.current_stream()
            for event in self._pending_up:
                current.wait_event(event)

    # ------------------------------------------------------------------ state dicts
    def _expose(self, optimizer, p, host: _HostGroup, j: int) -> None:
        """``optimizer.state[p]``: the host states as DTensors shaped like ``p`` (kept while the
        host tensors are the same objects)."""
        state = self._cpu().state.get(host.params[j])
        if not state:
            return
        key = tuple((k, id(v)) for k, v in state.items())
        if host.exposed[j] == key and p in optimizer.state:
            return
        shape = host.params[j].shape
        optimizer.state[p] = {k: _compat.dtensor_with_local(p, v)
                              if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shape else v
                              for k, v in state.items()}
        host.exposed[j] = key

    def _after_load(self, optimizer) -> None:
        """After ``optimizer.load_state_dict``: the loaded states of offloaded parameters (cast to
        the device by torch) become host tensors again, exposed as before."""
        self.discard()
        self._drain()
        cpu = self._cpu()
        fused = self._flags.get("fused") is True
        for host in self._host.values():
            host.backed_up = False
        for group in self.groups:
            if not group.requires_grad:
                continue
            host = self._host.get(id(group)) or self._host.setdefault(id(group), _HostGroup(group, self._pinned))
            for p in group.sharded_params:
                j = host.index[id(p)]
                loaded = optimizer.state.get(p)
                cpu.state.pop(host.params[j], None)
                host.exposed[j] = None
                if not loaded:
                    optimizer.state.pop(p, None)
                    continue
                shape, states = host.params[j].shape, {}
                for k, v in loaded.items():
                    if isinstance(v, torch.Tensor):
                        local = _local(v).detach()
                        if local.dim() > 0 and local.shape == shape:
                            v = torch.empty(shape, dtype=local.dtype, device="cpu").copy_(local)
                        else:  # the step count
                            v = local.to("cpu", torch.float32 if fused else local.dtype, copy=True)
                    states[k] = v
                cpu.state[host.params[j]] = states
                self._expose(optimizer, p, host, j)


@contextlib.contextmanager
def _threads(n: Optional[int]):
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_ENGINES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OffloadedStep]" = weakref.WeakKeyDictionary()


def bind(model: nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence, policy: OffloadPolicy) -> OffloadedStep:
    """The host step of the groups ``policy`` chooses among the optimizer's ``groups``."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload must be an mfsdp.OffloadPolicy, got {type(policy).__name__}")
    engine = OffloadedStep(optimizer, choose_groups(model, groups, policy), policy)
    ref = weakref.ref(engine)
    model.register_state_dict_pre_hook(lambda *_: (e := ref()) is not None and e.wait_weights())
    # A load writes the main weights: after any copy up still in flight, never under it.
    model.register_load_state_dict_pre_hook(lambda *_: (e := ref()) is not None and e.wait_weights())
    _ENGINES[optimizer] = engine
    return engine


def offload_of(optimizer: torch.optim.Optimizer) -> Optional[OffloadedStep]:
    """The host step bound to ``optimizer`` by ``fully_shard_optimizer(..., offload=...)``, if any."""
    return _ENGINES.get(optimizer)
