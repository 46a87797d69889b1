"""Which rank computes each (token, expert) pair, and the all-to-all there and back.

Experts are split contiguously over the ``ep`` ranks: rank ``r`` of the expert-parallel group holds
experts ``[r * E / ep, (r + 1) * E / ep)``. ``dispatch`` sends each of a rank's (token, slot) copies
to the rank holding its expert and returns what this rank's experts must compute, sorted by local
expert; ``combine`` sends the results back and mixes each token's outputs with its router weights.
Without a group (or one of one rank) both are local: a sort and its inverse.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Dispatch:
    """What ``combine`` needs from ``dispatch``: the permutation and the split sizes of the way back."""

    order: torch.Tensor
    """The (token, slot) copies in the order they were sent: index into ``expert_ids.flatten()``."""
    num_tokens: int
    top_k: int
    group: Optional[dist.ProcessGroup] = None
    # The EP path adds its split sizes and the received copies' permutation here.


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
             group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, list[int], Dispatch]:
    """``x`` [T, D] and ``expert_ids`` [T, K] (global expert ids) -> (rows [N, D] for this rank's
    experts sorted by local expert, the per-local-expert row counts, the state ``combine`` needs).

    Every rank of ``group`` must call it once per MoE layer forward, whatever its tokens chose (a rank
    that sends nothing, or an expert no token chose, included): the all-to-alls are collectives.
    """
    if group is not None and dist.get_world_size(group) > 1:
        raise NotImplementedError("expert-parallel dispatch")
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return x[order // expert_ids.shape[1]], counts, Dispatch(order, x.shape[0], expert_ids.shape[1], group)


def combine(y: torch.Tensor, weights: torch.Tensor, state: Dispatch) -> torch.Tensor:
    """``y`` [N, D], ``dispatch``'s rows after the experts -> [T, D]: each token's ``K`` outputs
    weighted by ``weights`` [T, K] and summed."""
    w = weights.flatten()[state.order].to(y.dtype)
    out = y.new_zeros(state.num_tokens, y.shape[-1])
    return out.index_add(0, state.order // state.top_k, y * w[:, None])
