"""`mfsdp train --model.preset moe-tiny`: the mixture of experts end to end on two CPU ranks.

The trainer runs in the test session's world of two gloo processes (the launch itself is
test_train_e2e.py's). Each rank draws its own batches, so the ranks route their tokens differently;
each layer's stacked experts run on every rank (an expert no token of a rank reached computes
nothing there), and with ``--parallel.expert_units true`` they are a shard unit of their own.
"""

import json
import math

import pytest

from test_eval_loss import run_per_expert_trainer, run_trainer
from test_train_e2e import REPO, _one_error_line, corpus, in_process  # noqa: F401
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

MOE = ["--model.preset", "moe-tiny", "--data.seq_len", "32", "--data.local_batch", "4",
       "--train.lr", "1e-2", "--train.warmup_steps", "2", "--train.progress", "false",
       "--train.device", "cpu", "--train.checkpoint_every", "0", "--train.eval_every", "0"]


def train(world, *args, worker=run_trainer) -> tuple[list[dict], str]:
    """Two CPU ranks; returns metrics.jsonl's records and what rank 0 printed. A hang fails the
    case after the world's timeout (and restarts the world)."""
    return world(2).run(worker, timeout=150, argv=[*MOE, *args], stdout=True)[0]


def test_moe_tiny_trains_on_two_cpu_ranks_with_the_loss_falling(world, corpus, tmp_path):
    rows, printed = train(world, "--data.path", str(corpus), "--train.steps", "12",
                          "--train.sample_tokens", "16", "--train.out_dir", str(tmp_path))
    assert "moe-tiny model" in printed and "2 process(es)" in printed
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # The load-balancing loss is logged unweighted: 1 when balanced, at most num_experts.
    assert all(math.isfinite(r["aux_loss"]) and 0.99 < r["aux_loss"] < 4 for r in rows), rows
    meta = json.loads((tmp_path / "checkpoints" / "step_12" / "meta.json").read_text())
    assert meta["model"]["num_experts"] == 4 and meta["model"]["experts"] == "stacked"
    assert "--- sample" in printed


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per_expert"])
def test_moe_tiny_with_its_experts_as_shard_units(world, corpus, tmp_path, per_expert):
    """The experts module of each block a unit of its own; ``per_expert``: the test-local one module
    per expert, each its own unit, which a rank whose tokens do not reach it skips (the runtime's
    conditional computation under the trainer)."""
    rows, _ = train(world, "--data.path", str(corpus), "--train.steps", "6",
                    "--parallel.expert_units", "true", "--train.sample_tokens", "8",
                    "--train.out_dir", str(tmp_path), worker=run_per_expert_trainer if per_expert else run_trainer)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]


def test_moe_config_keys_and_errors():
    cfg = load_config(["--config", str(REPO / "configs" / "moe-tiny.yaml")])
    shape = cfg.resolved.shape
    assert (cfg.model.preset, shape.num_experts, shape.top_k, shape.moe_aux_loss_coef) == (
        "moe-tiny", 4, 2, 0.01)
    shape = load_config(["--model.preset", "moe-tiny", "--model.num_experts", "8",
                         "--model.top_k", "1", "--model.moe_aux_loss_coef", "0"]).resolved.shape
    assert (shape.num_experts, shape.top_k, shape.moe_aux_loss_coef) == (8, 1, 0.0)
    with pytest.raises(ConfigError, match=r"top_k \(3\) must lie in \[1, num_experts=2\]"):
        load_config(["--model.preset", "moe-tiny", "--model.num_experts", "2",
                     "--model.top_k", "3"]).resolved.shape
    with pytest.raises(ConfigError, match="expert_units true needs a built-in mixture-of-experts"):
        load_config(["--parallel.expert_units", "true"]).resolved.shape
    with pytest.raises(ConfigError, match="mixtures of experts: moe-1b, moe-tiny"):
        load_config(["--model.preset", "moe-2b"]).resolved.shape


def test_expert_units_on_a_dense_model_is_one_error_line(tmp_path, capsys):
    _one_error_line(in_process(capsys, "--parallel.expert_units", "true", "--train.out_dir", str(tmp_path)),
                    "--parallel.expert_units true needs a built-in mixture-of-experts model")


def test_a_checkpoint_with_one_module_per_expert_is_refused_in_one_line(corpus, tmp_path, capsys):
    """A checkpoint of the bundled MoE written before its experts were stacked (per-expert DCP keys,
    ``layers.0.feed_forward.experts.3.w1.weight``, and a fingerprint with no experts layout): --resume
    and `mfsdp export` refuse it in one line that says why and what to do, exit code 2, no DCP error."""
    import torch

    from conditional_models import with_per_expert_modules
    from mfsdp.models import build_model
    from mfsdp.train.checkpoint import CheckpointMeta, save_checkpoint
    from mfsdp.train.export import ExportError, export_hf
    from mfsdp.train.run.preflight import model_fingerprint

    args = [*MOE, "--model.n_layers", "1", "--data.path", str(corpus), "--train.out_dir", str(tmp_path),
            "--train.steps", "2"]
    cfg = load_config(args)
    model = with_per_expert_modules(build_model(cfg.resolved.shape))
    assert "layers.0.feed_forward.experts.3.w1.weight" in model.state_dict()
    old = {k: v for k, v in model_fingerprint(cfg.resolved.shape).items() if k != "experts"}
    checkpoint = save_checkpoint(tmp_path / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()),
                                 CheckpointMeta(model=old, config=cfg.to_dict()))
    why = "stores the experts one module per expert (mfsdp before the stacked layout)"
    run = in_process(capsys, *args, "--resume")
    _one_error_line(run, why)
    assert run.returncode == 2 and "start fresh in another --train.out_dir" in run.stderr
    with pytest.raises(ExportError, match=r"stores the experts one module per expert"):
        export_hf(checkpoint, tmp_path / "hf")
