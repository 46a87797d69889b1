"""The host side of offloaded groups: master weights, the CPU optimizer and its states, the backup
that undoes a speculative step, and the states as the user's optimizer shows them."""

from __future__ import annotations

import inspect
import threading
from typing import Optional

import torch

from mfsdp import _compat
from mfsdp.runtime.parameter_group import local_tensor


def host_buffer(numel: int, dtype: torch.dtype, pinned: Optional[list]) -> torch.Tensor:
    """A flat host tensor; page-locked (exactly its bytes) and appended to ``pinned`` when given."""
    t = torch.empty(numel, dtype=dtype, device="cpu")
    if pinned is not None:
        _compat.pin_host_memory(t)
        pinned.append(t)
    return t


def unpin(pinned: list) -> None:
    for t in pinned:
        _compat.unpin_host_memory(t)
    pinned.clear()


def shard_views(group, flat: torch.Tensor) -> list[torch.Tensor]:
    """Per-parameter views of ``flat`` (laid out like the group's ``main``), shaped like the local
    shards of ``group.sharded_params``."""
    layout, geometry = group.layout, group.geometry
    return layout.shards(layout.regions(flat, geometry.num_shards), geometry.shard_index)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _construct(cls: type, params, settings: dict) -> torch.optim.Optimizer:
    """``cls(params, **settings)`` with the settings its constructor takes (AdamW's defaults also
    hold ``decoupled_weight_decay``, which only the param groups carry)."""
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
            _construct(cls, [torch.zeros(1)], {**defaults, **flags, "foreach": None, "fused": True})
            return {**flags, "fused": True, "foreach": None}
        except (RuntimeError, ValueError, TypeError):
            pass
    if "foreach" in defaults:
        flags["foreach"] = True
    if "fused" in defaults:
        flags["fused"] = None
    return flags


def _copy_into(dst: dict, src: dict) -> dict:
    """``src``'s entries written into ``dst``: a tensor in place where ``dst`` has one of its shape
    and dtype (exposed and backed-up tensors stay the same objects), else a clone."""
    for k, v in src.items():
        old = dst.get(k)
        if not isinstance(v, torch.Tensor):
            dst[k] = v
        elif isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
            old.copy_(v)
        else:
            dst[k] = v.clone()
    return dst


class HostGroup:
    """One offloaded group's host record, written by ``HostState`` alone."""

    def __init__(self, group, pinned: Optional[list]) -> None:
        main = group.main.tensor
        self.master = host_buffer(main.numel(), main.dtype, pinned)
        self.params = shard_views(group, self.master)  # the CPU optimizer's parameters
        self.index = {id(p): j for j, p in enumerate(group.sharded_params)}
        self.epoch: Optional[int] = None  # the group's weights epoch the master last equalled
        self.exposed: list[Optional[tuple]] = [None] * len(self.params)
        self.copied_up: Optional[torch.Event] = None  # the master may be written once it is done
        self.backup_master: Optional[torch.Tensor] = None
        self.backup_states: list[Optional[dict]] = [None] * len(self.params)
        self.backed_up = False  # the backup equals master and states


