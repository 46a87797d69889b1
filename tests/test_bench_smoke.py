"""CPU smoke test of benchmarks/throughput.py: two gloo ranks, the tiny preset, a few steps.

It checks the harness (launch, per-implementation workers, JSON lines, table), not speed.
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
SCRIPT = ROOT / "benchmarks" / "throughput.py"

REQUIRED_KEYS = {
    "impl", "preset", "world_size", "local_batch", "seq", "tokens_per_s_per_gpu", "tflops_per_gpu",
    "mfu", "peak_mem_alloc_gib", "peak_mem_reserved_gib", "step_time_median_s",
    "grad_reduce_dtype", "status", "speed_vs_fsdp2", "speed_vs_none", "command", "torch",
}


def run_tiny(tmp_path, nproc: int, *flags: str, preset: str = "tiny") -> tuple[str, dict]:
    """The tiny preset in fp32 on ``nproc`` gloo ranks; its stdout and its records by impl."""
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), "--preset", preset, "--warmup", "1", "--local-batch", "2", "--dtype", "fp32",
           "--out", str(out), "--report-dir", str(tmp_path), "--impl-timeout", "120", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_throughput_smoke_two_ranks(tmp_path):
    stdout, records = run_tiny(tmp_path, 2, "--impl", "mfsdp,fsdp2,none", "--steps", "3", "--seq", "64")
    assert set(records) == {"mfsdp", "fsdp2", "none"}
    for impl, rec in records.items():
        assert REQUIRED_KEYS <= rec.keys(), (impl, REQUIRED_KEYS - rec.keys())
        assert rec["world_size"] == 2 and rec["preset"] == "tiny" and rec["seq"] == 64
    for impl in ("fsdp2", "none", "mfsdp"):
        rec = records[impl]
        assert rec["status"] == "ok", (impl, rec["status"])
        assert rec["step_time_median_s"] > 0 and rec["tokens_per_s_per_gpu"] > 0
        expected_tps = rec["local_batch"] * rec["seq"] / rec["step_time_median_s"]
        assert abs(rec["tokens_per_s_per_gpu"] - expected_tps) / expected_tps < 1e-3
        assert rec["tflops_per_gpu"] > 0
        assert rec["mfu"] is None and rec["peak_mem_alloc_gib"] is None  # CPU: no peak, no CUDA
        assert rec["step_time_p10_s"] <= rec["step_time_median_s"] <= rec["step_time_p90_s"]
        assert rec["loss_finite"] and 5.0 < rec["loss_first"] < 8.0  # about ln(512) = 6.24
    assert records["fsdp2"]["speed_vs_fsdp2"] == 1.0
    assert records["fsdp2"]["grad_reduce_dtype"] == "fp32"
    assert records["none"]["grad_reduce_dtype"] == "none"
    assert "| fsdp2 | ok |" in stdout  # the markdown table on rank 0
    assert len(list(tmp_path.glob("*_cpu_tiny-b2-s64-w2.md"))) == 1


def test_throughput_hsdp_four_ranks(tmp_path):
    """--replicate 2 on four ranks: HSDP 2 x 2 for both FSDP implementations, named in the report."""
    # --in-process (here and in the MoE row): both rows in the four torchrun processes instead of a
    # fresh set of four workers each; run_one is the same, and the fresh-worker launch is what
    # test_throughput_smoke_two_ranks and test_throughput_float8_row (torchao's patches) go through.
    _, records = run_tiny(tmp_path, 4, "--impl", "mfsdp,fsdp2", "--steps", "2", "--seq", "32", "--replicate", "2",
                          "--in-process")
    assert records["mfsdp"]["status"] == "ok" and records["fsdp2"]["status"] == "ok", records
    assert "Placements.hsdp" in records["mfsdp"]["setup"] and "HSDP 2 x 2" in records["fsdp2"]["setup"]
    assert all(r["replicate"] == 2 and r["world_size"] == 4 and r["loss_finite"] for r in records.values())
    assert len(list(tmp_path.glob("*_cpu_tiny-b2-s32-w4-hsdp2.md"))) == 1


def test_replicate_must_divide_the_world_size():
    env = dict(os.environ, WORLD_SIZE="4", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--replicate", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--replicate 3 does not divide the world size 4" in proc.stderr


def test_exposed_comm_from_kernel_intervals(tmp_path, monkeypatch):
    """NCCL time counts as exposed only where no compute-stream kernel runs."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # trace_breakdown sets nothing on import
    import trace_breakdown

    def kernel(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}

    events = [
        kernel("gemm", 0, 100, 7),                         # compute 0-100
        kernel("ncclDevKernel_AllGather", 50, 100, 20),   # 50-150: 50 hidden, 50 exposed
        kernel("chunk_cat", 150, 20, 20),                 # comm-stream copy: not compute
        kernel("ncclDevKernel_ReduceScatter", 200, 40, 21),  # 200-240: all exposed
        kernel("elementwise", 230, 30, 7),                # compute 230-260: hides 10 of it
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # ignored
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = trace_breakdown.kernel_summary(str(path))
    assert summary["nccl_busy_ms"] == pytest.approx(0.14)
    assert summary["compute_busy_ms"] == pytest.approx(0.13)
    assert summary["exposed_comm_ms"] == pytest.approx(0.08)   # 50 + 30 us
    assert summary["gpu_span_ms"] == pytest.approx(0.26)
    assert summary["gpu_idle_ms"] == pytest.approx(0.03)       # 170-200 us


def test_trace_breakdown_on_a_synthetic_trace(tmp_path, capsys, monkeypatch):
    """The profile tool: categories per stream kind, differences against a baseline, idle gaps."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import trace_breakdown

    def trace(name, kernels):  # (name, stream, start us, duration us)
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": [
            {"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": d, "args": {"stream": st}}
            for n, st, s, d in kernels]}))
        return str(path)

    base = trace("none.json", [("nvjet_sm90_gemm", 7, 0, 1000), ("multi_tensor_apply_kernel", 7, 1000, 500)])
    other = trace("mfsdp.json", [
        ("nvjet_sm90_gemm", 7, 0, 1200), ("ncclDevKernel_AllGather", 21, 100, 300),
        ("multi_tensor_apply_kernel", 21, 400, 200),  # a copy on the communication stream
        ("multi_tensor_apply_kernel", 7, 1500, 500)])  # after 300 us with nothing running
    times = trace_breakdown.kernel_times(other)
    assert times["compute"]["gemm"] == pytest.approx(1.2)
    assert times["comm"]["foreach/optimizer"] == pytest.approx(0.2) and times["comm"]["nccl"] == pytest.approx(0.3)
    trace_breakdown.report_kernels([base, other])
    out = capsys.readouterr().out
    assert "+0.20  nvjet_sm90_gemm" in out
    assert "kernel ms per stream: 7: 1.5" in out  # the baseline's one stream
    assert "largest compute-stream kernels (ms, of 1.5)" in out and "1.00  nvjet_sm90_gemm" in out
    trace_breakdown.report_idle([other])
    assert "idle gaps >0.05 ms: 1, 0.30 ms" in capsys.readouterr().out


def test_attention_bench_cpu_smoke(monkeypatch):
    """benchmarks/attention_bench.py --cpu-smoke: both ways of passing grouped heads run and agree."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention_bench

    records = attention_bench.main(["--cpu-smoke"])
    assert [(r["backend"], r["way"], r["status"]) for r in records] == [("math", "expand", "ok"), ("math", "gqa", "ok")]
    assert records[1]["max_rel_diff_vs_first"] < 1e-5 and all(r["ms_median"] > 0 for r in records)


def test_host_overhead_script_runs():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "benchmarks" / "host_overhead.py"), "--layers", "2", "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if "ms/step" in line] == ["mfsdp", "fsdp2"]


