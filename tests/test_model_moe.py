"""The mixture-of-experts model (mfsdp.models.moe): routing, the stacked experts, the load-balancing
loss, FLOP counts; then MoE blocks sharded by mfsdp on two gloo ranks against an unsharded model.

The distributed cases route the two ranks' tokens to disjoint experts on purpose ("split"): an
expert one rank's tokens reach gets none of the other's. With the model's stacked experts every rank
still runs the experts module; with the test-local one module per expert
(``conditional_models.PerExpertExperts``, the layout the model had before) each rank skips experts
the other one runs, in forward and in backward: the cases the runtime's conditional-computation
support exists for. The "same" cases give every rank the same batch, so every rank runs the same
experts.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import mfsdp
from conditional_models import PerExpertExperts, per_expert_units, with_per_expert_modules
from models import full_params, max_rel_error
from mfsdp.mesh import build_mesh, resolve_placements
from mfsdp.models import (Llama, LlamaConfig, MoEFeedForward, MoELlama, build_model, flops_per_token,
                          get_config, param_counts)
from mfsdp.models.moe import GroupedExperts
from mfsdp.models.parallelize import ParallelizeConfig, parallelize, sharding_units

pytestmark = pytest.mark.timeout(300)

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40,
                  max_seq_len=16, num_experts=4, top_k=2)


def build(cfg=CFG, seed=0) -> MoELlama:
    model = MoELlama(cfg)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def expert(layer: MoEFeedForward, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s SwiGLU from its slabs of the stacked weights: w1 the gate rows, w3 the up rows."""
    w1, w3 = layer.experts.gate_up_proj[e].chunk(2)
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), layer.experts.down_proj[e])


def dense_reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The layer computed token by token and expert by expert, with no gathering or scattering."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts, _ = layer.route(flat)
    rows = []
    for t in range(flat.shape[0]):
        row = torch.zeros_like(flat[t])
        for j in range(layer.top_k):
            row = row + expert(layer, int(experts[t, j]), flat[t:t + 1])[0] * weights[t, j]
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)