class HostState:
    """The masters and optimizer states of the offloaded groups, in host memory, and the CPU
    optimizer of the user's class that steps them (torch's fused CPU kernel where the class has
    one). The only writer of a group's master, its states and, after a host step, its ``main``."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, pinned: Optional[list]) -> None:
        self.flags = _cpu_flags(type(optimizer), optimizer.defaults)
        self.cpu = _construct(type(optimizer), [torch.zeros(1)], {**optimizer.defaults, **self.flags})
        self._pinned = pinned
        self._up = torch.cuda.Stream(device) if device.type == "cuda" else None  # copies up
        self._groups: dict[int, HostGroup] = {}
        # The CPU optimizer's param groups and states: one group steps, saves or restores at a time
        # (the worker's speculation beside the step's redo of another group).
        self._lock = threading.RLock()

    def of(self, group) -> HostGroup:
        host = self._groups.get(id(group))
        if host is None:
            host = self._groups[id(group)] = HostGroup(group, self._pinned)
        return host

    def reread(self, group) -> None:
        """The group's main weights were written on the device (a load, an init, an edit): the
        master becomes them again, synchronously (it is read right after)."""
        host = self.of(group)
        host.master.copy_(group.main.tensor)
        host.epoch, host.backed_up = group.weights_epoch, False

    def step(self, host: HostGroup, entries, settings: list, grads: list) -> None:
        """One CPU step of ``host`` on ``grads`` (None: no gradient); ``entries`` and ``settings``:
        the user's param groups narrowed to the group's parameters, and their settings."""
        if host.copied_up is not None:
            host.copied_up.synchronize()  # the last copy up has read the master
        with self._lock:
            self.cpu.param_groups = [{**s, **self.flags, "params": [host.params[host.index[id(p)]] for p in params]}
                                     for (_, params), s in zip(entries, settings)]
            for p, grad in zip(host.params, grads):
                p.grad = grad
            try:
                with torch.no_grad():
                    self.cpu.step()
            finally:
                for p in host.params:
                    p.grad = None

    def save(self, host: HostGroup) -> None:
        """The backup of master and states (in place after the first time)."""
        if host.copied_up is not None:
            host.copied_up.synchronize()
        with self._lock:
            if host.backup_master is None:
                host.backup_master = torch.empty_like(host.master)
            host.backup_master.copy_(host.master)
            for j, p in enumerate(host.params):
                state = self.cpu.state.get(p)
                host.backup_states[j] = _copy_into(host.backup_states[j] or {}, state) if state else None
            host.backed_up = True

    def restore(self, host: HostGroup) -> None:
        """Undo a speculative step: master and states back to the backup, in place."""
        with self._lock:
            host.master.copy_(host.backup_master)
            for j, p in enumerate(host.params):
                if host.backup_states[j] is None:
                    self.cpu.state.pop(p, None)
                    host.exposed[j] = None
                else:
                    _copy_into(self.cpu.state.setdefault(p, {}), host.backup_states[j])

    def commit(self, group) -> None:
        """After the group's host step: the master is copied into its ``main`` (on CUDA on a side
        stream, its event the group's ``weights_ready``, which its next refresh or gather waits
        for) and the group's weights are marked written. The one place offload writes them."""
        host, main = self._groups[id(group)], group.main.tensor
        if self._up is None:
            main.copy_(host.master)
        else:
            self._up.wait_stream(torch.cuda.current_stream(main.device))  # nothing still reads the old weights
            with torch.cuda.stream(self._up):
                main.copy_(host.master, non_blocking=True)
            host.copied_up = group.weights_ready = self._up.record_event()
        group.weights_written()
        host.epoch, host.backed_up = group.weights_epoch, False

    def wait_weights(self) -> None:
        """The current stream waits for every group's last copy up."""
        if self._up is not None:
            current = torch.cuda.current_stream()
            for host in self._groups.values():
                if host.copied_up is not None:
                    current.wait_event(host.copied_up)

    def expose(self, optimizer: torch.optim.Optimizer, p, host: HostGroup) -> None:
        """``optimizer.state[p]``: the host states as DTensors shaped like ``p`` (kept while the
        host tensors are the same objects), so state dicts and DCP see what a device step keeps."""
        j = host.index[id(p)]
        state = self.cpu.state.get(host.params[j])
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

    def load(self, optimizer: torch.optim.Optimizer, groups) -> None:
        """After ``optimizer.load_state_dict`` (nothing speculated, the worker idle): the loaded
        states of the groups' parameters, which torch cast to the device, become host tensors again,
        exposed as before."""
        fused = self.flags.get("fused") is True
        for group in (g for g in groups if g.requires_grad):
            host = self.of(group)
            host.backed_up = False
            for p in group.sharded_params:
                j = host.index[id(p)]
                loaded = optimizer.state.get(p)
                self.cpu.state.pop(host.params[j], None)
                host.exposed[j] = None
                if not loaded:
                    optimizer.state.pop(p, None)
                    continue
                self.cpu.state[host.params[j]] = {k: _to_host(v, host.params[j].shape, fused) for k, v in loaded.items()}
                self.expose(optimizer, p, host)

    def nbytes(self) -> dict:
        hosts = self._groups.values()
        return {"master": tensor_bytes(h.master for h in hosts),
                "states": sum(tensor_bytes(self.cpu.state.get(p, {}).values()) for h in hosts for p in h.params),
                "backup": sum(tensor_bytes([h.backup_master, *(v for s in h.backup_states if s for v in s.values())])
                              for h in hosts)}


def _to_host(v, shape: torch.Size, fused: bool):
    """A loaded state on the host: a tensor shaped like the parameter's shard as it is, the step
    count in float32 for the fused kernel."""
    if not isinstance(v, torch.Tensor):
        return v
    local = local_tensor(v).detach()
    if local.dim() > 0 and local.shape == shape:
        return torch.empty(shape, dtype=local.dtype, device="cpu").copy_(local)
    return local.to("cpu", torch.float32 if fused else local.dtype, copy=True)