def test_scaling_table_efficiency_and_ratios(tmp_path, monkeypatch):
    """Weak-scaling efficiency against each implementation's smallest size, the reference's ratio
    against each peer at the same size, repeats pooled by median, and reduce dtypes never pooled."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import scaling

    def rec(impl, ws, tps, dtype="fp32", status="ok"):
        return {"impl": impl, "world_size": ws, "tokens_per_s_per_gpu": tps, "grad_reduce_dtype": dtype,
                "status": status, "preset": "1b", "local_batch": 2, "seq": 4096, "ac": False,
                "compile": False, "replicate": 1}

    rows = [rec("mfsdp", 1, 100.0), rec("mfsdp", 4, 96.0), rec("mfsdp", 4, 98.0), rec("mfsdp", 4, 200.0),
            rec("fsdp2", 1, 90.0), rec("fsdp2", 4, 80.0), rec("fsdp2", 4, 1.0, status="failed: OOM"),
            rec("none", 1, 120.0, dtype="none")]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    text = scaling.render(scaling.collect(scaling.load([str(path)])), "mfsdp")
    assert "| mfsdp | 100 (1.000) | 98 (0.980) |" in text      # median of 96, 98, 200
    assert "| fsdp2 | 90 (1.000) | 80 (0.889) |" in text       # the failed run is not counted
    assert "| fsdp2 | 1.111 | 1.225 |" in text                 # 100/90 and 98/80
    assert "none" not in text

    rows.append(rec("mfsdp", 4, 120.0, dtype="bf16"))
    path.write_text("\n".join(json.dumps(r) for r in rows))
    text = scaling.render(scaling.collect(scaling.load([str(path)])), "mfsdp")
    assert "| mfsdp (fp32) | 100 (1.000) | 98 (0.980) |" in text
    assert "| mfsdp (bf16) | – | 120 (1.000) |" in text


def test_throughput_moe_row(tmp_path):
    """The MoE preset runs for mfsdp and for FSDP2 (with zeros for unused experts), with the
    load-balancing loss; ranks draw different tokens, so they route to different experts."""
    _, records = run_tiny(tmp_path, 2, "--impl", "mfsdp,fsdp2", "--steps", "2", "--seq", "32", "--in-process",
                          preset="moe-tiny")
    for impl in ("mfsdp", "fsdp2"):
        rec = records[impl]
        assert rec["status"] == "ok" and rec["loss_finite"] and rec["tokens_per_s_per_gpu"] > 0, rec
    # The same initial weights (one init seed) and data: the same first loss, cross-entropy plus the
    # load-balancing term, up to fp32 rounding.
    assert abs(records["mfsdp"]["loss_first"] - records["fsdp2"]["loss_first"]) < 1e-3, records


def test_throughput_float8_row(tmp_path):
    """--float8 tensorwise --fp8-all-gather: mfsdp (one FP8 gather per block, precomputed scales),
    FSDP2 with torchao's FP8 all-gather, and the unsharded float8 model, from the same weights."""
    pytest.importorskip("torchao.float8")
    # One block: float8 GEMMs on the CPU are emulated, slowly.
    stdout, records = run_tiny(tmp_path, 2, "--impl", "mfsdp,fsdp2,none", "--steps", "1", "--seq", "32",
                               "--float8", "tensorwise", "--fp8-all-gather", "--n-layers", "1")
    for impl, rec in records.items():
        assert rec["status"] == "ok" and rec["loss_finite"], (impl, rec["status"])
        assert rec["float8"] == "tensorwise" and rec["fp8_all_gather"] is True
        assert "torchao float8 tensorwise (7 linears)" in rec["setup"], rec["setup"]  # 1 block x 7
    assert "precompute_fp8_scales" in records["mfsdp"]["setup"]
    assert "enable_fsdp_float8_all_gather" in records["fsdp2"]["setup"]
    # The same initial weights and data, float8 GEMMs everywhere: the same first loss up to rounding.
    assert abs(records["mfsdp"]["loss_first"] - records["fsdp2"]["loss_first"]) < 1e-3, records
    assert len(list(tmp_path.glob("*_cpu_tiny-l1-b2-s32-fp8tensorwise-ag-w2.md"))) == 1
