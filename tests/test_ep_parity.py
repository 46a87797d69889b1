"""Expert parallelism on the bundled MoE model (``ParallelizeConfig.ep``) against an unsharded model
trained on the full batch: logits, loss, every gradient (the experts' included) and the weights after
two AdamW steps, on gloo ranks in fp32.

The objective is the data-parallel one: the mean over ranks of each rank's cross entropy plus the
load-balancing loss of its own rows (routing is per token, so the load-balancing loss of a rank's rows
is the same at every ep); the reference computes exactly that on one process, chunk by chunk.

"forced" routing pins each token's experts by the vocabulary half it comes from: rank 0's tokens go to
experts 0 and 1 (both on ep rank 0 at ep 2, so rank 0 sends no token to rank 1), rank 1's to experts 2
and 1, and expert 3 gets no token anywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mfsdp
from models import full_params, max_rel_error
from mfsdp.mesh import build_mesh
from mfsdp.models import LlamaConfig, MoELlama
from mfsdp.models.parallelize import ParallelizeConfig, parallelize

pytestmark = pytest.mark.timeout(300)

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40,
                  max_seq_len=16, num_experts=4, top_k=2)
COEF = 0.1  # a large load-balancing weight, so a wrong router gradient shows
LOGITS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-4


def build(forced: bool) -> MoELlama:
    model = MoELlama(CFG)
    torch.manual_seed(0)
    model.init_weights()
    if forced:
        with torch.no_grad():
            half = CFG.vocab_size // 2
            model.tok_embeddings.weight[:half, 0] = 4.0
            model.tok_embeddings.weight[half:, 0] = -4.0
            model.tok_embeddings.weight[:, 1] = 4.0
            for layer in model.moe_layers():
                layer.router.weight.zero_()
                layer.router.weight[:, 0] = torch.tensor([1.0, 0.5, -1.0, -1.0])
                layer.router.weight[3, 1] = -10.0  # expert 3: never among the top 2
    return model


def batch(step: int, ws: int, forced: bool):
    """The global batch as ``ws`` equal row chunks; forced: rank r's rows from vocabulary half r % 2."""
    g = torch.Generator().manual_seed(100 + step)
    half = CFG.vocab_size // 2
    rows = [torch.randint(*(((r % 2) * half, (r % 2 + 1) * half) if forced else (0, CFG.vocab_size)), (2, 9),
                          generator=g) for r in range(ws)]
    full = torch.cat(rows)
    return list(zip(full[:, :-1].chunk(ws), full[:, 1:].chunk(ws)))


def local_loss(model, tokens, targets):
    logits = model(tokens)
    return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) + COEF * model.aux_loss()


def full_grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def ep_parity(rank, ws, ep=2, placements="zero3", forced=False, steps=2, device="cpu"):
    """Errors of the expert-parallel model against the full-batch reference, step by step."""
    model = build(forced).to(device)
    ref = copy.deepcopy(model)
    mesh = build_mesh(device, ws, replicate=2) if placements == "hsdp" else build_mesh(device, ws)
    parallelize(model, mesh, ParallelizeConfig(placements=placements, ep=ep))

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    opt, ref_opt = mfsdp.fully_shard_optimizer(model, adamw(model.parameters())), adamw(ref.parameters())
    out = dict(logits=[], loss=[], grads=[], weights=[])
    for step in range(steps):
        chunks = [(x.to(device), y.to(device)) for x, y in batch(step, ws, forced)]
        ref_out = [local_loss(ref, x, y) for x, y in chunks]
        (sum(loss for _, loss in ref_out) / ws).backward()
        logits, loss = local_loss(model, *chunks[rank])
        loss.backward()
        out["logits"].append(float((logits - ref_out[rank][0]).abs().max()))
        out["loss"].append(abs(float(loss - ref_out[rank][1])))
        out["grads"].append(max_rel_error(full_grads(model), full_grads(ref)))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        out["weights"].append(max_rel_error(full_params(model), full_params(ref)))
    return out


def check(results):
    for r in results:
        assert max(r["logits"]) < LOGITS_TOL and max(r["loss"]) < LOGITS_TOL, r
        assert max(r["grads"]) < GRAD_TOL and max(r["weights"]) < WEIGHT_TOL, r


def test_ep2_forced_routing(world):
    """ep 2 on 2 ranks, zero3; rank 0 sends no token to rank 1 and expert 3 gets none."""
    check(world(2).run(ep_parity, timeout=120, ep=2, forced=True))


def test_ep2_by_dp2_zero2(world):
    """4 ranks: experts over ep 2, each sharded over the other 2 ranks; zero2."""
    check(world(4).run(ep_parity, timeout=200, ep=2, placements="zero2"))


def test_ep4(world):
    check(world(4).run(ep_parity, timeout=200, ep=4, forced=True))


@pytest.mark.slow
@pytest.mark.parametrize("ws,ep,placements,forced", [(2, 2, "zero2", False), (4, 4, "zero2", False),
                                                      (4, 2, "zero3", True), (4, 2, "hsdp", False)])
def test_ep_grid(world, ws, ep, placements, forced):
    check(world(ws).run(ep_parity, timeout=200, ep=ep, placements=placements, forced=forced))
