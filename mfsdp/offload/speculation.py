"""The speculation: each offloaded group's host step started from its reduction hook, on a worker
thread during backward, and checked in ``step`` against the gradient and settings ``step`` would
use; undone from the backup where they differ (``docs/design.md``, Offload)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from typing import Optional, Sequence

import torch

from mfsdp.offload.host import HostGroup, HostState
from mfsdp.offload.staging import Staged, StagingRing
from mfsdp.runtime.parameter_group import local_tensor

_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """A 1-d int64 tensor on the tensors' device: for each, the sum of its elements' bit patterns
    read as signed integers (a scaling by any factor other than 1 moves every changed element's
    pattern the same way, so it changes the sum). None if no tensor."""
    sums = [local_tensor(t).detach().reshape(-1).view(_AS_INTEGERS[t.element_size()]).sum(dtype=torch.int64)
            for t in tensors if t is not None]
    return torch.stack(sums) if sums else None


def _hyper(settings: list, entries) -> list:
    """``settings`` (the optimizer's param group of each of ``entries``) in a comparable form (a
    tensor setting by identity and version)."""
    out = []
    for group_settings, (i, params) in zip(settings, entries):
        items = tuple(sorted((k, ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v)
                             for k, v in group_settings.items() if k != "params"))
        out.append((i, items, tuple(id(p) for p in params)))
    return out


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


class _Job:
    """One offloaded group's step from its staging to ``step``: its gradients and settings as read
    then, their fingerprint, its place in the ring, and (speculating) the CPU step's future."""

    def __init__(self, group, host: HostGroup, entries, settings: list) -> None:
        self.group, self.host, self.entries, self.settings = group, host, entries, settings
        self.epoch = group.weights_epoch
        self.grads = [p.grad for p in group.sharded_params]
        self.hyper = _hyper(settings, entries)
        self.fingerprint: Optional[torch.Tensor] = None  # taken where the gradient is final
        self.staged: Optional[Staged] = None
        self.future: Optional[concurrent.futures.Future] = None
        self.stepped = False  # the host master and states hold this job's step


