"""Asynchronous checkpoints: each rank's shards staged into one pinned host buffer kept for the
run, then written by DCP from a background thread while training goes on."""

from __future__ import annotations

import copy
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mfsdp import _compat
from mfsdp.train.checkpoint.meta import CheckpointMeta, checkpoint_bytes
from mfsdp.train.checkpoint.storage import (damage, describe, is_complete, make_temp, paths, publish_when_written,
                                            raise_if_any, save_checkpoint, state_of)
from mfsdp.train.command.errors import CheckpointError


@dataclass
class _Write:
    """A save whose files are being written in the background."""
    step: int
    meta: CheckpointMeta
    future: Future
    started: float  # perf_counter when the write began
    stall: "_Stall"  # how long training waited for the save, and for what
    note: str = ""  # appended to the save's line


@dataclass
class _Stall:
    """Where the training's wait for an asynchronous save went (seconds)."""
    previous: float = 0.0  # waiting for the previous save's write to end (and publishing it)
    pinning: float = 0.0  # the staging buffer's allocation and page-locking: what was left of it
    #                       in the background, or all of it where the save had to make it
    copy: float = 0.0  # the copy into the staging buffer (one wait for the device at its end)
    planning: float = 0.0  # the state dict, the temp directory and handing the save to DCP

    @property
    def total(self) -> float:
        return self.previous + self.pinning + self.copy + self.planning

    def line(self) -> str:
        pinning = f", page-locking {self.pinning:.2f} s" if self.pinning >= 0.005 else ""
        return (f"training waited {self.total:.2f} s to stage it (previous write {self.previous:.2f} s"
                f"{pinning}, copy {self.copy:.2f} s, planning {self.planning:.2f} s)")


