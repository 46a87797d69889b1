"""Preference-pair batches: the samples of a preference token file in one of two layouts.

A preference token file (version 3) stores each pair as one sample [prompt | chosen | rejected],
its per-token byte the segment: 0 prompt, 1 chosen, 2 rejected (``PROMPT``, ``CHOSEN``,
``REJECTED``).

* ``packed`` (the bundled models): many pairs to a window of ``seq_len`` tokens, no padding
  between them (best-fit decreasing, as ``mfsdp.data.packing``), each pair once as stored. The
  rejected tokens' positions continue from the prompt's end, and ``Batch.branch_ids`` (the
  segments) let ``document_mask`` hide the chosen answer from them: each answer is computed as
  if it followed the prompt alone, and the prompt once.
* padded (``packed=False``, the manager route, which has no document attention): one pair to a
  window, as two rows [prompt | chosen] and [prompt | rejected] right-padded to the batch's
  longest row, the batch's chosen rows first, then its rejected rows, as trl stacks them; plain
  causal attention.

Either way ``Batch.answers`` says which output predicts each answer token: in the packed layout
the first rejected token is predicted by the last prompt token, not by the token before it.
``Batch.targets`` counts nothing (all -100): the loss reads ``answers`` (``answer_logps``).
"""

from __future__ import annotations

import torch

from mfsdp.data.packing import IGNORE, PAD_DOCUMENT, PAD_ID, FixedWindows, pack
from mfsdp.data.sampler import Batch
from mfsdp.data.token_file import CHOSEN, PROMPT, REJECTED, DataError, TokenFile


def pair_lengths(data: TokenFile, chunk: int = 1 << 24) -> torch.Tensor:
    """(pairs, 3) int64: each pair's prompt, chosen and rejected token counts, from the segment
    bytes ``chunk`` tokens at a time; a file whose samples are not pairs is a DataError."""
    starts, segments, pairs = data.sample_starts, data.segments, data.num_samples
    counts = torch.zeros(3 * pairs, dtype=torch.int64)
    for first in range(0, segments.numel(), chunk):
        part = segments[first:first + chunk].to(torch.int64)
        offsets = torch.arange(first, first + part.numel())
        sample = torch.searchsorted(starts, offsets, right=True) - 1
        backwards = (part[1:] < part[:-1]) & (sample[1:] == sample[:-1])
        if int(part.max()) > REJECTED or bool(backwards.any()):
            raise DataError(f"{data.path} does not hold preference pairs [prompt | chosen | rejected] "
                            f"(near token {first + int(torch.argmax(backwards.to(torch.uint8)))}); "
                            "re-create it with `mfsdp prepare-data PAIRS.jsonl OUT`")
        counts += torch.bincount(sample * 3 + part, minlength=3 * pairs)
    lengths = counts.view(pairs, 3)
    empty = (lengths[:, 1:] == 0).any(1)
    if bool(empty.any()):
        raise DataError(f"{data.path}: pair {int(torch.argmax(empty.to(torch.uint8)))} has an empty answer; "
                        "re-create it with `mfsdp prepare-data PAIRS.jsonl OUT`")
    lengths[:, PROMPT] = data.sample_lengths - lengths[:, 1:].sum(1)
    return lengths


def check_lengths(data: TokenFile, ids: torch.Tensor, lengths: torch.Tensor, seq_len: int, packed: bool) -> torch.Tensor:
    """The tokens each pair takes in a window (all three parts packed; the prompt and the longer
    answer padded); one DataError line naming the longest pair and the two fixes when any is
    longer than ``seq_len``."""
    need = lengths.sum(1) if packed else lengths[:, PROMPT] + lengths[:, 1:].amax(1)
    over = int((need > seq_len).sum())
    if over:
        worst = int(torch.argmax(need))
        prompt, chosen, rejected = lengths[worst].tolist()
        what = "prompt + chosen + rejected, packed" if packed else "prompt + the longer answer, padded"
        raise DataError(f"{over:,} of {len(ids):,} pairs in {data.path} are longer than --data.seq_len "
                        f"{seq_len} ({what}); the longest, pair {int(ids[worst])}, takes {int(need[worst]):,} "
                        f"tokens (prompt {prompt}, chosen {chosen}, rejected {rejected}): raise --data.seq_len "
                        f"to {int(need[worst])}, or cut prompt + answer when preparing "
                        f"(`mfsdp prepare-data ... --data.max_len {seq_len // 2 if packed else seq_len}`)")
    return need


