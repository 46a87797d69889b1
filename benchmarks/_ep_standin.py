"""A stand-in for the expert-parallel dispatch of ``mfsdp.experts.dispatch`` while that is being written:
the same collectives the contract describes, so ``ep_bytes.py`` can count them now.

Per MoE layer forward: an ``all_to_all_single`` of the per-expert counts (``E`` int64 per rank, ``E / ep``
to each rank of the ``ep`` group), then a variable-size ``all_to_all_single`` of the token copies to the
ranks holding their experts; ``combine`` sends the results back the same way. Backward mirrors both token
all-to-alls (``torch.distributed.nn.functional.all_to_all_single``); the counts are not sent again.

Only ``ep_bytes.py`` uses it, and only while ``mfsdp/experts/dispatch.py`` lacks EP (``needed``: its
``Dispatch`` state has no ``send_splits``); once the real dispatch is in the tree, the real one is
counted, and this file and its call in ``ep_bytes.py`` (``shard_model``) can be deleted.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor

from mfsdp.experts.grouped import expert_swiglu


@dataclasses.dataclass
class Sent:
    order: torch.Tensor  # the (token, slot) copies in the order sent: index into top_k_index.flatten()
    inverse: torch.Tensor  # received rows sorted by local expert -> received order
    send: list  # rows sent to each rank of the group
    recv: list  # rows received from each rank of the group
    num_tokens: int
    top_k: int


def dispatch(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group) -> tuple:
    """Each (token, slot) copy to the rank holding its expert (contiguous split of the experts); returns
    the received rows sorted by local expert, the rows per local expert, and what ``combine`` needs."""
    ep, top_k = dist.get_world_size(group), top_k_index.shape[1]
    per = num_experts // ep
    flat = top_k_index.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # counts first: the split sizes of the tokens
    by_source = got.view(ep, per)  # [source rank, local expert]
    send, recv = counts.view(ep, per).sum(1).tolist(), by_source.sum(1).tolist()
    rows = all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x[order // top_k], recv, send, group=group)
    local = torch.arange(per).repeat(ep).repeat_interleave(by_source.flatten())
    perm = local.argsort(stable=True)
    state = Sent(order, perm.argsort(), send, recv, x.shape[0], top_k)
    return rows[perm], by_source.sum(0).tolist(), state


def combine(y: torch.Tensor, weights: torch.Tensor, state: Sent, group) -> torch.Tensor:
    """The expert outputs back to the ranks their tokens came from, each token's copies mixed with its
    router weights."""
    back = all_to_all_single(y.new_empty(sum(state.send), y.shape[1]), y[state.inverse], state.send,
                             state.recv, group=group)
    w = weights.flatten()[state.order].to(back.dtype)
    out = back.new_zeros(state.num_tokens, back.shape[1])
    return out.index_add(0, state.order // state.top_k, back * w[:, None])


def forward(experts, group, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward under expert parallelism (``mfsdp.experts.parallel.ep_forward`` with
    this file's dispatch and combine)."""
    rows, counts, state = dispatch(hidden, top_k_index, experts.num_experts, group)
    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w
                     for w in (experts.gate_up_proj, experts.down_proj))
    return combine(expert_swiglu(rows, counts, gate_up, down, experts.act_fn), top_k_weights, state, group)


def needed() -> bool:
    """Whether this tree's ``mfsdp.experts.dispatch`` lacks expert parallelism (its state has no split sizes)."""
    from mfsdp.experts import dispatch as real

    return "send_splits" not in {f.name for f in dataclasses.fields(real.Dispatch)}


def install(modules, group) -> None:
    """Route each experts module of ``modules`` through this file's dispatch over ``group``."""
    for experts in modules:
        experts.forward = functools.partial(forward, experts, group)
