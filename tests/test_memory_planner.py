"""The memory planner (mfsdp.memory): model state to the byte against live sharded buffers, activations
against a real CPU run, `mfsdp plan`'s output and ordering, and `mfsdp train`'s refusal."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io

import pytest
from _dist import World, fresh_process_context
import torch

from models import Net, global_batch, loss_fn, make_mesh, make_placements, shard_net

KINDS = ["zero3", "zero2", "zero1", "ddp", "hsdp", "hfsdp"]


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _live_model_state(model, opt) -> tuple[dict, int]:
    """{unit name: [each group's live main, model, unsharded, main-gradient and accumulator bytes]}
    of a sharded model (every FSDP module by its name, the root as ""), and AdamW's state bytes."""
    from mfsdp import FsdpModule

    out = {}
    for name, unit in model.named_modules():
        if not isinstance(unit, FsdpModule):
            continue
        out[name] = []
        for group in unit.parameter_groups:
            r = group.reducer
            out[name].append({
                "main": _storage_bytes([group.main.tensor]),
                "model": _storage_bytes([group.model.tensor]) if group.model not in (None, group.main) else 0,
                "unsharded": (group.unsharded.tensor.numel() * group.unsharded.tensor.element_size()
                              if group.unsharded is not group.model else 0),
                "main_grad": _storage_bytes([r.main_grad.tensor, r._usage_main]) if r is not None else 0,
                "accumulator": _storage_bytes([r._accum.tensor, r._usage_accum])
                if r is not None and r._accum is not None else 0,
            })
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    states = sum(local(s["exp_avg"]).nbytes + local(s["exp_avg_sq"]).nbytes for s in opt.state.values())
    return out, states


def _predicted_model_state(units) -> dict:
    """The planner's view of the same buffers: {unit name: [group fields]}."""
    return {u.name: [{k: getattr(g, k) for k in ("main", "model", "unsharded", "main_grad", "accumulator")}
                     for g in u.groups] for u in units}


def _compare_model_state(case, results, predictions):
    """Each rank's live buffers and AdamW states against the prediction for its optimizer shard."""
    for rank, (shard, live, states) in enumerate(results):
        predicted, predicted_states = predictions[shard]
        assert set(live) == set(predicted), (case, rank, sorted(live), sorted(predicted))
        for name, groups in live.items():
            assert groups == predicted[name], (case, rank, name or "root", groups, predicted[name])
        assert states == predicted_states, (case, rank, states, predicted_states)


def _two_microbatches_and_a_step(model, opt, batches, backward) -> None:
    """Two microbatches (HFSDP's accumulator, ZeRO-1's deferred reduction) and an AdamW step;
    ``backward(model, batch)`` runs one microbatch's forward and backward."""
    import mfsdp

    for step, batch in enumerate(batches):
        with mfsdp.microbatch(model, is_last=step == 1):
            backward(model, batch)
    opt.step()


def model_state_case(rank, ws, kind, policy):
    import mfsdp
    from mfsdp.memory.model_state import Levels, describe_units, optimizer_state_bytes

    compute, mp = {"bf16": (torch.bfloat16, mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32)),
                   "fp32": (torch.float32, mfsdp.MixedPrecisionPolicy())}[policy]
    shape = dict(vocab=13, dim=6, hidden=10, n_blocks=3)
    with torch.device("meta"):  # the planner's view: shapes only
        template = Net(**shape).to(compute)
    placements = make_placements(kind)
    mesh_shape = {"dp": ws} if kind in ("zero3", "zero2", "zero1", "ddp") else {"replicate": 2, "shard": ws // 2}
    levels = Levels.of(placements, mesh_shape)

    torch.manual_seed(0)
    net = Net(**shape).to(compute)
    mesh = make_mesh(kind, ws)
    shard_net(net, mesh, placements, mp)
    opt = mfsdp.fully_shard_optimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    batches = [global_batch(step, 2 * ws, 5, 13) for step in range(2)]
    _two_microbatches_and_a_step(net, opt, batches,
                                 lambda m, b: loss_fn(m(b[0].chunk(ws)[rank]), b[1].chunk(ws)[rank]).backward())
    shard_index = net.parameter_groups[0].geometry.shard_index
    units = describe_units(template, list(template.blocks), mp, levels, rank_shard=shard_index)
    live, states = _live_model_state(net, opt)
    return shard_index, live, states, (_predicted_model_state(units), optimizer_state_bytes(units, "adamw"))


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_model_state_is_exact_to_the_byte(world, policy):
    """Every group's main, model, unsharded, main-gradient and accumulator buffers, and AdamW's
    states, after a step of two microbatches on 4 gloo ranks: predicted == live, to the byte."""
    w = world(4)
    for kind in KINDS:
        results = w.run(model_state_case, kind=kind, policy=policy)
        _compare_model_state((kind, policy), [r[:3] for r in results], {r[0]: r[3] for r in results})


# ------------------------------------------------------- model state: tensor parallel and MoE
TP_SHAPE = dict(vocab_size=62, hidden_size=16, intermediate_size=26, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, use_cache=False, max_position_embeddings=64)
"""Vocabulary 62 and MLP width 26 split over tp=2 into 31 and 13 rows: uneven over dp=2."""


def _hf_config(**overrides):
    import transformers

    return transformers.LlamaConfig(**{**TP_SHAPE, **overrides})


def tp_model_state_case(rank, ws, strategy):
    """The manager at tp=2 x dp=ws/2 with sequence parallel and the parallel loss, bf16 compute."""
    import transformers

    import mfsdp
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config()).to(torch.bfloat16)
    config = MegatronFSDPConfig(zero_dp_strategy=strategy, sequence_parallel=True, loss_parallel=True)
    model, _ = MegatronFSDPManager(config, build_device_mesh("cpu", tp_size=2)).parallelize(model)
    opt = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    dp = ws // 2
    batches = [global_batch(step, 2 * dp, 8, TP_SHAPE["vocab_size"])[0].chunk(dp)[rank // 2] for step in range(2)]

    def backward(m, x):
        with m.loss_context():
            m(input_ids=x, labels=x).loss.backward()
    _two_microbatches_and_a_step(model, opt, batches, backward)
    return (model.parameter_groups[0].geometry.shard_index, *_live_model_state(model, opt))


def _tp_predictions(strategy, dp):
    """Per optimizer shard: the planner's model state of the manager's tp=2 model (fake tp group)."""
    from mfsdp.manager.core_options import dp_placements, precision_policy, resolve_unit_modules
    from mfsdp.manager import MegatronFSDPConfig
    from mfsdp.hf.sharded import meta_model_from_config
    from mfsdp.manager.mesh import MeshSizes
    from mfsdp.memory import TensorParallel
    from mfsdp.memory.model_state import Levels, describe_units, optimizer_state_bytes
    from mfsdp.memory.tensor_parallel import apply_tp, fake_tp_mesh

    placements = dp_placements(strategy, MeshSizes(1, dp, 1, 2))
    levels = Levels.of(placements, {"dp_shard": dp})
    policy = precision_policy(MegatronFSDPConfig())
    model = meta_model_from_config(_hf_config(), dtype=torch.bfloat16)
    out = {}
    with fake_tp_mesh(2) as mesh:
        apply_tp(model, TensorParallel(2), mesh)
        for shard in range(dp):
            units = describe_units(model, [m for _, m in resolve_unit_modules(model)], policy, levels, shard)
            out[shard] = (_predicted_model_state(units), optimizer_state_bytes(units, "adamw"))
    return out


def moe_model_state_case(rank, ws, kind, expert_units):
    """moe-tiny through ``parallelize`` (bf16 compute, fp32 main weights and gradients)."""
    import mfsdp
    from mfsdp.mesh import build_mesh
    from mfsdp.models import build_model, get_config
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    cfg = get_config("moe-tiny")
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.bfloat16)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    parallelize(model, build_mesh("cpu", ws), ParallelizeConfig(kind, policy, expert_units=expert_units))
    opt = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batches = [global_batch(step, 2 * ws, 16, cfg.vocab_size)[0].chunk(ws)[rank] for step in range(2)]

    def backward(m, x):
        torch.nn.functional.cross_entropy(m(x).float().flatten(0, 1), x.flatten()).backward()
    _two_microbatches_and_a_step(model, opt, batches, backward)
    return (model.parameter_groups[0].geometry.shard_index, *_live_model_state(model, opt))


def _moe_predictions(kind, ws, expert_units):
    import mfsdp
    from mfsdp.memory import mesh_for
    from mfsdp.memory.api import _resolve
    from mfsdp.memory.model_state import Levels, describe_units, optimizer_state_bytes
    from mfsdp.memory.tensor_parallel import TensorParallel

    placements, mesh_shape = mesh_for(kind, ws)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    model, units, _, _, _ = _resolve("moe-tiny", torch.bfloat16, 16, expert_units, TensorParallel(1), None)
    out = {}
    for shard in range(ws):
        described = describe_units(model, units, policy, Levels.of(placements, mesh_shape), shard)
        out[shard] = (_predicted_model_state(described), optimizer_state_bytes(described, "adamw"))
    return out


def test_the_planner_groups_units_by_the_runtimes_rule(monkeypatch):
    """``describe_units`` takes each unit's parameters and groups through the runtime's ``unit_groups``
    (what ``fully_shard`` groups by), not a copy of its rule: children first, the root last."""
    from torch import nn

    from mfsdp import MixedPrecisionPolicy, Placements
    from mfsdp.memory import model_state
    from mfsdp.runtime import module, ownership
    from mfsdp.runtime.geometry import Levels

    seen = []

    def spy(unit, unit_cls, policy):
        seen.append(unit)
        return ownership.unit_groups(unit, unit_cls, policy)

    monkeypatch.setattr(model_state, "unit_groups", spy)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False))
    levels = Levels.of(Placements.zero3("dp"), {"dp": 2})
    units = model_state.describe_units(model, [model[0]], MixedPrecisionPolicy(), levels)
    assert seen == [model[0], model] and module.unit_groups is ownership.unit_groups
    assert [(u.name, [g.requires_grad for g in u.groups]) for u in units] == [("", [False]), ("0", [True])]


