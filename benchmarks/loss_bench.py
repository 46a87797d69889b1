"""Forward+backward time and peak memory of the output head with its cross-entropy: the plain path
against ``mfsdp.models.loss.linear_cross_entropy``, both eager and under ``torch.compile``.

Variants (each returns a loss sum and a count; the step backprops ``sum / count``, so the
``grad_output`` scaling a trainer relies on is part of what is timed):
- ``plain``: ``cross_entropy_sum(F.linear(h, w), labels)``, the fp32 cross-entropy on the whole logits.
- ``fused``: ``linear_cross_entropy(h, w, labels)``, chunked over tokens, eager.
- ``fused_compiled``: the same under ``torch.compile(fullgraph=True)``. A graph break shows as its status.
- ``plain_compiled``: the plain path under ``torch.compile(fullgraph=True)``, the honest peer:
  inductor fuses the cross-entropy's elementwise work itself.

Time: CUDA events around each step after the warm-up (which holds the compilation), the median
and the range of ``--iters`` steps. Peak: ``torch.cuda.max_memory_allocated`` over the timed steps
minus what was allocated before them (the inputs; the gradients made by each step count). Each
variant also reports how far its loss and gradients lie from the plain eager variant's (the
relative norm of the difference), a check of the real shape in bf16.

    python benchmarks/loss_bench.py                 # the H200: N = 4096 and 8192, D = 4096, V = 128256, bf16
    python benchmarks/loss_bench.py --cpu-smoke     # tiny shapes on CPU, fp32: checks the harness only

One JSON line per variant and shape on stdout, appended to ``--out`` (default ``$OUT/loss_bench.jsonl``
when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mfsdp
from mfsdp.models.loss import cross_entropy_sum, default_chunk_tokens, linear_cross_entropy  # noqa: E402

VARIANTS = ("plain", "fused", "fused_compiled", "plain_compiled")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,8192", help="comma-separated token counts N")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--chunk-tokens", type=int, default=None, help="fused chunk size (default: the module's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ignored", type=float, default=0.05, help="share of labels set to -100")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--out", default=None, help="JSON lines file (default: $OUT/loss_bench.jsonl if $OUT is set)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU, fp32, N = 40, D = 16, V = 300 in 2 uneven chunks, 2 warm-up and 3 timed steps, aot_eager")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/loss_bench.py", *argv])
    if args.cpu_smoke:
        args.tokens, args.dim, args.vocab, args.dtype = "40", 16, 300, "fp32"
        args.iters, args.warmup, args.compile_backend = 3, 2, "aot_eager"
        args.chunk_tokens = 24 if args.chunk_tokens is None else args.chunk_tokens
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "loss_bench.jsonl")
    return args


def plain(h, w, labels, chunk_tokens=None):
    return cross_entropy_sum(F.linear(h, w), labels)


def fused(h, w, labels, chunk_tokens=None):
    return linear_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens)


def make_fn(variant: str, backend: str):
    fn = fused if variant.startswith("fused") else plain
    if variant.endswith("_compiled"):
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    return fn


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


class Timer:
    """Step times: CUDA events on a GPU, read after one synchronize at the end; the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, begin) -> None:
        self.pairs.append((begin, self.start()))

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [b.elapsed_time(e) for b, e in self.pairs]
        return [(e - b) * 1e3 for b, e in self.pairs]


def bench_shape(n: int, args, device: torch.device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, args.dim, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(args.vocab, args.dim, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (n,), device=device, generator=gen)
    labels[torch.rand(n, device=device, generator=gen) < args.ignored] = -100
    chunk = args.chunk_tokens or default_chunk_tokens(args.vocab)
    common = {"bench": "loss", "tokens": n, "dim": args.dim, "vocab": args.vocab, "dtype": args.dtype,
              "iters": args.iters, "warmup": args.warmup, "device": device_name(device),
              "torch": torch.__version__, "command": args.command}
    reference: dict = {}
    records = []
    for variant in args.variants.split(","):
        record = {**common, "variant": variant,
                  "chunk_tokens": chunk if variant.startswith("fused") else None,
                  "compile_backend": args.compile_backend if variant.endswith("_compiled") else None}
        try:
            record.update(measure(variant, args, h, w, labels))
            record.update(compare(h, w, record, reference, variant))
            record["status"] = "ok"
        except torch.cuda.OutOfMemoryError as e:
            record["status"] = f"oom: {str(e)[:200]}"
        except Exception as e:  # a compile failure or graph break is a result, not the end of the run
            record["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(record)
        emit(record, args.out)
    return records


def measure(variant, args, h, w, labels) -> dict:
    device = h.device
    cuda = device.type == "cuda"
    fn = make_fn(variant, args.compile_backend)

    def step():
        h.grad = w.grad = None
        loss, count = fn(h, w, labels, args.chunk_tokens)
        (loss / count).backward()
        return loss, count

    for _ in range(args.warmup):
        step()
    h.grad = w.grad = None
    base = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    timer = Timer(device)
    for _ in range(args.iters):
        begin = timer.start()
        loss, count = step()
        timer.stop(begin)
    times = timer.times_ms()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB if cuda else None
    loss = loss.detach()
    return {"ms_median": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "peak_gib": peak, "loss": float(loss), "count": int(count), "_loss": loss}


def compare(h, w, record: dict, reference: dict, variant: str) -> dict:
    """Relative distances of this variant's loss and gradients from the plain eager variant's."""
    loss = record.pop("_loss")
    if variant == "plain":
        reference.update(loss=loss, grad_h=h.grad.clone(), grad_w=w.grad.clone())
    if not reference:
        return {}
    return {"loss_rel_diff": rel_diff(loss, reference["loss"]),
            "grad_hidden_rel_diff": rel_diff(h.grad, reference["grad_h"]),
            "grad_weight_rel_diff": rel_diff(w.grad, reference["grad_w"])}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    records = []
    for n in (int(t) for t in args.tokens.split(",")):
        records += bench_shape(n, args, device)
    return records


if __name__ == "__main__":
    main()
