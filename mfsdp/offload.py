"""Optimizer offload: the master weights and optimizer states of chosen units live on the host.

``fully_shard_optimizer(model, optimizer, offload=OffloadPolicy(...))`` picks parameter groups
(whole units: a fraction counted from the units whose gradients finish first in backward, or
units by name). For each of them this rank keeps, in host memory:

* the fp32 master weights of its optimizer shard, one flat buffer laid out like the group's
  ``main`` buffer (page-locked on CUDA, exactly its bytes);
* the optimizer states, created and updated by a CPU optimizer of the user's class and
  hyper-parameters (torch's fused CPU kernel where the class has one, foreach otherwise);

and one staging buffer, the size of the largest offloaded group's shard in the main dtype, that
every offloaded group's gradient passes through in turn. Nothing else is copied: no pinned copy of
the whole model's parameters or gradients.

At step time (inside the bound optimizer's group-by-group step, ``mfsdp.optimizer._GroupedStep``)
an offloaded group is stepped by ``OffloadedStep.step_group``: its reduced gradient is copied down
into the staging buffer (on CUDA on a side stream, ``non_blocking``, followed by an event), the
CPU optimizer steps the host master weights with it once the event has completed, and the updated
master weights are copied up into the group's ``main`` buffer (side stream again; the compute
stream waits for that copy's event, so the refresh, the next forward's gathers and any later read
see the new weights). The group's weights are then marked written (``_weights_written``, the one
place that touches the group's staleness marks). The other groups step on the device as before.

[Note: exact and serialized, this first version]
Offloaded groups step after backward, in ``optimizer.step()``, one after another, the copy of
each group's gradient and the CPU step not overlapping backward or each other. That keeps every
rule of the step exact with no special case: global-norm clipping (the user's
``clip_grad_norm_`` scaled the gradients before ``step``), accumulation over microbatches (the
gradient read is the final one), NaN checks made before the step, and ``zero_grad``; the CPU
optimizer is the user's math (bit-identical where its CPU kernel is the one the device would run,
as on CPU). The cost is the whole CPU step exposed per optimizer step (issue 21: ~2.6 s for 8B).

The seam for the overlapped version is ``OffloadedStep.gradient_final(group)``: "this group's
gradient is final, start copying it down". Today the step calls it just before stepping the group;
the overlapped version calls it from the reduction path when the group's last-microbatch reduction
finishes, and must then also decide how clipping stays exact (a norm computed before any unit
steps, or speculate-and-validate). A group staged early is stepped from what was staged.

Also still on the device in this version: the fp32 ``main`` buffer of an offloaded group (the
runtime gathers and refreshes from it), so the device saves the optimizer states' bytes (8 per
parameter for Adam), not the master weights'. Dropping the device's master needs the runtime to
keep only compute weights for such groups.

State dicts: the CPU optimizer's states are exposed in the user optimizer's ``state`` as DTensors
of the device parameter's mesh, placements and global shape whose local shards are the host
tensors themselves, so ``optimizer.state_dict()``, ``get_optimizer_state_dict`` and DCP see the
same entries as for a group stepped on the device (DCP reshards them on load like any DTensor).
A load (``load_state_dict``, which torch casts to the parameter's device) is moved back into host
tensors by a post hook; the device copies it made are then dropped.

The host master is re-read from the device's ``main`` whenever the group's ``weights_epoch`` moved
since the last write here (a model state-dict load, an init, ``refresh_model_weights`` after an
edit): checked at the start of every step, before the step's own marks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
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


# ---------------------------------------------------------------------------- the group's side
# Everything this module reads or writes on a parameter group goes through these few helpers.

def _weights_written(group) -> None:
    """The group's main weights were written (by the host step's copy up)."""
    group.weights_written()


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
                       stream: Optional[torch.Stream]):
    """Copy each present gradient (a local shard) into its staging view; returns a handle whose
    ``synchronize()`` waits for the copies (a CUDA event recorded after them, on ``stream``).

    On CUDA a gradient kept in another dtype (bf16 main gradients) is cast on the device first,
    one parameter at a time on ``stream``: a device-to-host copy that also converts would go
    through a pageable host temporary. The casts' memory returns to ``stream``'s pool, where later
    work is ordered after these copies."""
    if stream is None:
        for src, dst in zip(sources, destinations):
            if src is not None:
                dst.copy_(src)
        return _Done()
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the gradients are written
    with torch.cuda.stream(stream):
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


class _HostGroup:
    """One offloaded group's host side: the master weights and the CPU optimizer's parameters
    (views of them), and the epoch of the group's weights the master was last equal to."""

    def __init__(self, group, pinned: Optional[list]) -> None:
        main = _main_flat(group)
        self.master = _host_buffer(main.numel(), main.dtype, pinned)
        self.params = [v for v in _shard_views(group, self.master)]
        self.index = {id(p): j for j, p in enumerate(group.sharded_params)}
        self.epoch: Optional[int] = None  # not yet read from the device
        self.exposed: list[Optional[tuple]] = [None] * len(self.params)


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
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._optimizer = weakref.ref(optimizer)
        self._cls = type(optimizer)
        self._flags = _cpu_flags(self._cls, optimizer.defaults)
        self._host: dict[int, _HostGroup] = {}
        self._staging: Optional[torch.Tensor] = None
        self._staged: Optional[tuple[int, object, list]] = None  # (id(group), handle, present)
        self._cpu_optimizer: Optional[torch.optim.Optimizer] = None
        self.copy_down: Callable = copy_gradient_down
        """The copy of a group's gradient into the staging buffer (a seam for tests)."""
        optimizer.register_load_state_dict_post_hook(lambda opt: self._after_load(opt))

    def owns(self, group) -> bool:
        return id(group) in self._ids

    # ------------------------------------------------------------------ host memory
    def host_nbytes(self) -> dict:
        """Host bytes held: the master weights, the optimizer states, the staging buffer."""
        states = 0
        cpu = self._cpu_optimizer
        if cpu is not None:
            for host in self._host.values():
                for p in host.params:
                    for v in cpu.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            states += v.numel() * v.element_size()
        master = sum(h.master.numel() * h.master.element_size() for h in self._host.values())
        staging = 0 if self._staging is None else self._staging.numel() * self._staging.element_size()
        return {"master": master, "states": states, "staging": staging}

    def _host_of(self, group) -> _HostGroup:
        host = self._host.get(id(group))
        if host is None:
            host = self._host[id(group)] = _HostGroup(group, self._pinned)
        if host.epoch != group.weights_epoch:  # written since on the device (a load, an init, an edit)
            self._pull(group, host)
        return host

    def _pull(self, group, host: _HostGroup) -> None:
        host.master.copy_(_main_flat(group))  # synchronous: the master is read right after
        host.epoch = group.weights_epoch

    def _staging_views(self, group) -> list[torch.Tensor]:
        if self._staging is None:
            numel = max(_main_flat(g).numel() for g in self.groups)
            self._staging = _host_buffer(numel, _main_flat(self.groups[0]).dtype, self._pinned)
        main = _main_flat(group)
        assert main.dtype == self._staging.dtype, (main.dtype, self._staging.dtype)
        return _shard_views(group, self._staging[: main.numel()])

    def _cpu(self) -> torch.optim.Optimizer:
        if self._cpu_optimizer is None:
            optimizer = self._optimizer()
            self._cpu_optimizer = _construct(self._cls, [torch.zeros(1)], {**optimizer.defaults, **self._flags})
        return self._cpu_optimizer

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        """At the start of ``step``, before the step's own marks: read back the master of every
        group written on the device since (see the module's notes)."""
        for group in self.groups:
            if group.requires_grad:
                self._host_of(group)

    def gradient_final(self, group) -> None:
        """The seam: ``group``'s reduced gradient is final; start copying it down. Today the step
        calls it right before stepping the group; the overlapped version calls it when the group's
        last-microbatch reduction finishes. One staging buffer: a group stays staged until it steps."""
        if self._staged is not None:
            if self._staged[0] == id(group):
                return
            raise RuntimeError("mfsdp offload: a group's gradient was staged while another's still "
                               "waits to step (one staging buffer)")
        sources = [None if p.grad is None else _local(p.grad) for p in group.sharded_params]
        handle = self.copy_down(sources, self._staging_views(group), self._stream)
        self._staged = (id(group), handle, [s is not None for s in sources])

    def step_group(self, optimizer: torch.optim.Optimizer, group, entries) -> None:
        """Step ``group`` on the host; ``entries``: [(index of a param group of ``optimizer``, the
        group's parameters in it)], as the grouped step narrows them."""
        host = self._host_of(group)
        self.gradient_final(group)
        _, handle, present = self._staged
        self._staged = None
        grads = self._staging_views(group)
        handle.synchronize()
        cpu = self._cpu()
        cpu_groups, stepped = [], []
        for i, params in entries:
            hp = []
            for p in params:
                j = host.index[id(p)]
                host.params[j].grad = grads[j] if present[j] else None
                hp.append(host.params[j])
                stepped.append((p, j))
            cpu_groups.append({**optimizer.param_groups[i], **self._flags, "params": hp})
        cpu.param_groups = cpu_groups
        try:
            with torch.no_grad(), _threads(self.policy.threads):
                cpu.step()
        finally:
            for p in host.params:
                p.grad = None
        for p, j in stepped:
            self._expose(optimizer, p, host, j)
        self._copy_up(group, host)
        _weights_written(group)
        host.epoch = group.weights_epoch

    def _copy_up(self, group, host: _HostGroup) -> None:
        main = _main_flat(group)
        if self._stream is None:
            main.copy_(host.master)
            return
        current = torch.cuda.current_stream(main.device)
        self._stream.wait_stream(current)  # nothing on the device still reads the old weights
        with torch.cuda.stream(self._stream):
            main.copy_(host.master, non_blocking=True)
        current.wait_stream(self._stream)

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
        cpu = self._cpu()
        fused = self._flags.get("fused") is True
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
    _ENGINES[optimizer] = engine
    return engine


def offload_of(optimizer: torch.optim.Optimizer) -> Optional[OffloadedStep]:
    """The host step bound to ``optimizer`` by ``fully_shard_optimizer(..., offload=...)``, if any."""
    return _ENGINES.get(optimizer)
