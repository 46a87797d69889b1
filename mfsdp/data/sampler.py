"""Deterministic, resumable batches: a pure function of (seed, step, rank, world size).

Each step draws random window starts from a generator seeded by (seed, step) alone, so
the whole global batch is known to every rank without communication, and resuming needs
nothing but the step counter: there is no iterator state to save. Rank r takes its own
slice of the global batch, so the global batch of a step does not depend on how many
ranks share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mfsdp.data.token_file import DataError, TokenFile


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    """Token ids, (local_batch, seq_len), int64."""
    targets: torch.Tensor
    """The token each position must predict (the inputs shifted left by one), or -100 where
    the loss counts nothing (``ignore_index``: padding, prompts, a sample's last token)."""
    positions: torch.Tensor | None = None
    """Rotary positions, (local_batch, seq_len) int64, restarting at 0 where each packed
    sample starts; None for 0 .. seq_len - 1 in every row (a plain token stream)."""
    document_ids: torch.Tensor | None = None
    """(local_batch, seq_len) int32: the index of each position's sample within its row, -1
    for padding, so attention can stay within a sample (document-causal); None for plain
    causal attention over the whole row."""
    branch_ids: torch.Tensor | None = None
    """Preference pairs packed with a shared prompt (``mfsdp.data.pair_packing``): (local_batch,
    seq_len) int8, 0 for the prompt, 1 chosen, 2 rejected (``document_mask``'s branches)."""
    answers: torch.Tensor | None = None
    """Preference pairs: (3, answer tokens) int64, per answer token the flat position (row *
    row width + column) of the output that predicts it, its id, and its sequence (pair * 2, + 1
    for the rejected answer), pairs numbered in ``pair_ids`` order (``answer_logps``)."""
    pair_ids: torch.Tensor | None = None
    """Preference pairs: (pairs,) int64, each pair's sample index in the token file."""


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens from the first ``limit`` tokens of a token file
    (all of them by default; ``mfsdp.data.heldout`` keeps the tail for evaluation)."""

    def __init__(self, data: TokenFile, seq_len: int, local_batch: int, rank: int,
                 world_size: int, seed: int = 0, microbatches: int = 1,
                 limit: int | None = None):
        self.limit = len(data) if limit is None else min(limit, len(data))
        if self.limit < seq_len + 2:
            held = f" (the other {len(data) - self.limit} are held out for evaluation)" \
                if self.limit < len(data) else ""
            raise DataError(f"{data.path} holds {self.limit} training tokens{held}, too few for "
                            f"windows of {seq_len + 1}; use more text or a smaller data.seq_len")
        self.data = data
        self.seq_len = seq_len
        self.local_batch = local_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.microbatches = microbatches

    def batch(self, step: int, microbatch: int = 0) -> Batch:
        """This rank's ``microbatch``-th batch of optimizer step ``step``."""
        starts = self._global_starts(step)
        first = (microbatch * self.world_size + self.rank) * self.local_batch
        rows = [self.data.window(int(s), self.seq_len + 1)
                for s in starts[first:first + self.local_batch]]
        windows = torch.stack(rows)
        return Batch(inputs=windows[:, :-1], targets=windows[:, 1:])

    def loss_tokens(self, step: int) -> int:
        """The targets the loss counts in the global batch of ``step``: every one of them."""
        return self.microbatches * self.world_size * self.local_batch * self.seq_len

    def _global_starts(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, step))
        count = self.microbatches * self.world_size * self.local_batch
        return torch.randint(0, self.limit - self.seq_len, (count,), generator=generator)


def mix_seed(seed: int, step: int) -> int:
    """One generator seed from a run's seed and a counter (a step, or an epoch)."""
    # A fixed odd multiplier spreads nearby (seed, step) pairs over the seed space; plain
    # seed + step would make run (seed=0, step=1) replay run (seed=1, step=0).
    return (seed * 0x9E3779B97F4A7C15 + step) % (2**63 - 1)