class Speculation:
    """The offloaded groups' jobs between their staging and ``step``, and the one worker thread
    (``threads`` intra-op threads) that runs their speculative steps and the backups. ``speculate``:
    the policy's ``overlap="step"``; otherwise jobs are only staged in backward."""

    def __init__(self, optimizer: torch.optim.Optimizer, host: HostState, ring: StagingRing,
                 threads: Optional[int], speculate: bool) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.host, self.ring, self.threads, self.speculate = host, ring, threads, speculate
        self.jobs: dict[int, _Job] = {}  # id(group) -> the group's job since its staging
        self.doubted: set[int] = set()  # groups whose last gradient changed after backward
        # Group steps so far: speculated and kept; speculated and undone (redone in ``step``, or
        # dropped by ``zero_grad``); queued for speculation but dropped before it started; stepped in
        # ``step`` (not speculated).
        self.counts = {"kept": 0, "redone": 0, "dropped": 0, "serialized": 0}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mfsdp-offload",
            initializer=None if threads is None else torch.set_num_threads, initargs=() if threads is None else (threads,))
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def stage(self, group, host: HostGroup, entries, stream: Optional[torch.Stream], in_backward: bool) -> _Job:
        """Queue ``group``'s gradient, final on ``stream`` (None: it is), into the ring. From the
        hook (``in_backward``) it is fingerprinted for ``validate`` and, where the group speculates,
        stepped on the worker; from ``step`` it is stepped there."""
        job = _Job(group, host, entries, [dict(self._optimizer().param_groups[i]) for i, _ in entries])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            job.fingerprint = fingerprint(job.grads) if in_backward else None
            event = None if stream is None else stream.record_event()
        job.staged = self.ring.stage(group, [None if g is None else local_tensor(g) for g in job.grads], event)
        self.jobs[id(group)] = job
        if in_backward and self.speculate and id(group) not in self.doubted:
            job.future = self._pool.submit(self._speculate, job)
        return job

    def _speculate(self, job: _Job) -> None:  # on the worker thread
        if not job.host.backed_up:
            self.host.save(job.host)
        self.run(job)

    def run(self, job: _Job) -> None:
        """Step the job's group on the host with its staged gradient, then free its buffer."""
        try:
            grads = self.ring.wait(job.staged)
            job.stepped = True
            self.host.step(job.host, job.entries, job.settings, grads)
        finally:
            self.ring.release(job.staged)

    def drain(self) -> None:
        """Wait for every queued host task (steps, backups)."""
        self._pool.submit(lambda: None).result()

    def cancel(self, group) -> None:
        """Drop the group's job: its step undone, its buffer freed."""
        job = self.jobs.pop(id(group), None)
        if job is None:
            return
        self.ring.withdraw(job.staged)
        if job.future is not None and job.future.cancel():
            self.counts["dropped"] += 1
        elif job.future is not None:  # it has started: let it finish
            try:
                job.future.result()
            except Exception:  # noqa: BLE001 - undone below either way
                pass
        if job.stepped:
            self.host.restore(job.host)
            self.counts["redone"] += 1
        self.ring.release(job.staged)

    def discard(self) -> None:
        """Undo every job (``zero_grad`` before ``step``, a load, a state dict)."""
        for job in list(self.jobs.values()):
            self.cancel(job.group)

    def changed(self) -> set:
        """The ids of the groups whose staged gradient or settings are no longer what ``step``
        would use: the same gradient tensors with the same bits (one fingerprint each, compared on
        the host in one read) and the same hyper-parameters."""
        changed, compared, now = set(), [], []
        groups = self._optimizer().param_groups
        for gid, job in self.jobs.items():
            current = [p.grad for p in job.group.sharded_params]
            if any(a is not b for a, b in zip(job.grads, current)) \
                    or job.hyper != _hyper([groups[i] for i, _ in job.entries], job.entries):
                changed.add(gid)
            elif job.fingerprint is not None:
                compared.append(gid)
                now.append(fingerprint(current))
        if compared:
            old = torch.cat([self.jobs[gid].fingerprint for gid in compared])
            sizes = [len(f) for f in now]
            differ = torch.stack([d.any() for d in (old != torch.cat(now)).split(sizes)]).tolist()
            changed.update(gid for gid, d in zip(compared, differ) if d)
        return changed

    def validate(self) -> None:
        """At the start of ``step``: the jobs whose gradient, settings or weights changed since
        their hook are undone (``step`` stages them again). Such a group does not speculate in the
        next backward (a clip that bit tends to bite again) until its gradient comes through
        unchanged."""
        changed = self.changed() if self.jobs else set()
        for gid, job in list(self.jobs.items()):
            (self.doubted.add if gid in changed else self.doubted.discard)(gid)
            if gid in changed or job.epoch != job.group.weights_epoch:
                self.cancel(job.group)

    def complete(self, group, host: HostGroup, entries, stream: Optional[torch.Stream]) -> None:
        """``step`` reaches ``group``: its speculative step is kept (``validate`` let it through),
        or its gradient (staged now if it was not in backward) is stepped here, serialized."""
        job = self.jobs.get(id(group))
        if job is None:
            job = self.stage(group, host, entries, stream, in_backward=False)
        elif job.future is not None:
            job.future.result()
        self.counts["kept" if job.stepped and job.future is not None else "serialized"] += 1
        if not job.stepped:
            with _threads(self.threads):
                while not job.staged.copied.is_set() and (ahead := self._holding_buffer(job)) is not None:
                    self.run(ahead)  # staged earlier, it holds a buffer this one waits for
                self.run(job)
        del self.jobs[id(group)]

    def _holding_buffer(self, but: _Job) -> Optional[_Job]:
        """A job staged but not stepped and not queued on the worker, holding a buffer."""
        return next((j for j in self.jobs.values() if j is not but and j.staged.slot is not None
                     and not j.stepped and j.future is None), None)

    def back_up(self, group, host: HostGroup) -> None:
        """After ``group``'s commit: its next speculation's backup, taken on the worker (during the
        next forward, where it is idle), unless the group does not speculate next."""
        if self.speculate and id(group) not in self.doubted:
            self._pool.submit(self.host.save, host)
