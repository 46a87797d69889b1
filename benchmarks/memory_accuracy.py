"""Predicted against measured peak memory: ``mfsdp.memory.estimate`` vs ``torch.cuda.max_memory_allocated``.

For each grid point that the planner says fits, every rank builds the model as ``mfsdp train``
does (bundled Llama on the meta device, ``parallelize``; or a Hugging Face Llama-3.2-1B shape through
the manager), runs ``--warmup`` steps of the training loop's step (logits kept, fp32 cross entropy,
gradient clipping, foreach AdamW, ``zero_grad(set_to_none=True)``), resets the peak and measures one
more step. Rank 0 prints and writes a Markdown table: predicted and measured peak (GiB), the error,
and the phase the planner names.

    torchrun --nproc-per-node 2 benchmarks/memory_accuracy.py --models 1b 8b --out benchmarks/results/memory_accuracy_ws2.md
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

GIB = 1 << 30
HF_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, use_cache=False,
             max_position_embeddings=8192, rope_theta=500000.0)


def build_bundled(preset, placements, ac, world, policy, device):
    from mfsdp.models import build_model, get_config
    from mfsdp.models.parallelize import ParallelizeConfig, build_mesh, parallelize

    cfg = get_config(preset)
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    mesh = build_mesh("cuda", world, placements)
    parallelize(model, mesh, ParallelizeConfig(placements=placements, mixed_precision=policy,
                                               activation_checkpointing=ac))
    return model, cfg.vocab_size


def build_hf(placements, ac, world, grad_fp32, device):
    import transformers

    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
    from mfsdp.manager.hf_checkpoint import meta_model_from_config

    strategy = {"zero3": 3, "zero2": 2, "zero1": 1}[placements]
    config = MegatronFSDPConfig(zero_dp_strategy=strategy, grad_reduce_in_fp32=grad_fp32,
                                activation_checkpointing=ac, init_fsdp_with_meta_device=True)
    model = meta_model_from_config(transformers.LlamaConfig(**HF_1B), dtype=torch.bfloat16)
    model, _ = MegatronFSDPManager(config, build_device_mesh("cuda", world_size=world)).parallelize(model)
    return model, HF_1B["vocab_size"]


def step(model, opt, x, y):
    logits = model(x)
    logits = getattr(logits, "logits", logits)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], help="1b, 8b (bundled) and/or hf-1b")
    ap.add_argument("--placements", nargs="+", default=["zero3", "zero2", "zero1"])
    ap.add_argument("--ac", nargs="+", default=["off", "on"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--grad-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="main gradients and reduction dtype (mfsdp train's default is bf16)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mfsdp
    from mfsdp.memory import estimate
    from mfsdp.memory.estimate import CUBLAS_WORKSPACES

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    gpu = torch.cuda.mem_get_info(device)[1]
    grads = torch.float32 if args.grad_dtype == "fp32" else None
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=grads)
    rows = []
    for name, placements, ac, batch in itertools.product(args.models, args.placements, args.ac, args.batches):
        ac = ac == "on"
        target = estimate_target(name)
        t0 = time.perf_counter()
        e = estimate(target, world_size=world, placements=placements, mixed_precision_policy=policy,
                     local_batch=batch, seq_len=args.seq_len, activation_checkpointing=ac)
        plan_s = time.perf_counter() - t0
        label = f"{name} {placements} ac={'on' if ac else 'off'} b={batch}"
        if e.device_bytes > gpu:
            rows.append((label, e.peak_bytes, None, None, f"skipped: needs {e.device_bytes / GIB:.1f} GiB", plan_s))
            continue
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        if name == "hf-1b":
            model, vocab = build_hf(placements, ac, world, args.grad_dtype == "fp32", device)
        else:
            model, vocab = build_bundled(name, placements, ac, world, policy, device)
        opt = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True))
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, vocab, (batch, args.seq_len), generator=g).to(device)
        y = torch.randint(0, vocab, (batch, args.seq_len), generator=g).to(device)
        for _ in range(args.warmup):
            step(model, opt, x, y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        step(model, opt, x, y)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated(device) - base
        # Workspaces the process already holds (from an earlier grid point) are in ``base``.
        predicted = e.peak_bytes - (CUBLAS_WORKSPACES if base >= CUBLAS_WORKSPACES // 2 else 0)
        peaks = [torch.tensor([measured], device=device) for _ in range(world)]
        dist.all_gather(peaks, torch.tensor([measured], device=device))
        measured = max(int(p) for p in peaks)
        rows.append((label, predicted, measured, (predicted - measured) / measured, e.peak_phase, plan_s))
        if rank == 0:
            print(f"{label}: predicted {predicted / GIB:.2f} GiB, measured {measured / GIB:.2f} GiB "
                  f"({100 * (predicted - measured) / measured:+.1f} %) at {e.peak_phase}", flush=True)
        del model, opt, x, y
        gc.collect()
        torch.cuda.empty_cache()
    if rank == 0:
        table = render(rows, world, args)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
    dist.destroy_process_group()


def estimate_target(name: str):
    if name == "hf-1b":
        import transformers

        return transformers.LlamaConfig(**HF_1B)
    return name


def render(rows, world, args) -> str:
    lines = [f"# Memory planner accuracy, {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}",
             "", f"seq {args.seq_len}, bf16 compute, fp32 main weights, {args.grad_dtype} gradients, foreach AdamW. "
             "Measured: the highest rank's `max_memory_allocated` over one steady-state step, less what was "
             "allocated before the model was built.", "",
             f"Command: `torchrun --nproc-per-node {world} benchmarks/memory_accuracy.py "
             f"--models {' '.join(args.models)} --grad-dtype {args.grad_dtype}`", "",
             "| point | predicted GiB | measured GiB | error | peak phase (predicted) | plan s |",
             "|---|---|---|---|---|---|"]
    for label, pred, meas, err, phase, plan_s in rows:
        if meas is None:
            lines.append(f"| {label} | {pred / GIB:.2f} | – | – | {phase} | {plan_s:.1f} |")
        else:
            lines.append(f"| {label} | {pred / GIB:.2f} | {meas / GIB:.2f} | {100 * err:+.1f} % | {phase} | {plan_s:.1f} |")
    errs = [abs(r[3]) for r in rows if r[3] is not None]
    if errs:
        lines += ["", f"Worst error {100 * max(errs):.1f} %; {sum(e <= 0.05 for e in errs)}/{len(errs)} points within 5 %, "
                  f"{sum(e <= 0.02 for e in errs)}/{len(errs)} within 2 %."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