def test_model_state_is_exact_to_the_byte_tensor_parallel(world):
    """The manager at tp=2 x dp=2 (4 gloo ranks; ZeRO-3, 2, 1): every group's buffers, sized from the
    TP-local shards of the manager's own plan, equal the live ones to the byte."""
    pytest.importorskip("transformers")
    w = world(4)
    for strategy in (3, 2, 1):
        _compare_model_state(("tp2", strategy), w.run(tp_model_state_case, strategy=strategy),
                             _tp_predictions(strategy, dp=2))


def test_model_state_is_exact_to_the_byte_moe(world):
    """moe-tiny on 4 ranks, experts with their block or as units of their own (ZeRO-3, ZeRO-2)."""
    w = world(4)
    for kind in ("zero3", "zero2"):
        for expert_units in (False, True):
            _compare_model_state((kind, expert_units), w.run(moe_model_state_case, kind=kind, expert_units=expert_units),
                                 _moe_predictions(kind, 4, expert_units))


# ----------------------------------------------------------------------------- activations
def _real_block_saved(cfg, dtype, batch, seq):
    """A real CPU forward of one block: bytes of the new storages it saves for backward, and of its output."""
    from mfsdp.models.llama import Block, rotary_tables

    torch.manual_seed(0)
    block = Block(cfg, dtype=dtype)
    cos, sin = (t.to(dtype) for t in rotary_tables(cfg.head_dim, seq, cfg.rope_theta))
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    old = {t.untyped_storage().data_ptr() for t in [*block.parameters(), x, cos, sin]}  # the block's inputs
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in old:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, cos, sin)
    return sum(saved.values()), out.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype,head_loss", [(torch.float32, "plain"), (torch.bfloat16, "plain"),
                                             (torch.bfloat16, "fused")])