class Checkpointer:
    """The saves of one training run: synchronous (``save_checkpoint``), or staged into pinned host
    memory and written in the background (``docs/design.md``, "Asynchronous checkpoints", has the
    choreography). Either way ``meta.json`` and ``latest`` appear only once every rank's files are
    on disk, and every step below is collective, taken by every rank at the same training step."""

    def __init__(self, root: str | os.PathLike, keep: int, asynchronous: bool,
                 pinned: bool = False, timeout_s: float = 1800.0, log=None,
                 model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, save_dtype: torch.dtype | None = None):
        self.root = Path(root)
        self.keep = keep
        self.asynchronous = asynchronous
        self.save_dtype = save_dtype  # --train.save_only_model: the weights' dtype (None: the full state)
        self.log = log or (lambda message: None)  # one line per published save
        self._write: _Write | None = None
        self._step = 0  # the training step of the last poll
        self._stager = self._write_group = self._poll_group = None
        self._unprepared = None  # (model, optimizer) whose staging buffer is not yet being made
        if not asynchronous:
            return
        try:
            self._already_staged = _compat.already_staged_stager()
        except RuntimeError as err:
            raise CheckpointError(str(err)) from None
        self._stager = HostStager(pinned, save_dtype)
        if dist.is_initialized():  # collective: every rank builds its Checkpointer together
            timeout = timedelta(seconds=timeout_s)
            self._write_group = dist.new_group(backend="gloo", timeout=timeout)
            self._poll_group = dist.new_group(backend="gloo", timeout=timeout)
        if model is not None and optimizer is not None:
            self._unprepared = (model, optimizer)
            self._prepare()

    def _prepare(self) -> None:
        """Start making the staging buffer in the background once the state dict's layout is
        known: the optimizer has state (after loading a checkpoint, or after the first step), or
        is not saved. Before that, ``get_optimizer_state_dict`` would initialise it with a step of
        its own, which would change the training."""
        model, optimizer = self._unprepared
        model_only = self.save_dtype is not None
        if not (model_only or getattr(optimizer, "state", True)):
            return
        self._unprepared = None
        self._stager.prepare(state_of(model, optimizer, model_only))

    @property
    def writing(self) -> str | None:
        """The name of the checkpoint being written in the background, if one is."""
        return paths(self.root, self._write.step)[0].name if self._write else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             meta: CheckpointMeta) -> Path:
        """Save ``step``: at once, or staged and then written in the background."""
        start = time.perf_counter()
        if not self.asynchronous:
            path = save_checkpoint(self.root, step, model, optimizer, meta, self.keep, self.save_dtype)
            self.log(f"checkpoint {path.name} saved: training waited "
                     f"{time.perf_counter() - start:.2f} s for the whole write")
            return path
        self._step = step
        self.wait()  # training waits here when the previous write is still running
        stall = _Stall(previous=time.perf_counter() - start)
        final, temp = paths(self.root, step)
        if is_complete(final) and damage(final) is None:  # resumed from this very step (see save_checkpoint)
            return final
        mark = time.perf_counter()
        make_temp(self.root, final, temp, self._poll_group)
        problem, staged, note = None, None, ""
        try:
            state = state_of(model, optimizer, model_only=self.save_dtype is not None)
            stall.planning = time.perf_counter() - mark
            staged = self._stager.stage(state)
            stall.pinning, stall.copy = self._stager.last_wait_s, self._stager.last_copy_s
            made = self._stager.take_background_s()
            note = ("" if made is None else f"; its staging buffer ({self._stager.nbytes() / 2**30:.1f} "
                    f"GiB) was allocated{' and page-locked' if self._stager.pinned else ''} in "
                    f"the background in {made:.2f} s")
        except (Exception, CheckpointException) as err:
            problem = describe(err)
        mark = time.perf_counter()
        raise_if_any(problem, self.root, final, temp, self._poll_group)
        writer = _storage_writer(temp)
        # Nothing to copy ahead from the GPU: the state is staged in host memory already. DCP's
        # own staging sets the same (FileSystemWriter.stage); with it left at its default, the
        # writer's loader would sync the CUDA stream of its thread (device 0 on every rank)
        # every 10 MB.
        writer.per_thread_copy_ahead = 0
        future = dcp.async_save(staged, storage_writer=writer, process_group=self._write_group,
                                async_stager=self._already_staged)
        now = time.perf_counter()
        stall.planning += now - mark
        self._write = _Write(step, meta, future, now, stall, note)
        return final

    def poll(self, step: int) -> None:
        """Publish the background write once it has ended on every rank; CheckpointError if it
        failed anywhere. Call it after every training ``step``, on every rank: it is collective
        while a write is in flight (one all-reduce), and free otherwise."""
        self._step = step
        if self._unprepared is not None:
            self._prepare()  # after the first step: AdamW has its moments now
        if self._write is None:
            return
        running = torch.tensor([0 if self._write.future.done() else 1])
        if dist.is_initialized():
            dist.all_reduce(running, group=self._poll_group)
        if running.item() == 0:
            self._finish()

    def wait(self) -> None:
        """Block until the background write (if any) has ended, then publish it as ``poll``."""
        if self._write is not None:
            try:
                self._write.future.result()
            except (Exception, CheckpointException):  # reported by _finish, on every rank
                pass
            self._finish()

    def close(self) -> None:
        """Wait for the last write and release the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()

    def _finish(self) -> None:
        write, self._write = self._write, None
        error = write.future.exception()
        problem = None if error is None else describe(error)
        publish_when_written(self.root, write.step, write.meta, self.keep, problem,
                             self._poll_group, self.save_dtype)
        # The write ended after the poll of the step before self._step: the steps between
        # write.step and self._step ran while it was written.
        during = (f", over steps {write.step + 1}-{self._step}" if self._step > write.step
                  else ", as the run ended")
        self.log(f"checkpoint {paths(self.root, write.step)[0].name} saved: {write.stall.line()}, then it was "
                 f"written in the background in {time.perf_counter() - write.started:.1f} s{during}"
                 f"{write.note}")


class HostStager:
    """Copies a state dict into host buffers that it keeps from one save to the next.

    All tensors (a DTensor: its shard on this rank) are copied into one flat host buffer, at
    offsets given by their key paths in the state dict, so the second and later saves allocate
    nothing. On CUDA the buffer is page-locked in place (exactly its bytes) and filled by
    non-blocking copies, then one event is waited for. A staged DTensor keeps its global shape and
    placements, with the host copy as its local shard, so DCP writes the same checkpoint as from
    the device.

    ``prepare`` allocates and page-locks the buffer in a background thread (tens of GiB take seconds
    to fault in and lock), so that ``stage`` only waits for what is left of it. Each staged tensor
    is a view of the buffer that owns exactly its bytes (through DLPack): DCP's writer clones any
    CPU tensor whose storage is larger than itself, which for plain views of one flat buffer would
    be a second copy of every byte.

    With ``cast`` (a model-only save's dtype), every floating-point tensor is staged in that dtype,
    cast on its device as it is copied, so the buffer holds the checkpoint's bytes exactly.

    DCP's own ``DefaultStager`` is not used: it takes a DTensor whose wrapper reports a non-zero
    ``data_ptr`` (mfsdp's parameters are views at an offset into a flat buffer) for a plain
    tensor, and fails on its storage ("invalid python storage").
    """

    _ALIGN = 64  # bytes; every dtype's view of the flat buffer starts aligned
    _PAGE = 4096  # bytes; the buffer is touched once per page before it is page-locked

    def __init__(self, pinned: bool, cast: torch.dtype | None = None):
        self.pinned = pinned
        self.cast = cast
        self._flat: torch.Tensor | None = None
        self._layout: dict[tuple, tuple] = {}  # key path -> (offset, shape, dtype)
        self._views: dict[tuple, torch.Tensor] = {}  # key path -> its exact-storage view
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # of the background allocation
        self.allocate_s = 0.0  # how long the last allocation (and page-locking) took
        self.last_wait_s = 0.0  # how long the last stage waited for the buffer (made or making)
        self.last_copy_s = 0.0  # how long the last stage's copy took (with its final wait)
        self._background_s: float | None = None  # of the last allocation in the background

    def prepare(self, state: dict) -> None:
        """Allocate (and page-lock) the buffer for ``state``'s tensors in a background thread."""
        layout, total = _staging_layout(_leaves(state), self.cast)
        self._join()
        if layout == self._layout:
            return
        self.close()
        device = torch.cuda.current_device() if self.pinned else None  # the thread's is 0

        def allocate():
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                self._allocate(layout, total)
                self._background_s = self.allocate_s
            except BaseException as err:  # raised by the stage that waits for it
                self._error = err

        self._thread = threading.Thread(target=allocate, name="mfsdp-staging-pin", daemon=True)
        self._thread.start()

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        start = time.perf_counter()
        self._join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        leaves = _leaves(state)
        layout, total = _staging_layout(leaves, self.cast)
        if layout != self._layout:  # not prepared (or the shapes changed): allocate now
            self.close()
            self._allocate(layout, total)
        self.last_wait_s = time.perf_counter() - start
        start = time.perf_counter()
        staged = {key: self._views[key].copy_(local.detach(), non_blocking=self.pinned)
                  for key, local in leaves.items()}
        if self.pinned:
            _wait_for_copies()
        self.last_copy_s = time.perf_counter() - start
        return _rebuild(state, (), staged)

    def take_background_s(self) -> float | None:
        """How long the buffer took to make in the background, once after it was (else None)."""
        self._join()
        made, self._background_s = self._background_s, None
        return made

    def nbytes(self) -> int:
        """The host bytes held now."""
        self._join()
        return 0 if self._flat is None else self._flat.numel()

    def close(self) -> None:
        """Release the buffer (unpinning it)."""
        self._join()
        self._error = None
        if self._flat is not None and self.pinned:
            _compat.unpin_host_memory(self._flat)
        self._flat, self._layout, self._views = None, {}, {}

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _allocate(self, layout: dict, total: int) -> None:
        start = time.perf_counter()
        flat = torch.empty(total, dtype=torch.uint8)
        if self.pinned:
            # Fault the pages in first, so the driver call that locks them holds its locks for
            # less time (it runs beside training's kernel launches).
            flat[::self._PAGE].zero_()
            _compat.pin_host_memory(flat)
        views = {}
        for key, (offset, shape, dtype) in layout.items():
            view = flat[offset:offset + shape.numel() * dtype.itemsize]
            # A tensor whose storage is exactly its bytes, aliasing the buffer and keeping it
            # alive, so that DCP writes it as it is (taken as uint8, then viewed as its dtype).
            views[key] = torch.from_dlpack(view).view(dtype).view(shape)
        self._flat, self._layout, self._views = flat, layout, views
        self.allocate_s = time.perf_counter() - start


def _wait_for_copies() -> None:
    """Wait once for the non-blocking device-to-host copies queued on the current stream."""
    done = torch.cuda.Event()
    done.record()
    done.synchronize()


def _leaves(state: dict) -> dict[tuple, torch.Tensor]:
    leaves: dict[tuple, torch.Tensor] = {}
    _local_tensors(state, (), leaves)
    return leaves


def _local_tensors(value, key: tuple, out: dict) -> None:
    """The tensors of a state dict by key path (a DTensor: its local shard)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _local_tensors(v, key + (k,), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _local_tensors(v, key + (i,), out)
    elif isinstance(value, torch.Tensor):
        out[key] = value.to_local() if hasattr(value, "to_local") else value


def _rebuild(value, key: tuple, staged: dict):
    """``value`` with every tensor replaced by its staged host copy (a DTensor keeping its spec)."""
    if isinstance(value, dict):
        return {k: _rebuild(v, key + (k,), staged) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, key + (i,), staged) for i, v in enumerate(value))
    if isinstance(value, torch.Tensor):
        local = staged[key]
        return _compat.dtensor_with_local(value, local) if hasattr(value, "to_local") else local
    return copy.deepcopy(value)


def _storage_writer(path: Path) -> dcp.FileSystemWriter:
    """The DCP writer of a background save (a function so tests can slow it down)."""
    return dcp.FileSystemWriter(path)


def staging_bytes(state: dict, cast: torch.dtype | None = None) -> int:
    """Host bytes that ``HostStager(cast=cast)`` holds to stage ``state`` (a state dict as
    ``Checkpointer`` saves it): its tensors', a DTensor's counted by its shard on this rank, each
    rounded up to 64 bytes."""
    return _staging_layout(_leaves(state), cast)[1]


def _staging_layout(leaves: dict, cast: torch.dtype | None) -> tuple[dict, int]:
    """Where ``HostStager`` puts each tensor of ``leaves`` (key path -> (byte offset, shape,
    dtype)) in its flat buffer, and the buffer's bytes: each tensor (floating-point ones in
    ``cast``, if given) rounded up to 64 bytes."""
    layout, total, align = {}, 0, HostStager._ALIGN
    for key, local in leaves.items():
        dtype = cast if cast is not None and local.is_floating_point() else local.dtype
        layout[key] = (total, local.shape, dtype)
        total += -(-local.numel() * dtype.itemsize // align) * align
    return layout, total



HOST_STAGING_FRACTION = 0.5
"""The share of the host's RAM that ``--train.async_checkpoint auto`` lets the pinned staging of a
node's ranks take; beyond it saves stay synchronous. Page-locked memory cannot be swapped or
reclaimed: a node that pins most of its RAM kills its own data loaders and the run with them."""


def async_staging_problem(staging_per_rank: int, ranks_per_node: int, host_bytes: int) -> str | None:
    """Why ``auto`` keeps saves synchronous on this node (its ranks' staging would pin more than
    ``HOST_STAGING_FRACTION`` of ``host_bytes``), or None when the staging fits."""
    need = staging_per_rank * ranks_per_node
    if need <= HOST_STAGING_FRACTION * host_bytes:
        return None
    return (f"checkpoints are written synchronously: background writes would pin {need / 2**30:.1f} GiB of this "
            f"node's {host_bytes / 2**30:.1f} GiB of RAM ({ranks_per_node} rank(s) x {staging_per_rank / 2**30:.1f} "
            f"GiB), over the {HOST_STAGING_FRACTION:.0%} that --train.async_checkpoint auto allows; "
            "--train.async_checkpoint true forces them")

def make_checkpointer(root: Path, cfg, device_type: str, shard_params: int, log, model, optimizer) -> Checkpointer:
    """The Checkpointer of the run ``cfg`` (a ``RunConfig``; its --train checkpoint keys and collective
    timeout): asynchronous as ``--train.async_checkpoint`` asks, except that "auto" stays synchronous
    where the node's staging would pin too much of its RAM."""
    mode, save_dtype, asynchronous = cfg.train.async_checkpoint, cfg.save_dtype(device_type), \
        cfg.train.async_checkpoint_on(device_type)
    held = checkpoint_bytes(shard_params, save_dtype)
    if asynchronous and mode == "auto":  # "true" forces it whatever it pins
        problem = async_staging_problem(held, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), host_memory())
        if problem:
            log(problem)
            asynchronous = False
    if asynchronous:
        size = f"{held / 2**30:.1f} GiB" if held >= 2**30 else f"{held / 2**20:.1f} MiB"
        log(f"checkpoints are written in the background (--train.async_checkpoint {mode}), staged in about "
            f"{size} of {'pinned ' if device_type == 'cuda' else ''}host memory per rank")
    return Checkpointer(root, cfg.train.keep_checkpoints, asynchronous, pinned=device_type == "cuda", log=log,
                        timeout_s=cfg.parallel.collective_timeout_s, model=model, optimizer=optimizer,
                        save_dtype=save_dtype)  # model and optimizer: to pin its staging early


def host_memory() -> int:
    """Bytes of this node's RAM; a function so tests can replace it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
