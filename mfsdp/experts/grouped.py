"""A rank's experts over the tokens routed to them: SwiGLU per expert on expert-sorted rows."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def expert_swiglu(x: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(x W_gate^T) * (x W_up^T) W_down^T`` for each expert over its rows of ``x``.

    ``x`` [N, D] holds the rows sorted by expert: ``counts[e]`` rows for expert ``e`` of ``gate_up``
    [E, 2F, D] and ``down`` [E, D, F], ``sum(counts) == N``. Returns [N, D], unweighted. An expert
    with no rows contributes nothing and gets a zero gradient slice.
    """
    outs = []
    for e, rows in enumerate(x.split(list(counts))):
        gate, up = torch.nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(torch.nn.functional.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])
