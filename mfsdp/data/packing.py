"""Fine-tuning batches: whole samples of a version-2 token file packed into windows.

The samples are packed once, best-fit decreasing (longest first, each into the fullest window
it still fits), into windows of ``seq_len`` tokens; a sample is never split, and one longer
than a window keeps its first ``seq_len`` tokens (counted in ``truncated``; ``cut_note`` says so
at the start of training). Padding fills the
rest of a window. ``packing=False`` puts one sample in each window instead (padded).

An epoch is one pass over the windows in an order drawn from a generator seeded by (seed,
epoch): every sample once, in a different order each epoch. Because the windows are packed
once, every epoch has the same number of windows and so of steps, and the batch of a step is
a pure function of (seed, step, rank, world size), as with ``WindowSampler``: resuming needs
only the step. The price is that samples sharing a window share it every epoch; with
document-causal attention (``Batch.document_ids``) and positions restarting per sample, a
window's loss is the sum of its samples' own, so only which samples share a step is fixed
more coarsely. The alternative rejected, re-packing each epoch's sample order, makes the steps
per epoch vary with the order (and ``epoch_of`` a sum over all earlier epochs), and packs
worse than best-fit decreasing.

The global batch of a step is ``world_size * local_batch * microbatches`` windows and rank r
takes its slice as ``WindowSampler`` does, so it does not depend on the world size. The last
step of an epoch is filled up with empty windows (every target -100), whose positions count
nothing; a trainer may skip a global batch with no counted token.
"""

from __future__ import annotations

import bisect
import math

import torch

from mfsdp.data.sampler import Batch, mix_seed
from mfsdp.data.token_file import DataError, TokenFile

IGNORE = -100
"""The target of a position the loss does not count (``cross_entropy``'s ``ignore_index``)."""
PAD_ID = 0
"""The input id of padding (any valid id: padding is never a target and attends to no sample)."""
PAD_DOCUMENT = -1
"""The document id of padding."""


