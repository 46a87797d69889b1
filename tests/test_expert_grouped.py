"""The experts' grouped SwiGLU: the grouped GEMM (``_compat.grouped_mm``) and the per-expert loop give
the same outputs and gradients, experts with no rows included (their gradient slice is zero); the
loop is taken where this torch lacks the grouped GEMM or the operands do not suit it."""

from __future__ import annotations

import pytest
import torch

from mfsdp import _compat
from mfsdp.experts.grouped import expert_swiglu, grouped_mm_usable

pytestmark = pytest.mark.skipif(not _compat.has_grouped_mm(), reason="this torch has no grouped_mm")
COUNTS = [3, 0, 5, 0, 2]  # two experts with no rows


def _problem(counts, d=16, f=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), d, generator=g)
    gate_up, down = torch.randn(len(counts), 2 * f, d, generator=g) / 4, torch.randn(len(counts), d, f, generator=g) / 3
    probe = torch.randn(sum(counts), d, generator=g)
    return [t.to(dtype) for t in (x, gate_up, down, probe)]


def _run(counts, x, gate_up, down, probe, expanded_grad: bool):
    """Output and gradients; ``expanded_grad``: the loss is ``out.sum()``, whose gradient has zero
    strides (the grouped GEMM's backward refuses one unless made dense)."""
    x, gate_up, down = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    out = expert_swiglu(x, counts, gate_up, down, torch.nn.functional.silu)
    (out.sum() if expanded_grad else (out * probe).sum()).backward()
    return [out.detach(), x.grad, gate_up.grad, down.grad]


def _without_grouped_mm(monkeypatch):
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert not _compat.has_grouped_mm()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


@pytest.mark.parametrize("expanded_grad", [False, True])
def test_grouped_matches_loop(monkeypatch, expanded_grad):
    """fp32: forward and backward agree to rounding; the empty experts' gradient slices are zero."""
    problem = _problem(COUNTS)
    assert grouped_mm_usable(*problem[:3])
    grouped = _run(COUNTS, *problem, expanded_grad)
    with monkeypatch.context() as m:
        _without_grouped_mm(m)
        assert not grouped_mm_usable(*problem[:3])
        loop = _run(COUNTS, *problem, expanded_grad)
    assert all(_rel(a, b) < 1e-6 for a, b in zip(grouped, loop)), [_rel(a, b) for a, b in zip(grouped, loop)]
    for grads in (grouped[2:], loop[2:]):
        assert all(g[[1, 3]].abs().max() == 0 and g[[0, 2, 4]].abs().amax(dim=(1, 2)).min() > 0 for g in grads)


def test_no_rows_and_unsuitable_strides():
    """No row at all (a rank that receives nothing), and rows of 24 bytes (not a multiple of 16):
    the loop, with zero (not missing) expert gradients where no row went."""
    empty = _run([0, 0], *_problem([0, 0]), expanded_grad=False)
    assert empty[0].shape == (0, 16) and all(g.abs().max() == 0 for g in empty[2:])
    x, gate_up, down, probe = _problem(COUNTS, d=6)
    assert not grouped_mm_usable(x, gate_up, down)
    out = _run(COUNTS, x, gate_up, down, probe, expanded_grad=False)
    gate, up = torch.nn.functional.linear(x[:3], gate_up[0]).chunk(2, dim=-1)
    assert _rel(out[0][:3], torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[0])) < 1e-6
    with pytest.raises(ValueError, match="one entry per expert"):
        expert_swiglu(x, COUNTS[:-1], gate_up, down, torch.nn.functional.silu)


@pytest.mark.slow
def test_grouped_matches_loop_bf16(monkeypatch):
    """bf16 (slow): the two paths agree to bf16 rounding."""
    problem = _problem(COUNTS, d=32, f=16, dtype=torch.bfloat16)
    assert grouped_mm_usable(*problem[:3])
    grouped = _run(COUNTS, *problem, expanded_grad=False)
    _without_grouped_mm(monkeypatch)
    loop = _run(COUNTS, *problem, expanded_grad=False)
    assert all(_rel(a.float(), b.float()) < 2e-2 for a, b in zip(grouped, loop))