def test_activation_measurement_matches_a_real_cpu_run(dtype, head_loss):
    """On fake tensors a block leaves exactly what a real CPU forward saves, plus its output; and the
    whole profile measured on fake tensors equals the same measurement on real ones, the labels through
    the model's forward and its head's loss (``--model.head_loss``), as mfsdp train runs it."""
    from mfsdp.memory.activations import labels_run, measure, measure_llama
    from mfsdp.models import build_model, get_config

    cfg = get_config("tiny", n_layers=2)
    batch, seq = 2, 64
    fake = measure_llama(cfg, dtype, batch, seq, checkpointing=False, head_loss=head_loss)
    saved, output = _real_block_saved(cfg, dtype, batch, seq)
    assert fake.block_bytes == saved + output, (fake.block_bytes, saved, output)
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, max_seq_len=seq), dtype=dtype)
    model.set_head_loss(head_loss)
    real = measure(model, list(model.layers), labels_run(torch.randint(0, cfg.vocab_size, (batch, seq))))
    assert dataclasses.asdict(real) == dataclasses.asdict(fake)
    ckpt = measure_llama(cfg, dtype, batch, seq, checkpointing=True, head_loss=head_loss)
    assert ckpt.block_bytes == output  # a checkpointed block keeps only its output (its input is the previous one's)
    assert ckpt.block_backward_peak > fake.block_backward_peak - fake.block_bytes  # recompute happens in backward


