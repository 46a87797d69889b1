"""The transformers + PEFT LoRA row: how fast the usual LoRA fine-tune runs on one GPU, the figure
``mfsdp train --peft.method lora`` is compared with.

A Hugging Face causal LM in bf16 (random weights from ``mfsdp.hf.random_model.SHAPES[--shape]``, built on
the device, or ``--hf DIR`` loaded with ``from_pretrained``), SDPA attention,
``peft.get_peft_model`` with LoRA r 16, alpha 32, dropout 0 on every linear but the head, fused
AdamW (lr 2e-4, weight decay 0) on the adapters, no autocast, adapters in PEFT's default dtype
(reported: fp32, since ``autocast_adapter_dtype=True`` upcasts bf16 adapters), loss
``model(ids, labels=ids).loss / microbatches`` on seeded random tokens. The 8B row (one H200, 1 x 4096 x 4 tokens per step):

    python benchmarks/peft_lora.py --shape llama3-8b --local-batch 1 --seq 4096 --microbatches 4 \\
        --steps 12 --warmup 4 --out benchmarks/results/peft_lora.jsonl

Each step is bracketed by ``torch.cuda.synchronize()`` and timed on the host clock; tok/s is the
tokens of a step over the median timed step; peak memory is ``torch.cuda.max_memory_allocated``
over the timed steps. Columns: impl | shape | batch x seq x microbatches | tok/s | step s |
peak GiB | trainable / total | adapter dtype. CPU smoke run:
``python benchmarks/peft_lora.py --shape tiny --seq 64 --steps 3 --warmup 1 --microbatches 2``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mfsdp

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from mfsdp.hf.random_model import SHAPES, model_config  # noqa: E402


def build(args, device: torch.device):
    """The bf16 base model (random from ``--shape`` or loaded from ``--hf``) wrapped by PEFT's LoRA."""
    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    if args.hf:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, device_map=device, **kw)
    else:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(model_config(args.shape), **kw)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                           task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora)


def run(args) -> dict:
    """Warm-up and timed steps; the result line."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model = build(args, device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0, fused=True)
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n_steps = args.warmup + args.steps
    batches = torch.randint(0, vocab, (n_steps, args.microbatches, args.local_batch, args.seq),
                            generator=gen, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses = [], []
    for step in range(n_steps):
        if step == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for ids in batches[step]:
            loss = model(input_ids=ids, labels=ids).loss / args.microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(total.item())
    step_s = statistics.median(times[args.warmup:])
    tokens = args.local_batch * args.seq * args.microbatches
    return dict(
        impl="peft", shape=args.hf or args.shape, local_batch=args.local_batch, seq=args.seq,
        microbatches=args.microbatches, gradient_checkpointing=args.gradient_checkpointing,
        tokens_per_s=tokens / step_s, step_s=step_s, step_times_s=times[args.warmup:],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        trainable=sum(p.numel() for p in params), total=sum(p.numel() for p in model.parameters()),
        adapter_dtype=str(params[0].dtype).removeprefix("torch."), loss_first=losses[0],
        loss_last=losses[-1], device=torch.cuda.get_device_name() if cuda else "cpu",
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      peft=peft.__version__))


def row(r: dict) -> str:
    """One markdown table row of a result line."""
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    return (f"| {r['impl']} | {r['shape']} | {r['local_batch']} x {r['seq']} x {r['microbatches']} "
            f"| {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {peak} "
            f"| {r['trainable'] / 1e6:,.2f}M / {r['total'] / 1e6:,.2f}M | {r['adapter_dtype']} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--hf", help="a Hugging Face model directory to load instead of --shape")
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps before them")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="append the result as one JSON line to this file")
    args = p.parse_args(argv)
    if min(args.local_batch, args.seq, args.microbatches, args.steps) < 1 or args.warmup < 0:
        p.error("--local-batch, --seq, --microbatches and --steps must be >= 1, --warmup >= 0")
    result = run(args)
    print(f"versions {result['versions']}, device {result['device']}, loss "
          f"{result['loss_first']:.3f} -> {result['loss_last']:.3f}")
    print(row(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
