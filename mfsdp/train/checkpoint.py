"""Sharded checkpoints that an interrupted save can never corrupt.

Layout under ``OUT_DIR/checkpoints``::

    step_200/          a complete checkpoint: DCP shards, .metadata, meta.json
    step_300/
    latest             the name of the newest complete checkpoint ("step_300")

Every rank writes its shards with ``torch.distributed.checkpoint`` into a hidden
``.tmp-step_N`` directory. Only once all shards and the metadata are on disk does rank 0
rename it to ``step_N`` and then rewrite ``latest`` (itself through a temp file and a
rename). A crash at any point before the rename leaves ``latest`` and the previous
checkpoint untouched, so resuming always finds a whole one. The data sampler is a pure
function of the step, so ``meta.json``'s step counter is the entire data state. Each rank's
random generators (CPU, and CUDA when in use) are saved under a key of that rank and restored on
resume, so whatever draws from them (dropout in Hugging Face models) continues where it stopped.

``meta.json`` is written last and lists every file of the checkpoint with its size, so it
marks the checkpoint complete. Resuming checks that list: a checkpoint with a missing or
truncated file (a disk that filled, a copy cut short) is skipped, with a message saying so,
in favour of the newest one that is whole. A save that fails (a full disk, a failing
write) raises CheckpointError naming the cause and leaves the previous checkpoint and
``latest`` as they were.

``Checkpointer`` runs the saves of a training run, either through ``save_checkpoint`` or, with
``--train.async_checkpoint``, in the background (its docstring has the choreography). Either way
``meta.json`` and ``latest`` appear only once every rank's files are on disk.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
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
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from mfsdp import _compat

LATEST = "latest"
META = "meta.json"
RNG = "rng"  # the state-dict key of the ranks' random generator states
_PREFIX = "step_"
_TEMP_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint problem the user can fix; the message names the fix."""


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META).is_file()


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete and undamaged checkpoint under ``root``, or None."""
    return find_resumable(root)[0]


def find_resumable(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest complete, undamaged checkpoint under ``root`` (or None), and one note for
    each newer checkpoint that was skipped because a file of it is missing or truncated.

    ``latest`` is tried first; a hand-edited or missing marker falls back to the complete
    ``step_N`` directories, newest first.
    """
    root = Path(root)
    candidates = list(reversed(complete_checkpoints(root)))
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    notes = []
    for path in candidates:
        problem = damage(path)
        if problem is None:
            return path, _incomplete_notes(root, _step_of(path)) + notes
        notes.append(f"checkpoint {path} is damaged ({problem}); skipping it")
    return None, _incomplete_notes(root, -1) + notes


def _incomplete_notes(root: Path, after: int) -> list[str]:
    """One note per save newer than step ``after`` whose write never finished (the run was
    killed during it, say): only its temporary directory is there."""
    notes = []
    for temp in sorted(root.glob(_TEMP_PREFIX + _PREFIX + "*")):
        step = temp.name[len(_TEMP_PREFIX + _PREFIX):]
        if step.isdigit() and int(step) > after and temp.is_dir():
            notes.append(f"checkpoint {_PREFIX}{step} is incomplete (the run stopped while it "
                         f"was being written; only {temp} is there); skipping it")
    return notes


def damage(path: Path) -> str | None:
    """What is wrong with the files of checkpoint ``path``, or None when they are whole.

    Checks each file that ``meta.json`` lists against its recorded size; checkpoints written
    before the list existed are only checked for ``.metadata`` and ``meta.json``.
    """
    if not _is_complete(path):
        return "no .metadata or meta.json"
    try:
        files = json.loads((path / META).read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        return f"unreadable {META}: {err}"
    for name, size in (files or {}).items():
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        if file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path} has an unreadable {META} ({err}); delete "
                              f"the directory to resume from an older checkpoint") from None


def check_compatible(path: Path, model_config: dict) -> dict:
    """The checkpoint's metadata, after checking it was written for this model shape."""
    meta = read_meta(path)
    saved = meta.get("model", {})
    differences = [f"{key}: checkpoint {saved.get(key)!r}, now {value!r}"
                   for key, value in model_config.items() if saved.get(key) != value]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written for a different model ({'; '.join(differences)}); "
            "resume with the same --model.* settings, or start fresh in "
            "another --train.out_dir")
    return meta


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict, keep: int = 2) -> Path:
    """Save model and optimizer state as ``root/step_{step}``; collective over all ranks."""
    root = Path(root)
    final, temp = _paths(root, step)
    if _is_complete(final):
        # Only reachable by stopping again at the step just resumed from: the state on disk
        # is the state in memory, and rewriting it would open a window with no checkpoint.
        return final
    _make_temp(root, final, temp)
    problem = None
    try:
        # DCP gathers every rank's write errors and raises them on all ranks alike.
        dcp.save(_state(model, optimizer), checkpoint_id=temp)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        problem = _describe(err)
    _publish_when_written(root, step, meta, keep, problem)
    return final


