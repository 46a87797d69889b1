"""Tokens computed per preference pair: trl's padded layout against mfsdp's packed shared-prompt one.

No model runs: a forward costs about its tokens, so the tokens a layout puts through the model
per pair are its cost, padding included (the attention's share grows with the window, and the
packed windows' document mask skips what lies across pairs: not counted here).

* trl padded (DPOTrainer 1.16): each pair as two rows [prompt | chosen] and [prompt | rejected],
  the 8 pairs of a device batch (``per_device_train_batch_size`` default 8) stacked as 16 rows and
  right-padded to the longest (``pad_to_multiple_of`` "auto": no padding off Neuron).
* unpadded rows: the same rows without any padding (what ``padding_free`` would give, forced off
  in trl 1.x): the prompt still twice.
* mfsdp packed: each pair once as [prompt | chosen | rejected] (``mfsdp.data.pair_packing``),
  best-fit decreasing into windows of ``--seq-len`` tokens; every window counted whole.

Both truncate as trl does by default (``max_length`` 1024: prompt + answer keeps its first 1024).

The pairs are synthetic, drawn from the published length statistics of UltraFeedback (binarized,
HuggingFaceH4/ultrafeedback_binarized, train_prefs: 61,135 pairs per its dataset card), as Wang
and Hegde measured them for "Accelerating Direct Preference Optimization with Prefix Sharing"
(arXiv 2410.20305), in the Speedups table of https://github.com/frankxwang/dpo-prefix-sharing
(README): median overall length 409 tokens, median prefix-to-completion length ratio 0.42 (the
Llama-3 tokenizer). Read here as: overall = prompt + chosen + rejected (their prefix-shared
sequence), ratio = prompt / the answers' mean, so a pair of median shape has a prompt of
409 * 0.42 / 2.42 = 71 tokens and answers of 169. The spread is not published there: the overall
length, the ratio and the chosen / rejected split are each log-normal with ``--sigma`` (0.8 by
default: an assumption), about 409, 0.42 and 1.

    python benchmarks/dpo_layout.py                      # 61,135 pairs, seq_len 4096
    python benchmarks/dpo_layout.py --seq-len 2048 --sigma 1.0
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mfsdp.data.packing import pack  # noqa: E402

SOURCE = "https://github.com/frankxwang/dpo-prefix-sharing (README, Speedups table; arXiv 2410.20305)"
MEDIAN_OVERALL, MEDIAN_RATIO = 409, 0.42
TRL_BATCH, TRL_MAX_LENGTH = 8, 1024


def synthetic_pairs(pairs: int, sigma: float, seed: int) -> torch.Tensor:
    """(pairs, 3) int64 prompt, chosen and rejected lengths: the overall length and the prompt /
    answer ratio log-normal about their published medians, the answers split by a log-normal
    chosen / rejected ratio about 1; each prompt + answer then cut to trl's max_length as trl cuts
    it (the start kept)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.exp(sigma * torch.randn(pairs, 3, generator=g, dtype=torch.float64))
    overall, ratio, split = MEDIAN_OVERALL * noise[:, 0], MEDIAN_RATIO * noise[:, 1], noise[:, 2]
    answers = overall / (1 + ratio / 2)  # chosen + rejected; the prompt is ratio * their mean
    lengths = torch.stack([overall - answers, answers * split / (1 + split), answers / (1 + split)], 1)
    lengths = lengths.round().clamp(min=1).to(torch.int64)
    lengths[:, 0] = lengths[:, 0].clamp(max=TRL_MAX_LENGTH - 1)  # keep at least one answer token
    lengths[:, 1:] = torch.minimum(lengths[:, 1:], TRL_MAX_LENGTH - lengths[:, :1])
    return lengths


def trl_padded(lengths: torch.Tensor, batch: int = TRL_BATCH) -> int:
    """Tokens through the model: per batch of ``batch`` pairs, 2 * batch rows of the longest row."""
    rows = lengths[:, 0:1] + lengths[:, 1:]  # (pairs, 2): prompt + chosen, prompt + rejected
    return sum(2 * len(part) * int(part.max()) for part in rows.split(batch))


def mfsdp_packed(lengths: torch.Tensor, seq_len: int) -> tuple[int, int]:
    """(tokens through the model, windows): every window of ``seq_len`` counted whole."""
    _, bounds = pack(lengths.sum(1), seq_len)
    windows = bounds.numel() - 1
    return windows * seq_len, windows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=61_135)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lengths = synthetic_pairs(args.pairs, args.sigma, args.seed)
    if int(lengths.sum(1).max()) > args.seq_len:
        parser.error(f"--seq-len {args.seq_len} is shorter than the longest pair ({int(lengths.sum(1).max())})")
    padded = trl_padded(lengths)
    unpadded = int((2 * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]).sum())
    packed, windows = mfsdp_packed(lengths, args.seq_len)
    n = args.pairs
    prompt, answer = lengths[:, 0].double().median(), lengths[:, 1:].double().median()
    lines = [
        f"synthetic UltraFeedback (binarized): {n:,} pairs; source {SOURCE}: median overall "
        f"{MEDIAN_OVERALL}, median prompt/answer {MEDIAN_RATIO}; log-normal sigma {args.sigma}, seed {args.seed}",
        f"drawn: median prompt {prompt:.0f}, median answer {answer:.0f}, median pair "
        f"{lengths.sum(1).double().median():.0f} tokens; trl max_length {TRL_MAX_LENGTH}",
        "",
        "| layout | tokens computed | per pair | padding |",
        "| --- | ---: | ---: | ---: |",
    ]
    stored = int(lengths.sum())
    for name, tokens, real in (
            (f"trl padded (batch {TRL_BATCH}, chosen + rejected rows, to the longest)", padded, unpadded),
            ("rows without padding (prompt twice)", unpadded, unpadded),
            (f"mfsdp packed shared prompt (seq_len {args.seq_len}, {windows:,} windows)", packed, stored)):
        lines.append(f"| {name} | {tokens:,} | {tokens / n:,.1f} | {1 - real / tokens:.1%} |")
    lines += ["", f"unpadded rows / mfsdp packed (the shared prompt alone): {unpadded / packed:.2f}x",
              f"trl padded / mfsdp packed: {padded / packed:.2f}x"]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