def only_experts_0_and_1(layer: MoEFeedForward) -> torch.Tensor:
    """Point the router at experts 0 and 1 for every input whose first feature is large; return one."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 2.0
        layer.router.weight[1, 0] = 1.0
    x = 0.1 * torch.randn(3, 5, CFG.dim)
    x[..., 0] = 4.0
    return x


# ------------------------------------------------------------------------------- one process
def test_config_validation_and_presets():
    with pytest.raises(ValueError, match=r"top_k \(5\) must lie in \[1, num_experts=4\]"):
        dataclasses.replace(CFG, top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(CFG, top_k=0)
    with pytest.raises(ValueError, match="num_experts must be a non-negative integer"):
        dataclasses.replace(CFG, num_experts=-1)
    with pytest.raises(ValueError, match="moe_aux_loss_coef"):
        dataclasses.replace(CFG, moe_aux_loss_coef=-0.1)
    dataclasses.replace(CFG, num_experts=0, top_k=7)  # top_k is ignored by a dense config
    with pytest.raises(ValueError, match="mfsdp.models.build_model"):
        Llama(CFG)  # the dense class refuses an MoE config instead of silently building a dense one
    tiny = get_config("moe-tiny")
    assert (tiny.num_experts, tiny.top_k) == (4, 2)
    assert get_config("moe-1b").num_experts == 8
    assert isinstance(build_model(tiny), MoELlama) and type(build_model(get_config("tiny"))) is Llama


def test_top_k_weights_sum_to_one_and_pick_the_best_experts():
    layer = build().layers[0].feed_forward
    x = torch.randn(30, CFG.dim)
    weights, experts, probs = layer.route(x)
    assert weights.shape == experts.shape == (30, 2) and probs.shape == (30, 4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(30))
    assert torch.equal(experts, probs.topk(2, dim=-1).indices)
    # Mixtral's gating: softmax over the chosen experts' router scores.
    logits = layer.router(x).float()
    torch.testing.assert_close(weights, logits.gather(1, experts).softmax(-1))


def test_output_equals_the_token_by_token_reference():
    layer = build().layers[1].feed_forward
    x = torch.randn(2, 7, CFG.dim)
    torch.testing.assert_close(layer(x), dense_reference(layer, x), atol=1e-6, rtol=1e-5)


def test_stacked_experts_have_the_interface_of_transformers_experts():
    experts = build().layers[0].feed_forward.experts
    assert isinstance(experts, GroupedExperts) and experts.num_experts == CFG.num_experts
    assert experts.gate_up_proj.shape == (CFG.num_experts, 2 * CFG.ffn_dim, CFG.dim)
    assert experts.down_proj.shape == (CFG.num_experts, CFG.dim, CFG.ffn_dim)
    assert experts.act_fn is F.silu
    x, ids = torch.randn(5, CFG.dim), torch.tensor([[0, 3], [3, 1], [1, 0], [2, 3], [0, 1]])
    w = torch.rand(5, 2)
    want = torch.stack([sum(w[t, j] * expert(build().layers[0].feed_forward, int(ids[t, j]), x[t]) for j in range(2))
                        for t in range(5)])
    torch.testing.assert_close(experts(x, ids, w), want, atol=1e-6, rtol=1e-5)


def test_experts_no_token_reached_get_a_zero_gradient_slice():
    layer = build().layers[0].feed_forward
    x = only_experts_0_and_1(layer)
    out = layer(x)
    torch.testing.assert_close(out, dense_reference(layer, x), atol=1e-6, rtol=1e-5)
    out.square().sum().backward()
    for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
        for i in range(CFG.num_experts):
            if i < 2:
                assert p.grad[i].abs().sum() > 0, i
            else:
                assert torch.equal(p.grad[i], torch.zeros_like(p.grad[i])), i  # stacked: zeros, not None
    assert layer.router.weight.grad is not None


def test_one_module_per_expert_computes_the_same_and_skips_the_unused_ones():
    """The test-local per-expert layout (conditional computation) is the stacked model's twin."""
    model = build()
    old = with_per_expert_modules(copy.deepcopy(model))
    layer = old.layers[0].feed_forward
    assert isinstance(layer.experts, PerExpertExperts)
    x = only_experts_0_and_1(model.layers[0].feed_forward)
    only_experts_0_and_1(layer)
    calls = [0] * CFG.num_experts
    for i, e in enumerate(layer.experts):
        e.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    out = layer(x)
    assert calls == [1, 1, 0, 0]
    torch.testing.assert_close(out, model.layers[0].feed_forward(x), atol=1e-6, rtol=1e-5)
    out.square().sum().backward()
    for i, e in enumerate(layer.experts):
        grads = [p.grad for p in e.parameters()]
        if i < 2:
            assert all(g is not None and g.abs().sum() > 0 for g in grads), i
        else:
            assert all(g is None for g in grads), i  # never ran, so autograd never saw them
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    torch.testing.assert_close(old(tokens), model(tokens), atol=1e-6, rtol=1e-5)


def test_load_balancing_loss_is_one_when_balanced_and_grows_when_collapsed():
    layer = build().layers[0].feed_forward
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities: f sums to 1, P_i = 1 / E
    layer(torch.randn(10, CFG.dim))
    assert float(layer.last_aux_loss.detach()) == pytest.approx(1.0)
    x = only_experts_0_and_1(layer)
    layer(x)
    collapsed = layer.last_aux_loss
    assert float(collapsed.detach()) > 1.5  # every token on the same two experts: about 2
    collapsed.backward()
    assert layer.router.weight.grad.abs().sum() > 0  # the loss trains the router


def test_model_forward_backward_aux_loss_and_checkpointing():
    model = build()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    targets = torch.randint(0, CFG.vocab_size, (2, 12))
    with pytest.raises(RuntimeError, match="after a forward"):
        model.aux_loss()

    def loss_and_grads(m):
        logits = m(tokens)
        assert logits.shape == (2, 12, CFG.vocab_size)
        aux = m.aux_loss()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.1 * aux
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert "layers.0.feed_forward.router.weight" in grads
    again = build()
    again.set_activation_checkpointing(True)
    loss2, grads2 = loss_and_grads(again)
    torch.testing.assert_close(loss2, loss)
    assert grads2.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], msg=name)
    with pytest.raises(ValueError, match="non-reentrant"):
        again.set_activation_checkpointing(True, reentrant=True)