def pack(lengths: torch.Tensor, seq_len: int, packing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of samples whose ``lengths`` (already at most ``seq_len``) fit ``seq_len``:
    ``(members, bounds)``, window w holding samples ``members[bounds[w]:bounds[w + 1]]``.

    Best-fit decreasing, O(n log n) in Python over the lengths only: ``spaces`` lists the
    distinct room left in some window, ``free[room]`` the windows with that room.
    """
    n = lengths.numel()
    if not packing:
        return torch.arange(n), torch.arange(n + 1)
    order = torch.argsort(lengths, descending=True, stable=True)
    spaces: list[int] = []
    free: dict[int, list[int]] = {}
    window_of, windows = [], 0
    for length in lengths[order].tolist():
        at = bisect.bisect_left(spaces, length)
        if at == len(spaces):  # no window has room: open one
            window, room = windows, seq_len - length
            windows += 1
        else:
            room = spaces[at]
            window = free[room].pop()
            if not free[room]:
                del free[room], spaces[at]
            room -= length
        window_of.append(window)
        if room:
            if room not in free:
                free[room] = []
                bisect.insort(spaces, room)
            free[room].append(window)
    window_of = torch.tensor(window_of, dtype=torch.int64)
    members = order[torch.argsort(window_of, stable=True)]  # each window's samples, longest first
    bounds = torch.zeros(windows + 1, dtype=torch.int64)
    bounds[1:] = torch.cumsum(torch.bincount(window_of, minlength=windows), 0)
    return members, bounds


def cut_counts(lengths: torch.Tensor, limit: int) -> tuple[int, int]:
    """What keeping the first ``limit`` tokens of samples of ``lengths`` drops: (samples cut,
    tokens cut). ``prepare-data --max-len`` and training's windows count cuts alike."""
    over = lengths[lengths > limit]
    return over.numel(), int((over - limit).sum())


def cut_note(data: TokenFile, seq_len: int) -> str | None:
    """One line for the start of training when samples of ``data`` are longer than a window of
    ``seq_len`` tokens (each keeps its first ``seq_len``: training and validation alike), else None."""
    if data.sample_lengths is None:
        return None
    samples, tokens = cut_counts(data.sample_lengths, seq_len)
    if not samples:
        return None
    return (f"mfsdp train: {samples:,} of {data.num_samples:,} samples in {data.path} are longer than "
            f"--data.seq_len {seq_len} and are cut to it, dropping {tokens:,} of {len(data):,} tokens "
            f"(the longest sample has {int(data.sample_lengths.max()):,}); raise --data.seq_len to keep them whole, "
            "or cut them when preparing (`mfsdp prepare-data ... --data.max_len N`) to make it explicit")


def counted_targets(mask: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                    chunk: int = 1 << 24) -> torch.Tensor:
    """Per sample of ``lengths`` tokens at ``starts``, the targets its window counts: position j
    predicts token j + 1, so ``mask[start + 1:start + length].sum()``. From prefix sums of the
    mask taken ``chunk`` tokens at a time: vectorised, with no int64 copy of a whole large file."""
    points = torch.cat([starts + 1, starts + lengths])  # prefix sum P[i] = mask[:i].sum()
    prefix = torch.zeros_like(points)
    total = 0
    for first in range(0, mask.numel(), chunk):
        part = mask[first:first + chunk].to(torch.int64).cumsum(0)
        inside = (points > first) & (points <= first + part.numel())
        prefix[inside] = total + part[points[inside] - first - 1]
        total += int(part[-1])
    begin, end = prefix.chunk(2)
    return end - begin


class FixedWindows:
    """Windows packed once: window w holds samples ``members[bounds[w]:bounds[w + 1]]``."""

    def __len__(self) -> int:
        return self.bounds.numel() - 1

    def samples_of(self, window: int) -> torch.Tensor:
        """The sample indices (in ``data``) packed into ``window``."""
        return self.members[self.bounds[window]:self.bounds[window + 1]]

    def sizes(self, windows: list[int | None]) -> torch.Tensor:
        """How many samples each of ``windows`` holds (0 for None, an empty window)."""
        return torch.tensor([0 if w is None else int(self.bounds[w + 1] - self.bounds[w]) for w in windows],
                            dtype=torch.int64)


class PackedWindows(FixedWindows):
    """The fixed windows of the samples ``samples`` (a range of sample indices) of ``data``."""

    def __init__(self, data: TokenFile, seq_len: int, samples: range | None = None,
                 packing: bool = True):
        if data.sample_starts is None:
            raise DataError(f"{data.path} is a plain token stream (version 1) without samples; "
                            "prepare prompt/completion or messages rows with `mfsdp prepare-data "
                            "ROWS.jsonl OUT`, or train it as a stream")
        if data.is_pairs:
            raise DataError(f"{data.path} holds preference pairs (token-file version 3), which fine-tuning's "
                            "samples are not; pass a file prepared from prompt/completion or chat rows")
        samples = range(data.num_samples) if samples is None else samples
        if len(samples) == 0 or samples.start < 0 or samples[-1] >= data.num_samples:
            raise DataError(f"{data.path} holds samples 0 .. {data.num_samples - 1}, not the "
                            f"{len(samples)} samples {samples}; use more rows or a smaller "
                            "held-out fraction")
        if seq_len < 2:
            raise DataError(f"windows of {seq_len} tokens predict nothing; use data.seq_len >= 2")
        ids = torch.arange(samples.start, samples.stop, samples.step)
        lengths = data.sample_lengths[ids]
        self.data, self.seq_len = data, seq_len
        self.truncated = cut_counts(lengths, seq_len)[0]
        """How many samples are longer than a window (each keeps its first seq_len tokens)."""
        members, self.bounds = pack(lengths.clamp(max=seq_len), seq_len, packing)
        self.members = ids[members]  # sample indices in data
        per_sample = counted_targets(data.loss_mask, data.sample_starts[self.members],
                                     lengths[members].clamp(max=seq_len))
        window_of = torch.repeat_interleave(torch.arange(len(self)), self.bounds.diff())
        self.counted = torch.zeros(len(self), dtype=torch.int64).index_add_(0, window_of, per_sample)
        """Per window, the targets the loss counts (``Batch.targets`` other than -100)."""

    def batch(self, windows: list[int | None]) -> Batch:
        """The rows of these windows (None for an empty one), built with a few vectorised
        gathers over all their samples: no Python loop over tokens or samples."""
        data, seq_len = self.data, self.seq_len
        counts = self.sizes(windows)
        picked = [self.samples_of(w) for w in windows if w is not None]
        samples = torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64)
        lengths = data.sample_lengths[samples].clamp(max=seq_len)
        row_of = torch.repeat_interleave(torch.arange(len(windows)), counts)  # per sample
        first_of = torch.cumsum(counts, 0) - counts  # each row's first sample in `samples`
        before = torch.cumsum(lengths, 0) - lengths  # tokens of all earlier samples
        column0 = before - before[first_of[row_of]]  # each sample's first column in its row
        index_in_row = torch.arange(samples.numel()) - first_of[row_of]
        # Per token: its sample, its offset within the sample, its place in the batch.
        sample_of = torch.repeat_interleave(torch.arange(samples.numel()), lengths)
        within = torch.arange(sample_of.numel()) - before[sample_of]
        source = data.sample_starts[samples][sample_of] + within
        rows, cols = row_of[sample_of], column0[sample_of] + within
        shape = (len(windows), seq_len)
        inputs = torch.full(shape, PAD_ID, dtype=torch.int64)
        inputs[rows, cols] = data.take(source)
        counted = torch.zeros(shape, dtype=torch.bool)
        counted[rows, cols] = data.loss_mask[source].bool()
        positions = torch.zeros(shape, dtype=torch.int64)
        positions[rows, cols] = within
        document_ids = torch.full(shape, PAD_DOCUMENT, dtype=torch.int32)
        document_ids[rows, cols] = index_in_row[sample_of].to(torch.int32)
        # Position j predicts token j + 1 where both lie in one sample and the mask counts it.
        same = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] != PAD_DOCUMENT)
        targets = torch.full(shape, IGNORE, dtype=torch.int64)
        targets[:, :-1] = torch.where(same & counted[:, 1:], inputs[:, 1:], IGNORE)
        return Batch(inputs=inputs, targets=targets, positions=positions, document_ids=document_ids)


