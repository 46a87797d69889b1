"""The manager on GPUs: a 1B Llama-shaped HF model, tensor parallel against data parallel and FSDP2 + torch TP.

    torchrun --nproc-per-node 2 benchmarks/hf_manager.py --tp 2 [--impl mfsdp,fsdp2,mfsdp-dp]
        [--no-sp] [--no-loss-parallel] [--tp-path local|dtensor] [--profile DIR] [--out FILE]

Implementations, one after the other in one job, on the same HF model and the same tokens per
data-parallel rank:

- ``mfsdp``: ``MegatronFSDPManager`` over (dp, tp) with the built-in TP plan, sequence parallel
  and the vocabulary-parallel loss (when tp > 1; ``--no-sp`` / ``--no-loss-parallel`` turn them off);
  ``--tp-path`` picks ``MegatronFSDPConfig.tp_activation_path`` (default ``local``: local tensors
  and explicit collectives inside the blocks; ``dtensor``: torch's ParallelStyles, as FSDP2 + TP);
- ``fsdp2``: the same plan (``mfsdp.manager.tp_plans``, so SP and the parallel loss too) applied
  with torch's ``parallelize_module``, then ``torch.distributed.fsdp.fully_shard`` per decoder
  layer and on the root over the dp axis, bf16 params and fp32 reduction: FSDP2 + torch TP as
  torchtitan composes them;
- ``mfsdp-dp``: the manager with tp = 1, ZeRO-3 over every rank (the data-parallel baseline).

Per implementation:

1. Parity (fp32, ``--parity-seq`` tokens, 3 AdamW steps) against the unsharded model on every
   rank, trained on the full batch: the losses, the step-0 gradient error (``|a - b|max / |b|max``,
   the direct measure) and the parameter error afterwards.
2. Throughput (bf16 compute, fp32 main weights and fp32 gradient reduction), ``--seq`` tokens x
   ``--local-batch`` sequences per data-parallel rank: tokens/s/GPU, TFLOP/s/GPU, MFU, peak memory,
   and the host time per step (the CPU's time to issue a step; near the step time = host-bound, e.g.
   DTensor dispatch). FLOPs per token = 6 x (non-embedding parameters, head included) + 12 x layers x
   dim x seq.
3. ``--profile DIR``: one more step under ``torch.profiler``; rank 0's chrome trace goes to
   ``DIR/hf_<impl>_tp<tp>_rank0.json`` (for ``benchmarks/trace_breakdown.py kernels|idle``) and the
   record gets the exposed-communication summary of every rank's trace (max over ranks).

One JSON line per implementation goes to ``--out`` (and stdout), rank 0 only, then a table with
each implementation's speed against ``mfsdp-dp`` and ``mfsdp`` against ``fsdp2``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_breakdown import kernel_summary  # noqa: E402

# Llama 3.2 1B's shape (tied embeddings), the model most users would try first.
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             tie_word_embeddings=True, rope_theta=500000.0, use_cache=False)
IMPLS = ("mfsdp", "fsdp2", "mfsdp-dp")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of mfsdp and fsdp2 (mfsdp-dp: 1)")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, from {IMPLS}")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="no sequence parallel")
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="all-gather the logits instead of the vocabulary-parallel loss")
    p.add_argument("--tp-path", default="local", choices=("local", "dtensor"),
                   help="mfsdp: MegatronFSDPConfig.tp_activation_path (fsdp2 always runs torch's DTensor styles)")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--parity-seq", type=int, default=512)
    p.add_argument("--parity-steps", type=int, default=3)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--double-buffer", action="store_true", help="mfsdp: fsdp_double_buffer=True")
    p.add_argument("--nccl-ub", action="store_true", help="mfsdp: nccl_ub=True (needs --double-buffer)")
    p.add_argument("--no-nan-check", dest="nan_check", action="store_false",
                   help="mfsdp: check_for_nan_in_grad=False (its per-step host sync off, as FSDP2 has none)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing of each decoder layer")
    p.add_argument("--profile", metavar="DIR", default=None, help="profile one extra step per implementation")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (gloo)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--heads", type=int, default=SHAPE["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["num_key_value_heads"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = set(args.impls) - set(IMPLS)
    if unknown or not args.impls:
        p.error(f"--impl {args.impl!r}: unknown {sorted(unknown)}; choose from {IMPLS}")
    return args


def hf_config(args):
    import transformers

    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": args.layers, "vocab_size": args.vocab,
                                      "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                                      "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads})
    cfg._attn_implementation = "sdpa"
    return cfg


# ------------------------------------------------------------------------------ the builders
class Built(NamedTuple):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tp: int
    loss_context: Callable[[], contextlib.AbstractContextManager]
    setup: str


def impl_tp(impl: str, args) -> int:
    return 1 if impl == "mfsdp-dp" else args.tp


def tp_flags(args, tp: int) -> dict:
    return {"sequence_parallel": args.sp and tp > 1, "loss_parallel": args.loss_parallel and tp > 1}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def build_mfsdp(impl, args, ws, model, *, meta: bool) -> Built:
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh, fully_shard_optimizer

    tp = impl_tp(impl, args)
    flags = tp_flags(args, tp)
    config = MegatronFSDPConfig(fsdp_double_buffer=args.double_buffer, nccl_ub=args.nccl_ub,
                                activation_checkpointing=args.ac, check_for_nan_in_grad=args.nan_check,
                                init_fsdp_with_meta_device=meta, tp_activation_path=args.tp_path, **flags)
    model, _ = MegatronFSDPManager(config, build_device_mesh(args.device, tp_size=tp, world_size=ws)).parallelize(model)
    opt = fully_shard_optimizer(model, adamw(model.parameters()))
    setup = (f"MegatronFSDPManager ZeRO-3 over dp={ws // tp} x tp={tp}, "
             + ", ".join(f"{k}={v}" for k, v in flags.items()) + f", check_for_nan_in_grad={args.nan_check}"
             + (f", tp_activation_path={args.tp_path}" if tp > 1 else ""))
    return Built(model, opt, tp, model.loss_context, setup)


def build_fsdp2(impl, args, ws, model, *, compute_dtype: torch.dtype) -> Built:
    """FSDP2 + torch TP on ``model`` (fp32, on the device): the manager's plan over mesh["tp"], then
    ``fully_shard`` of each decoder layer and the root over mesh["dp"]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mfsdp.manager.core_options import checkpoint_forward
    from mfsdp.manager.tp_plans import apply_tp_plan, loss_context, select_tp_plan, validate_tp

    tp = impl_tp(impl, args)
    flags = tp_flags(args, tp)
    mesh = init_device_mesh(args.device, (ws // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        validate_tp(model, tp)
        apply_tp_plan(model, mesh["tp"], select_tp_plan(model, **flags))
    policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
              if compute_dtype != torch.float32 else MixedPrecisionPolicy())
    for layer in model.model.layers:
        if args.ac:
            checkpoint_forward(layer)
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    setup = (f"torch TP (the manager's plan) over tp={tp}, then fully_shard(decoder layer) x n + root over "
             f"dp={ws // tp}; fp32 params, param_dtype={compute_dtype}, reduce_dtype=float32, "
             + ", ".join(f"{k}={v}" for k, v in flags.items()))
    return Built(model, adamw(model.parameters()), tp, lambda: loss_context(flags["loss_parallel"]), setup)


def build(impl, args, ws, *, parity: bool) -> Built:
    """Parity: an fp32 model on the device, seeded like the reference. Throughput: mfsdp builds a
    bf16 model on the meta device (shard-local init), FSDP2 an fp32 one on the device (bf16 compute)."""
    import transformers

    cfg = hf_config(args)
    torch.manual_seed(0)
    if parity:  # built on the CPU, as the reference is: the same weights on every device
        model = transformers.LlamaForCausalLM(cfg).to(args.device)
        if impl == "fsdp2":
            return build_fsdp2(impl, args, ws, model, compute_dtype=torch.float32)
        return build_mfsdp(impl, args, ws, model, meta=False)
    if impl == "fsdp2":
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(cfg)
        return build_fsdp2(impl, args, ws, model, compute_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return build_mfsdp(impl, args, ws, model, meta=True)


def train_step(built: Built, ids: torch.Tensor):
    with built.loss_context():
        loss = built.model(input_ids=ids, labels=ids).loss
        loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad()
    return loss


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def full(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------- the runs
def parity(impl, args, rank: int, ws: int) -> dict:
    import transformers

    built = build(impl, args, ws, parity=True)
    dp = ws // built.tp
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(hf_config(args)).to(args.device)
    ref_opt = adamw(ref.parameters())
    losses, grad_error = [], None
    for step in range(args.parity_steps):
        g = torch.Generator(device=args.device).manual_seed(step)
        ids = torch.randint(0, args.vocab, (2 * dp, args.parity_seq), device=args.device, generator=g)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        mine = ids.chunk(dp)[rank // built.tp]  # tp is the innermost mesh dim
        with built.loss_context():
            loss = built.model(input_ids=mine, labels=mine).loss
            loss.backward()
        if step == 0:  # the direct check: reduced gradients against the full-batch gradients
            if hasattr(built.model, "finish_grad_sync"):
                built.model.finish_grad_sync()
            mine_g = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
                      for n, p in built.model.named_parameters()}
            errs = {n: float((mine_g[n] - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-12))
                    for n, p in ref.named_parameters()}
            grad_error = (max(errs.values()), max(errs, key=errs.get))
            del mine_g
        ref_opt.step()
        ref_opt.zero_grad()
        built.optimizer.step()
        built.optimizer.zero_grad()
        mean = torch.tensor(float(loss.detach()), device=args.device)
        dist.all_reduce(mean)
        losses.append((float(mean) / ws, float(ref_loss)))
    a, b = full(built.model), full(ref)
    errors = {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-6)) for n in b}
    worst = max(errors, key=errors.get)
    del built, ref, ref_opt, a, b
    release(args.device)
    # AdamW turns rounding-level differences in near-zero gradients (embedding rows of unseen
    # tokens) into +-lr steps, so the parameter error after steps is bounded by ~lr/|w|max, while
    # the gradient error is the direct measure of the reduction.
    return {"step0_max_rel_grad_error": grad_error[0], "worst_grad": grad_error[1],
            "losses_vs_ref": losses, "max_rel_param_error": errors[worst], "worst_param": worst}


def profile_step(impl, args, built: Built, ids, rank: int) -> dict:
    """One step under torch.profiler; rank 0 keeps its trace, every rank's summary is gathered."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    if cuda:  # no empty_cache here: the profiled step would then time cudaMalloc calls
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        train_step(built, ids)
        if cuda:
            torch.cuda.synchronize()
    folder = args.profile if rank == 0 else tempfile.mkdtemp(prefix="hf_manager_trace_")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"hf_{impl}_tp{built.tp}_rank{rank}.json")
    prof.export_chrome_trace(path)
    summary = kernel_summary(path) if cuda else {}
    if rank != 0:
        os.remove(path)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    exposed = [g["exposed_comm_ms"] for g in gathered if "exposed_comm_ms" in g]
    return {"trace": path if rank == 0 else None, **gathered[0], "exposed_comm_ms_max_rank": max(exposed, default=None)}


def throughput(impl, args, rank: int, ws: int) -> dict:
    from mfsdp.models.flops import flops_per_token, mfu
    from mfsdp.models.llama import LlamaConfig

    cfg = hf_config(args)
    shape = LlamaConfig.from_hf(cfg.to_dict(), args.seq)
    built = build(impl, args, ws, parity=False)
    total = sum(p.numel() for p in built.model.parameters())
    dp = ws // built.tp
    g = torch.Generator(device=args.device).manual_seed(1234 + rank // built.tp)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, host = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.local_batch, args.seq), device=args.device, generator=g)
        sync()  # the step's wall time, the kernels queued before it excluded
        t0 = time.perf_counter()
        loss = train_step(built, ids)
        issued = time.perf_counter() - t0
        sync()
        seconds = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(seconds)
            host.append(issued)
    step_s = statistics.median(times)
    tokens_per_gpu = args.local_batch * args.seq * dp / ws / step_s
    out = {"setup": built.setup, "params": total, "step_time_median_s": step_s,
           "step_time_spread_s": max(times) - min(times), "host_time_median_s": statistics.median(host),
           "tokens_per_s_per_gpu": tokens_per_gpu,
           "tflops_per_gpu": tokens_per_gpu * flops_per_token(shape, args.seq) / 1e12,
           "mfu": mfu(tokens_per_gpu, shape, args.seq) if cuda else None, "final_loss": float(loss.detach()),
           "peak_mem_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "peak_mem_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}
    if args.profile:
        out["profile"] = profile_step(impl, args, built, ids, rank)
    del built, loss
    release(args.device)
    return out


def table(records: list[dict]) -> str:
    """Markdown: speed and memory per implementation, against mfsdp-dp and mfsdp against fsdp2."""
    tps = {r["impl"]: r["throughput"]["tokens_per_s_per_gpu"] for r in records if "throughput" in r}
    rows = ["| impl | tp x dp | tok/s/GPU | vs mfsdp-dp | MFU | peak GiB | host s/step | step s | grad err |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        t, par = r.get("throughput", {}), r.get("parity", {})
        ratio = f"{tps[r['impl']] / tps['mfsdp-dp']:.3f}" if t and "mfsdp-dp" in tps else "–"
        fmt = (lambda v, f: format(v, f) if isinstance(v, (int, float)) else "–")
        rows.append(f"| {r['impl']} | {r['tp']} x {r['dp']} | {fmt(t.get('tokens_per_s_per_gpu'), ',.0f')} | {ratio} | "
                    f"{fmt(t.get('mfu'), '.3f')} | {fmt(t.get('peak_mem_alloc_gib'), '.1f')} | "
                    f"{fmt(t.get('host_time_median_s'), '.3f')} | {fmt(t.get('step_time_median_s'), '.3f')} | "
                    f"{fmt(par.get('step0_max_rel_grad_error'), '.1e')} |")
    if "mfsdp" in tps and "fsdp2" in tps:
        rows.append(f"\nmfsdp+TP / FSDP2+TP tokens/s: {tps['mfsdp'] / tps['fsdp2']:.3f}")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse(argv)
    rank, ws = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if ws % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {ws}")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    records = []
    for impl in args.impls:
        tp = impl_tp(impl, args)
        record = {"bench": "hf_manager", "impl": impl, "model": f"Llama-shaped HF config: {args.layers} layers, "
                                                                f"hidden {args.hidden}, vocab {args.vocab}",
                  "world_size": ws, "tp": tp, "dp": ws // tp, **tp_flags(args, tp), "seq": args.seq,
                  "tp_activation_path": args.tp_path if impl == "mfsdp" and tp > 1 else None,
                  "local_batch": args.local_batch, "double_buffer": args.double_buffer, "nccl_ub": args.nccl_ub,
                  "activation_checkpointing": args.ac, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  "command": "torchrun --nproc-per-node %d benchmarks/hf_manager.py %s" % (ws, " ".join(
                      sys.argv[1:] if argv is None else argv))}
        if not args.skip_parity:
            record["parity"] = parity(impl, args, rank, ws)
        if not args.skip_throughput:
            record["throughput"] = throughput(impl, args, rank, ws)
        records.append(record)
        if rank == 0:
            line = json.dumps(record)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    if rank == 0:
        print(table(records), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
