"""benchmarks/ep_bytes.py: the bytes counted from the collectives a tiny slice issues equal the closed form
(4 gloo ranks, no EP and ep 2 with experts sharded 2 ways), and the closed form at the real width."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

TINY = ["--ranks", "4", "--eps", "1", "2", "--layers", "1", "--tokens", "128", "--experts", "8", "--top-k", "2",
        "--hidden", "16", "--moe-intermediate", "8", "--heads", "2", "--head-dim", "8", "--vocab", "64"]


@pytest.mark.slow  # a benchmark script: `make test-all` runs it, `make test` does not (about 12 s)
def test_counted_bytes_equal_the_formula_on_a_tiny_slice():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ep_bytes.py"), *TINY], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (no EP|ep 2) \| (.*)$", out, re.M)}
    assert set(rows) == {"no EP", "ep 2"}
    for name, row in rows.items():
        cells = [c.strip() for c in row.split("|")]
        pairs = [tuple(map(float, c.split(" / "))) for c in cells[:4]]
        assert all(abs(counted - expected) <= 1e-4 + 0.01 * expected for counted, expected in pairs), (name, pairs)
        assert pairs[0][0] > 0 and pairs[1][0] > 0  # gathers and reduce-scatters were counted
        assert (pairs[3][0] > 0) == (name == "ep 2")  # tokens cross ranks only under EP
    assert "largest difference" in out and "(within 1%)" in out
    assert re.fullmatch(r"ep 8 / no ep: [0-9.]+x", out.strip().splitlines()[-1])


def test_the_real_shape_has_qwen3_30b_a3b_parameter_count_and_ep8_sends_under_a_quarter():
    from ep_bytes import QWEN3_30B_A3B, formula

    assert QWEN3_30B_A3B.parameters() == 30_532_122_624  # llama.cpp's 30.53B for the published weights
    no_ep, ep8 = (sum(formula(QWEN3_30B_A3B, 8, ep, 4096).values()) for ep in (1, 8))
    assert ep8 < no_ep / 4
    gathers = formula(QWEN3_30B_A3B, 8, 1, 4096)["all-gather"]
    assert gathers == pytest.approx(7 / 8 * 2 * (2 * 48 * 623_120_640 + 311_164_928 * 2 + 2048))


def test_the_gpu_row_parses_and_its_dry_run_prints_both_commands():
    script = ROOT / "benchmarks" / "ep_gpu_row.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run(["bash", str(script), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("mfsdp.cli train" in ln and "--parallel.ep 8" in ln and "--nproc-per-node 8" in ln for ln in lines)
    assert any("torchtitan.train" in ln and "--parallelism.expert_parallel_degree 8" in ln for ln in lines)


def test_the_gpu_row_report_reads_both_logs(tmp_path, capsys):
    import json

    from ep_gpu_row import main

    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"step": s, "tokens_per_s_per_gpu": 1000.0 + s,
                                                          "peak_mem_gib": 60.0 + s}) + "\n" for s in range(1, 9)))
    (tmp_path / "tt.log").write_text("".join(
        f"[rank0]: step: {s:2}  loss:  9.1  grad_norm:  1.2  memory: {50 + s:.2f}GiB(52.1%)  tps: 2,{s}00  "
        f"tflops: 100  mfu: 10%\n" for s in range(1, 9)))
    main(["report", "--mfsdp", str(tmp_path / "m.jsonl"), "--torchtitan", str(tmp_path / "tt.log"),
          "--span", "3..7"])
    out = capsys.readouterr().out
    assert "| mfsdp ep 8 | 1,005 | 67.0 |" in out and "| torchtitan ep 8 | 2,500 | 57.0 |" in out
    assert out.strip().endswith("mfsdp / torchtitan tok/s: 0.40x")


def test_the_gpu_row_config_is_the_real_shape(tmp_path):
    import json

    from ep_gpu_row import main

    main(["config", str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
    assert (config["num_hidden_layers"], config["hidden_size"], experts, config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["vocab_size"]) == (48, 2048, 128, 8, 768, 32, 4, 128, 151936)
    assert config["rope_parameters"]["rope_theta"] == 1000000.0
