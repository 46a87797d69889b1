"""A persistent process world for tests: spawn once per test module, run many cases in it.

Starting ranks and importing torch costs seconds, so a module starts one ``World`` (gloo on CPU,
or NCCL on CUDA) and sends it cases. A case is a module-level function ``fn(rank, world_size,
**kwargs)``; every rank runs it and the results come back as a list. A rank that raises fails the
case with its traceback; a rank that hangs (a collective mismatch) fails it after a timeout and
the world is restarted for the next case.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import warnings

import torch.multiprocessing as mp

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world_size: int, backend: str, init_file: str, tasks, results, pg_timeout_s: float,
            environ: dict) -> None:
    # A rank forked from the forkserver has the server's environment: give it the parent's, as spawn does.
    os.environ.clear()
    os.environ.update(environ)
    sys.path.insert(0, _TESTS_DIR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang shows every rank's stack
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    pool = _GroupPool(dist)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, kwargs, fresh_groups = task
        pool.next_case(fresh_groups)
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(rank, world_size, **kwargs)))
        except BaseException:  # report everything, keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without interpreter finalization (as ``python -m mfsdp.train`` does): every result was
    # read by the parent before it sent the stop, and tearing down torch's state (inductor's
    # compile workers, the modules of every case run here) took seconds per world at session end.
    results.close()
    results.join_thread()
    os._exit(0)


class _GroupPool:
    """Process groups kept across a world's cases: the n-th ``new_group`` call of a case with given
    arguments returns the group that the n-th such call of an earlier case created. Each case builds
    its device meshes and mfsdp its ordered groups afresh, and a gloo group that stays alive polls
    its sockets on a thread of its own: left to pile up, a session's worlds held hundreds of them,
    which took most of the two cores' time from every later test (an 83-minute `make test`).
    Destroying the previous case's groups instead is not safe: torch's DTensor caches keep the old
    meshes (equal to the new ones by shape and names) and with them the destroyed groups' names.

    Every rank makes the same ``new_group`` calls (the call is collective), so every rank reuses
    the same groups. After a failed case the parent asks every rank for new groups (a rank that
    failed may have left a group's collectives out of step)."""

    def __init__(self, dist) -> None:
        import inspect

        from torch.distributed import device_mesh, distributed_c10d

        self._real = distributed_c10d.new_group
        self._signature = inspect.signature(self._real)
        self._groups: dict[tuple, list] = {}
        self._used: dict[tuple, int] = {}
        pooled = functools.wraps(self._real)(lambda *args, **kwargs: self._new_group(*args, **kwargs))
        # (wraps: the same signature, which mfsdp reads to see whether sort_ranks is there)
        for module in (dist, distributed_c10d, device_mesh):
            module.new_group = pooled

    def next_case(self, fresh: bool) -> None:
        self._used.clear()
        if fresh:
            self._groups.clear()

    def _new_group(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        if options["pg_options"] is not None or options["device_id"] is not None:
            return self._real(*args, **kwargs)
        options.pop("group_desc")
        ranks = options.pop("ranks")
        key = (None if ranks is None else tuple(ranks), *sorted(options.items()))
        n = self._used.get(key, 0)
        self._used[key] = n + 1
        groups = self._groups.setdefault(key, [])
        if n == len(groups):
            groups.append(self._real(*args, **kwargs))
        return groups[n]


class _Hung(AssertionError):
    """A case on which some rank did not answer within its timeout."""


# What the forkserver imports once, by name (Python 3.11's forkserver ignores the parent's sys.path,
# so only what the environment's own path reaches: torch and the mfsdp that PYTHONPATH or the
# editable install names, not the tests' modules).
# The ranks' own imports cost seconds of CPU each and many ranks make them: torch's compiler
# (``_compat.COMPILER_MODULE``: DTensor and torch.compile import it on first use), transformers (the
# manager's tests) and torchao (float8's).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "mfsdp",
            "transformers", "torchao"]


def fresh_process_context():
    """The multiprocessing context of the CPU worlds' ranks: each a fork of one forkserver that has
    imported torch, torch.distributed and mfsdp and done nothing else, so a rank starts without
    importing them afresh as a spawned one does (seconds of CPU a rank on two cores). A forked
    rank has the server's environment and C library state, not the parent's: ``World`` hands its
    ranks the parent's ``os.environ``, and the worker sets its thread count as before; what the C
    library reads at process start (glibc's ``MALLOC_*`` variables) needs ``World(..., spawn=True)``."""
    from mfsdp._compat import COMPILER_MODULE

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, COMPILER_MODULE])  # takes effect when the server first starts
    return ctx


class World:
    def __init__(self, world_size: int, backend: str = "gloo", pg_timeout_s: float = 90.0,
                 spawn: bool = False) -> None:
        """``spawn``: each rank a fresh interpreter (always so for NCCL: CUDA after a fork)."""
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s  # a collective mismatch fails the case after this long
        self.spawn = spawn or backend != "gloo"
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn") if self.spawn else fresh_process_context()
        fd, self._init_file = tempfile.mkstemp(prefix="mfsdp_world_")
        os.close(fd)
        os.unlink(self._init_file)
        self._fresh_groups = False
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, self.backend, self._init_file, self._tasks[r], self._results,
                              self.pg_timeout_s, dict(os.environ)))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, timeout: float = 180.0, **kwargs) -> list:
        """Run ``fn`` on every rank. A hang dumps the silent ranks' stacks (SIGUSR1), restarts the
        world and runs the case once more: a second hang fails it; a pass after a hang passes with a
        warning naming the case and the ranks, so it shows in the test summary instead of
        vanishing (a rare CPU-only hang of a tensor-parallel case, under investigation)."""
        try:
            return self._run_once(fn, timeout, kwargs)
        except _Hung as first:
            out = self._run_once(fn, timeout, kwargs, retry_of=first)
            warnings.warn(f"{first}; it passed when run again (stacks of the silent ranks are in the "
                          "captured stderr)", stacklevel=2)
            return out

    def _run_once(self, fn, timeout: float, kwargs: dict, retry_of=None) -> list:
        module_name = fn.__module__.rsplit(".", 1)[-1]
        for q in self._tasks:
            q.put((module_name, fn.__name__, kwargs, self._fresh_groups))
        self._fresh_groups = False
        out, failures, answered = [None] * self.world_size, [], set()
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                silent = [r for r in range(self.world_size) if r not in answered]
                for r in silent:
                    if self._procs[r].is_alive():
                        os.kill(self._procs[r].pid, signal.SIGUSR1)
                time.sleep(1.0)
                self.close(force=True)
                self._start()
                message = f"{fn.__name__}{kwargs}: rank(s) {silent} hung for {timeout}s (collective mismatch?)"
                if retry_of is not None:
                    raise AssertionError(f"{message}, twice") from None
                raise _Hung(message) from None
            answered.add(rank)
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self._fresh_groups = True
            raise AssertionError(f"{fn.__name__}{kwargs} failed:\n" + "\n".join(failures))
        return out

    def close(self, force: bool = False) -> None:
        for q, p in zip(self._tasks, self._procs):
            if not force and p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 20)
            if p.is_alive():
                p.kill()
