"""Held-out tokens or samples, and the fixed windows the validation loss is computed on.

The held-out set is either a token file of its own (``--data.val_path``) or the tail of the
training file (``--data.val_fraction``), which ``WindowSampler(limit=...)`` then never samples.
Evaluation reads consecutive, non-overlapping windows of ``seq_len + 1`` tokens from the start of
the held-out tokens (wrapping around when more are asked for than there are): the same windows at
every world size. Eval batch ``b`` is windows ``[b * G, (b + 1) * G)`` for the global batch ``G``
(world size x local batch x microbatches), and each rank takes its slice of it as training does, so
``K`` eval batches cover the same ``K * G`` windows however the ranks split them.

A file of samples (token-file version 2) holds out its last samples instead
(``held_out_samples``; ``PackedSampler(samples=...)`` trains on the others), and
``PackedEvalWindows`` packs them once, masked as for training, into windows read the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from mfsdp.data.packing import PackedWindows
from mfsdp.data.sampler import Batch
from mfsdp.data.token_file import DataError, TokenFile


def held_out_tokens(n_tokens: int, val_fraction: float, seq_len: int) -> int:
    """How many tokens at the end of a file of ``n_tokens`` to hold out: ``val_fraction`` of
    them, rounded up, and at least one evaluation window (``seq_len + 1``); 0 for a fraction 0."""
    if val_fraction <= 0:
        return 0
    return min(n_tokens, max(math.ceil(n_tokens * val_fraction), seq_len + 1))


def held_out_samples(n_samples: int, val_fraction: float) -> int:
    """How many of ``n_samples`` samples at the end of a file to hold out: ``val_fraction`` of
    them, rounded up, and at least one; 0 for a fraction 0. Train on ``range(n_samples - k)``."""
    if val_fraction <= 0:
        return 0
    return min(n_samples, max(math.ceil(n_samples * val_fraction), 1))


class _EvalShares:
    """Eval batch ``b`` is windows ``[b * G, (b + 1) * G)`` of ``count`` fixed windows (wrapping
    around); this rank reads its slice as training does, and its ``windows`` build the rows."""

    def __init__(self, count: int, local_batch: int, rank: int, world_size: int, microbatches: int):
        self.count = count
        self.local_batch, self.rank, self.world_size = local_batch, rank, world_size
        self.microbatches = microbatches

    def batches(self, eval_batches: int) -> Iterator[Batch]:
        """This rank's rows of eval batches ``0 .. eval_batches - 1``, ``local_batch`` at a time."""
        for b in range(eval_batches):
            for micro in range(self.microbatches):
                first = ((b * self.microbatches + micro) * self.world_size + self.rank) * self.local_batch
                yield self._rows([self._window(i) for i in range(first, first + self.local_batch)])

    def _window(self, i: int) -> int | None:
        """The window at slot ``i``: wrapping around the ``count`` windows."""
        return i % self.count

    def _rows(self, windows: list[int | None]) -> Batch:
        return self.windows.batch(windows)


class EvalWindows(_EvalShares):
    """This rank's share of the fixed evaluation windows in ``data[start:stop]``."""

    def __init__(self, data: TokenFile, seq_len: int, local_batch: int, rank: int,
                 world_size: int, microbatches: int = 1, start: int = 0,
                 stop: int | None = None):
        stop = len(data) if stop is None else stop
        count = (stop - start - 1) // seq_len  # windows of seq_len + 1 at stride seq_len
        if count < 1:
            raise DataError(f"the held-out part of {data.path} ({max(0, stop - start)} tokens) is "
                            f"too short for one evaluation window of {seq_len + 1} tokens; use a "
                            "larger --data.val_fraction or --data.val_path, or --train.eval_every 0")
        super().__init__(count, local_batch, rank, world_size, microbatches)
        self.data, self.seq_len, self.start = data, seq_len, start

    def _rows(self, windows: list[int]) -> Batch:
        rows = torch.stack([self.data.window(self.start + i * self.seq_len, self.seq_len + 1)
                            for i in windows])
        return Batch(inputs=rows[:, :-1], targets=rows[:, 1:])


class PackedEvalWindows(_EvalShares):
    """This rank's share of the fixed evaluation windows packed from the samples ``samples``
    (the held-out tail: ``range(n - held_out_samples(n, f), n)``), masked as for training and
    read in packing order as ``EvalWindows`` reads its windows."""

    def __init__(self, data: TokenFile, seq_len: int, local_batch: int, rank: int,
                 world_size: int, microbatches: int = 1, samples: range | None = None,
                 packing: bool = True):
        self.windows = PackedWindows(data, seq_len, samples, packing)
        super().__init__(len(self.windows), local_batch, rank, world_size, microbatches)


class PairEvalWindows(_EvalShares):
    """This rank's share of ``windows`` (``PairWindows`` of the validation pairs), each visited
    once: ``batches`` is the number of eval batches that covers them, the last one topped up
    with empty windows, so every pair counts once in the means."""

    def __init__(self, windows, local_batch: int, rank: int, world_size: int, microbatches: int = 1):
        super().__init__(len(windows), local_batch, rank, world_size, microbatches)
        self.windows = windows
        self.batches_needed = math.ceil(len(windows) / (world_size * local_batch * microbatches))

    def _window(self, i: int) -> int | None:
        return i if i < self.count else None
