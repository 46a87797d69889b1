"""The memory planner (mfsdp.memory): model state to the byte against live sharded buffers, activations
against a real CPU run, `mfsdp plan`'s output and ordering, and `mfsdp train`'s refusal."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import types

import pytest
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
    for step in range(2):  # two microbatches: HFSDP's accumulator, ZeRO-1's deferred reduction
        x, y = global_batch(step, 2 * ws, 5, 13)
        with mfsdp.microbatch(net, is_last=step == 1):
            loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    opt.step()
    shard_index = net.parameter_groups[0].geometry.shard_index
    units = describe_units(template, list(template.blocks), mp, levels, rank_shard=shard_index)
    live_units = list(net.blocks) + [net]
    out = []
    for unit, live in zip([u for u in units if u.name] + [units[0]], live_units):
        for g, group in zip(unit.groups, live.parameter_groups):
            r = group.reducer
            measured = {
                "main": _storage_bytes([group.main.tensor]),
                "model": _storage_bytes([group.model.tensor]) if group.model not in (None, group.main) else 0,
                "unsharded": (group.unsharded.tensor.numel() * group.unsharded.tensor.element_size()
                              if group.unsharded is not group.model else 0),
                "main_grad": _storage_bytes([r.main_grad.tensor, r._usage_main]),
                "accumulator": _storage_bytes([r._accum.tensor, r._usage_accum]) if r._accum is not None else 0,
            }
            predicted = {k: getattr(g, k) for k in measured}
            out.append((unit.name, measured, predicted))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    states = sum(local(s["exp_avg"]).nbytes + local(s["exp_avg_sq"]).nbytes for s in opt.state.values())
    return out, states, optimizer_state_bytes(units, "adamw")


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_model_state_is_exact_to_the_byte(world, policy):
    """Every group's main, model, unsharded, main-gradient and accumulator buffers, and AdamW's
    states, after a step of two microbatches on 4 gloo ranks: predicted == live, to the byte."""
    w = world(4)
    for kind in KINDS:
        for rank, (groups, states, predicted_states) in enumerate(w.run(model_state_case, kind=kind, policy=policy)):
            for name, measured, predicted in groups:
                assert measured == predicted, (kind, policy, rank, name or "root", measured, predicted)
            assert states == predicted_states, (kind, policy, rank, states, predicted_states)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_measurement_matches_a_real_cpu_run(dtype):
    """On fake tensors a block leaves exactly what a real CPU forward saves, plus its output; and the
    whole profile measured on fake tensors equals the same measurement on real ones."""
    from mfsdp.memory.activations import cross_entropy_run, measure, measure_llama
    from mfsdp.models import build_model, get_config

    cfg = get_config("tiny", n_layers=2)
    batch, seq = 2, 64
    fake = measure_llama(cfg, dtype, batch, seq, checkpointing=False)
    saved, output = _real_block_saved(cfg, dtype, batch, seq)
    assert fake.block_bytes == saved + output, (fake.block_bytes, saved, output)
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, max_seq_len=seq), dtype=dtype)
    real = measure(model, list(model.layers), cross_entropy_run(torch.randint(0, cfg.vocab_size, (batch, seq))))
    assert dataclasses.asdict(real) == dataclasses.asdict(fake)
    ckpt = measure_llama(cfg, dtype, batch, seq, checkpointing=True)
    assert ckpt.block_bytes == output  # a checkpointed block keeps only its output (its input is the previous one's)
    assert ckpt.block_backward_peak > fake.block_backward_peak - fake.block_bytes  # recompute happens in backward


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
def _trainer(args, device="cuda"):
    from mfsdp.train.config import load_config

    return types.SimpleNamespace(cfg=load_config(args), world=8, device=torch.device(device))


def test_train_refuses_a_run_that_does_not_fit(monkeypatch):
    from mfsdp.train import loop

    monkeypatch.setattr(loop, "device_memory", lambda device: 40 * 2**30)
    args = ["--model.preset", "8b", "--data.seq_len", "8192", "--data.local_batch", "2",
            "--parallel.placements", "zero2"]
    with pytest.raises(loop.RunFailed) as err:
        loop.Trainer.check_memory(_trainer(args))
    message = str(err.value)
    assert "\n" not in message
    assert "does not fit this GPU's 40.00 GiB" in message and "nearest setting that fits" in message, message
    assert "--train.skip_memory_check true" in message
    loop.Trainer.check_memory(_trainer(args + ["--train.skip_memory_check", "true"]))  # overridden
    loop.Trainer.check_memory(_trainer(args, device="cpu"))  # CPU runs skip the check
    monkeypatch.setattr(loop, "device_memory", lambda device: 141 * 2**30)
    loop.Trainer.check_memory(_trainer(args[:-2] + ["--parallel.placements", "zero3",
                                                    "--parallel.activation_checkpointing", "true"]))


def test_plan_sizes_a_hugging_face_directory(tmp_path):
    """--model.hf DIR: the manager's units (decoder layers), activations measured on the HF layers."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             use_cache=False).save_pretrained(tmp_path / "hf")
    code, text = _plan(["--model.hf", str(tmp_path / "hf"), "--data.seq_len", "128", "--data.local_batch", "2",
                        "--nproc-per-node", "2", "--gpu-memory", "4GiB"], tmp_path)
    assert code == 0, text
    assert "activations (saved)" in text and "settings that fit" in text, text
