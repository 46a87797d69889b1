"""CPU smoke test of the issue-21 rows of benchmarks/throughput.py: ``--microbatches`` and
``--offload`` with mfsdp, mfsdp-offload, fsdp2 and fsdp2-offload side by side in one job (two
gloo ranks, the tiny preset). The same initial weights and data give every row the same losses;
tokens per second count every microbatch."""

from __future__ import annotations

import pytest

from test_bench_smoke import REQUIRED_KEYS, run_tiny

pytestmark = pytest.mark.slow  # a benchmark script: `make test-all` runs it, `make test` does not


def test_offload_rows_run_side_by_side(tmp_path):
    # --in-process: the four rows in the torchrun processes, not four fresh sets of workers (each
    # importing torch on both ranks); the rows' code (run_one) is the same, and the fresh-worker
    # launch they would go through is the one test_bench_smoke's tests run.
    _, records = run_tiny(tmp_path, 2, "--impl", "mfsdp,mfsdp-offload,fsdp2,fsdp2-offload", "--steps", "3",
                          "--seq", "32", "--microbatches", "2", "--offload", "0.5", "--in-process")
    assert set(records) == {"mfsdp", "mfsdp-offload", "fsdp2", "fsdp2-offload"}
    for impl, rec in records.items():
        assert rec["status"] == "ok", (impl, rec["status"])
        assert REQUIRED_KEYS <= rec.keys()
        assert rec["microbatches"] == 2 and rec["tokens_per_step_per_gpu"] == 2 * 2 * 32
        expected_tps = rec["tokens_per_step_per_gpu"] / rec["step_time_median_s"]
        assert abs(rec["tokens_per_s_per_gpu"] - expected_tps) / expected_tps < 1e-3
        assert rec["optimizer_step_call_s_median"] > 0
    assert records["mfsdp"]["offload"] is None and records["fsdp2"]["offload"] is None
    assert records["mfsdp-offload"]["offload"] == "fraction 0.5"
    assert records["fsdp2-offload"]["offload"] == "all (CPUOffloadPolicy)"
    counts = records["mfsdp-offload"]["offload_counts"]  # no clip here: every speculated step is kept
    assert counts["kept"] > 0 and counts["redone"] == counts["dropped"] == 0, counts
    losses = {impl: (rec["loss_first"], rec["loss_last"]) for impl, rec in records.items()}
    assert len(set(losses.values())) == 1, losses  # same weights, data and exact AdamW everywhere
