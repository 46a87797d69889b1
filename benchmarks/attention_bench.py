"""Forward+backward time and memory of one block's causal attention at a model's shape, per SDPA
backend and per way of handing it grouped key/value heads.

    python benchmarks/attention_bench.py                      # the 8B shape: 1 x 4096, 32 heads, 8 kv, 128
    python benchmarks/attention_bench.py --cpu-smoke          # tiny, on the CPU: checks the harness only

Variants: ``expand`` repeats each key/value head for its query heads before SDPA (what
``mfsdp.models.llama.Attention`` does), ``gqa`` passes the grouped heads with ``enable_gqa=True``.
Each runs under one ``sdpa_kernel`` backend (flash, cudnn, efficient); a backend that refuses the
inputs shows as its status. Time: CUDA events around each step after the warm-up, the median of
``--iters``. Memory: what the forward keeps for the backward (allocated after the forward minus
before it). Each variant's output and gradients are compared with flash + expand's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def expand(t: torch.Tensor, repeats: int) -> torch.Tensor:
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, repeats, s, d).reshape(b, h * repeats, s, d)


def attention(q, k, v, way: str):
    if way == "gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeats = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, expand(k, repeats), expand(v, repeats), is_causal=True)


def run(args, backend: str, way: str, inputs, reference):
    q, k, v, g = inputs
    cuda = q.is_cuda
    times, kept = [], None
    try:
        with sdpa_kernel([BACKENDS[backend]]):
            for i in range(args.warmup + args.iters):
                before = torch.cuda.memory_allocated() if cuda else 0
                start = time.perf_counter()
                if cuda:
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                out = attention(q, k, v, way)
                if i == 0 and cuda:
                    torch.cuda.synchronize()
                    kept = (torch.cuda.memory_allocated() - before) / 2**20
                grads = torch.autograd.grad(out, (q, k, v), g)
                if cuda:
                    t1.record()
                    torch.cuda.synchronize()
                    ms = t0.elapsed_time(t1)
                else:
                    ms = (time.perf_counter() - start) * 1e3
                if i >= args.warmup:
                    times.append(ms)
    except RuntimeError as err:  # the backend refuses these inputs
        return {"backend": backend, "way": way, "status": str(err).splitlines()[0][:160]}
    rel = None
    if reference is not None:
        ref_out, ref_grads = reference
        rel = max(float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())
                  for a, b in zip((out, *grads), (ref_out, *ref_grads)))
    return {"backend": backend, "way": way, "status": "ok", "ms_median": statistics.median(times),
            "ms_min": min(times), "kept_mib": kept, "max_rel_diff_vs_first": rel, "result": (out, grads)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default="flash,cudnn,efficient")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="append one JSON line per variant here")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, math backend, fp32, on the CPU")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.backends = 16, 4, 2, 8, "math"
        args.iters, args.warmup = 2, 1
    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)

    def rand(h):
        return torch.randn(1, h, args.seq, args.head_dim, device=device, dtype=dtype, generator=gen)

    q, k, v, g = rand(args.heads).requires_grad_(), rand(args.kv_heads).requires_grad_(), \
        rand(args.kv_heads).requires_grad_(), rand(args.heads)
    records, reference = [], None
    for backend in args.backends.split(","):
        for way in ("expand", "gqa"):
            r = run(args, backend, way, (q, k, v, g), reference)
            result = r.pop("result", None)
            if reference is None and result is not None:
                reference = result
                r["max_rel_diff_vs_first"] = 0.0
            r.update(seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__)
            print(json.dumps(r), flush=True)
            records.append(r)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()
