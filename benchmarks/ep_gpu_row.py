"""Helpers of ep_gpu_row.sh (NOT RUN YET on a GPU): the Qwen3-30B-A3B-shaped config directory, and the row
that sets mfsdp at ep 8 beside torchtitan's expert parallelism.

    python benchmarks/ep_gpu_row.py config DIR                       # DIR/config.json (no weights)
    python benchmarks/ep_gpu_row.py report --mfsdp METRICS.jsonl --torchtitan TT.log [--span 6..20]

``report`` reads mfsdp's ``metrics.jsonl`` (``tokens_per_s_per_gpu``, ``peak_mem_gib`` per step) and
torchtitan's log lines (``step: N ... memory: X GiB(...) tps: T``, tokens per second per GPU and its
peak reserved memory), takes the median throughput and the largest peak over the steps of ``--span``,
and prints a markdown table and ``mfsdp / torchtitan tok/s: R x``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TT_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)\s*GiB.*?tps:\s*([\d,]+)")


def write_config(out: Path) -> None:
    from ep_bytes import QWEN3_30B_A3B, hf_config

    config = hf_config(QWEN3_30B_A3B, seq=40960)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"))


def in_span(step: int, span: tuple[int, int]) -> bool:
    return span[0] <= step <= span[1]


def mfsdp_row(metrics: Path, span: tuple[int, int]) -> tuple[float, float]:
    """(median tokens/s per GPU, largest peak GiB) over the steps of ``span`` of an mfsdp run."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r and in_span(r["step"], span) and r.get("tokens_per_s_per_gpu")]
    if not rows:
        raise SystemExit(f"{metrics}: no step in {span[0]}..{span[1]} with tokens_per_s_per_gpu")
    return statistics.median(r["tokens_per_s_per_gpu"] for r in rows), max(r["peak_mem_gib"] for r in rows)


def torchtitan_row(log: Path, span: tuple[int, int]) -> tuple[float, float]:
    """(median tps, largest memory GiB) over the steps of ``span`` of a torchtitan log."""
    found = [(int(s), float(m), float(t.replace(",", ""))) for s, m, t in TT_LINE.findall(log.read_text())]
    found = [f for f in found if in_span(f[0], span)]
    if not found:
        raise SystemExit(f"{log}: no torchtitan step line in {span[0]}..{span[1]} (step: N ... memory: X GiB ... tps: T)")
    return statistics.median(f[2] for f in found), max(f[1] for f in found)


def report(args) -> None:
    span = tuple(int(x) for x in args.span.split(".."))
    rows = {"mfsdp ep 8": mfsdp_row(Path(args.mfsdp), span),
            "torchtitan ep 8": torchtitan_row(Path(args.torchtitan), span)}
    print(f"| Qwen3-30B-A3B shape, 8 GPUs, steps {args.span} | tok/s per GPU (median) | peak memory GiB |")
    print("|---|---|---|")
    for name, (tps, peak) in rows.items():
        print(f"| {name} | {tps:,.0f} | {peak:.1f} |")
    ratio = rows["mfsdp ep 8"][0] / rows["torchtitan ep 8"][0]
    print(f"\nmfsdp / torchtitan tok/s: {ratio:.2f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("config", help="write DIR/config.json of the Qwen3-30B-A3B shape")
    c.add_argument("out", type=Path)
    r = sub.add_parser("report", help="the markdown row of both runs and the throughput ratio")
    r.add_argument("--mfsdp", required=True, help="mfsdp train's metrics.jsonl")
    r.add_argument("--torchtitan", required=True, help="torchtitan's log")
    r.add_argument("--span", default="6..20", help="steps FIRST..LAST measured (default 6..20)")
    args = p.parse_args(argv)
    write_config(args.out) if args.command == "config" else report(args)


if __name__ == "__main__":
    main()
