"""Predicted against measured peak memory: ``mfsdp.memory.estimate`` vs ``torch.cuda.max_memory_allocated``.

For each grid point that the planner says fits, every rank builds the model as ``mfsdp train``
does (a bundled preset, dense or mixture of experts, on the meta device, ``parallelize``; or a
Hugging Face Llama-3.2-1B shape through the manager, at tp=1 or, with ``--tp``, tensor parallel
with sequence parallel and the vocabulary-parallel loss), runs ``--warmup`` steps of the training
loop's step (a bundled model computes its loss in its head from the labels, ``--head-loss``, as
``mfsdp train`` runs it; a Hugging Face one returns logits, kept, for the fp32 cross entropy; plus the
MoE load-balancing loss, gradient clipping, foreach AdamW, ``zero_grad(set_to_none=True)``), resets
the peak and measures one more step. Rank 0
prints and writes a Markdown table: predicted and measured peak (GiB), the error, and the phase
the planner names. Rank 0 makes every point's estimate and sends it to the others (it is the same on
every rank); a tensor-parallel estimate runs in a spawned child process (over a fake process group of
its own), so it leaves nothing behind in the measured run's process.

    torchrun --nproc-per-node 2 benchmarks/memory_accuracy.py --models 1b 8b --out benchmarks/results/memory_accuracy_ws2.md
    torchrun --nproc-per-node 2 benchmarks/memory_accuracy.py --models hf-1b --tp 2 --placements zero3 zero1
    torchrun --nproc-per-node 2 benchmarks/memory_accuracy.py --models moe-1b --expert-units on off

``--device cpu`` is a smoke mode (gloo, no peak to measure: the measured column stays empty), e.g.
``--device cpu --models hf-tiny moe-tiny --tp 2 --seq-len 32`` on two processes.
"""

from __future__ import annotations

import argparse
import contextlib
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
HF_SHAPES = {"hf-1b": HF_1B, "hf-tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                             use_cache=False, max_position_embeddings=256)}


def build_bundled(preset, placements, ac, world, policy, device, expert_units=False, head_loss="plain"):
    from mfsdp.mesh import build_mesh
    from mfsdp.models import build_model, get_config
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    cfg = get_config(preset)
    with torch.device("meta"):
        model = build_model(cfg, dtype=torch.bfloat16)
    model.set_head_loss(head_loss)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    mesh = build_mesh(device.type, world)
    parallelize(model, mesh, ParallelizeConfig(placements=placements, mixed_precision=policy,
                                               activation_checkpointing=ac, expert_units=expert_units))
    return model, cfg.vocab_size


def build_hf(name, placements, ac, world, grad_fp32, device, tp=1):
    import transformers

    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
    from mfsdp.hf.sharded import meta_model_from_config

    strategy = {"zero3": 3, "zero2": 2, "zero1": 1}[placements]
    config = MegatronFSDPConfig(zero_dp_strategy=strategy, grad_reduce_in_fp32=grad_fp32,
                                activation_checkpointing=ac, init_fsdp_with_meta_device=True,
                                sequence_parallel=tp > 1, loss_parallel=tp > 1)
    model = meta_model_from_config(transformers.LlamaConfig(**HF_SHAPES[name]), dtype=torch.bfloat16)
    mesh = build_device_mesh(device.type, tp_size=tp, world_size=world)
    model, _ = MegatronFSDPManager(config, mesh).parallelize(model)
    return model, HF_SHAPES[name]["vocab_size"]


def step(model, opt, x, y):
    with getattr(model, "loss_context", contextlib.nullcontext)():  # the manager's loss_parallel()
        if hasattr(model, "set_head_loss"):  # the bundled Llama: the loss in its head, as mfsdp train runs it
            logits = None
            loss_sum, count = model(x, labels=y)
            loss = loss_sum / count
        else:
            logits = model(x)
            logits = getattr(logits, "logits", logits)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if hasattr(model, "aux_loss") and model.moe_layers():  # what mfsdp train adds for a MoE
            loss = loss + model.cfg.moe_aux_loss_coef * model.aux_loss()
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
    ap.add_argument("--models", nargs="+", default=["1b", "8b"],
                    help="bundled presets (1b, 8b, moe-1b, tiny, moe-tiny) and/or hf-1b, hf-tiny")
    ap.add_argument("--placements", nargs="+", default=["zero3", "zero2", "zero1"])
    ap.add_argument("--ac", nargs="+", default=["off", "on"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size of the hf-* models (the manager, with sequence parallel and the "
                         "parallel loss); bundled presets always run tp=1")
    ap.add_argument("--expert-units", nargs="+", default=["off"], choices=["off", "on"],
                    help="MoE presets: experts sharded with their block (off) or as units of their own (on)")
    ap.add_argument("--head-loss", default="plain", choices=["plain", "fused"],
                    help="the bundled models' head loss (mfsdp train --model.head_loss); Hugging Face models: plain")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--grad-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="main gradients and reduction dtype (mfsdp train's default is bf16)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run, nothing measured")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mfsdp
    from mfsdp.memory import estimate
    from mfsdp.memory.estimate import CUBLAS_WORKSPACES

    cuda = args.device == "cuda"
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    gpu = torch.cuda.mem_get_info(device)[1] if cuda else float("inf")
    grads = torch.float32 if args.grad_dtype == "fp32" else None
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=grads)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    # The estimates are the same on every rank (the planner predicts rank 0's memory): rank 0 makes
    # them and hands them out, so a tensor-parallel point spawns one estimating child, not one per rank.
    # With the default group up, that estimate runs in its spawned child (``estimate``'s rule), which
    # leaves nothing in the measured process.
    points = []
    for name, placements, ac, batch, experts in itertools.product(args.models, args.placements, args.ac,
                                                                  args.batches, args.expert_units):
        moe = name.startswith("moe-")
        if experts == "on" and not moe:
            continue
        tp = args.tp if name.startswith("hf-") else 1
        t0 = time.perf_counter()
        e = None
        if rank == 0:
            e = estimate(estimate_target(name), world_size=world, placements=placements,
                         mixed_precision_policy=policy, local_batch=batch, seq_len=args.seq_len,
                         activation_checkpointing=ac == "on", expert_units=experts == "on", tensor_parallel=tp,
                         device=args.device, head_loss="plain" if name in HF_SHAPES else args.head_loss)
        label = (f"{name}{f' tp={tp}' if tp > 1 else ''}{' expert units' if experts == 'on' else ''} {placements} "
                 f"ac={ac} b={batch}" + (" fused loss" if args.head_loss == "fused" and name not in HF_SHAPES else ""))
        points.append((name, placements, ac == "on", batch, experts == "on", tp, label, e, time.perf_counter() - t0))
    box = [points]
    dist.broadcast_object_list(box, src=0)
    points = box[0]
    rows = []
    for name, placements, ac, batch, experts, tp, label, e, plan_s in points:
        if e.device_bytes > gpu:
            rows.append((label, e.peak_bytes, None, None, f"skipped: needs {e.device_bytes / GIB:.1f} GiB", plan_s))
            continue
        measured, predicted = measure_point(args, name, placements, ac, batch, experts, tp, world, policy, device, e,
                                            CUBLAS_WORKSPACES)
        err = (predicted - measured) / measured if measured else None
        rows.append((label, predicted, measured, err, e.peak_phase, plan_s))
        if rank == 0:
            got = f"measured {measured / GIB:.2f} GiB ({100 * err:+.1f} %)" if measured else "ran (cpu: not measured)"
            print(f"{label}: predicted {predicted / GIB:.2f} GiB, {got} at {e.peak_phase}", flush=True)
    if rank == 0:
        table = render(rows, world, args)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table + "\n")
    dist.destroy_process_group()