@pytest.mark.parametrize("head_loss", ["plain", "fused"])
def test_the_heads_backward_phase_holds_what_a_real_run_holds(head_loss):
    """The plan's phase of the head's backward, where a loss computed in the head's forward runs
    backward too, holds what a real CPU run of the same model holds at its highest point there: the
    activations the blocks saved, what the loss saved and the backward's own, and the weight gradients
    (the head's counted once, the final norm's from the start of backward)."""
    from mfsdp.memory import estimate
    from mfsdp.memory.activations import _LiveBytes, _measure, labels_run
    from mfsdp.models import build_model, get_config

    cfg, batch, seq = get_config("tiny", n_layers=2, vocab_size=2048), 2, 64
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, max_seq_len=seq))
    model.set_head_loss(head_loss)
    real = _LiveBytes()
    _measure(model, list(model.layers), labels_run(torch.randint(0, cfg.vocab_size, (batch, seq))), None, real)
    e = estimate(cfg, world_size=1, placements="zero3", local_batch=batch, seq_len=seq, compute_dtype=torch.float32,
                 device="cpu", head_loss=head_loss)
    phase = next(p.components for p in e.phases if p.name == "backward: output")
    predicted = sum(phase[c] for c in ("activations (saved)", "activations (transient)", "logits and loss"))
    highest_act, highest_grads = max(real.window("loss_backward_end", "bwd_enter_1"), key=sum)
    assert (predicted, phase["module grads"]) == (highest_act, highest_grads + 4 * cfg.dim)


TRANSIENTS = ("block_forward_transient", "block_backward_peak", "embed_backward_peak")


