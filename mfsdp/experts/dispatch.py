"""Which rank computes each (token, expert) pair, and the all-to-all there and back.

Experts are split contiguously over the ``ep`` ranks: rank ``r`` of the expert-parallel group holds
experts ``[r * E / ep, (r + 1) * E / ep)``. ``dispatch`` sends each of a rank's (token, slot) copies
to the rank holding its expert and returns what this rank's experts must compute, sorted by local
expert; ``combine`` sends the results back and mixes each token's outputs with its router weights.
Without a group (or one of one rank) both are local: a sort and its inverse.

The way there (ep > 1). A rank sorts its copies by global expert, which also groups them by
destination rank. Counts go first: an all-to-all of the per-expert counts (``E`` int64 each way)
tells each rank how many rows every source sends to each of its local experts, which the token
all-to-all needs as split sizes before it can start. One host sync reads all split sizes at once,
then one variable-size all-to-all moves the rows (autograd; its backward is the reverse all-to-all).
The rows arrive source-major, each source's block already in expert order; a stable sort by local
expert makes them expert-major (within an expert, by source rank) for the grouped GEMM.

The way back. ``combine`` undoes that sort, sends the outputs home by the reverse all-to-all and
adds each copy into its token with its weight. Every rank issues the same collectives in the same
order whatever it routed (nothing sent, nothing received, an expert no token chose), forward and
backward, provided ``x`` requires grad on every rank of the group or on none.
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
    send_splits: Optional[list[int]] = None
    """ep > 1: the rows this rank sent to each rank of ``group`` (None on the local path)."""
    recv_splits: Optional[list[int]] = None
    """ep > 1: the rows this rank received from each rank of ``group``."""
    to_expert_major: Optional[torch.Tensor] = None
    """ep > 1: ``rows = received[to_expert_major]`` (received rows are source-major)."""
    to_source_major: Optional[torch.Tensor] = None
    """ep > 1: the inverse, ``received = rows[to_source_major]``."""


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
             group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, list[int], Dispatch]:
    """``x`` [T, D] and ``expert_ids`` [T, K] (global expert ids) -> (rows [N, D] for this rank's
    experts sorted by local expert, the per-local-expert row counts, the state ``combine`` needs).

    Every rank of ``group`` must call it once per MoE layer forward, whatever its tokens chose (a rank
    that sends nothing, or an expert no token chose, included): the all-to-alls are collectives.
    """
    ep = 1 if group is None else dist.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ep} expert-parallel ranks: "
                         "choose an ep that divides the number of experts")
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)
    state = Dispatch(order, x.shape[0], expert_ids.shape[1], group)
    sent = x[order // expert_ids.shape[1]]
    if ep == 1:
        return sent, torch.bincount(flat, minlength=num_experts).tolist(), state
    return _to_experts(sent, flat, num_experts, ep, state)


def combine(y: torch.Tensor, weights: torch.Tensor, state: Dispatch) -> torch.Tensor:
    """``y`` [N, D], ``dispatch``'s rows after the experts -> [T, D]: each token's ``K`` outputs
    weighted by ``weights`` [T, K] and summed."""
    if state.send_splits is not None:
        y = _AllToAll.apply(y[state.to_source_major], state.send_splits, state.recv_splits, state.group)
    w = weights.flatten()[state.order].to(y.dtype)
    out = y.new_zeros(state.num_tokens, y.shape[-1])
    return out.index_add(0, state.order // state.top_k, y * w[:, None])


def _to_experts(sent: torch.Tensor, flat: torch.Tensor, num_experts: int, ep: int,
                state: Dispatch) -> tuple[torch.Tensor, list[int], Dispatch]:
    """The ep > 1 way there: ``sent`` holds this rank's copies sorted by global expert."""
    local = num_experts // ep
    sent_counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    sent_counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))  # no host sync, unlike bincount
    recv_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(recv_counts, sent_counts, group=state.group)
    recv_counts = recv_counts.view(ep, local)  # [source rank, local expert]
    sizes = torch.cat([sent_counts.view(ep, local).sum(1), recv_counts.sum(1), recv_counts.sum(0)])
    sizes = sizes.tolist()  # the one host sync
    state.send_splits, state.recv_splits, counts = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    received = _AllToAll.apply(sent, state.recv_splits, state.send_splits, state.group)
    expert_of_row = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(
        recv_counts.flatten(), output_size=received.shape[0])
    state.to_expert_major = expert_of_row.argsort(stable=True)
    state.to_source_major = torch.empty_like(state.to_expert_major).scatter_(
        0, state.to_expert_major, torch.arange(received.shape[0], device=flat.device))
    return received[state.to_expert_major], counts, state


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with variable split sizes; its backward is the reverse one.
    (torch's autograd form, ``torch.distributed.nn.functional.all_to_all_single``, is deprecated.)"""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(output_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out