def _paths(root: Path, step: int) -> tuple[Path, Path]:
    """The checkpoint directory of ``step`` and the temporary one its save writes into."""
    final = root / f"{_PREFIX}{step}"
    return final, root / f"{_TEMP_PREFIX}{final.name}"


def _make_temp(root: Path, final: Path, temp: Path, group=None) -> None:
    """Rank 0 deletes the temporary directories of earlier saves that never finished (no other
    save is in flight now) and creates ``temp``; collective, raises on every rank if it failed."""
    problem = None
    if _rank() == 0:
        try:
            for debris in root.glob(_TEMP_PREFIX + "*"):  # of an earlier crashed save
                shutil.rmtree(debris, ignore_errors=True)
            temp.mkdir(parents=True)
        except OSError as err:
            problem = _describe(err)
    _raise_if_any(problem, root, final, temp, group)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer), RNG: _rng_state()}


def _publish_when_written(root: Path, step: int, meta: dict, keep: int, problem: str | None,
                          group=None) -> None:
    """Finish the save of ``step`` once every rank's write has ended (``problem``: why this rank's
    failed): raise CheckpointError on every rank when any failed, else rank 0 writes meta.json,
    publishes the checkpoint and prunes old ones. Collective over ``group``."""
    final, temp = _paths(root, step)
    _raise_if_any(problem, root, final, temp, group)
    if _rank() == 0:
        try:
            # meta.json is written last and lists every file: it marks the save complete.
            files = {p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()}
            (temp / META).write_text(json.dumps({**meta, "step": step, "files": files}, indent=1))
            _publish(temp, final)
        except OSError as err:
            problem = _describe(err)
    _raise_if_any(problem, root, final, temp, group)
    if _rank() == 0:
        _prune(root, keep)
    _barrier(group)