def test_init_is_deterministic_meta_init_matches_and_dense_config_is_llama():
    a = build(seed=3)
    with torch.device("meta"):
        meta = MoELlama(CFG)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights(buffer_device="cpu")
    for (name, pa), pb in zip(a.named_parameters(), meta.parameters()):
        assert torch.equal(pa, pb), name
    router_std = float(a.layers[0].feed_forward.router.weight.detach().std())
    assert 0.015 < router_std < 0.025
    # Every expert's gate and up rows at init_std, its down projection at the residual std.
    experts = a.layers[0].feed_forward.experts
    for e in range(CFG.num_experts):
        assert float(experts.gate_up_proj[e].detach().std()) == pytest.approx(CFG.init_std, rel=0.1), e
        assert float(experts.down_proj[e].detach().std()) == pytest.approx(
            CFG.init_std / math.sqrt(2 * CFG.n_layers), rel=0.1), e
    dense_cfg = dataclasses.replace(CFG, num_experts=0)
    dense, llama = build(dense_cfg, seed=5), Llama(dense_cfg)
    torch.manual_seed(5)
    llama.init_weights()
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    assert torch.equal(dense(tokens), llama(tokens))  # same modules, same draws
    assert float(dense.aux_loss()) == 0.0


def test_parameter_and_flop_counts_use_active_experts():
    for name in ("moe-tiny", "moe-1b"):
        cfg = get_config(name)
        with torch.device("meta"):
            model = build_model(cfg)
        assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"], name
    one_b = param_counts(get_config("moe-1b"))
    assert 0.95e9 < one_b["total"] < 1.1e9
    cfg = get_config("moe-tiny")
    counts = param_counts(cfg)
    idle_experts = cfg.n_layers * (cfg.num_experts - cfg.top_k) * 3 * cfg.dim * cfg.ffn_dim
    assert counts["active_non_embedding"] == counts["non_embedding"] - idle_experts
    assert flops_per_token(cfg, 64) == 6.0 * counts["active_non_embedding"] + 12.0 * cfg.n_layers * cfg.dim * 64
    dense = param_counts(get_config("tiny"))
    assert dense["active_non_embedding"] == dense["non_embedding"]


def test_from_hf_reads_mixtral_experts():
    c = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=24, vocab_size=62, num_local_experts=4, num_experts_per_tok=2)
    cfg = LlamaConfig.from_hf(c, max_seq_len=32)
    assert (cfg.num_experts, cfg.top_k, cfg.ffn_dim) == (4, 2, 24)
    assert LlamaConfig.from_hf({k: v for k, v in c.items() if "expert" not in k}, 32).num_experts == 0


def test_sharding_units_with_and_without_expert_units():
    model = build()
    blocks = sharding_units(model)
    assert blocks == [model.tok_embeddings, *model.layers, model.output]
    experts = sharding_units(model, expert_units=True)
    first = model.layers[0]
    assert experts[1:3] == [first.feed_forward.experts, first]  # the experts module, then its block
    assert len(experts) == 2 + CFG.n_layers * 2


# --------------------------------------------------------------------------- two gloo ranks
COEF = 0.1  # a large load-balancing weight, so a wrong router gradient shows
TOL = 1e-5  # fp32 relative; a wrong or missing gradient is off by far more


def route_by_vocabulary_half(model: MoELlama) -> None:
    """Tokens of the lower half of the vocabulary go to experts 0 and 1, the upper half to 2 and 3.

    The embedding's first feature is +-4 by half (it dominates the normalised residual stream);
    each router reads only that feature. The margin keeps the routing fixed over a few steps.
    """
    with torch.no_grad():
        half = model.cfg.vocab_size // 2
        model.tok_embeddings.weight[:half, 0] = 4.0
        model.tok_embeddings.weight[half:, 0] = -4.0
        for layer in model.moe_layers():
            layer.router.weight.zero_()
            layer.router.weight[:, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0])


