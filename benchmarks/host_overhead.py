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
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mfsdp  # noqa: E402
from mfsdp.models.llama import Llama, LlamaConfig  # noqa: E402
from mfsdp.models.parallelize import sharding_units  # noqa: E402


def build(impl: str, cfg: LlamaConfig, mesh):
    """bf16 compute, fp32 main weights and reductions, one unit per block (as in throughput.py)."""
    if impl == "mfsdp":
        model = Llama(cfg, dtype=torch.bfloat16)
        policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
        for unit in sharding_units(model):
            mfsdp.fully_shard(unit, mesh, mixed_precision_policy=policy)
        mfsdp.fully_shard(model, mesh, mixed_precision_policy=policy)
        return model, mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Llama(cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="mfsdp,fsdp2")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cprofile", action="store_true", help="print each implementation's hottest functions")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    cfg = LlamaConfig(dim=64, n_layers=args.layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                      max_seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    for impl in args.impl.split(","):
        torch.manual_seed(0)
        model, optimizer = build(impl, cfg, mesh)

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