@dataclass
class _Write:
    """A save whose files are being written in the background."""
    step: int
    meta: dict
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
    """The saves of one training run: synchronous (``save_checkpoint``), or asynchronous.

    An asynchronous save goes like this (every step is collective over all ranks, and every rank
    takes it at the same training step):

    1. ``save`` first waits for the previous save's write and publishes it (step 5), so at most
       one write is in flight and its staging buffers are free again.
    2. Rank 0 deletes debris of unfinished saves and creates ``.tmp-step_N``; the ranks agree that
       it worked.
    3. Each rank copies its shards into one host buffer (``HostStager``; page-locked, and filled
       by non-blocking device-to-host copies with one wait at the end, on CUDA). It is allocated
       and page-locked by a background thread as soon as the state dict's layout is known (when
       the Checkpointer is built with a model and an optimizer that has state, as on resume;
       else after the first training step, when AdamW has made its moments), so the first save
       only waits for that thread if it has not finished; every later save reuses the buffer:
       the state dict's keys and shapes stay the same for the run. The ranks agree that the copy
       worked. This copy is all that training waits for.
    4. ``dcp.async_save`` writes the copy from a background thread (the state dict is handed on as
       staged). Its collectives run on a gloo group of their own, created here, so that they never
       interleave with the training's (on CUDA they also need a CPU backend). DCP's planning (local
       and global plan, dedup, metadata) runs in that thread too, in torch 2.11 and 2.13 alike.
       The writer copies nothing ahead from the GPU (``per_thread_copy_ahead=0``, as DCP's own
       staging sets it), so the thread makes no CUDA calls, and each staged tensor owns exactly
       its bytes, so DCP's loader writes it as it is instead of cloning it.
    5. Every step, ``poll`` asks each rank whether its write has ended: one all-reduce of one
       number over a second gloo group, and only while a write is in flight. Once all have, the
       ranks exchange their outcomes. If every write succeeded, rank 0 writes meta.json and
       publishes (the rename, then ``latest``) exactly as a synchronous save does; if any failed,
       every rank raises the same CheckpointError as a failed synchronous save. ``wait`` (the
       next save, the end of the run) does the same after blocking on the write.

    Until step 5, ``latest`` names the previous checkpoint. A run killed during the write leaves
    only ``.tmp-step_N``: ``--resume`` says so and loads the previous checkpoint, and the next
    save deletes the directory.

    The trade-off: the staging buffer holds this rank's checkpoint bytes of (page-locked) host
    memory for the whole run (``staging_bytes``; ``planned_staging_bytes``: 12 bytes per parameter
    of the rank's shard with fp32 weights and AdamW), so that a save stalls training for a
    device-to-host copy instead of the whole write. Each save's line splits the stall into
    waiting for the previous write, for the page-locking (only if it was still running), the
    copy, and the planning on the training's thread. Synchronous saves hold no host memory and
    stall for the write. The background write also shares the host's CPU (serialisation) and the
    disk with training, and a save due while the previous write still runs waits for it.
    """

    def __init__(self, root: str | os.PathLike, keep: int, asynchronous: bool,
                 pinned: bool = False, timeout_s: float = 1800.0, log=None,
                 model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None):
        self.root = Path(root)
        self.keep = keep
        self.asynchronous = asynchronous
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
        self._stager = HostStager(pinned)
        if dist.is_initialized():  # collective: every rank builds its Checkpointer together
            timeout = timedelta(seconds=timeout_s)
            self._write_group = dist.new_group(backend="gloo", timeout=timeout)
            self._poll_group = dist.new_group(backend="gloo", timeout=timeout)
        if model is not None and optimizer is not None:
            self._unprepared = (model, optimizer)
            self._prepare()

    def _prepare(self) -> None:
        """Start making the staging buffer in the background once the state dict's layout is
        known: the optimizer has state (after loading a checkpoint, or after the first step).
        Before that, ``get_optimizer_state_dict`` would initialise it with a step of its own,
        which would change the training."""
        model, optimizer = self._unprepared
        if not getattr(optimizer, "state", True):
            return
        self._unprepared = None
        self._stager.prepare(_state(model, optimizer))

    @property
    def writing(self) -> str | None:
        """The name of the checkpoint being written in the background, if one is."""
        return f"{_PREFIX}{self._write.step}" if self._write else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             meta: dict) -> Path:
        """Save ``step``: at once, or staged and then written in the background."""
        start = time.perf_counter()
        if not self.asynchronous:
            path = save_checkpoint(self.root, step, model, optimizer, meta, keep=self.keep)
            self.log(f"checkpoint {path.name} saved: training waited "
                     f"{time.perf_counter() - start:.2f} s for the whole write")
            return path
        self._step = step
        self.wait()  # training waits here when the previous write is still running
        stall = _Stall(previous=time.perf_counter() - start)
        final, temp = _paths(self.root, step)
        if _is_complete(final):  # resumed from this very step (see save_checkpoint)
            return final
        mark = time.perf_counter()
        _make_temp(self.root, final, temp, self._poll_group)
        problem, staged, note = None, None, ""
        try:
            state = _state(model, optimizer)
            stall.planning = time.perf_counter() - mark
            staged = self._stager.stage(state)
            stall.pinning, stall.copy = self._stager.last_wait_s, self._stager.last_copy_s
            made = self._stager.take_background_s()
            note = ("" if made is None else f"; its staging buffer ({self._stager.nbytes() / 2**30:.1f} "
                    f"GiB) was allocated{' and page-locked' if self._stager.pinned else ''} in "
                    f"the background in {made:.2f} s")
        except (Exception, CheckpointException) as err:
            problem = _describe(err)
        mark = time.perf_counter()
        _raise_if_any(problem, self.root, final, temp, self._poll_group)
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
        problem = None if error is None else _describe(error)
        _publish_when_written(self.root, write.step, write.meta, self.keep, problem,
                              self._poll_group)
        # The write ended after the poll of the step before self._step: the steps between
        # write.step and self._step ran while it was written.
        during = (f", over steps {write.step + 1}-{self._step}" if self._step > write.step
                  else ", as the run ended")
        self.log(f"checkpoint {_PREFIX}{write.step} saved: {write.stall.line()}, then it was "
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

    ``prepare`` allocates and page-locks the buffer in a background thread (16.7 GiB take seconds
    to fault in and lock), so that ``stage`` only waits for what is left of it. Each staged tensor
    is a view of the buffer that owns exactly its bytes (through DLPack): DCP's writer clones any
    CPU tensor whose storage is larger than itself, which for plain views of one flat buffer would
    be a second copy of every byte.

    DCP's own ``DefaultStager`` is not used: it takes a DTensor whose wrapper reports a non-zero
    ``data_ptr`` (mfsdp's parameters are views at an offset into a flat buffer) for a plain
    tensor, and fails on its storage ("invalid python storage").
    """

    _ALIGN = 64  # bytes; every dtype's view of the flat buffer starts aligned
    _PAGE = 4096  # bytes; the buffer is touched once per page before it is page-locked

    def __init__(self, pinned: bool):
        self.pinned = pinned
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
        layout, total = _staging_layout(_leaves(state))
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
        layout, total = _staging_layout(leaves)
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


def staging_bytes(state: dict) -> int:
    """Host bytes that ``HostStager`` holds to stage ``state`` (a state dict as ``Checkpointer``
    saves it): its tensors', a DTensor's counted by its shard on this rank, each rounded up to
    64 bytes."""
    return _staging_layout(_leaves(state))[1]


def _staging_layout(leaves: dict) -> tuple[dict, int]:
    """Where ``HostStager`` puts each tensor of ``leaves`` (key path -> (byte offset, shape,
    dtype)) in its flat buffer, and the buffer's bytes: each tensor rounded up to 64 bytes."""
    layout, total, align = {}, 0, HostStager._ALIGN
    for key, local in leaves.items():
        layout[key] = (total, local.shape, local.dtype)
        total += -(-local.numel() * local.element_size() // align) * align
    return layout, total


def planned_staging_bytes(params_per_rank: int, main_bytes: int = 4, optimizer_states: int = 2,
                          state_bytes: int = 4) -> int:
    """The pinned host memory an asynchronous save holds on one rank, predicted from the number
    of parameters in its shard: the main weights (fp32) and AdamW's two moments (fp32), the bytes
    of its checkpoint. For a host-RAM figure: ``mfsdp plan`` has none yet; one would add this per
    rank (times the ranks per node) when ``--train.async_checkpoint`` is on."""
    return params_per_rank * (main_bytes + optimizer_states * state_bytes)


def _raise_if_any(problem: str | None, root: Path, final: Path, temp: Path, group=None) -> None:
    """Raise CheckpointError on every rank when any rank saw ``problem``; collective over
    ``group`` (None: the default group)."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    first = next((p for p in problems if p), None)
    if first is None:
        return
    if _rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
    previous = find_latest(root)
    kept = (f"the previous checkpoint {previous} is intact and is what --resume will load"
            if previous else "there is no earlier checkpoint")
    raise CheckpointError(f"saving checkpoint {final.name} failed ({first}); {kept}. Free disk "
                          f"space or fix {root}'s permissions, then continue with --resume")


def _describe(err: BaseException) -> str:
    """The root cause of a failed save in one line: DCP wraps each rank's error."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_describe(inner)}"
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


def _publish(temp: Path, final: Path) -> None:
    """Make ``temp`` the checkpoint ``final`` and point ``latest`` at it, in that order."""
    shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover of the same name
    os.replace(temp, final)
    marker = final.parent / LATEST
    marker_temp = final.parent / (LATEST + ".tmp")
    marker_temp.write_text(final.name + "\n")
    os.replace(marker_temp, marker)


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete ``step_N`` directories under ``root``, oldest first (what pruning counts)."""
    return sorted((p for p in Path(root).glob(_PREFIX + "*") if p.name[len(_PREFIX):].isdigit() and _is_complete(p)),
                  key=_step_of)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (0 keeps everything)."""
    if keep <= 0:
        return
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict:
    """Load ``path`` into the (sharded) model and optimizer; returns its metadata."""
    path = Path(path)
    meta = read_meta(path)
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    rng = _saved_rng_state(path)
    if rng:
        state[RNG] = rng
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    generators = rng.get(_rng_key(), {})
    if "cpu" in generators:
        torch.set_rng_state(generators["cpu"])
    if "cuda" in generators:
        torch.cuda.set_rng_state(generators["cuda"])
    return meta


def _rng_key() -> str:
    # One key per rank: DCP writes a key that several ranks hold only once, as replicated.
    return f"rank_{_rank()}"


def _rng_state() -> dict:
    """This rank's generator states: the CPU one, and the current GPU's once CUDA is in use."""
    generators = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators["cuda"] = torch.cuda.get_rng_state()
    return {_rng_key(): generators}


def _saved_rng_state(path: Path) -> dict:
    """The part of ``_rng_state()`` that checkpoint ``path`` holds for this rank, to load into:
    nothing for checkpoints written before the states were saved or by fewer ranks."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    mine = {key: value for key, value in _rng_state()[_rng_key()].items()
            if f"{RNG}.{_rng_key()}.{key}" in saved}
    return {_rng_key(): mine} if mine else {}


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
