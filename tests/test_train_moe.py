"""`mfsdp train --model.preset moe-tiny`: the mixture of experts end to end on two CPU ranks.

The trainer runs in the test session's world of two gloo processes (the launch itself is
test_train_e2e.py's). Each rank draws its own batches, so the ranks route their tokens differently,
and an expert a rank's tokens do not reach is skipped on that rank only; with
``--parallel.expert_units true`` each expert is a shard unit of its own.
"""

import json
import math

import pytest

from test_eval_loss import run_trainer
from test_train_e2e import REPO, _one_error_line, corpus, in_process  # noqa: F401
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

MOE = ["--model.preset", "moe-tiny", "--data.seq_len", "32", "--data.local_batch", "4",
       "--train.lr", "1e-2", "--train.warmup_steps", "2", "--train.progress", "false",
       "--train.device", "cpu", "--train.checkpoint_every", "0", "--train.eval_every", "0"]


def train(world, *args) -> tuple[list[dict], str]:
    """Two CPU ranks; returns metrics.jsonl's records and what rank 0 printed. A hang fails the
    case after the world's timeout (and restarts the world)."""
    return world(2).run(run_trainer, timeout=150, argv=[*MOE, *args], stdout=True)[0]


def test_moe_tiny_trains_on_two_cpu_ranks_with_the_loss_falling(world, corpus, tmp_path):
    rows, printed = train(world, "--data.path", str(corpus), "--train.steps", "12",
                          "--train.sample_tokens", "16", "--train.out_dir", str(tmp_path))
    assert "moe-tiny model" in printed and "2 process(es)" in printed
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # The load-balancing loss is logged unweighted: 1 when balanced, at most num_experts.
    assert all(math.isfinite(r["aux_loss"]) and 0.99 < r["aux_loss"] < 4 for r in rows), rows
    meta = json.loads((tmp_path / "checkpoints" / "step_12" / "meta.json").read_text())
    assert meta["model"]["num_experts"] == 4
    assert "--- sample" in printed


def test_moe_tiny_with_each_expert_its_own_shard_unit(world, corpus, tmp_path):
    rows, _ = train(world, "--data.path", str(corpus), "--train.steps", "6",
                    "--parallel.expert_units", "true", "--train.sample_tokens", "8",
                    "--train.out_dir", str(tmp_path))
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
