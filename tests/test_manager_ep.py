"""Expert parallelism on the manager route (``MegatronFSDPConfig.ep_size``) with transformers 5's MoE
models, against the unsharded model on the full batch (every rank's rows): logits, loss, every
gradient (the split experts' included) and the weights after two AdamW steps, fp32 on gloo.

Routing forced (``force=True``): the last expert of each layer gets no token anywhere, and the last
rank's rows repeat one token, so all its tokens choose the same experts and it sends none to the rest.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from models import full_params as full, max_rel_error
from test_manager_models import optimizer_groups

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]
VOCAB = 64


def make_moe(family: str = "qwen3_moe", experts: int = 8, seed: int = 0, **extra):
    """A two-layer MoE causal LM with random weights: ``experts`` experts, 2 per token, hidden 32."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=False)
    common.update(extra)
    torch.manual_seed(seed)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=experts, **common))
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=experts, moe_intermediate_size=16, shared_expert_intermediate_size=48, decoder_sparse_step=1,
            **common))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=experts, moe_intermediate_size=16, head_dim=8, **common))


def rows(step: int, ws: int, force: bool) -> torch.Tensor:
    """The global batch, two rows a rank; with ``force`` the last rank's rows repeat one token."""
    x = torch.randint(0, VOCAB, (2 * ws, 8), generator=torch.Generator().manual_seed(100 + step))
    if force:
        x[-2:] = 7
    return x


def starve_last_expert(model) -> None:
    """Every router of ``model`` picks its top-k among all experts but the last (Qwen3 / Mixtral's
    routing rule: softmax, top-k, renormalised where the config says so)."""
    def hook(gate, args, out):
        logits = out[0].clone()
        logits[:, -1] = -1e4
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, gate.top_k, dim=-1)
        if getattr(gate, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return out[0], top.to(out[1].dtype), idx

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


def routed(model, x) -> list[torch.Tensor]:
    """Per layer, how many of ``x``'s (token, slot) pairs each expert got."""
    counts = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda g, a, out: counts.append(torch.bincount(out[2].flatten(), minlength=g.num_experts)))
        for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    return counts


