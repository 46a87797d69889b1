"""MegatronFSDPManager on tiny HF Llama/Qwen2 models over gloo (persistent worlds of 1, 2 and 4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import mfsdp
from models import full_params as full, max_rel_error
from test_manager_models import batch, make_hf, optimizer_groups
from mfsdp.manager import (MegatronFSDPConfig, MegatronFSDPManager, NonFiniteGradientError, build_device_mesh,
                           fully_shard_optimizer, maybe_shard_optimizer, precision_policy,
                           restore_distributed_param_attrs, snapshot_distributed_param_attrs)
from mfsdp.optimizer import _BOUND_OPTIMIZERS  # bound by the core's fully_shard_optimizer

pytest.importorskip("transformers")
TOL = 5e-5  # fp32; Adam amplifies the summation-order differences of split batches


def _manager(**kwargs):
    replicate = kwargs.get("dp_replicate_size") or 1
    mesh = build_device_mesh("cpu", dp_replicate_size=replicate, tp_size=kwargs.get("tp_size") or 1)
    return MegatronFSDPManager(MegatronFSDPConfig(**kwargs), mesh)


# ------------------------------------------------------------------------------------- parity
def train_parity(rank, ws, family="llama", bind="pre", steps=3, layers=2, **config):
    """3 AdamW steps (two param groups) vs the unsharded HF model on the full batch."""
    # HFSDP and TP-over-dim-0 shards need rows divisible by the shard count; 62 tests the padding.
    vocab = 64 if config.get("outer_dp_sharding_strategy") or config.get("tp_size") else 62
    model = make_hf(family, vocab=vocab, tied=family == "llama", layers=layers)
    ref = copy.deepcopy(model)
    ref_opt = optimizer_groups(ref)
    manager = _manager(**config)
    if bind == "pre":  # built before parallelize: re-pointed at the shards, groups kept
        model, opt = manager.parallelize(model, optimizer_groups(model))
    else:
        model, none = manager.parallelize(model)
        assert none is None
        opt = optimizer_groups(model)
        if bind == "post":
            fully_shard_optimizer(model, opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    errors = []
    for step in range(steps):
        x = batch(step, vocab=vocab)
        ref_opt.zero_grad()
        ref(input_ids=x, labels=x).loss.backward()
        ref_opt.step()
        tp = config.get("tp_size") or 1  # tp is the innermost mesh axis: ranks r*tp..r*tp+tp-1 share data
        local = x.chunk(ws // tp)[rank // tp]
        model(input_ids=local, labels=local).loss.backward()
        if bind == "none":  # the optimizer-less loop of the seed
            model.finish_grad_sync()
            opt.step()
            model.install_optimized_model_weights()
            opt.zero_grad()
            model.zero_grad_buffer()
        else:
            opt.step()
            opt.zero_grad()
        errors.append(max_rel_error(full(model), full(ref)))
    return errors


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_parity_dp2(world, family, strategy):
    errors = world(2).run(train_parity, family=family, zero_dp_strategy=strategy)[0]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parity_hsdp_world4(world, family):
    errors = world(4).run(train_parity, family=family, dp_replicate_size=2, zero_dp_strategy="optim_grads_params")[0]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", [3, 1])
def test_parity_tp2_dp2(world, family, strategy):
    errors = world(4).run(train_parity, family=family, tp_size=2, zero_dp_strategy=strategy)[0]
    # Row-parallel layers sum partial products in another order, so fp32 rounding grows a little;
    # a wrong gradient would be off by orders of magnitude more.
    assert max(errors) < 2 * TOL, errors


def test_parity_hfsdp_world4(world):
    errors = world(4).run(train_parity, dp_replicate_size=2, outer_dp_sharding_strategy="optim")[0]
    assert max(errors) < TOL, errors


def test_parity_world1_same_path(world):
    errors = world(1).run(train_parity, bind="post")[0]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("bind", ["post", "none"])
def test_parity_optimizer_modes(world, bind):
    errors = world(2).run(train_parity, family="qwen2", bind=bind, zero_dp_strategy="optim_grads")[0]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("flags", [
    {"overlap_grad_reduce": False, "overlap_param_gather": False, "disable_bucketing": True},
    {"overlap_param_gather": False, "zero_dp_strategy": 1},  # one False is enough for synchronous
])
def test_parity_synchronous_and_unbucketed(world, flags):
    errors = world(2).run(train_parity, **flags)[0]
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("ws,flags", [
    (2, {"activation_checkpointing": True}),
    (4, {"tp_size": 2}),  # tensor-parallel DTensors re-pointed into the shared buffers
])
def test_parity_double_buffer(world, ws, flags):
    # Four decoder layers share two persistent gather buffers, two layers per buffer.
    errors = world(ws).run(train_parity, layers=4, fsdp_double_buffer=True, **flags)[0]
    assert max(errors) < 2 * TOL, errors


def test_parity_activation_checkpointing_and_units(world):
    errors = world(2).run(train_parity, activation_checkpointing=True,
                          megatron_fsdp_unit_modules=["transformers.models.llama.modeling_llama.LlamaDecoderLayer",
                                                      "LlamaMLP"])[0]
    assert max(errors) < TOL, errors


# -------------------------------------------------------------------------------- bf16 dtype
def bf16_model_dtype(rank, ws, preserve=True, fp32_grads=True):
    model = make_hf("llama", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    model, _ = _manager(preserve_fp32_weights=preserve, grad_reduce_in_fp32=fp32_grads).parallelize(model)
    param_dtype = next(model.parameters()).dtype
    x = batch(0)
    mask = torch.ones_like(x)
    mask[:, :2] = 0  # left padding: exercises the HF mask path, which reads the compute dtype
    with torch.no_grad():
        got = model(input_ids=x, attention_mask=mask).logits
        want = ref(input_ids=x, attention_mask=mask).logits
    opt = fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    local = x.chunk(ws)[rank]
    model(input_ids=local, labels=local).loss.backward()
    grad_dtype = next(model.parameters()).grad.dtype
    opt.step()
    return (str(model.dtype), str(param_dtype), str(got.dtype), bool(torch.equal(got, want)), str(grad_dtype),
            bool(torch.isfinite(model(input_ids=x).logits).all()))


def test_bf16_model_computes_in_bf16(world):
    dtype, param, logits, equal, grad, finite = world(2).run(bf16_model_dtype)[0]
    assert (dtype, param, logits, grad) == ("torch.bfloat16", "torch.float32", "torch.bfloat16", "torch.float32")
    assert equal and finite
    dtype, param, logits, equal, grad, finite = world(2).run(bf16_model_dtype, preserve=False, fp32_grads=False)[0]
    assert (dtype, param, logits, grad) == ("torch.bfloat16",) * 4
    assert equal and finite


# ------------------------------------------------------------------------------ loss scaling
def loss_scaling(rank, ws, **config):
    """Per-token loss: each rank's loss is its token-sum over the *global* token count."""
    model = make_hf("llama")
    ref = copy.deepcopy(model)
    x = batch(0)
    total = x[:, 1:].numel()

    def token_loss(m, ids):
        logits = m(input_ids=ids).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="sum") / total

    token_loss(ref, x).backward()
    model, _ = _manager(**config).parallelize(model)
    token_loss(model, x.chunk(ws)[rank]).backward()
    model.finish_grad_sync()
    model.finish_grad_sync()  # once per step: a second call does not scale again
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    return {scale: max_rel_error({n: g * scale for n, g in got.items()}, want) for scale in (1, ws)}


