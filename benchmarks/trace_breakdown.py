"""Where a step's GPU time goes, from the chrome traces that ``throughput.py --trace-dir`` keeps.

    python3 benchmarks/trace_breakdown.py kernels BASELINE.json OTHER.json ...
    python3 benchmarks/trace_breakdown.py idle TRACE.json ...

``kernels``: per trace, kernel milliseconds by category on the compute streams and, for kernels
that are not NCCL's, on the communication streams (any stream that runs an NCCL kernel); then,
the first trace's largest kernels by name; per trace, the kernels whose compute-stream time differs
most from the first trace's. Run with
the ``none`` (single-GPU ceiling) trace first, the same GEMMs slower under FSDP are the cost of
communication kernels sharing the SMs and memory bandwidth.

``kernel_summary`` (used by ``throughput.py --profile``): compute, NCCL and idle time of one trace,
and the communication time exposed on the compute streams.

``idle``: gaps over 50 us in which no kernel runs on any stream, largest first, with the kernels
on either side. Such gaps mean the GPU waited for the host (launch-bound Python) or for a peer.

``gaps``: gaps over 20 us on the compute stream alone, by the kernel pair around them, and the
side-stream kernels that ran inside them: on one GPU a gather cast or a gradient add that only runs
while the compute stream waits for it is exposed, not overlapped (GEMMs hold every SM).

Traces may be gzipped (``trim_trace.py``'s output).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys


def _events(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for e in events:
        e["name"] = e.get("name", "")
        e["stream"] = (e.get("args") or {}).get("stream", e.get("tid"))
        e["start"] = float(e["ts"])
        e["end"] = e["start"] + float(e.get("dur", 0))
        e["nccl"] = "nccl" in e["name"].lower()
    return sorted(events, key=lambda e: e["start"])


def comm_streams(events: list[dict]) -> set:
    """Streams that run any NCCL kernel, except the compute stream; every other stream counts as a
    compute stream. The compute stream is the one with the most non-NCCL kernel time: tensor
    parallelism issues its collectives on it, and it must not count as communication for that."""
    work: collections.Counter = collections.Counter()
    for e in events:
        if not e["nccl"]:
            work[e["stream"]] += e["end"] - e["start"]
    compute = work.most_common(1)[0][0] if work else None
    return {e["stream"] for e in events if e["nccl"] and e["stream"] != compute}


def busy_time(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total


def kernel_summary(trace_path: str) -> dict:
    """Exposed communication from the GPU activity of a chrome trace, in ms.

    Streams that run any NCCL kernel are communication streams, except the compute stream (see
    ``comm_streams``); compute is every non-NCCL kernel elsewhere. Exposed communication is the time
    an NCCL kernel runs while no compute kernel does, NCCL kernels on the compute stream included:
    |NCCL u compute| - |compute|. The hidden rest may still slow compute (SM and HBM contention).
    """
    events = _events(trace_path)
    comm = comm_streams(events)
    spans = [(e["start"], e["end"]) for e in events]
    nccl = [(e["start"], e["end"]) for e in events if e["nccl"]]
    compute = [(e["start"], e["end"]) for e in events if e["stream"] not in comm and not e["nccl"]]
    wall = max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0
    us = {"gpu_span_ms": wall, "compute_busy_ms": busy_time(compute), "nccl_busy_ms": busy_time(nccl),
          "exposed_comm_ms": busy_time(nccl + compute) - busy_time(compute),
          "gpu_idle_ms": wall - busy_time(spans)}
    return {k: round(v / 1e3, 2) for k, v in us.items()}


def category(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm100_")):
        return "gemm"
    if "multi_tensor" in n or "adam" in n or "foreach" in n:
        return "foreach/optimizer"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if "copy" in n or "cat" in n.split("::")[-1][:4]:
        return "copy"
    if "reduce" in n or "norm" in n:
        return "reduce/norm"
    return "elementwise/other"


def kernel_times(path: str) -> dict:
    events = _events(path)
    comm = comm_streams(events)
    out: dict = collections.defaultdict(collections.Counter)
    for e in events:
        where = "comm" if e["stream"] in comm else "compute"
        ms = (e["end"] - e["start"]) / 1e3
        out[where][category(e["name"])] += ms
        out[where + "_names"][re.sub(r"\s+", " ", e["name"])[:90]] += ms
        out["streams"][e["stream"]] += ms
    return out


def report_kernels(paths: list[str]) -> None:
    traces = [(p, kernel_times(p)) for p in paths]
    for path, t in traces:
        print(f"== {path.split('/')[-1]}: compute-stream ms by category (sum {sum(t['compute'].values()):.1f}); "
              "comm-stream non-NCCL ms")
        for name, ms in sorted(t["compute"].items(), key=lambda kv: -kv[1]):
            print(f"   {name:20s} {ms:8.2f}   comm-stream: {t['comm'].get(name, 0):7.2f}")
        print("   kernel ms per stream: " + ", ".join(f"{k}: {v:.1f}" for k, v in t["streams"].most_common()))
    base_path, base = traces[0]
    for where in ("compute", "comm"):  # the first trace's largest kernels by name, per stream class
        names = base[where + "_names"]
        if names:
            print(f"== {base_path.split('/')[-1]}: largest {where}-stream kernels (ms, of {sum(names.values()):.1f})")
            for name, ms in names.most_common(30):
                print(f"   {ms:8.2f}  {name}")
    for path, t in traces[1:]:
        print(f"== {path.split('/')[-1]} minus {base_path.split('/')[-1]}: compute-stream kernels, "
              "largest differences (ms)")
        names = set(t["compute_names"]) | set(base["compute_names"])
        diffs = sorted(((t["compute_names"].get(n, 0) - base["compute_names"].get(n, 0), n) for n in names),
                       key=lambda d: -abs(d[0]))
        for ms, name in diffs[:18]:
            print(f"   {ms:+8.2f}  {name}")


def report_idle(paths: list[str], min_us: float = 50.0) -> None:
    for path in paths:
        events = _events(path)
        t0, end, prev, gaps = events[0]["start"], None, None, []
        for e in events:
            if end is not None and e["start"] - end > min_us:
                gaps.append(((end - t0) / 1e3, (e["start"] - end) / 1e3, prev[:60], e["name"][:60]))
            if end is None or e["end"] > end:
                end, prev = e["end"], e["name"]
        print(f"== {path.split('/')[-1]}: span {(end - t0) / 1e3:.1f} ms, idle gaps >{min_us / 1e3:.2f} ms: "
              f"{len(gaps)}, {sum(g[1] for g in gaps):.2f} ms")
        for at, ms, before, after in sorted(gaps, key=lambda g: -g[1])[:25]:
            print(f"  t={at:8.2f} idle={ms:6.2f} after={before} | before={after}")


def report_gaps(paths: list[str], min_us: float = 20.0) -> None:
    for path in paths:
        events = _events(path)
        streams = collections.defaultdict(list)
        for e in events:
            streams[e["stream"]].append(e)
        compute = max(streams, key=lambda s: sum(e["end"] - e["start"] for e in streams[s]))
        side = [e for e in events if e["stream"] != compute]
        kinds, counts, inside = collections.Counter(), collections.Counter(), collections.Counter()
        own = streams[compute]
        for a, b in zip(own, own[1:]):
            if b["start"] - a["end"] <= min_us:
                continue
            key = (a["name"][:50], b["name"][:50])
            kinds[key] += b["start"] - a["end"]
            counts[key] += 1
            for e in side:  # side streams are short lists: a plain scan is fast enough
                if e["start"] < b["start"] and e["end"] > a["end"]:
                    inside[(e["stream"], e["name"][:60])] += min(b["start"], e["end"]) - max(a["end"], e["start"])
        print(f"== {path.split('/')[-1]}: compute stream {compute}: busy {busy_time((e['start'], e['end']) for e in own) / 1e3:.1f} ms, "
              f"gaps >{min_us:.0f} us: {sum(counts.values())}, {sum(kinds.values()) / 1e3:.2f} ms")
        for key, us in kinds.most_common(12):
            print(f"   {us / 1e3:8.2f} ms {counts[key]:5d}  after {key[0]} | before {key[1]}")
        print("   side-stream kernels inside those gaps (ms):")
        for (stream, name), us in inside.most_common(8):
            print(f"   {us / 1e3:8.2f}  stream {stream}: {name}")


REPORTS = {"kernels": report_kernels, "idle": report_idle, "gaps": report_gaps}

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in REPORTS:
        sys.exit(__doc__)
    REPORTS[sys.argv[1]](sys.argv[2:])
