"""CPU smoke test of benchmarks/dpo_trl.py: the tiny shape end to end, trl + PEFT then mfsdp, 2 timed steps
each; it checks the harness (rows, table, ratio line), not speed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a benchmark script: `make test-all` runs it

ROOT = Path(__file__).resolve().parents[1]


def test_dpo_trl_tiny_runs_both_rows_and_prints_the_ratio(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dpo_trl.py"), "--shape", "tiny", "--steps", "2",
                           "--warmup", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"trl", "mfsdp"}
    for r in rows.values():
        assert len(r["step_times_s"]) == 2 and r["pairs_per_s"] > 0 and r["tokens_per_s"] > 0, r
        assert r["peak_gib"] is None and r["device"] == "cpu"  # no GPU: no peak
    assert rows["trl"]["pairs_per_step"] == 4  # its batch of 2 pairs, accumulated twice
    assert "packed shared prompt" in rows["mfsdp"]["layout"] and "--peft.method lora" in rows["mfsdp"]["command"]
    assert "mfsdp train:" in proc.stdout and "preference tuning (sigmoid, beta 0.1" in proc.stdout
    assert sum(line.startswith("| ") for line in proc.stdout.splitlines()) == 4  # header, rule, trl, mfsdp
    last = proc.stdout.strip().splitlines()[-1]
    ratio = float(re.fullmatch(r"mfsdp / trl \(pairs/s\): ([0-9.]+)x", last).group(1))
    assert ratio == pytest.approx(rows["mfsdp"]["pairs_per_s"] / rows["trl"]["pairs_per_s"], rel=1e-2)