def batch(step: int, rank: int, ws: int, routing: str):
    """This rank's (tokens, targets) and the global batch, as ``ws`` equal row chunks."""
    g = torch.Generator().manual_seed(100 + step)
    half = CFG.vocab_size // 2
    rows = []
    for r in range(ws):
        # "split": rank r draws from vocabulary half r % 2 only, so the ranks use disjoint experts.
        low, high = ((r % 2) * half, (r % 2 + 1) * half) if routing == "split" else (0, CFG.vocab_size)
        rows.append(torch.randint(low, high, (2, 9), generator=g))
    full = torch.cat(rows)
    return full[:, :-1], full[:, 1:]


def local_loss(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) + COEF * model.aux_loss()


def moe_parity(rank, ws, routing="split", expert_units=False, placements="zero3", steps=3, per_expert=False):
    """AdamW steps of the sharded MoE model against an unsharded copy; returns the worst errors.

    The data-parallel objective is the mean over ranks of each rank's (cross entropy + COEF * aux
    loss on its own rows); the reference computes exactly that on one process, chunk by chunk.
    With routing "same" every rank gets the whole batch (identical routing everywhere); with
    "different" each rank gets its own rows of the batch, so the ranks route differently (with this
    many tokens every expert still gets some on every rank); with "split" they use disjoint experts.
    ``per_expert``: the test-local one module per expert (``PerExpertExperts``), each a unit of its
    own with ``expert_units``, so a rank skips the modules of experts its tokens do not reach.
    """
    model = build()
    if routing == "split":
        route_by_vocabulary_half(model)
    if per_expert:
        with_per_expert_modules(model)
    ref = copy.deepcopy(model)
    mesh = build_mesh("cpu", ws)
    if per_expert and expert_units:
        per_expert_units(model, mesh, resolve_placements(placements))
    parallelize(model, mesh, ParallelizeConfig(placements=placements, expert_units=expert_units and not per_expert))

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    opt, ref_opt = mfsdp.fully_shard_optimizer(model, adamw(model.parameters())), adamw(ref.parameters())
    errors, used = [], set()
    for step in range(steps):
        x, y = batch(step, rank, ws, routing)
        chunks = [(x, y)] * ws if routing == "same" else list(zip(x.chunk(ws), y.chunk(ws)))
        local_x, local_y = chunks[rank]
        if step == 0:  # which of the first layer's experts this rank's rows reach
            first = ref.layers[0].feed_forward
            hook = first.register_forward_pre_hook(
                lambda m, a: used.update(m.route(a[0].reshape(-1, a[0].shape[-1]))[1].flatten().tolist()))
            with torch.no_grad():
                ref(local_x)
            hook.remove()
        ref_loss = sum(local_loss(ref, cx, cy) for cx, cy in chunks) / ws
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = local_loss(model, local_x, local_y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    return dict(errors=errors, first_layer_experts=sorted(used))


@pytest.mark.parametrize("expert_units", [False, True], ids=["block_units", "expert_units"])
def test_parity_same_routing_on_every_rank(world, expert_units):
    results = world(2).run(moe_parity, timeout=85, routing="same", expert_units=expert_units)
    for r in results:
        assert max(r["errors"]) < TOL, r


@pytest.mark.parametrize("expert_units", [False, True], ids=["block_units", "expert_units"])
def test_parity_ranks_route_differently(world, expert_units):
    results = world(2).run(moe_parity, timeout=85, routing="different", expert_units=expert_units)
    for r in results:
        assert max(r["errors"]) < TOL, r


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per_expert"])
@pytest.mark.parametrize("expert_units", [False, True], ids=["block_units", "expert_units"])
def test_parity_ranks_skip_different_experts(world, expert_units, per_expert):
    results = world(2).run(moe_parity, timeout=85, routing="split", expert_units=expert_units, per_expert=per_expert)
    # The construction works: rank 0 routes (layer 0) only to experts 0 and 1, rank 1 to 2 and 3.
    assert [r["first_layer_experts"] for r in results] == [[0, 1], [2, 3]], results
    for r in results:
        assert max(r["errors"]) < TOL, r


@pytest.mark.parametrize("per_expert", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["stacked", "per_expert"])
def test_parity_ranks_skip_different_experts_zero2(world, per_expert):
    results = world(2).run(moe_parity, timeout=85, routing="split", placements="zero2", per_expert=per_expert)
    for r in results:
        assert max(r["errors"]) < TOL, r
