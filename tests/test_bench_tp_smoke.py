"""CPU smoke test of benchmarks/hf_manager.py: mfsdp+TP, FSDP2+TP and mfsdp dp-only in one gloo job.

A tiny Llama-shaped config; it checks the harness (the three builders, parity against the
unsharded model, the records, the profile traces, the table), not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script: `make test-all` runs it, `make test` does not

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "hf_manager.py"
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
        "--seq", "32", "--local-batch", "2", "--warmup", "1", "--parity-seq", "16", "--parity-steps", "2"]

pytest.importorskip("transformers")


def run(tmp_path, nproc: int, *flags: str) -> tuple[str, dict]:
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), *TINY, "--out", str(out), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_tp2_against_fsdp2_and_dp(tmp_path):
    stdout, records = run(tmp_path, 2, "--tp", "2", "--steps", "2", "--profile", str(tmp_path / "traces"))
    assert set(records) == {"mfsdp", "fsdp2", "mfsdp-dp"}
    for impl, rec in records.items():
        tp = 1 if impl == "mfsdp-dp" else 2
        assert (rec["tp"], rec["dp"]) == (tp, 2 // tp), rec
        assert rec["sequence_parallel"] is rec["loss_parallel"] is (tp > 1), rec
        assert rec["parity"]["step0_max_rel_grad_error"] < 1e-5, (impl, rec["parity"])
        for mine, ref in rec["parity"]["losses_vs_ref"]:
            assert abs(mine - ref) < 1e-5 * ref, (impl, rec["parity"])
        t = rec["throughput"]
        assert t["tokens_per_s_per_gpu"] > 0 and 4.5 < t["final_loss"] < 6.5, (impl, t)  # about ln(256) = 5.5
        assert 0 < t["host_time_median_s"] <= t["step_time_median_s"] * 1.01, t
        trace = json.loads(Path(t["profile"]["trace"]).read_text())  # what trace_breakdown.py reads
        assert trace["traceEvents"] and Path(t["profile"]["trace"]).name == f"hf_{impl}_tp{tp}_rank0.json"
    assert "sequence_parallel=True, loss_parallel=True" in records["fsdp2"]["throughput"]["setup"]
    assert "| mfsdp | 2 x 1 |" in stdout and "| mfsdp-dp | 1 x 2 | " in stdout and "mfsdp+TP / FSDP2+TP" in stdout


def test_tp2_dp2_four_ranks_without_sp(tmp_path):
    """tp=2 x dp=2: FSDP2 and mfsdp over the strided (dp, tp) shards, plain TP with gathered logits."""
    _, records = run(tmp_path, 4, "--tp", "2", "--impl", "mfsdp,fsdp2", "--skip-throughput", "--no-sp",
                     "--no-loss-parallel")
    assert set(records) == {"mfsdp", "fsdp2"}
    for impl, rec in records.items():
        assert (rec["tp"], rec["dp"], rec["sequence_parallel"], rec["loss_parallel"]) == (2, 2, False, False)
        assert rec["parity"]["step0_max_rel_grad_error"] < 1e-5, (impl, rec["parity"])


def test_bad_impl_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--impl", "mfsdp,megatron"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown ['megatron']" in proc.stderr, proc.stderr
