"""A chrome trace cut down to what a timeline analysis reads, gzipped, so that one 8B step comes
back from the device (whose files return only up to 16 MiB each).

    python3 benchmarks/trim_trace.py TRACE.json OUT.json.gz [--no-cpu-ops]

Kept: GPU kernels, copies and sets, the user ranges (host and device), the CUDA runtime calls
(launches, event records and waits, synchronizations) and, unless ``--no-cpu-ops``, the aten
operators; each with its name, times, thread/stream and correlation id only.
"""

from __future__ import annotations

import gzip
import json
import sys

KEEP = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "user_annotation", "cuda_runtime",
        "cuda_driver", "cpu_op"}
ARGS = ("stream", "correlation", "External id", "device")


def trim(events: list[dict], cpu_ops: bool) -> list[dict]:
    out = []
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or cat not in KEEP or (cat == "cpu_op" and not cpu_ops):
            continue
        args = {k: v for k, v in (e.get("args") or {}).items() if k in ARGS}
        out.append({"ph": "X", "cat": cat, "name": e.get("name", ""), "pid": e.get("pid"), "tid": e.get("tid"),
                    "ts": round(float(e["ts"]), 3), "dur": round(float(e.get("dur", 0)), 3), "args": args})
    return out


def main(argv: list[str]) -> None:
    src, dst = argv[0], argv[1]
    with open(src) as f:
        events = json.load(f)["traceEvents"]
    kept = trim(events, "--no-cpu-ops" not in argv)
    with gzip.open(dst, "wt") as f:
        json.dump({"traceEvents": kept}, f, separators=(",", ":"))
    print(f"{src}: {len(events)} events, {len(kept)} kept -> {dst}")


if __name__ == "__main__":
    main(sys.argv[1:])
