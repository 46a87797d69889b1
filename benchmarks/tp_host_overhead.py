"""Host cost of tensor-parallel activations: the DTensor path against the local path, side by side.

    python benchmarks/tp_host_overhead.py                 # CPU: spawns 2 gloo ranks itself
    torchrun --nproc-per-node 2 benchmarks/tp_host_overhead.py --device cuda [--hidden 2048 --seq 4096]

A tiny Hugging Face Llama (hidden 64 by default, so compute is negligible and what remains is the
host) goes through ``MegatronFSDPManager`` at tp = world size (sequence parallel and the parallel
loss on, unless ``--no-sp`` / ``--no-loss-parallel``), once per ``tp_activation_path``. Per path:

* collectives of one training step (forward + backward, counted by
  :class:`mfsdp.manager.tp_local.CollectiveCounter`, which also counts the ops dispatched on
  DTensors), per decoder layer and for the rest of the model. Per layer = (count at ``--layers`` -
  count at 1 layer) / (layers - 1): no attribution guesswork;
* host ms per step: the median wall time to issue forward, backward and the optimizer step (no
  device sync inside; on CPU that is the step), and per layer by the same difference; on CUDA also
  the synchronised step time.

The theoretical minimum with sequence parallel, per decoder layer and step: forward, one all-gather
of the sequence before attention and one before the MLP, one reduce-scatter after each; backward,
the adjoints (two reduce-scatters, two all-gathers): 4 all-gathers + 4 reduce-scatters. The two
norm weights' gradients are partial sums over tp (each rank saw other tokens): + 2 small
all-reduces of ``hidden`` floats, done by mfsdp's gradient reduction. Without sequence parallel:
2 all-reduces forward and 2 backward. Outside the layers: the embedding (reduce-scatter forward,
all-gather backward), the head (all-gather forward, reduce-scatter backward), the final norm's
gradient (1 all-reduce), the parallel loss (3 small all-reduces) and mfsdp's NaN check (1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

PATHS = ("dtensor", "local")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, under torchrun)")
    p.add_argument("--nproc", type=int, default=2, help="CPU without torchrun: ranks to spawn")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {PATHS}")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--no-sp", dest="sp", action="store_false")
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false")
    p.add_argument("--out", default=None, help="append the JSON record here (rank 0)")
    args = p.parse_args(argv)
    args.path_list = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not args.path_list or set(args.path_list) - set(PATHS):
        p.error(f"--paths {args.paths!r}: choose from {PATHS}")
    if args.layers < 2:
        p.error("--layers must be at least 2 (per-layer figures are a difference against 1 layer)")
    return args


def build(args, path: str, layers: int, ws: int):
    import transformers

    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh, fully_shard_optimizer

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, tie_word_embeddings=True, use_cache=False,
                                   max_position_embeddings=max(args.seq, 64))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = transformers.LlamaForCausalLM(cfg).to(device=args.device, dtype=dtype)
    config = MegatronFSDPConfig(sequence_parallel=args.sp, loss_parallel=args.loss_parallel, tp_activation_path=path)
    model, _ = MegatronFSDPManager(config, build_device_mesh(args.device, tp_size=ws, world_size=ws)).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    return model, fully_shard_optimizer(model, opt)


def step(model, opt, ids):
    with model.loss_context():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def count(args, path: str, layers: int, ws: int, ids) -> dict:
    """Collectives (by kind, forward and backward) and DTensor dispatches of one warm step."""
    from mfsdp.manager.tp_local import count_forward_backward

    model, opt = build(args, path, layers, ws)
    step(model, opt, ids)
    out = {}
    with model.loss_context():
        counters = count_forward_backward(lambda: model(input_ids=ids, labels=ids).loss)
    for phase, counter in zip(("forward", "backward"), counters):
        out[phase] = dict(counter.counts)
        out[phase + "_dtensor_ops"] = counter.dtensor_ops
    opt.zero_grad()
    return out


def timed(args, path: str, layers: int, ws: int, ids) -> dict:
    model, opt = build(args, path, layers, ws)
    cuda = args.device == "cuda"
    host, wall = [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step(model, opt, ids)
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= args.warmup:
            host.append(t1 - t0)
            wall.append(t2 - t0)
    return {"host_ms": 1e3 * statistics.median(host), "step_ms": 1e3 * statistics.median(wall)}


def release(device: str) -> None:
    """Free the last model (the local path's forwards hold their module: a reference cycle)."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def per_layer(full: dict, one: dict, layers: int) -> dict:
    keys = set(full) | set(one)
    return {k: (full.get(k, 0) - one.get(k, 0)) / (layers - 1) for k in sorted(keys)}


def measure(args, path: str, rank: int, ws: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    counts, times = {}, {}
    for n in (args.layers, 1):  # one model at a time: free each before the next is built
        counts[n] = count(args, path, n, ws, ids)
        release(args.device)
        times[n] = timed(args, path, n, ws, ids)
        release(args.device)
    L = args.layers
    record = {"path": path, "layers": L}
    for phase in ("forward", "backward"):
        record[f"{phase}_collectives_per_layer"] = per_layer(counts[L][phase], counts[1][phase], L)
        layer = record[f"{phase}_collectives_per_layer"]
        record[f"{phase}_collectives_outside_layers"] = {k: counts[1][phase].get(k, 0) - v for k, v in layer.items()}
        record[f"{phase}_dtensor_ops_per_layer"] = (counts[L][phase + "_dtensor_ops"]
                                                    - counts[1][phase + "_dtensor_ops"]) / (L - 1)
    record["host_ms_per_step"] = times[L]["host_ms"]
    record["step_ms"] = times[L]["step_ms"]
    record["host_ms_per_layer"] = (times[L]["host_ms"] - times[1]["host_ms"]) / (L - 1)
    return record


def fmt_counts(c: dict) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "other": "other"}
    return " ".join(f"{v:g} {short.get(k, k)}" for k, v in sorted(c.items()) if v) or "0"


def table(records: list[dict]) -> str:
    rows = ["| path | per layer fwd | per layer bwd | outside layers fwd / bwd | DTensor ops/layer fwd+bwd "
            "| host ms/step | host ms/layer | step ms |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        rows.append(f"| {r['path']} | {fmt_counts(r['forward_collectives_per_layer'])} | "
                    f"{fmt_counts(r['backward_collectives_per_layer'])} | "
                    f"{fmt_counts(r['forward_collectives_outside_layers'])} / "
                    f"{fmt_counts(r['backward_collectives_outside_layers'])} | "
                    f"{r['forward_dtensor_ops_per_layer'] + r['backward_dtensor_ops_per_layer']:g} | "
                    f"{r['host_ms_per_step']:.2f} | {r['host_ms_per_layer']:.3f} | {r['step_ms']:.2f} |")
    by = {r["path"]: r for r in records}
    if "dtensor" in by and "local" in by:
        local, dtensor = by["local"], by["dtensor"]
        rows.append(f"\nlocal / dtensor host ms per step: {local['host_ms_per_step'] / dtensor['host_ms_per_step']:.3f}"
                    f"; per layer: {local['host_ms_per_layer'] / dtensor['host_ms_per_layer']:.3f}")
    return "\n".join(rows)


def run(rank: int, ws: int, args) -> None:
    records = []
    for path in args.path_list:
        record = {"bench": "tp_host_overhead", "device": args.device, "torch": torch.__version__, "tp": ws,
                  "sequence_parallel": args.sp, "loss_parallel": args.loss_parallel, "hidden": args.hidden,
                  "seq": args.seq, "batch": args.batch, "dtype": args.dtype, **measure(args, path, rank, ws)}
        records.append(record)
        if rank == 0:
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    if rank == 0:
        print(table(records), flush=True)


def _spawned(rank: int, ws: int, init_file: str, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        run(rank, ws, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "RANK" in os.environ:  # torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo")
        try:
            run(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    if args.device != "cpu":
        raise SystemExit("--device cuda runs under torchrun (one process per GPU)")
    import tempfile

    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(prefix="tp_host_overhead_"), "init")
    mp.spawn(_spawned, args=(args.nproc, init_file, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
