"""The manager's tensor parallel with sequence parallel and a vocabulary-parallel loss, on CPU (gloo).

Parity: tp=2 and tp=2 x dp=2 against the unsharded HF model trained on the full batch (fp32,
AdamW); the step-0 gradients are the direct check (1e-5 relative), the parameters after three
steps the cumulative one. Layout: with sequence parallel the activations between decoder layers
are ``Shard(1)`` DTensors holding seq/tp tokens per rank, and with the parallel loss the logits
stay vocabulary-sharded. Communication: the plan's collectives per step are exactly Megatron's
(one all-gather or all-reduce per sub-layer input, one reduce-scatter or all-reduce per output).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from models import full_params as full, max_rel_error
from test_manager_models import batch, make_hf, optimizer_groups
from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

pytest.importorskip("transformers")
VOCAB, SEQ = 64, 8  # vocab rows and the sequence divide by tp (and by dp x tp for the row shards)
GRAD_TOL = 1e-5     # step-0 gradients, fp32
PARAM_TOL = 1e-4    # after 3 AdamW steps: Adam turns rounding-level gradient differences into ~lr steps
                    # (as the TP cases of test_manager_dist.py)


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().float().clone()
            for n, p in model.named_parameters()}


def _model(family):
    if family != "qwen3":
        return make_hf(family, vocab=VOCAB, tied=family == "llama")
    import transformers  # per-head q_norm / k_norm: their weights see only this rank's heads

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False, max_position_embeddings=64))


def parity(rank, ws, family="llama", steps=3, tp=2, **config):
    """Losses, the step-0 gradient error and the parameter errors per step, against the full batch."""
    model = _model(family)
    ref = copy.deepcopy(model)
    ref_opt = optimizer_groups(ref)
    mesh = build_device_mesh("cpu", tp_size=tp)
    model, opt = MegatronFSDPManager(MegatronFSDPConfig(**config), mesh).parallelize(model, optimizer_groups(model))
    dp = ws // tp
    out = {"losses": [], "param_errors": []}
    for step in range(steps):
        x = batch(step, seq=SEQ, vocab=VOCAB)
        ref_opt.zero_grad()
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        local = x.chunk(dp)[rank // tp]  # tp is the innermost mesh dim
        with model.loss_context():
            loss = model(input_ids=local, labels=local).loss
            loss.backward()
        if step == 0:
            model.finish_grad_sync()
            out["grad_error"] = max_rel_error(_grads(model), {n: p.grad.float() for n, p in ref.named_parameters()})
        mean = torch.tensor(float(loss.detach()))
        dist.all_reduce(mean)
        out["losses"].append((float(mean) / ws, float(ref_loss)))
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        out["param_errors"].append(max_rel_error(full(model), full(ref)))
    return out


CASES = {
    "sp+loss": dict(sequence_parallel=True, loss_parallel=True),
    "sp": dict(sequence_parallel=True),
    "loss": dict(loss_parallel=True),
    "plain": {},
}


def _check(out):
    assert out["grad_error"] < GRAD_TOL, out
    assert max(out["param_errors"]) < PARAM_TOL, out
    for mine, ref in out["losses"]:
        assert abs(mine - ref) < 1e-5 * abs(ref), out["losses"]


@pytest.mark.parametrize("case", list(CASES))
def test_parity_tp2(world, case):
    _check(world(2).run(parity, **CASES[case])[0])


def test_parity_tp2_qwen3_head_norms(world):
    _check(world(2).run(parity, family="qwen3", **CASES["sp+loss"])[0])


@pytest.mark.parametrize("family,strategy", [("llama", 3), ("qwen2", 1)])
def test_parity_tp2_dp2(world, family, strategy):
    _check(world(4).run(parity, family=family, zero_dp_strategy=strategy, **CASES["sp+loss"])[0])


def test_parity_tp2_dp2_checkpointed_double_buffer(world):
    _check(world(4).run(parity, activation_checkpointing=True, fsdp_double_buffer=True, **CASES["sp+loss"])[0])


# ------------------------------------------------------------------------------------ layouts
def layouts(rank, ws, **config):
    """What flows between the decoder layers, into the final norm and out of the head."""
    from torch.distributed.tensor import DTensor

    model = make_hf("llama", vocab=VOCAB, tied=True, layers=3)
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(**config), build_device_mesh("cpu", tp_size=2)).parallelize(model)
    seen = []

    def describe(t):
        if isinstance(t, DTensor):
            return ("DTensor", [str(p) for p in t.placements], tuple(t.shape), tuple(t.to_local().shape))
        return ("Tensor", None, tuple(t.shape), tuple(t.shape))

    def hook(module, args, kwargs, output):
        seen.append((type(module).__name__, describe(args[0] if args else kwargs["hidden_states"]), describe(output)))

    for layer in model.model.layers:
        layer.register_forward_hook(hook, with_kwargs=True)
    model.model.norm.register_forward_hook(hook, with_kwargs=True)
    x = batch(0, seq=SEQ, vocab=VOCAB)
    with model.loss_context():
        out = model(input_ids=x, labels=x)
        out.loss.backward()
    return seen, describe(out.logits)


def test_sequence_parallel_activations_are_sharded(world):
    seen, logits = world(2).run(layouts, sequence_parallel=True, loss_parallel=True)[0]
    assert len(seen) == 4  # three decoder layers and the final norm
    for name, into, out in seen:
        for kind, placements, shape, local in (into, out):
            assert kind == "DTensor" and placements == ["S(1)"], (name, into, out)
            assert shape == (4, SEQ, 16) and local == (4, SEQ // 2, 16), (name, into, out)
    # vocabulary-sharded logits: the full (4, SEQ, VOCAB) never exists on a rank
    assert logits == ("DTensor", ["S(2)"], (4, SEQ, VOCAB), (4, SEQ, VOCAB // 2)), logits


def test_plain_tp_activations_are_local_and_replicated(world):
    seen, logits = world(2).run(layouts)[0]
    assert all(into == ("Tensor", None, (4, SEQ, 16), (4, SEQ, 16)) for _, into, _ in seen), seen
    assert logits == ("Tensor", None, (4, SEQ, VOCAB), (4, SEQ, VOCAB)), logits


# ----------------------------------------------------------------------------- communication
def plan_collectives(rank, ws, family="llama", **flags):
    """Collectives of one forward and one backward of the built-in plan alone (no FSDP), by kind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from mfsdp.manager.tp_plans import apply_tp_plan, loss_context, select_tp_plan

    model = make_hf(family, vocab=VOCAB, tied=family == "llama")
    apply_tp_plan(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)), select_tp_plan(model, **flags))
    x = batch(0, seq=SEQ, vocab=VOCAB)
    counts = []
    with loss_context(flags.get("loss_parallel", False)):
        for run in ("forward", "backward"):
            with CommDebugMode() as mode:
                if run == "forward":
                    loss = model(input_ids=x, labels=x).loss
                else:
                    loss.backward()
            counts.append({str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()})
    return counts


