"""Time a rank's experts (``mfsdp.experts.grouped.expert_swiglu``) forward and backward on CUDA: the
grouped GEMM against the per-expert loop, at the bundled moe-1b's shape and at a Qwen3-30B-A3B
rank's share under ep 8 (16 local experts). Prints a table of medians and the ratio loop / grouped.

    python benchmarks/experts_gemm.py            # needs a GPU
"""

from __future__ import annotations

import statistics
import sys
from unittest import mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mfsdp

from mfsdp import _compat
from mfsdp.experts.grouped import expert_swiglu

SHAPES = {  # name: (local experts, hidden, expert width, rows = tokens x top_k reaching this rank)
    "moe-1b (8 experts, top 2, 8192 tokens)": (8, 1024, 1792, 8192 * 2),
    "Qwen3-30B-A3B at ep 8 (16 local, 4096 tokens x 8)": (16, 2048, 768, 4096 * 8),
}


def time_ms(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, grouped_mm: {_compat.has_grouped_mm()}")
    print("| shape | grouped ms | loop ms | loop / grouped |\n| --- | ---: | ---: | ---: |")
    for name, (e, d, f, rows) in SHAPES.items():
        counts = torch.multinomial(torch.ones(e), rows, replacement=True, generator=torch.Generator().manual_seed(0))
        counts = torch.bincount(counts, minlength=e).tolist()
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        gate_up = (torch.randn(e, 2 * f, d, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
        down = (torch.randn(e, d, f, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
        probe = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, generator=g)

        def step():
            (expert_swiglu(x, counts, gate_up, down, torch.nn.functional.silu) * probe).sum().backward()

        grouped = time_ms(step)
        with mock.patch.object(_compat, "has_grouped_mm", return_value=False):  # expert_swiglu takes the loop
            loop = time_ms(step)
        print(f"| {name} | {grouped:.2f} | {loop:.2f} | {loop / grouped:.2f}x |")


if __name__ == "__main__":
    main()
