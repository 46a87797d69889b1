"""Weak-scaling and side-by-side tables from the JSON lines of ``throughput.py``.

    python3 benchmarks/scaling.py RESULTS.jsonl [RESULTS.jsonl ...] [--ref mfsdp]

Every ``ok`` record is keyed by its configuration (preset, local batch, seq, AC, compile, HSDP
replicas, gradient-reduction dtype) and its world size. Per configuration it prints tokens/s/GPU of
each implementation at each size (the median when a point was measured more than once), the weak-
scaling efficiency (tokens/s/GPU over the same implementation's figure on the smallest size
measured, 1 GPU normally), and ``--ref``'s ratio against every other implementation at each size.
Efficiencies only mean something when every size ran on the same machine in one session: the
script cannot check that, so the caller names the inputs.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

def config_name(rec: dict) -> str:
    name = f"{rec['preset']}, b={rec['local_batch']}, seq {rec['seq']}"
    name += ", AC" if rec.get("ac") else ""
    name += ", compiled" if rec.get("compile") else ""
    name += f", HSDP {rec['replicate']} x N/{rec['replicate']}" if rec.get("replicate", 1) > 1 else ""
    return name


def load(paths) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("status") == "ok" and r.get("impl") != "none"]


def collect(records) -> dict:
    """{config: {impl: {world_size: [tokens/s/GPU, ...]}}}; the reduce dtype joins the impl name
    when one implementation ran with more than one, so fp32 and bf16 runs are never pooled."""
    dtypes = collections.defaultdict(set)
    for r in records:
        dtypes[r["impl"]].add(r.get("grad_reduce_dtype"))
    table = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    for r in records:
        impl = r["impl"] if len(dtypes[r["impl"]]) == 1 else f"{r['impl']} ({r['grad_reduce_dtype']})"
        table[config_name(r)][impl][r["world_size"]].append(r["tokens_per_s_per_gpu"])
    return table


def render(table, ref: str) -> str:
    out = []
    for config, impls in table.items():
        sizes = sorted({ws for points in impls.values() for ws in points})
        speed = {impl: {ws: statistics.median(v) for ws, v in points.items()} for impl, points in impls.items()}
        out += [f"## {config}", "", "tokens/s/GPU (weak-scaling efficiency against the smallest size "
                "that implementation ran)", ""]
        out += ["| impl | " + " | ".join(f"{ws} GPU{'s' * (ws > 1)}" for ws in sizes) + " |",
                "|---|" + "---|" * len(sizes)]
        for impl, points in speed.items():
            base_ws = min(points)
            cells = [f"{points[ws]:,.0f} ({points[ws] / points[base_ws]:.3f})" if ws in points else "–"
                     for ws in sizes]
            out.append(f"| {impl} | " + " | ".join(cells) + " |")
        refs = [name for name in speed if name == ref or name.startswith(f"{ref} (")]
        for mine in refs:
            peers = [p for p in speed if p not in refs]
            if not peers:
                continue
            out += ["", f"{mine} against each peer (tokens/s/GPU ratio, same size)", "",
                    "| peer | " + " | ".join(str(ws) for ws in sizes) + " |", "|---|" + "---|" * len(sizes)]
            for peer in peers:
                cells = [f"{speed[mine][ws] / speed[peer][ws]:.3f}"
                         if ws in speed[mine] and ws in speed[peer] else "–" for ws in sizes]
                out.append(f"| {peer} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.jsonl files written by throughput.py --out")
    p.add_argument("--ref", default="mfsdp", help="implementation compared against the others")
    args = p.parse_args(argv)
    records = load(args.results)
    if not records:
        raise SystemExit(f"no successful records in {args.results}: nothing to tabulate")
    print(render(collect(records), args.ref))


if __name__ == "__main__":
    main()
