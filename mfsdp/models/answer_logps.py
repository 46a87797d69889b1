"""Log-prob extraction for preference pairs: model output -> summed log-probs of each answer.

The pair layouts (``mfsdp.data.pair_packing``) describe every answer token by three numbers
(``Batch.answers``): the flat position (row * row width + column) of the output that predicts
it, its id, and its sequence, pair * 2 + 0 for the chosen answer or + 1 for the rejected one. In
the packed shared-prompt layout the first rejected token is predicted by the last prompt token,
not by the token before it in the window, so a shifted-label cross entropy cannot serve; only
those positions are gathered, and the log-softmax runs over them alone, in fp32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class PairLogps(NamedTuple):
    """Per pair: the summed log-probs (fp32) of the chosen and rejected answers, and their
    token counts (int64). A reference model's sums travel in the same shape."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def answer_logps(outputs: torch.Tensor, answers: torch.Tensor, pairs: int,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PairLogps:
    """The per-pair answer log-prob sums of ``outputs`` (rows, seq, vocab) logits, or hidden
    states when ``head`` (the output projection) is given, at the (3, answer tokens) int64
    ``answers`` of a batch of ``pairs`` pairs. ``head`` then runs on the answer positions only."""
    flat = outputs.reshape(-1, outputs.shape[-1]).index_select(0, answers[0])
    logits = (flat if head is None else head(flat)).float()
    token_logps = torch.log_softmax(logits, dim=-1).gather(1, answers[1, :, None])[:, 0]
    sums = torch.zeros(2 * pairs, dtype=torch.float32, device=logits.device)
    sums = sums.index_add(0, answers[2], token_logps)
    counts = torch.zeros(2 * pairs, dtype=torch.int64, device=logits.device).index_add(
        0, answers[2], torch.ones_like(answers[2]))  # not bincount: its size is data-dependent (fake tensors)
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])
