"""The manager's tensor parallel with sequence parallel and a vocabulary-parallel loss, on CPU (gloo).

Both activation paths (``tp_activation_path``): ``local`` (the default: local tensors and explicit
collectives, :mod:`mfsdp.manager.tp_local`) and ``dtensor`` (torch's ParallelStyles).

Parity: tp=2 and tp=2 x dp=2 against the unsharded HF model trained on the full batch (fp32, SGD
with momentum in two parameter groups); the step-0 gradients are the direct check (1e-5
relative), the parameters after three steps the cumulative one. SGD rather than AdamW: Adam's
update has about the size of lr whatever the gradient's, so a rounding-level gradient difference
on a near-zero element becomes a 2 x lr parameter error, while SGD keeps the error in proportion. Layout: with sequence parallel the activations between decoder layers
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
from test_manager_models import batch, make_hf
from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

pytest.importorskip("transformers")
VOCAB, SEQ = 64, 8  # vocab rows and the sequence divide by tp (and by dp x tp for the row shards)
GRAD_TOL = 1e-5     # step-0 gradients, fp32
PARAM_TOL = 1e-5    # after 3 SGD steps, relative


def optimizer_groups(model, lr=0.5):
    """SGD with momentum in two groups with different settings, to prove the manager keeps them."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.SGD([{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "lr": lr * 0.5}],
                           lr=lr, momentum=0.9)


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().float().clone()
            for n, p in model.named_parameters()}


def _model(family, dtype=torch.float32):
    if family != "qwen3":
        return make_hf(family, vocab=VOCAB, tied=family == "llama", dtype=dtype)
    import transformers  # per-head q_norm / k_norm: their weights see only this rank's heads

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_cache=False, max_position_embeddings=64)).to(dtype)


def parity(rank, ws, family="llama", steps=3, tp=2, bf16=False, **config):
    """Losses, the step-0 gradient error and the parameter errors per step, against the full batch.

    ``bf16``: the model computes in bf16 (fp32 main weights); the reference is the same bf16-rounded
    weights in fp32."""
    model = _model(family, torch.bfloat16 if bf16 else torch.float32)
    ref = copy.deepcopy(model).float()
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
    out["params"] = full(model)
    return out


CASES = {
    "sp+loss": dict(sequence_parallel=True, loss_parallel=True),
    "sp": dict(sequence_parallel=True),
    "loss": dict(loss_parallel=True),
    "plain": {},
}


PATHS = ("local", "dtensor")
BF16_TOLS = dict(grad_tol=3e-2, param_tol=None, loss_tol=2e-3)
"""bf16 compute against the fp32 reference: the step-0 gradients are the direct check (a wrong one,
a missed reduction or a wrong shard, is off by O(1); bf16 rounding by ~1e-2). The parameters after
the steps carry bf16's rounding of every step, so the local path's are held to the DTensor path's,
computed with the same bf16 roundings."""
PATHS_TOL = 1e-3  # local against DTensor parameters after the bf16 steps (a wrong gradient: > 0.1)


def _check(out, grad_tol=GRAD_TOL, param_tol=PARAM_TOL, loss_tol=1e-5):
    assert out["grad_error"] < grad_tol, {k: v for k, v in out.items() if k != "params"}
    if param_tol is not None:
        assert max(out["param_errors"]) < param_tol, {k: v for k, v in out.items() if k != "params"}
    for mine, ref in out["losses"]:
        assert abs(mine - ref) < loss_tol * abs(ref), out["losses"]


def _check_bf16_paths(world_size, **kwargs):
    local, dtensor = (world_size.run(parity, bf16=True, tp_activation_path=p, **kwargs)[0] for p in PATHS)
    _check(local, **BF16_TOLS)
    _check(dtensor, **BF16_TOLS)
    assert max_rel_error(local["params"], dtensor["params"]) < PATHS_TOL


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_parity_tp2(world, case, path):
    _check(world(2).run(parity, tp_activation_path=path, **CASES[case])[0])


@pytest.mark.parametrize("path", PATHS)
def test_parity_tp2_qwen3_head_norms(world, path):
    _check(world(2).run(parity, family="qwen3", tp_activation_path=path, **CASES["sp+loss"])[0])


@pytest.mark.parametrize("family,case", [("llama", "sp+loss"), ("llama", "plain"), ("qwen3", "sp+loss")])
def test_parity_tp2_bf16(world, family, case):
    _check_bf16_paths(world(2), family=family, **CASES[case])


@pytest.mark.parametrize("family,strategy,path", [("llama", 3, "local"), ("qwen2", 1, "local"),
                                                  ("llama", 3, "dtensor")])