def tp_activation_case(rank, ws, sequence_parallel, seq):
    """A real CPU forward and backward of the two-layer HF model with the manager's tp=2 plan
    (gloo, ``ws`` ranks as dp=ws/2 x tp=2), measured exactly as the planner measures fake tensors."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.manager.tp_plans import loss_context
    from mfsdp.memory import TensorParallel
    from mfsdp.memory.activations import cross_entropy_run, measure
    from mfsdp.memory.tensor_parallel import apply_tp

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config()).to(torch.bfloat16)
    tp = TensorParallel(2, sequence_parallel, sequence_parallel)
    apply_tp(model, tp, init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    tokens = torch.randint(0, TP_SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(0))
    with loss_context(tp.loss_parallel):
        return dataclasses.asdict(measure(model, list(model.model.layers), cross_entropy_run(tokens),
                                          real_collectives=True))


def fake_tp_activations(sp: bool, seq: int) -> dict:
    from mfsdp.memory import TensorParallel
    from mfsdp.memory.activations import measure_hf
    from mfsdp.memory.tensor_parallel import fake_tp_mesh

    with fake_tp_mesh(2) as mesh:
        return dataclasses.asdict(measure_hf(_hf_config(), torch.bfloat16, 2, seq, False,
                                             tp=TensorParallel(2, sp, sp), tp_mesh=mesh))


def test_tensor_parallel_activations(request):
    """tp=2 on fake tensors over a fake process group equals the same measurement of a real gloo run
    of the manager's plan (saved bytes exactly, transient peaks within one activation); against
    tp=1 a block keeps 0.5-0.6 of its bytes with sequence parallel
    (what runs inside attention and the MLP halves; the all-gathered inputs of q/k/v and gate/up
    stay whole) and 0.6-0.8 without (the norms and the residual stay whole too), and the
    vocabulary-parallel loss halves the logits."""
    pytest.importorskip("transformers")
    from mfsdp.memory.activations import measure_hf

    # A world of its own: what the shared worlds ran before (other modules' models, dispatch modes,
    # torchao) has been seen to change what a real run saves in the head. Two ranks: one tp=2 group,
    # which is all a rank's activations see (a dp axis beside it, dp=2 x tp=2 on four ranks, only
    # ran the same tp group twice and cost two more spawned ranks).
    seq, w = 32, World(2)
    request.addfinalizer(w.close)
    activation = 2 * seq * TP_SHAPE["hidden_size"] * 2  # one (batch, seq, hidden) bf16 tensor
    one = measure_hf(_hf_config(), torch.bfloat16, 2, seq, False)
    for sp, (low, high) in ((True, (0.5, 0.6)), (False, (0.6, 0.8))):
        # The fake measurement in a fresh process too (a fork of the worlds' forkserver, which has
        # only imported torch and mfsdp): a fake process group that an earlier test of this process
        # made and destroyed changes what DTensor's caches hand a later mesh. It measures while the
        # real run does.
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=fresh_process_context()) as pool:
            pending = pool.submit(fake_tp_activations, sp, seq)
            reals = w.run(tp_activation_case, sequence_parallel=sp, seq=seq)
            fake = pending.result(timeout=120)
        for real in reals:
            for key, value in fake.items():
                if key in TRANSIENTS:  # the real collectives' outputs wait a little longer (see the report)
                    assert abs(value - real[key]) <= activation, (sp, key, value, real[key])
                else:
                    assert value == real[key], (sp, key, value, real[key])
        assert low < fake["block_bytes"] / one.block_bytes < high, (sp, fake["block_bytes"], one.block_bytes)
        assert fake["head_forward_bytes"] / one.head_forward_bytes == pytest.approx(0.5 if sp else 1.0, abs=0.05)


def test_estimate_tp2_against_tp1():
    """The 1B Hugging Face shape on 2 GPUs: tp=2 halves the model state that dp=2 ZeRO-3 shards
    (same main weights and optimizer states), and its peak is lower (sequence-parallel activations,
    vocabulary-sharded logits); by default, and always in a process with a default group, the
    estimate runs in a spawned child, with the same result."""
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from mfsdp.memory import estimate

    cfg = _hf_config(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8)
    dp2 = estimate(cfg, world_size=2, placements="zero3", seq_len=4096)
    tp2 = estimate(cfg, world_size=2, placements="zero3", seq_len=4096, tensor_parallel=2, tp_in_process=True)
    assert tp2.breakdown["main weights"] == pytest.approx(dp2.breakdown["main weights"], rel=0.01)
    assert tp2.component_max("optimizer states") == pytest.approx(dp2.component_max("optimizer states"), rel=0.01)
    assert 0.5 < tp2.component_max("activations (saved)") / dp2.component_max("activations (saved)") < 0.65
    assert tp2.peak_bytes < dp2.peak_bytes and tp2.settings.tp == 2 and tp2.settings.world_size == 2
    assert any("tp=2" in note for note in tp2.notes), tp2.notes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert estimate(cfg, world_size=2, placements="zero3", seq_len=4096, tensor_parallel=2) == tp2
    finally:
        dist.destroy_process_group()


def test_moe_activations_with_uniform_routing():
    """moe-tiny: the fake measurement routes uniformly; a real CPU run, whose router is not
    uniform, leaves the same saved bytes per block (they depend only on the total of assignments)."""
    from mfsdp.memory import estimate
    from mfsdp.memory.activations import labels_run, measure, measure_llama
    from mfsdp.models import build_model, get_config

    cfg = get_config("moe-tiny", n_layers=2)
    fake = measure_llama(cfg, torch.float32, 2, 64, checkpointing=False)
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, max_seq_len=64), dtype=torch.float32)
    real = measure(model, list(model.layers), labels_run(torch.randint(0, cfg.vocab_size, (2, 64))))
    assert fake.block_bytes == real.block_bytes and fake.embed_bytes == real.embed_bytes
    assert fake.head_forward_bytes == real.head_forward_bytes
    e = estimate("moe-tiny", world_size=2, placements="zero3", seq_len=64, expert_units=True, device="cpu")
    assert any("uniform routing" in note for note in e.notes), e.notes
    assert e.peak_bytes == sum(e.breakdown.values())


def test_estimate_of_8b_is_fast_and_sane():
    """The 8B shape on 8 GPUs in about a second; ZeRO-3 below ZeRO-2; checkpointing below none."""
    import time

    from mfsdp.memory import estimate

    t = time.perf_counter()
    z3 = estimate("8b", world_size=8, placements="zero3", seq_len=8192)
    assert time.perf_counter() - t < 20
    z2 = estimate("8b", world_size=8, placements="zero2", seq_len=8192)
    ac = estimate("8b", world_size=8, placements="zero3", seq_len=8192, activation_checkpointing=True)
    assert ac.peak_bytes < z3.peak_bytes < z2.peak_bytes
    assert z3.peak_bytes == sum(z3.breakdown.values())
    assert z3.breakdown["main weights"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)


# ------------------------------------------------------------------------------- mfsdp plan
def _plan(args, tmp_path):
    from mfsdp.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", *args, "--out", str(tmp_path / "plan.png")])
    return code, buf.getvalue()


def test_plan_prints_breakdown_and_orders_settings(tmp_path):
    code, text = _plan(["--model.preset", "1b", "--data.seq_len", "4096", "--data.local_batch", "4",
                        "--nproc-per-node", "8", "--gpu-memory", "40GiB"], tmp_path)
    assert code == 0, text
    for line in ("main weights", "optimizer states", "activations (saved)", "logits and loss", "peak allocated",
                 "device memory needed", "settings that fit"):
        assert line in text, text
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    rows = [line.split("  ")[-1] for line in text.splitlines() if "--parallel.placements" in line]
    assert rows, text
    parsed = [(r.split()[1], r.split()[3] == "true", int(r.split()[5])) for r in rows]
    keys = [(ac, -b, ["zero1", "zero2", "zero3"].index(pl)) for pl, ac, b in parsed]
    assert keys == sorted(keys), parsed  # no checkpointing first, then larger batches, ZeRO-2 before ZeRO-3
    assert any(pl == "zero3" for pl, _, _ in parsed) and any(pl != "zero3" for pl, _, _ in parsed), parsed
    assert any(ac for _, ac, _ in parsed) and not parsed[0][1], parsed


def test_plan_reports_a_bad_flag(tmp_path):
    code, _ = _plan(["--model.preset", "13b"], tmp_path)
    assert code == 2


# ------------------------------------------------------------------------- mfsdp train refusal
def _check_memory(args, device="cuda"):
    from mfsdp.train.run import preflight
    from mfsdp.train.run.resolve import load_config

    preflight.check_memory(load_config(args), 8, torch.device(device), print)


def test_train_refuses_a_run_that_does_not_fit(monkeypatch):
    from mfsdp.train.run import preflight

    monkeypatch.setattr(preflight, "device_memory", lambda device: 40 * 2**30)
    args = ["--model.preset", "8b", "--data.seq_len", "8192", "--data.local_batch", "2",
            "--parallel.placements", "zero2"]
    with pytest.raises(preflight.RunFailed) as err:
        _check_memory(args)
    message = str(err.value)
    assert "\n" not in message
    assert "does not fit this GPU's 40.00 GiB" in message and "nearest setting that fits" in message, message
    assert "--train.skip_memory_check true" in message
    _check_memory(args + ["--train.skip_memory_check", "true"])  # overridden
    _check_memory(args, device="cpu")  # CPU runs skip the check
    monkeypatch.setattr(preflight, "device_memory", lambda device: 141 * 2**30)
    _check_memory(args[:-2] + ["--parallel.placements", "zero3", "--parallel.activation_checkpointing", "true"])


def test_plan_sizes_a_hugging_face_directory(tmp_path):
    """--model.hf DIR --model.hf_impl manager: the manager's units (decoder layers), activations measured
    on the HF layers (the bundled route: tests/test_finetune_recipe.py)."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             use_cache=False).save_pretrained(tmp_path / "hf")
    code, text = _plan(["--model.hf", str(tmp_path / "hf"), "--model.hf_impl", "manager", "--data.seq_len", "128",
                        "--data.local_batch", "2", "--nproc-per-node", "2", "--gpu-memory", "4GiB"], tmp_path)
    assert code == 0, text
    assert "activations (saved)" in text and "settings that fit" in text, text