def measure_point(args, name, placements, ac, batch, experts, tp, world, policy, device, e, workspaces):
    """Build the point's model, run warmup steps and one measured step; (measured peak over the ranks
    or None on CPU, the prediction less the workspaces an earlier point already allocated)."""
    import mfsdp

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if name.startswith("hf-"):
        model, vocab = build_hf(name, placements, ac, world, args.grad_dtype == "fp32", device, tp)
    else:
        model, vocab = build_bundled(name, placements, ac, world, policy, device, experts, args.head_loss)
    opt = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True))
    g = torch.Generator().manual_seed(dist.get_rank() // tp)  # the ranks of one tp group read the same batch
    x = torch.randint(0, vocab, (batch, args.seq_len), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, args.seq_len), generator=g).to(device)
    for _ in range(args.warmup):
        step(model, opt, x, y)
    measured = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    step(model, opt, x, y)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) - base], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        measured = int(peak)
    # Workspaces the process already holds (from an earlier grid point) are in ``base``.
    predicted = e.peak_bytes - (workspaces if base >= workspaces // 2 else 0)
    del model, opt, x, y
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return measured, predicted


def estimate_target(name: str):
    if name in HF_SHAPES:
        import transformers

        return transformers.LlamaConfig(**HF_SHAPES[name])
    return name


def render(rows, world, args) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run, nothing measured)"
    flags = (f"--models {' '.join(args.models)} --placements {' '.join(args.placements)} --ac {' '.join(args.ac)} "
             f"--batches {' '.join(map(str, args.batches))} --seq-len {args.seq_len} --grad-dtype {args.grad_dtype}"
             + (f" --tp {args.tp}" if args.tp > 1 else "")
             + (f" --expert-units {' '.join(args.expert_units)}" if args.expert_units != ["off"] else "")
             + (" --head-loss fused" if args.head_loss == "fused" else "")
             + (" --device cpu" if args.device == "cpu" else ""))
    lines = [f"# Memory planner accuracy, {world} x {device}, torch {torch.__version__}",
             "", f"seq {args.seq_len}, bf16 compute, fp32 main weights, {args.grad_dtype} gradients, foreach AdamW. "
             "Measured: the highest rank's `max_memory_allocated` over one steady-state step, less what was "
             "allocated before the model was built. MoE: the planner assumes uniform routing.", "",
             f"Command: `torchrun --nproc-per-node {world} benchmarks/memory_accuracy.py {flags}`", "",
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
