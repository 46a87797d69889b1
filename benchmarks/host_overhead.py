"""Host (Python) time per training step of mfsdp and FSDP2 on a small CPU model, one process.

With one rank the collectives are local copies and the model is tiny, so the step time is almost
all host work: the model's own op dispatch plus each library's hooks. This is the cost that makes a
GPU step launch-bound when kernels are short.

    torchrun --nproc-per-node 1 benchmarks/host_overhead.py [--layers 16] [--steps 20] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _impls import BUILDERS, Ctx  # noqa: E402  (the builders throughput.py measures)
from mfsdp.models.llama import LlamaConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="mfsdp,fsdp2")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cprofile", action="store_true", help="print each implementation's hottest functions")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = LlamaConfig(dim=64, n_layers=args.layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                      max_seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    for impl in args.impl.split(","):
        torch.manual_seed(0)
        # bf16 compute, fp32 main weights and reductions, as throughput.py runs them
        built = BUILDERS[impl](Ctx(cfg, torch.device("cpu"), dist.get_world_size(), torch.bfloat16,
                                   torch.float32, ac=False, compile=False))
        model, optimizer = built.model, built.optimizer

        def step():
            model(tokens).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"{impl}: {times[len(times) // 2] * 1e3:.2f} ms/step median over {args.steps} steps, "
              f"{args.layers} blocks", flush=True)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(10):
                step()
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