class PackedSampler:
    """This rank's packed fine-tuning batches: a pure function of (seed, step, rank, world).

    ``samples`` restricts training to a range of sample indices (``held_out_samples`` keeps
    the tail for the validation loss). Steps start at 1: step 1 is the first batch of epoch 0.
    ``windows``: other fixed windows in place of ``PackedWindows(data, seq_len, samples,
    packing)`` (``PairWindows``: preference pairs, whose loss counts pairs).
    """

    def __init__(self, data: TokenFile, seq_len: int, local_batch: int, rank: int,
                 world_size: int, seed: int = 0, microbatches: int = 1,
                 samples: range | None = None, packing: bool = True, windows=None):
        if min(local_batch, world_size, microbatches) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need local_batch, world_size and microbatches >= 1 and 0 <= rank < "
                             f"world_size, not {local_batch}, {world_size}, {microbatches}, {rank}")
        self.windows = PackedWindows(data, seq_len, samples, packing) if windows is None else windows
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.local_batch, self.rank, self.world_size = local_batch, rank, world_size
        self.microbatches = microbatches
        self.global_batch = world_size * local_batch * microbatches
        self.steps_per_epoch = math.ceil(len(self.windows) / self.global_batch)
        """Optimizer steps in one pass over the samples (the last one topped up with empty windows)."""
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def truncated(self) -> int:
        """How many training samples are longer than a window and lose their tail."""
        return self.windows.truncated

    def epoch_of(self, step: int) -> int:
        """The epoch (from 0) that optimizer step ``step`` (from 1) belongs to."""
        if step < 1:
            raise ValueError(f"steps start at 1, not {step}")
        return (step - 1) // self.steps_per_epoch

    def window_order(self, epoch: int) -> torch.Tensor:
        """The order the windows are visited in during ``epoch``: a permutation, cached."""
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.windows), generator=generator))
        return self._order[1]

    def epoch_samples(self, epoch: int) -> torch.Tensor:
        """Every training sample index, in the order ``epoch`` visits them."""
        return torch.cat([self.windows.samples_of(int(w)) for w in self.window_order(epoch)])

    def batch(self, step: int, microbatch: int = 0) -> Batch:
        """This rank's ``microbatch``-th batch of optimizer step ``step`` (empty windows past the
        epoch's last)."""
        first = (microbatch * self.world_size + self.rank) * self.local_batch
        picked = self.global_windows(step)[first:first + self.local_batch].tolist()
        return self.windows.batch(picked + [None] * (self.local_batch - len(picked)))

    def global_windows(self, step: int) -> torch.Tensor:
        """The windows of the whole global batch of ``step`` (every rank and microbatch): known on
        every rank without communication."""
        order = self.window_order(self.epoch_of(step))
        first = (step - 1) % self.steps_per_epoch * self.global_batch
        return order[first:first + self.global_batch]

    def loss_tokens(self, step: int) -> int:
        """The targets the loss counts in the whole global batch of ``step``: what the step's summed
        loss is divided by."""
        return int(self.windows.counted[self.global_windows(step)].sum())
