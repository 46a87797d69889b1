"""A random Hugging Face model directory, a small BPE tokenizer with a chat template, and synthetic
chat rows: what a fine-tuning run needs, built here because nothing may be downloaded.

    python benchmarks/make_hf_dir.py OUT_DIR --shape llama3-8b [--rows ROWS.jsonl --n-rows 2000]

The directory comes from ``mfsdp.hf.random_model`` (``--shape`` is one of its ``SHAPES``); the rows are
sums of small numbers, each answer repeated a random number of times.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from mfsdp.hf.random_model import SHAPES, make_model, make_tokenizer, model_config


def make_rows(path: Path, n: int, seed: int = 0) -> None:
    """``n`` synthetic chat rows (a system turn sometimes, then one or two user/assistant turns)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You add small numbers."}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 2))):
            a, b = rng.randrange(10), rng.randrange(10)
            messages += [{"role": "user", "content": f"what is {a} plus {b}?"},
                         {"role": "assistant", "content": f"{a} plus {b} is {a + b}. " * rng.randrange(1, 20)}]
        rows.append({"messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--no-weights", action="store_true", help="config.json only (trains from random init)")
    p.add_argument("--init", choices=("hf", "bundled"), default="hf",
                   help="hf: transformers' init; bundled: the residual-writing projections scaled as the preset's")
    p.add_argument("--rows", type=Path, help="also write synthetic chat rows here")
    p.add_argument("--n-rows", type=int, default=2000)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.no_weights:
        model_config(args.shape).save_pretrained(args.out)
    else:
        make_model(args.out, args.shape, init=args.init)
    make_tokenizer(args.out)
    if args.rows:
        make_rows(args.rows, args.n_rows)
    print(f"wrote {args.out} ({args.shape}{', no weights' if args.no_weights else ''})"
          + (f" and {args.n_rows} chat rows in {args.rows}" if args.rows else ""))


if __name__ == "__main__":
    main()
