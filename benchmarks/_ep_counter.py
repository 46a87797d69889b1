"""The bytes each rank sends, counted from the torch.distributed collectives a process issues.

Convention (ring algorithms, bytes leaving one rank over a group of ``n`` ranks):

* all-gather of a gathered buffer of ``S`` bytes: ``(n - 1) / n * S`` (its own block to each other rank);
* reduce-scatter of an input of ``S`` bytes: ``(n - 1) / n * S``;
* all-reduce of ``S`` bytes: ``2 (n - 1) / n * S`` (a reduce-scatter, then an all-gather);
* all-to-all: the rows this rank sends to the other ranks (its own block stays home);
* broadcast: ``S`` from every rank (a pipelined chain forwards the whole tensor once per rank).

``ByteCounter.patch`` wraps every collective entry point mfsdp's runtime, ``mfsdp/_compat.py`` and the
expert dispatch go through; only the outermost call of a nesting is counted, so gloo's stand-ins inside
mfsdp (its reduce-scatter runs as an all-reduce on gloo, ``mfsdp/runtime/collectives.py``) count as the
reduce-scatter the runtime asked for, which is what NCCL runs. Functional collectives
(``torch.distributed._functional_collectives``, DTensor redistributions) are not wrapped: nothing on
the counted path issues them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading

import torch
import torch.distributed as dist

import mfsdp._compat as compat
import mfsdp.runtime.collectives as runtime_collectives

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "broadcast", "other")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _gather(output, input, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "all-gather", (n - 1) * _nbytes(input)


def _gather_list(output_list, tensor, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "all-gather", (n - 1) * _nbytes(tensor)


def _scatter(output, input, op=None, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "reduce-scatter", (n - 1) * _nbytes(input) // n


def _scatter_list(output, input_list, op=None, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "reduce-scatter", (n - 1) * sum(_nbytes(t) for t in input_list) // n


def _runtime_scatter(outputs, inputs, group, *a, **k):
    n, _ = _size_rank(group)
    return "reduce-scatter", 0 if n == 1 else (n - 1) * sum(_nbytes(t) for t in inputs) // n


def _reduce(tensor, op=None, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "all-reduce", 2 * (n - 1) * _nbytes(tensor) // n


def _to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *a, **k):
    n, rank = _size_rank(group)
    rows = input.shape[0] if input.dim() else 1
    splits = list(input_split_sizes) if input_split_sizes else [rows // n] * n
    row_bytes = _nbytes(input) // max(rows, 1)
    return "all-to-all", row_bytes * (sum(splits) - splits[rank])


def _to_all_list(output_list, input_list, group=None, *a, **k):
    _, rank = _size_rank(group)
    return "all-to-all", sum(_nbytes(t) for i, t in enumerate(input_list) if i != rank)


def _broadcast(tensor, src=None, group=None, *a, **k):
    n, _ = _size_rank(group)
    return "broadcast", 0 if n == 1 else _nbytes(tensor)


def _other(*a, **k):
    return "other", 0


# (module, attribute, how to read its arguments). Absent attributes (older torch) are skipped.
TARGETS = [
    (runtime_collectives, "reduce_scatter", _runtime_scatter),
    (compat, "all_gather_into_tensor", _gather), (compat, "reduce_scatter_tensor", _scatter),
    (dist, "all_gather_into_tensor", _gather), (dist, "all_gather_single", _gather),
    (dist, "all_gather", _gather_list), (dist, "reduce_scatter_tensor", _scatter),
    (dist, "reduce_scatter_single", _scatter), (dist, "reduce_scatter", _scatter_list),
    (dist, "all_reduce", _reduce), (dist, "all_to_all_single", _to_all), (dist, "all_to_all", _to_all_list),
    (dist, "broadcast", _broadcast),
    *((dist, name, _other) for name in ("all_gather_object", "broadcast_object_list", "gather", "scatter",
                                        "reduce", "send", "recv", "isend", "irecv", "barrier")),
]


class ByteCounter:
    """Bytes sent and calls per collective kind while ``counting`` (by this process, this convention)."""

    def __init__(self) -> None:
        self.sent: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.on = False
        self._local = threading.local()

    def _wrap(self, fn, read):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0 and self.on:
                kind, nbytes = read(*args, **kwargs)
                self.sent[kind] += nbytes
                self.calls[kind] += 1
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth
        return wrapper

    @contextlib.contextmanager
    def patch(self):
        """Wrap every target for the duration; the originals are restored after."""
        saved = [(m, name, getattr(m, name)) for m, name, _ in TARGETS if hasattr(m, name)]
        try:
            for (m, name, read), (_, _, fn) in zip([t for t in TARGETS if hasattr(t[0], t[1])], saved):
                setattr(m, name, self._wrap(fn, read))
            yield self
        finally:
            for m, name, fn in saved:
                setattr(m, name, fn)

    @contextlib.contextmanager
    def counting(self):
        """Count the collectives issued inside the block (accumulating)."""
        self.on = True
        try:
            yield self
        finally:
            self.on = False
