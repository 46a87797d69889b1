"""Smoke test of benchmarks/dpo_layout.py: a few thousand synthetic pairs, the table and the last line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark script: `make test-all` runs it, `make test` does not

ROOT = Path(__file__).resolve().parents[1]


def test_dpo_layout_prints_its_source_a_table_and_the_ratio():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dpo_layout.py"), "--pairs", "2000",
                           "--seq-len", "2048"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "https://github.com/frankxwang/dpo-prefix-sharing" in out and "median overall 409" in out
    assert out.count("\n| ") == 5  # header, rule and three layouts
    ratio = float(re.fullmatch(r"trl padded / mfsdp packed: ([0-9.]+)x", out.strip().splitlines()[-1]).group(1))
    assert ratio > 1.5


def test_the_trl_rows_pad_to_the_longest_of_each_batch_of_eight():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from dpo_layout import mfsdp_packed, trl_padded

    lengths = torch.tensor([[2, 3, 1]] * 8 + [[1, 1, 5]])  # rows of 5 and 3 tokens, then one pair of 6
    assert trl_padded(lengths) == 16 * 5 + 2 * 6
    assert mfsdp_packed(lengths[:8], 16) == (64, 4)  # 8 pairs of 6 tokens: two to a window of 16
