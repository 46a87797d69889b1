"""The manager on GPUs: a 1B Llama-shaped Hugging Face model over tp x dp, parity then throughput.

    torchrun --nproc-per-node 2 benchmarks/hf_manager.py --tp 2 [--double-buffer] [--out FILE]

1. Parity (fp32, ``--parity-seq`` tokens, 3 AdamW steps): the manager-parallelized model against
   the unsharded model on every rank, trained on the full batch. Reports the loss of each step for
   both and the largest relative error of any parameter afterwards (``|a - b|max / |b|max``).
2. Throughput (bf16 compute, fp32 main weights and fp32 gradient reduction, the manager defaults):
   built on the meta device and initialised shard-locally, ``--seq`` tokens x ``--local-batch``
   sequences per data-parallel rank. Reports tokens/s/GPU, TFLOP/s/GPU, MFU and peak memory, with
   FLOPs per token = 6 x (non-embedding parameters, output head included) + 12 x layers x dim x seq.

One JSON line per run goes to ``--out`` (and stdout), rank 0 only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch
import torch.distributed as dist

# Llama 3.2 1B's shape (tied embeddings), the model most users would try first.
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             tie_word_embeddings=True, rope_theta=500000.0, use_cache=False)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--parity-seq", type=int, default=512)
    p.add_argument("--parity-steps", type=int, default=3)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--double-buffer", action="store_true", help="fsdp_double_buffer=True")
    p.add_argument("--nccl-ub", action="store_true", help="nccl_ub=True (needs --double-buffer)")
    p.add_argument("--ac", action="store_true", help="activation_checkpointing=True")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (gloo)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--out", default=None)
    return p.parse_args()


def hf_config(args):
    import transformers

    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": args.layers, "vocab_size": args.vocab,
                                      "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden})
    cfg._attn_implementation = "sdpa"
    return cfg


def manager_for(args, ws: int, **extra):
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    config = MegatronFSDPConfig(fsdp_double_buffer=args.double_buffer, nccl_ub=args.nccl_ub,
                                activation_checkpointing=args.ac, **extra)
    return MegatronFSDPManager(config, build_device_mesh(args.device, tp_size=args.tp, world_size=ws))


def full(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            for n, p in model.named_parameters()}


def parity(args, rank: int, ws: int) -> dict:
    import transformers

    dp = ws // args.tp
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(hf_config(args)).to(args.device)
    model = copy.deepcopy(ref)
    model, _ = manager_for(args, ws).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    losses, grad_error = [], None
    for step in range(args.parity_steps):
        g = torch.Generator(device=args.device).manual_seed(step)
        ids = torch.randint(0, args.vocab, (2 * dp, args.parity_seq), device=args.device, generator=g)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        mine = ids.chunk(dp)[rank // args.tp]  # tp is the innermost mesh dim
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        if step == 0:  # the direct check: reduced gradients against the full-batch gradients
            mine_g = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
                      for n, p in model.named_parameters()}
            errs = {n: float((mine_g[n] - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-12))
                    for n, p in ref.named_parameters()}
            grad_error = (max(errs.values()), max(errs, key=errs.get))
            del mine_g
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append((float(mean) / ws, float(ref_loss)))
    a, b = full(model), full(ref.to(torch.float32))
    errors = {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-6)) for n in b}
    worst = max(errors, key=errors.get)
    del model, ref, opt, ref_opt, a, b
    if args.device == "cuda":
        torch.cuda.empty_cache()
    # AdamW turns rounding-level differences in near-zero gradients (embedding rows of unseen
    # tokens) into +-lr steps, so the parameter error after steps is bounded by ~lr/|w|max, while
    # the gradient error is the direct measure of the reduction.
    return {"step0_max_rel_grad_error": grad_error[0], "worst_grad": grad_error[1],
            "losses_mfsdp_vs_ref": losses, "max_rel_param_error": errors[worst], "worst_param": worst}


def throughput(args, rank: int, ws: int) -> dict:
    from mfsdp.manager import fully_shard_optimizer
    from mfsdp.models.flops import flops_per_token, mfu
    from mfsdp.models.llama import LlamaConfig
    from mfsdp.train.metrics import StepTimer

    dp = ws // args.tp
    cfg = hf_config(args)
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    shape = LlamaConfig.from_hf(cfg.to_dict(), args.seq)
    model, _ = manager_for(args, ws, init_fsdp_with_meta_device=True).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fully_shard_optimizer(model, opt)
    g = torch.Generator(device=args.device).manual_seed(1234 + rank // args.tp)
    times = []
    cuda = args.device == "cuda"
    timer = StepTimer(torch.device(args.device))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.local_batch, args.seq), device=args.device, generator=g)
        timer.start()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds = timer.stop()
        if step >= args.warmup:
            times.append(seconds)
    step_s = statistics.median(times)
    tokens_per_gpu = args.local_batch * args.seq * dp / ws / step_s
    return {"params": total, "step_time_median_s": step_s, "step_time_spread_s": max(times) - min(times),
            "tokens_per_s_per_gpu": tokens_per_gpu, "tflops_per_gpu": tokens_per_gpu * flops_per_token(shape, args.seq) / 1e12,
            "mfu": mfu(tokens_per_gpu, shape, args.seq) if cuda else None, "final_loss": float(loss),
            "peak_mem_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "peak_mem_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}


def main() -> None:
    args = parse()
    rank, ws = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    if ws % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {ws}")
    record = {"bench": "hf_manager", "model": f"Llama-shaped HF config: {args.layers} layers, hidden "
                                               f"{args.hidden}, vocab {args.vocab}",
              "world_size": ws, "tp": args.tp, "dp": ws // args.tp, "seq": args.seq,
              "local_batch": args.local_batch, "double_buffer": args.double_buffer, "nccl_ub": args.nccl_ub,
              "activation_checkpointing": args.ac, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    if not args.skip_parity:
        record["parity"] = parity(args, rank, ws)
    if not args.skip_throughput:
        record["throughput"] = throughput(args, rank, ws)
    if rank == 0:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