@pytest.mark.parametrize("flags,forward,backward", [
    # 2 layers x (attention, MLP) + embedding: one reduce-scatter per output, one all-gather per input
    # (+ the head's input); the loss adds three scalar-sized all-reduces and gathers no logits.
    ({"sequence_parallel": True, "loss_parallel": True},
     {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5, "all_reduce": 3},
     {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5}),
    ({"sequence_parallel": True},
     {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 6},  # + the logits' all-gather
     {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5}),
    # Plain TP: one all-reduce per sub-layer input gradient in backward, not one per projection
    # (q, k, v, gate, up each wrapping the input would make 2 x 5 + 1 = 11).
    ({}, {"all_reduce": 5, "all_gather_into_tensor": 1}, {"all_reduce": 5}),
])
def test_plan_collectives(world, flags, forward, backward):
    assert world(2).run(plan_collectives, **flags)[0] == [forward, backward]


# ---------------------------------------------------------------------------------- errors
def errors(rank, ws):
    out = {}
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(sequence_parallel=True),
                                   build_device_mesh("cpu", tp_size=2)).parallelize(make_hf(vocab=VOCAB))
    try:
        model(input_ids=batch(0, seq=7, vocab=VOCAB))
        out["odd_seq"] = "no error"
    except ValueError as exc:
        out["odd_seq"] = str(exc)
    out["null_context"] = type(MegatronFSDPManager(MegatronFSDPConfig(), build_device_mesh("cpu"))
                               .loss_context()).__name__
    for flag in ("sequence_parallel", "loss_parallel"):
        try:
            MegatronFSDPManager(MegatronFSDPConfig(**{flag: True}), build_device_mesh("cpu"))
            out[flag] = "no error"
        except ValueError as exc:
            out[flag] = str(exc)
    return out


def test_errors(world):
    out = world(2).run(errors)[0]
    assert "sequence length 7 does not divide by the tensor-parallel size 2" in out["odd_seq"], out
    assert out["null_context"] == "nullcontext", out
    assert "loss_parallel=True needs a mesh with tp > 1" in out["loss_parallel"], out
    assert "sequence_parallel=True needs a mesh with tp > 1" in out["sequence_parallel"], out