def ep_parity(rank, ws, ep, family="qwen3_moe", force=False, steps=2, replicate=1, **config):
    """Forward, backward and AdamW steps of the manager's model at ``ep`` on this rank's rows
    against the unsharded model on all of them; the worst errors."""
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    model = make_moe(family)
    ref = copy.deepcopy(model)
    if force:
        starve_last_expert(model)
        starve_last_expert(ref)
    ref_opt = optimizer_groups(ref)
    manager = MegatronFSDPManager(MegatronFSDPConfig(ep_size=ep, **config),
                                 build_device_mesh("cpu", dp_replicate_size=replicate))
    model, opt = manager.parallelize(model, optimizer_groups(model))
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.device_mesh is not None and "ep" in experts.device_mesh.mesh_dim_names, experts.device_mesh
    out_split = (experts.device_mesh.mesh_dim_names, str(experts.placements), tuple(experts.to_local().shape))
    out = dict(logits=0.0, loss=0.0, grads=0.0, weights=[], split=out_split)
    for step in range(steps):
        x = rows(step, ws, force)
        local = x.chunk(ws)[rank]
        if step == 0:
            out["local_counts"] = [c.tolist() for c in routed(ref, local)]
            out["global_counts"] = [c.tolist() for c in routed(ref, x)]
        ref_out = ref(input_ids=x, labels=x)
        ref_out.loss.backward()
        mine = model(input_ids=local, labels=local)
        mine.loss.backward()
        loss = mine.loss.detach().clone()
        dist.all_reduce(loss)
        if step == 0:
            out["logits"] = float((mine.logits - ref_out.logits.chunk(ws)[rank]).abs().max())
            out["loss"] = abs(float(loss) / ws - float(ref_out.loss))
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for n, p in model.named_parameters()}
            out["grads"] = max_rel_error(grads, {n: p.grad for n, p in ref.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        out["weights"].append(max_rel_error(full(model), full(ref)))
    return out


def check(results, force=False):
    for r in results:
        assert r["logits"] < 1e-5 and r["loss"] < 1e-5, r
        assert r["grads"] < 1e-4 and max(r["weights"]) < 1e-4, r
    if force:
        for layer in results[0]["global_counts"]:
            assert layer[-1] == 0 and sum(layer) > 0, results[0]["global_counts"]
        assert any(0 in layer[:-1] for layer in results[-1]["local_counts"]), results[-1]["local_counts"]


def test_ep2_zero3_two_ranks(world):
    check(world(2).run(ep_parity, timeout=120, ep=2))


def test_ep2_forced_routing_two_ranks(world):
    check(world(2).run(ep_parity, timeout=120, ep=2, force=True, zero_dp_strategy=2), force=True)


def test_ep2_dp_shard2_four_ranks(world):
    """ep 2 x ep_shard 2: each expert FSDP-sharded over the two ranks that hold it."""
    check(world(4).run(ep_parity, timeout=120, ep=2))


@pytest.mark.slow
@pytest.mark.parametrize("ep,strategy,force", [(4, 3, False), (4, 2, False), (2, 2, False), (4, 3, True),
                                               (2, 3, True)])
def test_ep_four_ranks(world, ep, strategy, force):
    check(world(4).run(ep_parity, timeout=120, ep=ep, zero_dp_strategy=strategy, force=force), force=force)


@pytest.mark.slow
def test_ep2_hsdp_four_ranks(world):
    """Two replicas of (ep_shard 1 x ep 2): the experts' gradients averaged over both replicas too."""
    check(world(4).run(ep_parity, timeout=120, ep=2, replicate=2))


@pytest.mark.slow
def test_ep2_activation_checkpointing(world):
    """The experts' units (and their all-to-alls) inside the recomputed decoder layers."""
    check(world(2).run(ep_parity, timeout=120, ep=2, activation_checkpointing=True))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_ep2_other_families(world, family):
    check(world(2).run(ep_parity, timeout=120, ep=2, family=family, force=True), force=True)


def aux_loss_case(rank, ws, ep, through_train_step=True, **config):
    """The manager route's load-balancing loss: the objective's cross entropy plus ``aux_loss_coef *
    aux_loss()`` against transformers' own loss with labels and router logits on this rank's rows;
    then one ``train_step`` (which adds it; or, ``through_train_step=False``, the same sum by hand,
    without its gradient clipping) against AdamW on the mean of transformers' per-rank losses."""
    from mfsdp.data import Batch
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
    from mfsdp.train.loop.step import train_step
    from mfsdp.train.objectives.causal_lm import CausalLM

    model = make_moe(output_router_logits=True, router_aux_loss_coef=0.05)
    ref = copy.deepcopy(model)
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(ep_size=ep, **config), build_device_mesh("cpu")).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = rows(0, ws, False)
    local = x.chunk(ws)[rank]
    batch = Batch(local, torch.cat([local[:, 1:], torch.full_like(local[:, :1], -100)], dim=1))
    with torch.no_grad():
        loss_sum, count, _ = CausalLM()(model, batch, torch.device("cpu"))
        ours = loss_sum / count + model.aux_loss_coef * model.aux_loss()
        theirs = ref(input_ids=local, labels=local, output_router_logits=True)
    out = dict(loss=abs(float(ours) - float(theirs.loss)), aux=float(model.aux_loss()),
               aux_err=abs(float(model.aux_loss()) - float(theirs.aux_loss)))
    if through_train_step:
        step_aux = train_step(model, opt, CausalLM(), lambda micro: batch, 1, int(count) * ws, 1e-2, 0.0,
                              model.aux_loss_coef, False, torch.device("cpu")).aux_loss
    else:
        loss_sum, count, _ = CausalLM()(model, batch, torch.device("cpu"))
        step_aux = model.aux_loss().detach().clone()
        (loss_sum / count + model.aux_loss_coef * model.aux_loss()).backward()
        opt.step()
        dist.all_reduce(step_aux)
    for r in range(ws):
        rows_r = x.chunk(ws)[r]
        (ref(input_ids=rows_r, labels=rows_r, output_router_logits=True).loss / ws).backward()
    ref_opt.step()
    aux_all = torch.tensor(out["aux"])
    dist.all_reduce(aux_all)
    out.update(step_aux=abs(float(step_aux) - float(aux_all)), weights=max_rel_error(full(model), full(ref)))
    return out


def check_aux(results):
    for r in results:
        assert r["loss"] < 1e-6 and r["aux_err"] < 1e-6 and r["step_aux"] < 1e-6, r
        assert r["weights"] < 1e-4, r


def test_aux_loss_as_transformers_adds_it_at_ep_1_and_2(world):
    """Routing is local, so each rank's load-balancing loss is the same whether the experts are split."""
    w = world(2)
    one = w.run(aux_loss_case, timeout=120, ep=1)
    two = w.run(aux_loss_case, timeout=120, ep=2, through_train_step=False)
    check_aux(one)
    check_aux(two)
    assert [r["aux"] for r in one] == pytest.approx([r["aux"] for r in two], abs=1e-6, rel=0)


@pytest.mark.slow
def test_aux_loss_with_activation_checkpointing(world):
    check_aux(world(2).run(aux_loss_case, timeout=120, ep=2, through_train_step=False, activation_checkpointing=True))


def _norm_per_mesh() -> bool:
    from mfsdp.train.loop import step

    return hasattr(step, "global_grad_norm")


@pytest.mark.skipif(not _norm_per_mesh(), reason="train_step's gradient norm stacks the norms of gradients on two "
                    "meshes (the experts' and the dense one), which torch refuses; main's step.py takes one per mesh")
def test_train_step_at_ep2(world):
    """``train_step`` itself (its gradient norm over the experts' and the dense meshes included) at ep 2."""
    check_aux(world(2).run(aux_loss_case, timeout=120, ep=2))


def refusals(rank, ws):
    """What the manager says to an ep it cannot run: each one line naming the fix."""
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    out = {}
    for key, ep, mesh, model in (("dp_shard", 4, {}, None), ("tp", 2, {"tp_size": 2}, None),
                                 ("experts", 2, {}, make_moe(experts=3)), ("dense", 2, {}, "dense")):
        try:
            manager = MegatronFSDPManager(MegatronFSDPConfig(ep_size=ep), build_device_mesh("cpu", **mesh))
            if model == "dense":
                model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8))
            manager.parallelize(model)
            out[key] = "no error"
        except ValueError as err:
            out[key] = str(err)
    return out


def test_ep_refusals(world):
    r = world(2).run(refusals, timeout=60)[0]
    assert "ep_size=4 must divide the mesh's dp_shard size 2" in r["dp_shard"], r
    assert "tensor or context parallelism is not supported" in r["tp"] and "tp_size=1" in r["tp"], r
    assert "ep_size 2 must divide the model's 3 experts per layer" in r["experts"], r
    assert "has no stacked experts" in r["dense"] and "set ep_size=1" in r["dense"], r
    assert all("\n" not in line for line in r.values()), r


def test_ep_size_is_validated():
    from mfsdp.manager import MegatronFSDPConfig

    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ep_size must be a positive integer"):
            MegatronFSDPConfig(ep_size=bad)


def full_state_dict_case(rank, ws, ep):
    """``load_state_dict`` of full tensors into the split experts: each rank keeps its own block."""
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    model = make_moe()
    other = make_moe(seed=1)
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(ep_size=ep), build_device_mesh("cpu")).parallelize(model)
    model.load_state_dict(other.state_dict())
    return max_rel_error(full(model), full(other))


def test_full_state_dict_loads_into_split_experts(world):
    assert max(world(4).run(full_state_dict_case, timeout=60, ep=2)) == 0.0
