"""`mfsdp train --model.preset moe-tiny`: the mixture of experts end to end on two CPU ranks.

Real torchrun launches, in the style of test_train_e2e.py. Each rank draws its own batches, so
the ranks route their tokens differently, and an expert a rank's tokens do not reach is skipped
on that rank only; with ``--parallel.expert_units true`` each expert is a shard unit of its own.
"""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_e2e import REPO, _env, _one_error_line, corpus, single  # noqa: F401
from mfsdp.train.config import ConfigError, load_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

MOE = ["--model.preset", "moe-tiny", "--data.seq_len", "32", "--data.local_batch", "4",
       "--train.lr", "1e-2", "--train.warmup_steps", "2", "--train.progress", "false",
       "--train.device", "cpu", "--train.checkpoint_every", "0", "--train.eval_every", "0"]


def torchrun(*args, timeout=150) -> subprocess.CompletedProcess:
    """Two CPU ranks under torchrun; a hang fails the test after ``timeout`` seconds and is
    stopped, workers included."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mfsdp.train", *args]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets torchrun stop its workers (they run in sessions of their own, out of reach
        # of a group kill); it kills them itself when they do not stop within its grace period.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err += f"\n(stopped: no exit within {timeout}s; a rank hung in a collective?)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_moe_tiny_trains_on_two_cpu_ranks_with_the_loss_falling(corpus, tmp_path):
    run = torchrun(*MOE, "--data.path", str(corpus), "--train.steps", "12",
                   "--train.sample_tokens", "16", "--train.out_dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "moe-tiny model" in run.stdout and "2 process(es)" in run.stdout
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # The load-balancing loss is logged unweighted: 1 when balanced, at most num_experts.
    assert all(math.isfinite(r["aux_loss"]) and 0.99 < r["aux_loss"] < 4 for r in rows), rows
    meta = json.loads((tmp_path / "checkpoints" / "step_12" / "meta.json").read_text())
    assert meta["model"]["num_experts"] == 4
    assert "--- sample" in run.stdout


def test_moe_tiny_with_each_expert_its_own_shard_unit(corpus, tmp_path):
    run = torchrun(*MOE, "--data.path", str(corpus), "--train.steps", "6",
                   "--parallel.expert_units", "true", "--train.sample_tokens", "8",
                   "--train.out_dir", str(tmp_path), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]


def test_moe_config_keys_and_errors():
    cfg = load_config(["--config", str(REPO / "configs" / "moe-tiny.yaml")])
    shape = cfg.llama_config()
    assert (cfg.model.preset, shape.num_experts, shape.top_k, shape.moe_aux_loss_coef) == (
        "moe-tiny", 4, 2, 0.01)
    shape = load_config(["--model.preset", "moe-tiny", "--model.num_experts", "8",
                         "--model.top_k", "1", "--model.moe_aux_loss_coef", "0"]).llama_config()
    assert (shape.num_experts, shape.top_k, shape.moe_aux_loss_coef) == (8, 1, 0.0)
    with pytest.raises(ConfigError, match=r"top_k \(3\) must lie in \[1, num_experts=2\]"):
        load_config(["--model.preset", "moe-tiny", "--model.num_experts", "2",
                     "--model.top_k", "3"]).llama_config()
    with pytest.raises(ConfigError, match="expert_units true needs a built-in mixture-of-experts"):
        load_config(["--parallel.expert_units", "true"]).llama_config()
    with pytest.raises(ConfigError, match="mixtures of experts: moe-1b, moe-tiny"):
        load_config(["--model.preset", "moe-2b"]).llama_config()


def test_expert_units_on_a_dense_model_is_one_error_line(tmp_path):
    _one_error_line(single("--parallel.expert_units", "true", "--train.out_dir", str(tmp_path)),
                    "--parallel.expert_units true needs a built-in mixture-of-experts model")
