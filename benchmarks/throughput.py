"""Training throughput of mfsdp against its peers on the same Llama model, data and optimizer.

    torchrun --standalone --nproc-per-node 2 benchmarks/throughput.py --preset 1b \
        --impl mfsdp,fsdp2,megatron-fsdp,megatron-fsdp-exp,none --out results.jsonl

Each implementation runs in its own fresh set of worker processes, one after the other on the same
GPUs: the torchrun processes only launch workers (they never touch the GPU), so no allocator state,
NCCL communicator, compile cache or library monkey-patch leaks from one implementation into the next,
and a crash or hang (``--impl-timeout``) costs only that implementation. ``--in-process`` runs them
all in the torchrun processes instead (faster to start, less isolated). The references ``none`` and
``fsdp2`` run first, so every JSON line can carry its speed ratios when it is written.

``--float8 tensorwise|rowwise`` trains the linears in float8 (torchao), ``--fp8-all-gather`` gathers
their weights in FP8 (see ``_float8.py``). The issue-16 rows:

    torchrun --standalone --nproc-per-node 2 benchmarks/throughput.py --preset 8b --local-batch 1 \
        --seq 4096 --compile --float8 tensorwise --fp8-all-gather --impl mfsdp,fsdp2,none
The issue-21 rows (Llama-3-8B on one H200: mfsdp without and with optimizer offload against FSDP2
without and with ``CPUOffloadPolicy``, 16k tokens per optimizer step, all compiled, exact AdamW):

    torchrun --standalone --nproc-per-node 1 benchmarks/throughput.py --preset 8b --local-batch 1 \
        --microbatches 4 --seq 4096 --compile --offload 0.5 --impl mfsdp-offload,fsdp2-offload

``--microbatches N`` accumulates N microbatches of ``--local-batch`` sequences per optimizer step
(tokens/s count all of them); ``--offload none|optimizer|F`` is the ``mfsdp-offload`` row's
``mfsdp.OffloadPolicy`` (all units, or a fraction F of them; ``mfsdp`` never offloads).
See benchmarks/README.md for the columns and the FLOP convention.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# No NVLink multicast / NVLS on shared hosts; must be set before NCCL initialises.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmark this checkout's mfsdp, not an installed copy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _float8 import float8_converter, precompute_scales_after_step  # noqa: E402
from _impls import BUILDERS, DTYPES, Ctx, Skip  # noqa: E402
from mfsdp.models.flops import flops_per_token, param_counts, peak_flops  # noqa: E402
from mfsdp.models.llama import PRESETS, get_config  # noqa: E402
from trace_breakdown import kernel_summary  # noqa: E402

REFERENCES = ("none", "fsdp2")
# Present in every JSON line, None when an implementation was skipped or failed.
METRICS = ("step_time_median_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
           "peak_mem_alloc_gib", "peak_mem_reserved_gib")
GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b", help="tiny, 1b or 8b")
    p.add_argument("--impl", default="mfsdp,fsdp2,none", help=f"comma list of {','.join(BUILDERS)}")
    p.add_argument("--n-layers", type=int, default=None,
                   help="cut the preset to this many blocks (the 8b layer shape on one GPU: --n-layers 16)")
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=1, help="microbatches accumulated per optimizer step")
    p.add_argument("--offload", default="optimizer",
                   help="the mfsdp-offload row's offload: none, optimizer (every unit) or a fraction in (0, 1]")
    p.add_argument("--offload-threads", type=int, default=None,
                   help="mfsdp-offload: CPU threads of the host step (OffloadPolicy.threads; default torch's)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile each block before wrapping")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--grad-reduce-dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: R replica groups, each sharding over world/R ranks (default 1: ZeRO-3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="compute dtype (fp32 only to keep CPU smoke runs fast)")
    p.add_argument("--float8", choices=("none", "tensorwise", "rowwise"), default="none",
                   help="train the blocks' linears in float8 (torchao recipe)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="with --float8 tensorwise: all-gather the float8 weights in FP8")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (anchors: 1e-4)")
    p.add_argument("--out", help="append one JSON line per implementation here (rank 0)")
    p.add_argument("--report-dir", help="write <date>_<gpu>_<config>.md with command, versions, table")
    p.add_argument("--profile", action="store_true",
                   help="profile one extra step: exposed communication and peak memory by phase")
    p.add_argument("--trace-dir", help="with --profile: keep the chrome trace of every rank here")
    p.add_argument("--impl-timeout", type=float, default=0, help="kill an implementation after S s")
    p.add_argument("--in-process", action="store_true", help="no worker processes (less isolated)")
    p.add_argument("--worker-result", help=argparse.SUPPRESS)  # set by the launcher for its workers
    args = p.parse_args(argv)
    args.impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = [i for i in args.impls if i not in BUILDERS]
    if unknown:
        p.error(f"unknown --impl {unknown}; choose from {list(BUILDERS)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.replicate < 1 or world % args.replicate:
        p.error(f"--replicate {args.replicate} does not divide the world size {world}")
    if args.preset not in PRESETS:
        p.error(f"unknown --preset {args.preset!r}; choose from {sorted(PRESETS)}")
    if args.n_layers is not None and args.n_layers < 1:
        p.error("--n-layers must be at least 1")
    if args.fp8_all_gather and args.float8 != "tensorwise":
        p.error("--fp8-all-gather needs --float8 tensorwise")
    if args.microbatches < 1:
        p.error("--microbatches must be at least 1")
    try:
        args.offload_fraction = {"none": 0.0, "optimizer": 1.0}.get(args.offload) or float(args.offload)
    except ValueError:
        p.error(f"--offload {args.offload!r}: none, optimizer or a fraction in (0, 1]")
    if not 0.0 <= args.offload_fraction <= 1.0 or (args.offload not in ("none", "optimizer")
                                                    and args.offload_fraction == 0.0):
        p.error(f"--offload {args.offload!r}: a fraction must be in (0, 1]")
    return args


# ---------------------------------------------------------------- measuring one implementation

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(args, cfg, device, n):
    """Uniform random tokens, fixed seed, different on each rank, made before any timing: ``n``
    steps of ``--microbatches`` (inputs, targets) pairs each."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * dist.get_rank())
    out = []
    for _ in range(n):
        step = []
        for _ in range(args.microbatches):
            t = torch.randint(0, cfg.vocab_size, (args.local_batch, args.seq + 1), device=device,
                              generator=gen)
            step.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        out.append(step)
    return out