def test_parity_tp2_dp2(world, family, strategy, path):
    _check(world(4).run(parity, family=family, zero_dp_strategy=strategy, tp_activation_path=path,
                        **CASES["sp+loss"])[0])


def test_parity_tp2_dp2_bf16(world):
    _check_bf16_paths(world(4), **CASES["sp+loss"])


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

    inputs = []

    def before(module, args, kwargs):  # prepended: the input as the previous module left it
        inputs.append(describe(args[0] if args else kwargs["hidden_states"]))

    def hook(module, args, kwargs, output):
        seen.append((type(module).__name__, inputs.pop(), describe(output)))

    for module in (*model.model.layers, model.model.norm):
        module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
        module.register_forward_hook(hook, with_kwargs=True)
    x = batch(0, seq=SEQ, vocab=VOCAB)
    with model.loss_context():
        out = model(input_ids=x, labels=x)
        out.loss.backward()
    return seen, describe(out.logits)


@pytest.mark.parametrize("path", PATHS)
def test_sequence_parallel_activations_are_sharded(world, path):
    seen, logits = world(2).run(layouts, sequence_parallel=True, loss_parallel=True, tp_activation_path=path)[0]
    assert len(seen) == 4  # three decoder layers and the final norm
    for name, into, out in seen:
        for kind, placements, shape, local in (into, out):
            assert kind == "DTensor" and placements == ["S(1)"], (name, into, out)
            assert shape == (4, SEQ, 16) and local == (4, SEQ // 2, 16), (name, into, out)
    # vocabulary-sharded logits: the full (4, SEQ, VOCAB) never exists on a rank
    assert logits == ("DTensor", ["S(2)"], (4, SEQ, VOCAB), (4, SEQ, VOCAB // 2)), logits


@pytest.mark.parametrize("path", PATHS)
def test_plain_tp_activations_are_local_and_replicated(world, path):
    seen, logits = world(2).run(layouts, tp_activation_path=path)[0]
    assert all(into == ("Tensor", None, (4, SEQ, 16), (4, SEQ, 16)) for _, into, _ in seen), seen
    assert logits == ("Tensor", None, (4, SEQ, VOCAB), (4, SEQ, VOCAB)), logits


# ----------------------------------------------------------------------------- communication
def plan_collectives(rank, ws, family="llama", **flags):
    """Collectives of one forward and one backward of the built-in plan alone (no FSDP), by kind."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.manager.tp_local import count_forward_backward
    from mfsdp.manager.tp_plans import apply_tp_plan, loss_context, select_tp_plan

    model = make_hf(family, vocab=VOCAB, tied=family == "llama")
    apply_tp_plan(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)), select_tp_plan(model, **flags))
    x = batch(0, seq=SEQ, vocab=VOCAB)
    with loss_context(flags.get("loss_parallel", False)):
        counts = [dict(c.counts) for c in count_forward_backward(lambda: model(input_ids=x, labels=x).loss)]
    return counts


@pytest.mark.parametrize("flags,forward,backward", [
    # 2 layers x (attention, MLP) + embedding: one reduce-scatter per output, one all-gather per input
    # (+ the head's input); the loss adds three scalar-sized all-reduces and gathers no logits.
    ({"sequence_parallel": True, "loss_parallel": True},
     {"reduce_scatter": 5, "all_gather": 5, "all_reduce": 3},
     {"reduce_scatter": 5, "all_gather": 5}),
    ({"sequence_parallel": True},
     {"reduce_scatter": 5, "all_gather": 6},  # + the logits' all-gather
     {"reduce_scatter": 5, "all_gather": 5}),
    # Plain TP: one all-reduce per sub-layer input gradient in backward, not one per projection
    # (q, k, v, gate, up each wrapping the input would make 2 x 5 + 1 = 11).
    ({}, {"all_reduce": 5, "all_gather": 1}, {"all_reduce": 5}),
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


# ------------------------------------------------------------------------- the local path
def step_collectives(rank, ws, path, sp=True, loss_parallel=True):
    """benchmarks/tp_host_overhead.py's count of one manager step: per layer and outside the layers."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import tp_host_overhead as bench

    argv = ["--layers", "3", "--hidden", "16", "--heads", "4", "--kv-heads", "2", "--vocab", str(VOCAB),
            "--seq", str(SEQ)] + ([] if sp else ["--no-sp"]) + ([] if loss_parallel else ["--no-loss-parallel"])
    args = bench.parse(argv)
    ids = batch(0, seq=SEQ, vocab=VOCAB)
    full, one = (bench.count(args, path, n, ws, ids) for n in (3, 1))
    out = {}
    for phase in ("forward", "backward"):
        layer = bench.per_layer(full[phase], one[phase], 3)
        out[phase] = {k: v for k, v in layer.items() if v}
        out[phase + "_outside"] = {k: one[phase].get(k, 0) - layer.get(k, 0) for k in one[phase] if one[phase][k]}
        out[phase + "_dtensor_ops"] = (full[phase + "_dtensor_ops"] - one[phase + "_dtensor_ops"]) / 2
    return out


@pytest.mark.parametrize("sp,loss_parallel,expected", [
    # Per layer, the minimum: forward one all-gather before attention and one before the MLP, one
    # reduce-scatter after each; backward their adjoints, and the two norm weights' partial
    # gradients summed over tp (one coalesced all-reduce for the block's group, by mfsdp). Outside
    # the layers: the embedding
    # (RS / AG), the head (AG / RS), the parallel loss (3 scalar-sized AR), the final norm's
    # gradient and the NaN check (AR each).
    (True, True, {"forward": {"all_gather": 2, "reduce_scatter": 2},
                  "backward": {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1},
                  "forward_outside": {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 3},
                  "backward_outside": {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}}),
    # Plain TP: one all-reduce per sub-layer output (forward) and input gradient (backward); the
    # norms see the whole sequence, so their gradients need none. Outside: the embedding's sum, the
    # logits' all-gather; the head's input gradient and the NaN check.
    (False, False, {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2},
                    "forward_outside": {"all_reduce": 1, "all_gather": 1},
                    "backward_outside": {"all_reduce": 2}}),
])
def test_local_path_collectives_are_the_minimum(world, sp, loss_parallel, expected):
    out = world(2).run(step_collectives, path="local", sp=sp, loss_parallel=loss_parallel)[0]
    assert {k: out[k] for k in expected} == expected, out
    # the per-layer DTensor dispatches left (grad wrapping, the norm-grad redistribution) are few;
    # the DTensor path dispatches ~150 ops per layer
    assert out["forward_dtensor_ops"] + out["backward_dtensor_ops"] <= 12, out


def test_dtensor_path_has_the_same_collectives(world):
    local, dtensor = (world(2).run(step_collectives, path=p)[0] for p in PATHS)
    assert {k: v for k, v in local.items() if "ops" not in k} == {k: v for k, v in dtensor.items() if "ops" not in k}
    assert dtensor["forward_dtensor_ops"] + dtensor["backward_dtensor_ops"] > 50, dtensor


def placements(rank, ws, family):
    """Parameter placements and local shapes of both paths (no FSDP), and whether ``to_local()`` of
    an mfsdp-unsharded weight is a view (two calls share memory)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.manager.tp_plans import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    out = {}
    for path in PATHS:
        model = _model(family)
        assert apply_tensor_parallel(model, mesh, sequence_parallel=True, loss_parallel=True,
                                     activation_path=path) == path
        out[path] = {n: ([str(x) for x in p.placements], tuple(p.to_local().shape))
                     for n, p in model.named_parameters(remove_duplicate=False)}
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(sequence_parallel=True),
                                   build_device_mesh("cpu", tp_size=2)).parallelize(_model(family))
    views = []

    def hook(module, args):
        a, b = module.weight.to_local(), module.weight.to_local()
        views.append(a.data_ptr() == b.data_ptr() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())

    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(hook)
    model(input_ids=batch(0, seq=SEQ, vocab=VOCAB))
    out["views"] = views
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_local_path_has_the_dtensor_placements(world, family):
    out = world(2).run(placements, family=family)[0]
    assert out["local"] == out["dtensor"]
    assert out["views"] == [True], out["views"]


def bad_inputs(rank, ws):
    out = {}
    cases = {"heads": dict(heads=1, kv_heads=1), "vocab": dict(vocab=VOCAB - 1)}
    for name, kwargs in cases.items():
        model = make_hf(**{"vocab": VOCAB, **kwargs})
        try:
            MegatronFSDPManager(MegatronFSDPConfig(), build_device_mesh("cpu", tp_size=2)).parallelize(model)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        MegatronFSDPConfig(tp_activation_path="fast")
        out["config"] = "no error"
    except ValueError as exc:
        out["config"] = str(exc)
    return out


def test_local_path_bad_inputs(world):
    out = world(2).run(bad_inputs)[0]
    assert "tensor parallel size 2 must divide num_attention_heads=1, num_key_value_heads=1" in out["heads"], out
    assert "tp_activation_path='local' needs vocab_size=63 divisible by the tensor-parallel size 2" in out["vocab"], out
    assert "tp_activation_path must be 'local' or 'dtensor', got 'fast'" in out["config"], out