@pytest.mark.parametrize("mode,strategy", [("default", 3), ("average_in_collective", 3),
                                           ("calculate_per_token_loss", 3), ("calculate_per_token_loss", 0)])
def test_loss_scaling(world, mode, strategy):
    config = {"zero_dp_strategy": strategy} if mode == "default" else {mode: True, "zero_dp_strategy": strategy}
    err = world(2).run(loss_scaling, **config)[0]
    scale = 1 if mode == "calculate_per_token_loss" else 2  # summed vs averaged over dp=2
    assert err[scale] < TOL, err
    assert err[3 - scale] > 0.3, err


# --------------------------------------------------------------------------------- NaN checks
def nan_check(rank, ws, via_optimizer=False, **config):
    """Step 1's loss is NaN on rank 0 only; the core's check raises from backward on every rank."""
    model, _ = _manager(**config).parallelize(make_hf("llama"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if via_optimizer:
        fully_shard_optimizer(model, opt)
    messages = []
    for step in range(2):
        local = batch(step).chunk(ws)[rank]
        loss = model(input_ids=local, labels=local).loss
        if step == 1 and rank == 0:
            loss = loss * float("nan")
        try:
            loss.backward()
        except NonFiniteGradientError as exc:
            messages.append(str(exc))
            break
        if via_optimizer:
            opt.step()
        else:
            model.finish_grad_sync()
            opt.step()
            model.install_optimized_model_weights()
        model.zero_grad_buffer()
    return messages


def test_nan_check_raises_on_every_rank(world):
    for msgs in world(2).run(nan_check):
        assert len(msgs) == 1 and "NaN or Inf" in msgs[0] and "after backward 2" in msgs[0], msgs
    for msgs in world(2).run(nan_check, via_optimizer=True, check_for_nan_in_grad=False,
                             report_nan_in_param_grad=True):
        assert len(msgs) == 1 and "NaN or Inf" in msgs[0], msgs
    assert world(2).run(nan_check, check_for_nan_in_grad=False) == [[], []]


# ----------------------------------------------------------------------- post-wrap operations
def post_wrap_ops(rank, ws, strategy=3, replicate=1):
    out = {}
    model = make_hf("llama", tied=True)
    other = make_hf("llama", tied=True, seed=1)
    model, _ = _manager(zero_dp_strategy=strategy, dp_replicate_size=replicate).parallelize(model)
    x = batch(0)
    # 1. load_state_dict with full tensors (and with our own DTensor state dict) refreshes compute weights.
    result = model.load_state_dict(other.state_dict())
    with torch.no_grad():
        out["load_full"] = bool(torch.allclose(model(input_ids=x).logits, other(input_ids=x).logits, atol=1e-6))
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    out["load_missing"] = list(result.missing_keys)
    # 2. re-tie lm_head after wrapping: HF's tie_weights keeps the shared shard.
    model.tie_weights()
    with torch.no_grad():
        out["retie_same"] = bool(torch.allclose(model(input_ids=x).logits, other(input_ids=x).logits, atol=1e-6))
    # 3. no-op conversions pass; a dtype cast raises clearly.
    model.float()
    model.to("cpu")
    try:
        model.to(torch.bfloat16)
        out["cast"] = "no error"
    except RuntimeError as exc:
        out["cast"] = str(exc)
    # snapshot/restore: user attributes by name, tied aliases included, present ones not clobbered.
    emb = model.model.embed_tokens.weight
    emb.tag, emb.keep = "embedding", "old"
    snap = snapshot_distributed_param_attrs(model)
    out["alias_in_snapshot"] = snap["lm_head.weight"].get("tag")
    del emb.tag
    emb.keep = "new"
    restore_distributed_param_attrs(model, snap)
    out["restored"] = (emb.tag, emb.keep)
    # A real re-tie of an untied model after wrapping cannot work: the next forward says so.
    untied, _ = _manager(zero_dp_strategy=strategy, dp_replicate_size=replicate).parallelize(make_hf("qwen2"))
    untied.lm_head.weight = untied.model.embed_tokens.weight
    try:
        untied(input_ids=x)
        out["retie_untied"] = "no error"
    except RuntimeError as exc:
        out["retie_untied"] = str(exc)
    return out


@pytest.mark.parametrize("strategy,replicate,ws", [(3, 1, 2), (0, 1, 2), (3, 2, 4), (3, 1, 1)])
def test_post_wrap_operations(world, strategy, replicate, ws):
    out = world(ws).run(post_wrap_ops, strategy=strategy, replicate=replicate)[0]
    assert out["load_full"] and out["retie_same"], out
    assert out["load_missing"] == [], out
    assert "cannot convert an mfsdp-sharded model to torch.bfloat16" in out["cast"], out
    assert out["alias_in_snapshot"] == "embedding" and out["restored"] == ("embedding", "new"), out
    assert "was replaced after parallelize" in out["retie_untied"], out


# ---------------------------------------------------------------------- errors that need a mesh
def _meta_hf():
    with torch.device("meta"):
        return make_hf()


def mesh_errors(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}

    def capture(key, fn):
        try:
            fn()
            out[key] = "no error"
        except (ValueError, NotImplementedError, TypeError, RuntimeError, FileNotFoundError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    mesh = build_device_mesh("cpu")
    for flag in ("fsdp_double_buffer", "keep_fp8_transpose_cache", "nccl_ub"):
        capture(flag, lambda f=flag: MegatronFSDPManager(MegatronFSDPConfig(**{f: True}), mesh))
    capture("meta_with_optimizer", lambda: MegatronFSDPManager(MegatronFSDPConfig(init_fsdp_with_meta_device=True),
                                                               mesh).parallelize(_meta_hf(), torch.optim.SGD(
                                                                   [torch.zeros(1, requires_grad=True)], lr=1)))
    capture("missing_hf_path", lambda: MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(
        make_hf(), hf_path="/nonexistent/dir"))
    capture("config_vs_mesh", lambda: MegatronFSDPManager(MegatronFSDPConfig(tp_size=2), mesh))
    capture("mesh_names", lambda: MegatronFSDPManager(MegatronFSDPConfig(),
                                                      init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))))
    capture("mesh_size", lambda: build_device_mesh("cpu", tp_size=3))
    capture("sp_without_tp", lambda: MegatronFSDPManager(MegatronFSDPConfig(sequence_parallel=True), mesh))
    capture("no_units", lambda: MegatronFSDPManager(MegatronFSDPConfig(megatron_fsdp_unit_modules=["Nope"]), mesh)
            .parallelize(make_hf()))
    capture("twice", lambda: MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(
        MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(make_hf())[0]))
    if ws == 2:
        tp_mesh = build_device_mesh("cpu", tp_size=2)
        capture("tp_heads", lambda: MegatronFSDPManager(MegatronFSDPConfig(), tp_mesh).parallelize(
            make_hf(heads=4, kv_heads=1)))
        capture("sp", lambda: MegatronFSDPManager(MegatronFSDPConfig(sequence_parallel=True), tp_mesh))
        cp_manager = MegatronFSDPManager(MegatronFSDPConfig(), build_device_mesh("cpu", cp_size=2))
        out["cp_axes"] = cp_manager.placements.dp_axes
        rep = build_device_mesh("cpu", dp_replicate_size=2)
        capture("replicate_zero2", lambda: MegatronFSDPManager(MegatronFSDPConfig(zero_dp_strategy=2), rep))
        # maybe_shard_optimizer: binds only for MegatronFSDPConfig at world > 1
        model, _ = MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(make_hf())
        opt = torch.optim.AdamW(model.parameters())
        out["maybe_other"] = maybe_shard_optimizer(model, opt, None) is opt and opt not in _BOUND_OPTIMIZERS
        capture("maybe_disallowed", lambda: maybe_shard_optimizer(model, opt, MegatronFSDPConfig(), allow=False))
        out["maybe_bound"] = maybe_shard_optimizer(model, opt, MegatronFSDPConfig()) is opt and opt in _BOUND_OPTIMIZERS
    else:
        opt = torch.optim.SGD(make_hf().parameters(), lr=0.1)
        out["maybe_world1"] = maybe_shard_optimizer(None, opt, MegatronFSDPConfig(), allow=False) is opt
    return out


def _core_setup(manager, model) -> tuple:
    """What the core was given and built: the placements and policies, and per parameter group its
    label, levels, this rank's shard and the exposed DTensors (mesh dims, placements, local shapes)."""
    groups = [(g.label, g.geometry.sizes, g.geometry.param_level, g.geometry.grad_level, g.geometry.shard_index,
               g.policy, [(p.device_mesh.mesh_dim_names, p.placements, p.to_local().shape) for p in g.sharded_params])
              for m in model.modules() if isinstance(m, mfsdp.FsdpModule) for g in m.parameter_groups]
    return manager.placements, manager.communication_policy, precision_policy(manager.config), groups


def placements_vs_integers(rank, ws):
    """For each Megatron integer option and the Placements it stands for, whether the two managers
    (same mesh, same model) set up the core alike; ZeRO-3 also as HSDP on one replica."""
    P = mfsdp.Placements
    pairs = [({"zero_dp_strategy": 0}, P.ddp("dp_shard")), ({"zero_dp_strategy": 1}, P.zero1("dp_shard")),
             ({"zero_dp_strategy": 2}, P.zero2("dp_shard")), ({}, P.zero3("dp_shard")),
             ({}, P.hsdp("dp_replicate", "dp_shard"))]
    if ws % 2 == 0:
        pairs += [({"dp_replicate_size": 2}, P.hsdp("dp_replicate", "dp_shard")),
                  ({"dp_replicate_size": 2, "outer_dp_sharding_strategy": 1}, P.hfsdp("dp_replicate", "dp_shard"))]
    out = []
    for integers, placements in pairs:
        replicate = integers.get("dp_replicate_size", 1)
        setups = []
        for config in (MegatronFSDPConfig(**integers), MegatronFSDPConfig(placements=placements,
                                                                          dp_replicate_size=replicate)):
            manager = MegatronFSDPManager(config, build_device_mesh("cpu", dp_replicate_size=replicate))
            model, _ = manager.parallelize(make_hf(vocab=64))
            setups.append(_core_setup(manager, model))
        assert setups[0][3], "no parameter groups compared"
        out.append((integers, placements.name, setups[0][0].name, setups[0] == setups[1]))
    return out


def test_placements_given_directly_build_the_same_core(world):
    """MegatronFSDPConfig(placements=...) and the equivalent zero_dp_strategy / outer_dp_sharding_strategy
    build the same core options and parameter groups (4 ranks: dp_shard=4, and 2 replicas x 2)."""
    results = world(4).run(placements_vs_integers)[0]
    assert [ran for _, _, ran, _ in results] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3", "HSDP", "HFSDP"]
    for integers, given, ran, same in results:
        assert same, (integers, given, ran)


def test_errors_world2(world):
    out = world(2).run(mesh_errors)[0]
    assert out["fsdp_double_buffer"] == "no error"
    assert out["keep_fp8_transpose_cache"].startswith("NotImplementedError") and "FP8" in out["keep_fp8_transpose_cache"]
    assert "build it on model.parameters() after parallelize" in out["meta_with_optimizer"]
    assert out["missing_hf_path"].startswith("FileNotFoundError") and "/nonexistent/dir" in out["missing_hf_path"]
    assert out["nccl_ub"].startswith("ValueError") and "CUDA" in out["nccl_ub"]
    assert "disagrees with the device mesh" in out["config_vs_mesh"]
    assert "4-D mesh with dims" in out["mesh_names"]
    assert "not divisible" in out["mesh_size"]
    assert "needs a mesh with tp > 1" in out["sp_without_tp"]
    assert "matches no submodule" in out["no_units"]
    assert "already sharded" in out["twice"]
    assert out["tp_heads"].startswith("ValueError") and "num_key_value_heads=1" in out["tp_heads"]
    assert out["sp"] == "no error"  # sequence parallel: tests/test_manager_tp_sp.py
    assert out["cp_axes"] == ("dp_shard_cp",)
    assert out["replicate_zero2"].startswith("NotImplementedError") and "zero_dp_strategy=2" in out["replicate_zero2"]
    assert out["maybe_other"] and out["maybe_bound"]
    assert out["maybe_disallowed"].startswith("ValueError") and "allow=False" in out["maybe_disallowed"]


def test_maybe_shard_optimizer_world1(world):
    assert world(1).run(mesh_errors)[0]["maybe_world1"]


# -------------------------------------------------------------------------- the TP plan itself
def tp_plan_logits(rank, ws):
    """The built-in plan alone (no FSDP) reproduces the unsharded logits over a tp=2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.manager.tp_plans import apply_tp_plan, select_tp_plan

    model = make_hf("qwen2")
    ref = copy.deepcopy(model)
    apply_tp_plan(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)),
                  select_tp_plan(model))
    x = batch(0)
    with torch.no_grad():
        got, want = model(input_ids=x).logits, ref(input_ids=x).logits
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    dist.barrier()
    return float((got - want).abs().max())


def test_tp_plan_matches_unsharded(world):
    assert world(2).run(tp_plan_logits)[0] < 1e-5
