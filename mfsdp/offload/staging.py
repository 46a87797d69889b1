"""The staging ring: a few page-locked host buffers that the offloaded groups' gradients pass
through in turn on their way down, instead of a pinned copy of every gradient."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from mfsdp.offload.host import host_buffer, shard_views, tensor_bytes


def copy_gradient_down(sources: Sequence[Optional[torch.Tensor]], destinations: Sequence[torch.Tensor],
                       stream: Optional[torch.Stream], after: Optional[torch.Event] = None):
    """Copy each present gradient (a local shard) into its staging view; returns a handle whose
    ``synchronize()`` waits for the copies (a CUDA event recorded after them, on ``stream``), or
    None where they have completed (CPU).

    On CUDA ``stream`` first waits for ``after`` (the event the reduction was issued before) or,
    without one, for the caller's current stream. A gradient kept in another dtype (bf16 main
    gradients) is cast on the device first, one parameter at a time on ``stream``: a
    device-to-host copy that also converts would go through a pageable host temporary. The casts'
    memory returns to ``stream``'s pool, where later work is ordered after these copies."""
    if stream is None:
        for src, dst in zip(sources, destinations):
            if src is not None:
                dst.copy_(src)
        return None
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


class Staged:
    """One group's gradient in the ring: its local shards (None where absent), the event they are
    final at, the buffer it holds, and its copy's handle once issued (``copied`` set then)."""

    def __init__(self, group, sources: list, after: Optional[torch.Event]) -> None:
        self.group, self.sources, self.after = group, sources, after
        self.slot: Optional[int] = None
        self.handle = None
        self.copied = threading.Event()  # set once the copy is issued (``handle``: None if done)


class StagingRing:
    """Up to ``size`` buffers of ``numel`` elements (allocated on first use, then kept), pinned when
    ``pinned`` is a list. A staged gradient's copy down is issued, in order, as soon as a buffer is
    free, by whichever thread frees it (on CUDA on a side stream, after the reduction's event)."""

    def __init__(self, numel: int, dtype: torch.dtype, size: int, device: torch.device,
                 pinned: Optional[list]) -> None:
        self._numel, self._dtype, self._size, self._pinned = numel, dtype, size, pinned
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slots: list[torch.Tensor] = []
        self._free: list[int] = []
        self._waiting: list[Staged] = []  # staged, their copy not yet issued (no free buffer)
        self._lock = threading.Lock()
        self.copy_down = copy_gradient_down  # the copy of a gradient into a buffer (a seam for tests)

    def stage(self, group, sources: list, after: Optional[torch.Event]) -> Staged:
        staged = Staged(group, sources, after)
        with self._lock:
            self._waiting.append(staged)
        self._pump()
        return staged

    def _pump(self) -> None:
        """Issue the copies of waiting gradients, in order, while buffers are free."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                if not self._free and len(self._slots) < self._size:
                    self._slots.append(host_buffer(self._numel, self._dtype, self._pinned))
                    self._free.append(len(self._slots) - 1)
                if not self._free:
                    return
                staged = self._waiting.pop(0)
                staged.slot = self._free.pop(0)
            staged.handle = self.copy_down(staged.sources, self._views(staged), self._stream, staged.after)
            staged.copied.set()

    def _views(self, staged: Staged) -> list[torch.Tensor]:
        main = staged.group.main.tensor
        assert main.dtype == self._slots[staged.slot].dtype, (main.dtype, self._slots[staged.slot].dtype)
        return shard_views(staged.group, self._slots[staged.slot][: main.numel()])

    def wait(self, staged: Staged) -> list[Optional[torch.Tensor]]:
        """Wait for the staged copy; its gradients, as views of the buffer (None where absent)."""
        staged.copied.wait()
        if staged.handle is not None:
            staged.handle.synchronize()
        return [None if s is None else v for s, v in zip(staged.sources, self._views(staged))]

    def withdraw(self, staged: Staged) -> None:
        """No copy of ``staged`` is issued from now on if none was yet."""
        with self._lock:
            if staged in self._waiting:
                self._waiting.remove(staged)

    def release(self, staged: Staged) -> None:
        """Once its copy is done, ``staged``'s buffer goes to the next gradient waiting."""
        if staged.handle is not None:
            staged.handle.synchronize()
        if staged.slot is not None:
            with self._lock:
                self._free.append(staged.slot)
            staged.slot = None
        self._pump()

    def nbytes(self) -> int:
        return tensor_bytes(self._slots)
