"""The experts on CUDA (skipped without a GPU): the grouped GEMM against the per-expert loop in fp32 and
bf16, with expert weights that are views into a flat buffer at the offsets mfsdp's unsharded buffer
gives them, and a compiled bundled MoE model against the eager one."""

from __future__ import annotations

import pytest
import torch

from mfsdp import _compat
from mfsdp.experts.grouped import expert_swiglu, grouped_mm_usable
from mfsdp.models import LlamaConfig, MoELlama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _swiglu(counts, x, gate_up, down, probe):
    x, gate_up, down = [t.detach().clone().requires_grad_() for t in (x, gate_up, down)]
    out = expert_swiglu(x, counts, gate_up, down, torch.nn.functional.silu)
    (out.float() * probe).sum().backward()
    return [out.float(), x.grad.float(), gate_up.grad.float(), down.grad.float()]


@pytest.mark.skipif(not _compat.has_grouped_mm(), reason="this torch has no grouped_mm")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_grouped_matches_loop_on_cuda(monkeypatch, dtype, tol):
    """bf16 takes the grouped GEMM; fp32 the loop (torch's CUDA kernel is bf16 only): both agree with
    the loop forced."""
    counts, d, f = [37, 0, 128, 5, 0, 64, 1, 19], 256, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.empty(8 * 2 * f * d + 8 * d * f + 8, dtype=dtype, device="cuda")  # one flat buffer
    gate_up = flat[:8 * 2 * f * d].view(8, 2 * f, d)
    down = flat[8 * 2 * f * d:8 * 2 * f * d + 8 * d * f].view(8, d, f)
    gate_up.copy_(torch.randn(gate_up.shape, generator=g, device="cuda") / 16)
    down.copy_(torch.randn(down.shape, generator=g, device="cuda") / 11)
    x = torch.randn(sum(counts), d, generator=g, device="cuda").to(dtype)
    probe = torch.randn(sum(counts), d, generator=g, device="cuda")
    assert grouped_mm_usable(x, gate_up, down) == (dtype == torch.bfloat16)
    grouped = _swiglu(counts, x, gate_up, down, probe)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    loop = _swiglu(counts, x, gate_up, down, probe)
    for a, b in zip(grouped, loop):
        assert float((a - b).norm() / b.norm()) < tol
    assert grouped[2][[1, 4]].abs().max() == 0  # the experts with no rows: zero gradient slices


def test_compiled_moe_matches_eager():
    cfg = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512,
                      max_seq_len=128, num_experts=8, top_k=2)
    torch.manual_seed(0)
    eager = MoELlama(cfg, dtype=torch.bfloat16, device="cuda")
    eager.init_weights(seed=0)
    compiled = MoELlama(cfg, dtype=torch.bfloat16, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    tokens = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    losses = []
    for model in (eager, compiled):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append((float(loss), float(model.layers[0].feed_forward.experts.gate_up_proj.grad.float().norm())))
    assert abs(losses[0][0] - losses[1][0]) < 1e-2 * abs(losses[0][0]), losses
    assert abs(losses[0][1] - losses[1][1]) < 5e-2 * losses[0][1], losses