def train_step(built, batch, phase_mark=lambda name: None):
    """One optimizer step over the microbatches of ``batch``; the mean loss. ``phase_mark`` marks
    the first microbatch's forward, the last one's backward, and the step."""
    total, n = None, len(batch)
    for i, (inp, tgt) in enumerate(batch):
        with built.microbatch(i == n - 1):
            logits = built.model(inp)
            # Loss in fp32 over the full vocabulary, as in the anchors.
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
            if hasattr(built.model, "aux_loss"):  # MoE: the load-balancing loss, as mfsdp train adds it
                loss = loss + built.model.cfg.moe_aux_loss_coef * built.model.aux_loss()
            if i == 0:
                phase_mark("forward")
            (loss / n if n > 1 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    phase_mark("backward")
    t0 = time.perf_counter()
    built.optimizer.step()
    built.step_call_s.append(time.perf_counter() - t0)
    built.optimizer.zero_grad(set_to_none=True)
    phase_mark("optimizer")
    return total / n


def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(args, impl, built, cfg, device) -> dict:
    batches = make_batches(args, cfg, device, args.warmup + args.steps + 2)
    losses = [train_step(built, b) for b in batches[:args.warmup]]
    sync(device)
    cuda = device.type == "cuda"
    if cuda:  # peaks below cover the timed steps only, not setup or warm-up
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    built.step_call_s.clear()
    for b in batches[args.warmup:-2]:
        sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(built, b))
        sync(device)
        times.append(time.perf_counter() - t0)
    alloc, reserved = max_over_ranks(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
        if cuda else [0.0, 0.0], device)
    loss_vals = [float(x) for x in torch.stack(losses).cpu()]
    # Step times are global (collectives keep ranks in step), so rank 0's stand for all.
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    med = statistics.median(times)
    tps = args.local_batch * args.microbatches * args.seq / med
    tflops = flops_per_token(cfg, args.seq) * tps / 1e12
    peak = peak_flops(device)
    rec = {
        "step_time_median_s": round(med, 5), "step_time_p10_s": round(q[0], 5),
        "step_time_p90_s": round(q[-1], 5), "step_time_min_s": round(min(times), 5),
        "step_time_max_s": round(max(times), 5), "step_times_s": [round(t, 5) for t in times],
        "tokens_per_s_per_gpu": round(tps, 1), "tflops_per_gpu": round(tflops, 2),
        "mfu": round(tflops * 1e12 / peak, 4) if peak else None,
        "peak_mem_alloc_gib": round(alloc / GIB, 2) if cuda else None,
        "peak_mem_reserved_gib": round(reserved / GIB, 2) if cuda else None,
        "loss_first": round(loss_vals[0], 4), "loss_last": round(loss_vals[-1], 4),
        "loss_finite": all(abs(x) < float("inf") for x in loss_vals),
        # Host time inside optimizer.step() (no sync around it): with offload, mostly the wait for
        # the CPU steps that backward did not hide; the trace (--profile) gives the exact figure.
        "optimizer_step_call_s_median": round(statistics.median(built.step_call_s), 5) if built.step_call_s else None,
    }
    if built.offload_counts is not None:
        rec["offload_counts"] = dict(built.offload_counts())
    # Host memory: this rank's peak resident set (the whole process: pinned and pageable), the max
    # over ranks, and the offload's own host buffers by kind.
    rec["host_rss_peak_gib"] = round(max_over_ranks([_peak_rss_bytes()], device)[0] / GIB, 2)
    if built.offload_host_nbytes is not None:
        rec["offload_host_gib"] = {k: round(v / GIB, 2) for k, v in built.offload_host_nbytes().items()}
    if args.profile:
        rec["profile"] = profile_step(args, impl, built, batches[-2:], device)
    return rec


