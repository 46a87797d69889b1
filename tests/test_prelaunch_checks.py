"""The checks before the first step: the memory check's margins against the committed GPU results
(the planner runs on CPU)."""

import json
import re
import types
from pathlib import Path

import pytest
import torch

from mfsdp.memory.estimate import GIB, OUTSIDE_ALLOCATOR, PLANNER_OVERSHOOT, RESERVE_FRACTION
from mfsdp.memory.plan import estimate_run, memory_check
from mfsdp.train import loop
from mfsdp.train.config import load_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


# ------------------------------------------------------------------------- the committed results
def _records():
    """Every committed throughput record of mfsdp as ``mfsdp train`` shards it (embedding, blocks, head,
    root; ZeRO-3), without torch.compile."""
    for path in sorted(RESULTS.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            setup = r.get("setup") or ""
            if r.get("impl") == "mfsdp" and "each block, head" in setup and "Placements.zero3" in setup \
                    and not r.get("compile"):
                yield path, r


def _committed_oom() -> dict:
    """The committed OOM's figures (GiB): the GPU's capacity, allocated, reserved but unallocated,
    and what the process held in all."""
    for path in sorted(RESULTS.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            m = re.search(r"total capacity of ([\d.]+) GiB.*this process has ([\d.]+) GiB memory in use. Of the "
                          r"allocated memory ([\d.]+) GiB is allocated by PyTorch, and ([\d.]+) GiB is reserved",
                          line)
            if m:
                capacity, in_use, allocated, unallocated = map(float, m.groups())
                return dict(capacity=capacity, in_use=in_use, allocated=allocated, unallocated=unallocated)
    raise AssertionError(f"no committed OOM record under {RESULTS}")


def _config(r):
    return load_config(["--model.preset", r["preset"], "--data.seq_len", str(r["seq"]), "--data.local_batch",
                        str(r["local_batch"]), "--parallel.activation_checkpointing", str(r["ac"]).lower(),
                        "--parallel.main_grads_dtype", r["grad_reduce_dtype"], "--parallel.compute_dtype", "bf16"])


def _trained(worlds):
    """The smallest measured peak of every trained configuration on ``worlds`` GPUs, with its record."""
    best = {}
    for path, r in _records():
        if r["status"] == "ok" and r["world_size"] in worlds:
            key = (r["preset"], r["world_size"], r["local_batch"], r["seq"], r["ac"], r["grad_reduce_dtype"])
            if key not in best or r["peak_mem_alloc_gib"] < best[key]["peak_mem_alloc_gib"]:
                best[key] = r
    return list(best.values())


def test_no_committed_run_that_trained_would_have_been_refused():
    """On the H200 it ran on, and on the smallest GPU that holds its measured peak and the CUDA context:
    whatever the allocator reserved beyond that, the check must not refuse a run that trained."""
    capacity = int(_committed_oom()["capacity"] * GIB)
    runs = _trained((1, 2))
    assert {r["world_size"] for r in runs} == {1, 2} and any(r["preset"] == "8b" for r in runs), runs
    for r in runs:
        e = estimate_run(_config(r), r["world_size"])
        smallest = int(r["peak_mem_alloc_gib"] * GIB) + OUTSIDE_ALLOCATOR
        assert e.fit(capacity) != "no", r
        assert e.fit(smallest) != "no", (r, e.peak_bytes / GIB, e.least_device_bytes / GIB)


def test_the_refusal_allows_for_the_planners_largest_over_prediction():
    """PLANNER_OVERSHOOT covers every committed point where the planner predicts more than was measured."""
    errors = []
    for _, r in _records():
        if r["status"] == "ok" and r["seq"] and r["world_size"] <= 4:
            predicted = estimate_run(_config(r), r["world_size"]).peak_bytes / GIB
            errors.append(predicted / r["peak_mem_alloc_gib"] - 1)
    assert len(errors) > 10 and max(errors) > 0, errors
    assert max(errors) <= PLANNER_OVERSHOOT, max(errors)


def test_the_warning_margin_covers_the_committed_oom_and_stays_within_the_measured_reserve():
    oom = _committed_oom()
    fragmentation = oom["unallocated"] / oom["allocated"]  # what emptying the cache could not give back
    context = oom["in_use"] - oom["allocated"] - oom["unallocated"]
    assert 0 < fragmentation < RESERVE_FRACTION and 0 < context * GIB <= OUTSIDE_ALLOCATOR, (fragmentation, context)
    # What max_memory_reserved adds over max_memory_allocated on the runs that trained: the margin
    # stays below what the allocator typically held, it is not added on top of it.
    added = sorted((r["peak_mem_reserved_gib"] - r["peak_mem_alloc_gib"]) / r["peak_mem_alloc_gib"]
                   for r in _trained((1, 2)))
    assert RESERVE_FRACTION <= added[len(added) // 2], added


def test_the_8b_run_on_one_gpu_warns_and_names_fp32_gradients():
    """The issue's command (bf16 gradients by default) on the committed H200: within the margin, a
    warning, with the fp32 gradients that leave room; on a smaller GPU a refusal that names them
    before it says "use more GPUs"."""
    capacity = int(_committed_oom()["capacity"] * GIB)
    cfg = load_config(["--model.preset", "8b", "--data.seq_len", "4096", "--data.local_batch", "1",
                       "--parallel.activation_checkpointing", "true"])
    level, line = memory_check(cfg, 1, capacity)
    assert level == "warn" and "within the 5% allocator margin" in line and "\n" not in line, line
    assert "--parallel.main_grads_dtype fp32" in line, line
    fp32 = estimate_run(load_config(["--model.preset", "8b", "--data.seq_len", "4096", "--data.local_batch", "1",
                                     "--parallel.activation_checkpointing", "true",
                                     "--parallel.main_grads_dtype", "fp32"]), 1)
    level, line = memory_check(cfg, 1, fp32.device_bytes)
    assert level == "refuse" and "does not fit" in line and "--parallel.main_grads_dtype fp32" in line, line
    level, line = memory_check(cfg, 1, 60 * GIB)
    assert level == "refuse" and "gradient dtype fits: use more GPUs" in line, line


def test_trainer_warns_within_the_margin_and_refuses_beyond_it(monkeypatch):
    capacity = int(_committed_oom()["capacity"] * GIB)
    said = []
    trainer = types.SimpleNamespace(
        cfg=load_config(["--model.preset", "8b", "--data.seq_len", "4096", "--data.local_batch", "1",
                         "--parallel.activation_checkpointing", "true"]),
        world=1, device=torch.device("cuda"), log=said.append)
    monkeypatch.setattr(loop, "device_memory", lambda device: capacity)
    loop.Trainer.check_memory(trainer)
    assert len(said) == 1 and said[0].startswith("mfsdp train: warning: predicted peak memory"), said
    monkeypatch.setattr(loop, "device_memory", lambda device: 100 * GIB)
    with pytest.raises(loop.RunFailed, match="does not fit this GPU's 100.00 GiB"):
        loop.Trainer.check_memory(trainer)