class PairWindows(FixedWindows):
    """The fixed windows of the pairs ``pairs`` (a range of sample indices) of ``data``, packed
    or padded; ``PackedSampler(..., windows=PairWindows(...))`` draws them by step as it draws
    fine-tuning windows, and its ``loss_tokens`` then counts pairs. ``first_id``: added to the
    batches' ``pair_ids``, so that a second file's pairs (``--data.val_path``) number after the first's."""

    def __init__(self, data: TokenFile, seq_len: int, pairs: range | None = None, packed: bool = True,
                 first_id: int = 0):
        if data.sample_starts is None or not data.is_pairs:
            raise DataError(f"{data.path} is a plain token stream, not preference pairs")
        pairs = range(data.num_samples) if pairs is None else pairs
        ids = torch.arange(pairs.start, pairs.stop, pairs.step)
        lengths = pair_lengths(data)[ids]
        need = check_lengths(data, ids, lengths, seq_len, packed)
        members, self.bounds = pack(need, seq_len, packed)
        self.data, self.seq_len, self.packed, self.first_id = data, seq_len, packed, first_id
        self.members, self.lengths = ids[members], lengths[members]
        self.counted = self.bounds.diff()
        """Per window, its pairs: what the loss is normalised by."""
        chosen = self.lengths[:, CHOSEN] - (self.lengths[:, PROMPT] == 0).long()  # the first token of none
        self.chosen_counted = torch.cat([chosen.new_zeros(1), chosen.cumsum(0)])[self.bounds].diff()
        """Per window, the chosen answer tokens ``answer_logps`` counts (``sft`` divides by them)."""
        self.truncated = 0

    def chosen_per_pair(self, windows: torch.Tensor | slice = slice(None)) -> float:
        """The chosen answer tokens per pair over ``windows`` (by default all): what trl's ``sft``
        term, a mean over a batch's chosen tokens, divides each pair's chosen sum by."""
        return int(self.chosen_counted[windows].sum()) / max(1, int(self.counted[windows].sum()))

    def batch(self, windows: list[int | None]) -> Batch:
        """The rows of these windows (None for an empty one): vectorised, no loop over tokens."""
        counts = self.sizes(windows)
        picked = torch.cat([torch.arange(int(self.bounds[w]), int(self.bounds[w + 1]))
                            for w in windows if w is not None] or [torch.empty(0, dtype=torch.int64)])
        window_of = torch.repeat_interleave(torch.arange(len(windows)), counts)  # per pair
        lengths = self.lengths[picked]
        place = self._packed if self.packed else self._padded
        pair_of, within, rows, cols, starts = place(lengths, window_of, counts, len(windows))
        return self._fill(self.members[picked], lengths, pair_of, within, rows, cols, starts,
                          len(windows) * (1 if self.packed else 2))

    @staticmethod
    def _packed(lengths, window_of, counts, _windows):
        """Per token of the batch's pairs, each pair whole in its window's row after the earlier ones."""
        size = lengths.sum(1)
        before = torch.cumsum(size, 0) - size
        column0 = before - before[(torch.cumsum(counts, 0) - counts)[window_of]]
        pair_of = torch.repeat_interleave(torch.arange(size.numel()), size)
        within = torch.arange(pair_of.numel()) - before[pair_of]
        return pair_of, within, window_of[pair_of], column0[pair_of] + within, column0[pair_of]

    @staticmethod
    def _padded(lengths, window_of, _counts, windows):
        """Per token: [prompt | chosen] in row w, [prompt | rejected] in row windows + w."""
        prompt, chosen = lengths[:, PROMPT], lengths[:, CHOSEN]
        parts = []
        for answer, row0, skip in ((CHOSEN, 0, 0), (REJECTED, windows, 1)):
            size = prompt + lengths[:, answer]
            pair_of = torch.repeat_interleave(torch.arange(size.numel()), size)
            cols = torch.arange(pair_of.numel()) - (torch.cumsum(size, 0) - size)[pair_of]
            within = cols + skip * chosen[pair_of] * (cols >= prompt[pair_of])  # skip the chosen tokens
            parts.append((pair_of, within, row0 + window_of[pair_of], cols))
        pair_of, within, rows, cols = (torch.cat(column) for column in zip(*parts))
        return pair_of, within, rows, cols, torch.zeros_like(cols)

    def _fill(self, ids, lengths, pair_of, within, rows, cols, row_starts, rows_count) -> Batch:
        """The batch from per-token places: ids, segments, answers, and for packed rows the
        positions, documents and branches."""
        prompt, chosen = lengths[pair_of, PROMPT], lengths[pair_of, CHOSEN]
        segment = (within >= prompt).to(torch.int64) + (within >= prompt + chosen).to(torch.int64)
        width = self.seq_len if self.packed else int(cols.max()) + 1 if cols.numel() else 1
        shape = (rows_count, width)
        inputs = torch.full(shape, PAD_ID, dtype=torch.int64)
        tokens = self.data.take(self.data.sample_starts[ids][pair_of] + within)
        inputs[rows, cols] = tokens
        predictor = cols - 1
        if self.packed:  # the first rejected token follows the prompt's last token
            predictor = predictor - chosen * (within == prompt + chosen)
        counted = (segment > PROMPT) & (predictor >= row_starts)
        answers = torch.stack([rows * width + predictor, tokens,
                               2 * pair_of + (segment == REJECTED)])[:, counted]
        batch = dict(inputs=inputs, targets=torch.full(shape, IGNORE, dtype=torch.int64),
                     answers=answers, pair_ids=ids + self.first_id)
        if self.packed:
            pair_rows = rows[within == 0]  # each pair's row, in pair order (non-decreasing)
            index_in_row = torch.arange(ids.numel()) - torch.searchsorted(pair_rows, pair_rows)
            positions = torch.zeros(shape, dtype=torch.int64)
            positions[rows, cols] = within - chosen * (segment == REJECTED)
            documents = torch.full(shape, PAD_DOCUMENT, dtype=torch.int32)
            documents[rows, cols] = index_in_row[pair_of].to(torch.int32)
            branches = torch.zeros(shape, dtype=torch.int8)
            branches[rows, cols] = segment.to(torch.int8)
            batch.update(positions=positions, document_ids=documents, branch_ids=branches)
        return Batch(**batch)