def test_plan_with_tensor_parallel(tmp_path):
    """--model.hf DIR --tp 2: the manager's tp=2 (sequence parallel, parallel loss) on 4 GPUs, dp=2;
    --tp on a bundled preset is an error."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             use_cache=False).save_pretrained(tmp_path / "hf")
    args = ["--model.hf", str(tmp_path / "hf"), "--data.seq_len", "128", "--data.local_batch", "2",
            "--nproc-per-node", "4", "--gpu-memory", "4GiB"]
    code, text = _plan(args + ["--tp", "2"], tmp_path)
    assert code == 0, text
    assert "x tp=2 (sequence parallel, parallel loss) on 4 GPU(s)" in text and "note: tp=2" in text, text
    assert "settings that fit" in text, text
    code, _ = _plan(["--model.preset", "tiny", "--nproc-per-node", "2", "--tp", "2"], tmp_path)
    assert code == 2


@pytest.mark.slow  # a benchmark script: `make test-all` runs it
def test_memory_accuracy_cpu_smoke(tmp_path):
    """benchmarks/memory_accuracy.py --device cpu on 2 gloo ranks: the GPU grid's new points (a
    Hugging Face model through the manager at tp=2; moe-tiny with and without expert units) build,
    step and land in the table."""
    pytest.importorskip("transformers")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "table.md"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "benchmarks" / "memory_accuracy.py"), "--device", "cpu", "--models", "hf-tiny", "moe-tiny",
           "--tp", "2", "--placements", "zero3", "--ac", "off", "--batches", "1", "--seq-len", "32", "--warmup", "1",
           "--expert-units", "off", "on", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    for row in ("| hf-tiny tp=2 zero3 ac=off b=1 |", "| moe-tiny zero3 ac=off b=1 |",
                "| moe-tiny expert units zero3 ac=off b=1 |"):
        assert row in table, table
