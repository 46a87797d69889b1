"""The manager on tiny Hugging Face mixtures of experts (Mixtral, Qwen2-MoE) at dp=2, against the
unsharded model trained on the full batch.

The two ranks get different rows, so they route their tokens differently. (transformers 5 keeps a
layer's experts in fused 3-D parameters and runs only the experts some token reached.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import full_params as full, max_rel_error
from test_manager_models import batch, optimizer_groups
from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
GRAD_TOL = 1e-5  # fp32 relative, the first step's gradients: a wrong or missing one is off by far more
TOL = 5e-5  # the weights after AdamW steps, as in test_manager_dist: Adam amplifies rounding differences


def make_moe(family: str, vocab: int = 62, seed: int = 0):
    """A two-layer MoE causal LM with random weights: 4 experts, 2 per token."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=False)
    torch.manual_seed(seed)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=12,
                                             shared_expert_intermediate_size=24, decoder_sparse_step=1,
                                             **common)
        return transformers.Qwen2MoeForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=12, head_dim=4, **common)
        return transformers.Qwen3MoeForCausalLM(config)
    raise ValueError(family)


def moe_parity(rank, ws, family="mixtral", steps=3, **config):
    """AdamW steps (two param groups) of the manager's model on this rank's rows against the
    unsharded model on the whole batch; returns the worst relative error of the first step's
    gradients, of the weights after each step, and the experts this rank's rows reached in the
    first layer."""
    model = make_moe(family)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ref = copy.deepcopy(model)
    ref_opt = optimizer_groups(ref)
    mesh = build_device_mesh("cpu")
    model, opt = MegatronFSDPManager(MegatronFSDPConfig(**config), mesh).parallelize(model, optimizer_groups(model))
    reached = set()
    router = ref.model.layers[0].mlp.gate
    hook = router.register_forward_hook(
        lambda m, args, out: reached.update(int(e) for e in (out[2] if isinstance(out, tuple) else out).flatten()))
    errors = []
    for step in range(steps):
        x = batch(step, size=4, seq=8)
        ref_opt.zero_grad()
        if step == 0:
            with torch.no_grad():
                ref(input_ids=x.chunk(ws)[rank])
            hook.remove()
        ref(input_ids=x, labels=x).loss.backward()
        ref_opt.step()
        local = x.chunk(ws)[rank]
        model(input_ids=local, labels=local).loss.backward()
        if step == 0:
            grads = {n: q.grad for n, q in model.named_parameters()}
            assert all(g is not None for g in grads.values()), sorted(n for n, g in grads.items() if g is None)
            grad_error = max_rel_error(
                {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()},
                {n: q.grad for n, q in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
        errors.append(max_rel_error(full(model), full(ref)))
    return dict(grad_error=grad_error, errors=errors, reached=sorted(reached))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("strategy", [3, 1])
def test_moe_parity_dp2(world, family, strategy):
    results = world(2).run(moe_parity, timeout=85, family=family, zero_dp_strategy=strategy)
    for r in results:
        assert r["grad_error"] < GRAD_TOL and max(r["errors"]) < TOL, r
        assert r["reached"], r


def test_moe_parity_dp2_experts_as_units(world):
    """The sparse MoE block (router and experts) as a unit of its own inside each decoder layer."""
    results = world(2).run(moe_parity, timeout=85, family="mixtral", megatron_fsdp_unit_modules=[
        "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer", "MixtralSparseMoeBlock"])
    for r in results:
        assert r["grad_error"] < GRAD_TOL and max(r["errors"]) < TOL, r
