"""The AdamW step of one parameter group on the GPU: torch's fused kernel (after the fp32 upcast of
bf16 gradients, as torch's optimizers want) against ``mfsdp.flat_adamw``'s update compiled several
ways, on one flat group of N fp32 weights (an 8B Llama block: 218M). Prints one JSON line per
variant: milliseconds per step and the bytes it must move over that time.

    python3 benchmarks/adamw_bench.py [--numel 218103808] [--iters 20] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch

from mfsdp.flat_adamw import adamw_update

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def variants(n: int):
    p, m, v = (torch.rand(n, device="cuda") for _ in range(3))
    g = torch.randn(n, device="cuda").to(torch.bfloat16)
    lr, step = torch.tensor(3e-4, device="cuda"), torch.tensor(10.0, device="cuda")
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def fused():  # what the bound step did before: upcast, then torch's fused kernel
        param.grad = g.float()
        opt.step()

    yield "torch fused + upcast", fused, 6 + 28
    yield "flat eager", lambda: adamw_update(p, g, m, v, lr, step, **HYPER), 26
    for name, kwargs in (("flat compiled dynamic", dict(dynamic=True)), ("flat compiled static", dict(dynamic=False)),
                         ("flat compiled static, coordinate descent", dict(dynamic=False, options={
                             "coordinate_descent_tuning": True}))):
        torch.compiler.reset()
        compiled = torch.compile(adamw_update, fullgraph=True, **kwargs)
        yield name, (lambda c=compiled: c(p, g, m, v, lr, step, **HYPER)), 26


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=218_103_808)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    for name, fn, nbytes in variants(args.numel):
        ms = timed(fn, args.iters)
        row = {"variant": name, "numel": args.numel, "ms": round(ms, 3),
               "tb_per_s": round(nbytes * args.numel / ms / 1e9, 3), "torch": torch.__version__}
        print(json.dumps(row))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