def _peak_rss_bytes() -> float:
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


# ---------------------------------------------------------------- profiling

def profile_step(args, impl, built, batches, device) -> dict:
    """Two extra steps after timing: one with peak-memory resets between the phases (their syncs
    would distort overlap, so it is not the profiled one), then one under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    peaks = {}

    def phase_mark(name):
        if cuda:
            sync(device)
            peaks[name] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
            torch.cuda.reset_peak_memory_stats(device)

    phase_mark("before")
    train_step(built, batches[0], phase_mark)
    peaks.pop("before", None)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        train_step(built, batches[1])
        sync(device)
    folder = args.trace_dir or tempfile.mkdtemp(prefix="throughput_trace_")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{args.preset}_{impl}_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    out = {"peak_mem_gib_by_phase": peaks or None, **(kernel_summary(path) if cuda else {})}
    if args.trace_dir:
        out["trace"] = path
    else:
        os.remove(path)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    exposed = [g["exposed_comm_ms"] for g in gathered if "exposed_comm_ms" in g]
    return {**gathered[0], "exposed_comm_ms_max_rank": max(exposed, default=None),
            "note": "rank 0's figures unless named max_rank"}


# ---------------------------------------------------------------- the worker side

def init_worker_dist(timeout_s: float) -> torch.device:
    timeout = datetime.timedelta(seconds=timeout_s or 900)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def environment(device) -> dict:
    cuda = device.type == "cuda"
    nccl = torch.cuda.nccl.version() if cuda else None  # a tuple in recent torch, an int before
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    return {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl, "python": sys.version.split()[0],
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                   "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS")}}


def run_one(args, impl, device) -> dict:
    cfg = get_config(args.preset, max_seq_len=args.seq,
                     **({"n_layers": args.n_layers} if args.n_layers is not None else {}))
    rec = {"impl": impl, "preset": args.preset, "n_layers": cfg.n_layers, "world_size": dist.get_world_size(),
           "local_batch": args.local_batch, "seq": args.seq, "ac": args.ac, "compile": args.compile,
           "microbatches": args.microbatches, "tokens_per_step_per_gpu": args.local_batch * args.microbatches * args.seq,
           "offload": None, "replicate": args.replicate, "float8": args.float8, "fp8_all_gather": args.fp8_all_gather,
           **dict.fromkeys(METRICS), "status": "failed",
           "compute_dtype": args.dtype, "grad_reduce_dtype": args.grad_reduce_dtype,
           "warmup_steps": args.warmup, "timed_steps": args.steps,
           "params_total": param_counts(cfg)["total"],
           "flops_per_token": flops_per_token(cfg, args.seq), **environment(device)}
    cuda = device.type == "cuda"
    # Non-zero here in --in-process mode means an earlier implementation leaked memory.
    rec["mem_alloc_at_start_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2) if cuda else None
    torch.manual_seed(args.seed)  # same initial weights for every implementation
    t0 = time.perf_counter()
    built = None
    try:
        convert, float8 = float8_converter(args, impl)
        ctx = Ctx(cfg=cfg, device=device, world_size=dist.get_world_size(),
                  compute_dtype=DTYPES[args.dtype], grad_reduce_dtype=DTYPES[args.grad_reduce_dtype],
                  ac=args.ac, compile=args.compile, lr=args.lr, replicate=args.replicate, convert=convert,
                  offload_fraction=args.offload_fraction, offload_threads=args.offload_threads)
        built = BUILDERS[impl](ctx)
        setup = "; ".join(x for x in (built.setup, float8 and f"torchao float8 {args.float8} "
                                      f"({float8['float8_linears']} linears)",
                                      precompute_scales_after_step(args, impl, built)) if x)
        rec.update(grad_reduce_dtype=built.grad_reduce_dtype, setup=setup, offload=built.offload, **built.extra)
        sync(device)
        rec["setup_s"] = round(time.perf_counter() - t0, 1)
        rec.update(measure(args, impl, built, cfg, device))
        rec["status"] = "ok"
    except Skip as exc:
        rec["status"] = f"skipped: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it and let the other implementations run
        traceback.print_exc()
        rec["status"] = f"failed: {type(exc).__name__}: {exc}"[:1500]
    finally:
        del built
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    if rec["status"].startswith("failed"):
        return rec  # peers may be stuck in a collective: no barrier after a failure
    dist.barrier()
    return rec


def run_workers_here(args, impls) -> list[dict]:
    device = init_worker_dist(args.impl_timeout)
    records = [run_one(args, impl, device) for impl in impls]
    if dist.get_rank() == 0 and args.worker_result:
        Path(args.worker_result).write_text(json.dumps(records))
    if not any(r["status"].startswith("failed") for r in records):
        dist.destroy_process_group()  # after a failure a peer may hang in a collective: skip it
    return records


# ---------------------------------------------------------------- the launcher side

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def spawn_worker(args, impl, port, result_file) -> int:
    """Run one implementation in a fresh process per rank; returns its exit code (124: timed out)."""
    env = dict(os.environ, MASTER_PORT=str(port))
    # The workers' rank 0 hosts a new store on `port`. Joining torchrun's agent store instead would
    # reuse the keys the previous implementation's process group wrote there.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--impl", impl,
           "--worker-result", result_file]
    proc = subprocess.Popen(cmd, env=env)

    def forward_and_exit(signum, _frame):  # torchrun stops us with SIGTERM: take the worker along
        proc.kill()
        sys.exit(128 + signum)

    old = {s: signal.signal(s, forward_and_exit) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait(timeout=args.impl_timeout or None)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return 124
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def launch(args, order, identity) -> list[dict]:
    # The launchers only coordinate, over gloo on the CPU; the GPUs are left to the workers.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = tempfile.mkdtemp(prefix="throughput_") if rank == 0 else ""
    records = []
    for impl in order:
        box = [(free_port(), os.path.join(tmp, f"{impl}.json"))]
        dist.broadcast_object_list(box, src=0)
        port, result_file = box[0]
        t0 = time.perf_counter()
        rc = spawn_worker(args, impl, port, result_file)
        codes = [None] * world
        dist.all_gather_object(codes, rc)
        if rank == 0:
            path = Path(result_file)
            rec = json.loads(path.read_text())[0] if path.exists() else {
                "impl": impl, "preset": args.preset, "n_layers": args.n_layers, "world_size": world,
                "local_batch": args.local_batch, "seq": args.seq, **dict.fromkeys(METRICS),
                "grad_reduce_dtype": None, "status": "failed"}
            if any(codes) and not rec["status"].startswith(("failed", "skipped")):
                rec["status"] = "failed"
            if any(codes):
                why = "timed out" if 124 in codes else "worker exit codes"
                rec["status"] += f" ({why} {codes})"
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            records.append(rec)
            emit(args, rec, records, identity)
    dist.destroy_process_group()
    return records


# ---------------------------------------------------------------- reporting (rank 0)

def run_identity() -> dict:
    """Command, date and code version shared by every line of one run."""
    digest = hashlib.sha256()  # the device's copy of the tree may have no .git: hash the sources too
    for path in sorted((ROOT / "mfsdp").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    commit = os.environ.get("MFSDP_COMMIT")  # lets the caller name the commit the copy came from
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if not commit and head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "mfsdp"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            commit = head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:  # no git on the machine
        pass
    # The exact command: torchrun's own command line when torchrun started us.
    command = shlex.join([sys.executable, *sys.argv])
    try:
        parent = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        if any("torchrun" in a or "torch.distributed.run" in a for a in parent[:3]):
            command = shlex.join(parent)
    except OSError:
        pass
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "mfsdp_commit": commit, "mfsdp_src_sha256": digest.hexdigest()[:16]}


def emit(args, rec, done, identity):
    """Add the ratios to the references measured so far, print and append the JSON line."""
    ok = {r["impl"]: r for r in done if r.get("status") == "ok"}
    mine = rec if rec.get("status") == "ok" else None
    for ref, key in (("fsdp2", "tokens_per_s_per_gpu"), ("none", "tokens_per_s_per_gpu"),
                     ("fsdp2", "peak_mem_alloc_gib")):
        name = ("speed_vs_" if key.startswith("tokens") else "mem_vs_") + ref
        base = ok.get(ref, {}).get(key)
        rec[name] = round(mine[key] / base, 4) if mine and base and mine.get(key) is not None else None
    rec.update(identity)
    print("RESULT " + json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _f(value, spec):
    return "–" if value is None else format(value, spec)


def table(records) -> str:
    profiled = any("profile" in r for r in records)
    head = ["impl", "status", "grad reduce", "step s median [p10–p90]", "tok/s/GPU", "TFLOP/s/GPU",
            "MFU %", "peak GiB alloc (reserved)", "host RSS GiB", "vs fsdp2", "vs none", "loss first→last"]
    head += ["exposed comm ms (NCCL busy)", "peak GiB fwd/bwd/opt"] if profiled else []
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        row = [r["impl"], str(r.get("status"))[:90], str(r.get("grad_reduce_dtype"))]
        if r.get("status") == "ok":
            row += [f"{r['step_time_median_s']:.4f} [{r['step_time_p10_s']:.4f}–{r['step_time_p90_s']:.4f}]",
                    f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
                    _f(r["mfu"] and 100 * r["mfu"], ".1f"),
                    f"{_f(r['peak_mem_alloc_gib'], '.1f')} ({_f(r['peak_mem_reserved_gib'], '.1f')})",
                    _f(r.get("host_rss_peak_gib"), ".1f"), _f(r["speed_vs_fsdp2"], ".3f"), _f(r["speed_vs_none"], ".3f"),
                    f"{r['loss_first']:.3f}→{r['loss_last']:.3f}"]
        else:
            row += ["–"] * 9
        if profiled:
            p = r.get("profile") or {}
            phases = p.get("peak_mem_gib_by_phase") or {}
            row += [f"{_f(p.get('exposed_comm_ms'), '.1f')} ({_f(p.get('nccl_busy_ms'), '.1f')})",
                    "/".join(_f(phases.get(k), ".1f") for k in ("forward", "backward", "optimizer"))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_report(args, records, text, identity):
    """benchmarks/results-style markdown: <date>_<gpu>_<config>.md with command, versions, table."""
    first = next((r for r in records if "gpu" in r), {})
    gpu = "".join(c if c.isalnum() else "-" for c in first.get("gpu", "unknown").lower()
                  .replace("nvidia", "").strip())
    config = (f"{args.preset}{f'-l{args.n_layers}' if args.n_layers else ''}-b{args.local_batch}"
              f"{f'x{args.microbatches}' if args.microbatches > 1 else ''}-s{args.seq}"
              f"{'-ac' * args.ac}"
              f"{'-compile' * args.compile}{f'-fp8{args.float8}' if args.float8 != 'none' else ''}"
              f"{'-ag' * args.fp8_all_gather}-w{first.get('world_size', '?')}"
              f"{f'-hsdp{args.replicate}' if args.replicate > 1 else ''}")
    day = identity["date_utc"][:10]
    path = Path(args.report_dir) / f"{day}_{gpu}_{config}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    versions = ", ".join(f"{k} {first.get(k)}" for k in ("gpu", "torch", "cuda", "nccl", "python"))
    mega = next((r["megatron_fsdp_version"] for r in records if r.get("megatron_fsdp_version")), None)
    path.write_text(
        f"# Throughput {config}, {day}\n\n- command: `{identity['command']}`\n"
        f"- versions: {versions}{f', megatron-fsdp {mega}' if mega else ''}\n"
        f"- mfsdp commit: {identity['mfsdp_commit']} (sources sha256 {identity['mfsdp_src_sha256']})\n"
        f"- {args.warmup} warm-up + {args.steps} timed steps, compute {args.dtype}, "
        f"{first.get('flops_per_token', 0):.4g} FLOPs/token; JSON lines: `{args.out}`\n\n{text}\n")
    print(f"report written to {path}", flush=True)


def main():
    args = parse_args()
    if "RANK" not in os.environ:  # a plain `python throughput.py` is a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if args.worker_result:  # a worker the launcher started for one implementation
        failed = any(r["status"].startswith("failed") for r in run_workers_here(args, args.impls))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)  # no interpreter teardown: NCCL may be wedged after a failure
    order = [i for i in REFERENCES if i in args.impls] + [i for i in args.impls if i not in REFERENCES]
    rank0 = os.environ["RANK"] == "0"
    identity = run_identity() if rank0 else {}
    if args.in_process:
        records = run_workers_here(args, order)
        for i, rec in enumerate(records if rank0 else []):
            emit(args, rec, records[:i + 1], identity)
    else:
        records = launch(args, order, identity)
    if rank0:
        text = table(records)
        print("\n" + text, flush=True)
        if args.report_dir:
            write_report(args, records, text, identity)


if __name__ == "__main__":
    main()
