"""Expert-parallel dispatch, grouped SwiGLU and combine (CPU, gloo) against a single-process reference
on the concatenation of every rank's tokens with every expert, written without dispatch: each
(token, slot) gathers its expert's weights. Forward and the gradients of the tokens, the router
weights and the expert weights, with random routing and with routing forced so that a rank has no
token, a rank receives no row, a rank sends nothing to another, and an expert gets no token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp import _compat
from mfsdp.experts.dispatch import combine, dispatch
from mfsdp.experts.grouped import expert_swiglu, grouped_mm_usable

pytestmark = pytest.mark.timeout(120)
FWD_TOL = 1e-6  # relative to the largest output: fp32 rounding of sums of 16 and 8 products
GRAD_TOL = 1e-5
E, K, D, F = 8, 2, 16, 8  # D and F: 64- and 32-byte rows, so CPU takes the grouped GEMM


def reference(x, ids, weights, gate_up, down):
    """Every (token, slot) with its own expert's weights, summed with the router weights."""
    gate, up = torch.einsum("tkfd,td->tkf", gate_up[ids], x).chunk(2, dim=-1)
    out = torch.einsum("tkdf,tkf->tkd", down[ids], torch.nn.functional.silu(gate) * up)
    return (out * weights[..., None]).sum(1)


def _banned(ep: int, rank: int) -> list[int]:
    """Forced routing: the experts rank ``rank`` may not choose. No rank chooses expert E-1; at ep 4
    no rank chooses rank 2's experts (rank 2 receives nothing) and rank 1 sends nothing to rank 0."""
    per = E // ep
    banned = [E - 1] + (list(range(2 * per, 3 * per)) if ep == 4 else [])
    return banned + (list(range(per)) if ep == 4 and rank == 1 else [])


def _global_problem(ep: int, forced: bool, seed: int):
    """Every rank's tokens, routing and the global expert weights (the same on each rank)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(3, 10, (ep,), generator=g)]
    if forced:
        sizes[-1] = 0  # the last rank has no token
    x = torch.randn(sum(sizes), D, generator=g)
    scores = torch.randn(sum(sizes), E, generator=g)
    if forced:
        for r, rows in enumerate(torch.arange(sum(sizes)).split(sizes)):
            scores[rows[:, None], torch.tensor(_banned(ep, r))] = -float("inf")
    ids = scores.topk(K, dim=-1).indices
    weights = torch.rand(sum(sizes), K, generator=g)
    gate_up, down = torch.randn(E, 2 * F, D, generator=g) / 4, torch.randn(E, D, F, generator=g) / 3
    probe = torch.randn(sum(sizes), D, generator=g)  # the loss is <out, probe>
    return sizes, x, ids, weights, gate_up, down, probe


def _peak(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0  # (a rank with no token has empty tensors)


def max_rel_error(a: dict, b: dict) -> float:
    """The worst ``max |a - b| / max |b|`` over the entries (0 where both are zero or empty)."""
    assert a.keys() == b.keys() and all(a[k] is not None and a[k].shape == b[k].shape for k in a), (a, b)
    return max(_peak(a[k] - b[k]) / max(_peak(b[k]), 1e-30) for k in a)


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def ep_parity(rank: int, world_size: int, ep: int, forced: bool, seed: int = 0) -> dict:
    """Rank ``rank`` of an ep group (the world, or consecutive ranks of it) against the reference;
    returns the worst relative errors and what this rank sent and received."""
    groups = [dist.new_group(list(range(i, i + ep))) for i in range(0, world_size, ep)]
    group, r = groups[rank // ep], rank % ep
    sizes, x, ids, w, gate_up, down, probe = _global_problem(ep, forced, seed + rank // ep)
    ref = _leaves(x, w, gate_up, down)
    expected = reference(ref[0], ids, *ref[1:])
    (expected * probe).sum().backward()
    rows = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
    experts = slice(r * E // ep, (r + 1) * E // ep)
    mine = _leaves(x[rows], w[rows], gate_up[experts], down[experts])
    sent, counts, state = dispatch(mine[0], ids[rows], E, group)
    out = combine(expert_swiglu(sent, counts, mine[2], mine[3], torch.nn.functional.silu), mine[1], state)
    (out * probe[rows]).sum().backward()
    fwd = _peak(out - expected[rows]) / _peak(expected)
    grads = max_rel_error({i: t.grad for i, t in enumerate(mine)},
                          {i: t.grad[s] for i, (t, s) in enumerate(zip(ref, (rows, rows, experts, experts)))})
    return {"fwd": fwd, "grad": grads, "sent": state.send_splits, "received": sum(counts),
            "grouped": grouped_mm_usable(sent, mine[2], mine[3])}


def _check(results, ep):
    for res in results:
        assert res["fwd"] < FWD_TOL and res["grad"] < GRAD_TOL, results
        assert len(res["sent"]) == ep, results


def test_ep2_random_routing_two_groups(world):
    """Two ep-2 groups in a world of 4, each with its own tokens: forward and every gradient."""
    results = world(4).run(ep_parity, ep=2, forced=False)
    _check(results, 2)
    assert any(res["grouped"] for res in results) or not _compat.has_grouped_mm()  # the grouped GEMM took part


def test_ep4_forced_routing_empty_ranks_and_experts(world):
    """A rank with no token, a rank receiving nothing, a rank sending nothing to another, an expert
    no token chose: exact forward and backward, no hang."""
    results = world(4).run(ep_parity, ep=4, forced=True)
    _check(results, 4)
    assert results[3]["sent"] == [0, 0, 0, 0] and results[2]["received"] == 0
    assert results[1]["sent"][0] == 0 and results[0]["received"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("ep, forced, seed", [(4, False, 1), (2, True, 2), (2, False, 3)])
def test_ep_parity_more_cells(world, ep, forced, seed):
    """More routings and sizes of the two tests above (slow)."""
    _check(world(4).run(ep_parity, ep=ep, forced=forced, seed=seed), ep)


def ep_indivisible(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as err:
        dispatch(torch.zeros(2, D), torch.zeros(2, K, dtype=torch.long), 6, dist.group.WORLD)
    return str(err.value)


def test_experts_not_divisible_by_ep(world):
    assert all("6 experts cannot be split evenly over 4" in m for m in world(4).run(ep_indivisible))


def test_local_path_without_group():
    """ep 1 (no group): dispatch, grouped SwiGLU and combine against the reference, with an expert
    no token chose."""
    _, x, ids, w, gate_up, down, probe = _global_problem(1, False, 5)
    ids[ids == 3] = 4  # expert 3: no token (a token may now use expert 4 twice)
    ref = _leaves(x, w, gate_up, down)
    expected = reference(ref[0], ids, *ref[1:])
    (expected * probe).sum().backward()
    mine = _leaves(x, w, gate_up, down)
    sent, counts, state = dispatch(mine[0], ids, E)
    assert counts[3] == 0 and state.send_splits is None
    out = combine(expert_swiglu(sent, counts, mine[2], mine[3], torch.nn.functional.silu), mine[1], state)
    (out * probe).sum().backward()
    assert (out - expected).abs().max() < FWD_TOL * expected.abs().max()
    assert max_rel_error({i: t.grad for i, t in enumerate(mine)}, {i: t.grad for i, t in enumerate(ref)}) < GRAD_TOL
    assert mine[2].grad[3].abs().max() == 0
