"""LoRA DPO on one GPU: TRL 1.16's ``DPOTrainer`` with PEFT beside ``mfsdp train --peft.method lora``,
in one job on the same device and the same preference pairs, one after the other.

The pairs are synthetic, with the UltraFeedback-like lengths of ``benchmarks/dpo_layout.py`` (its
``synthetic_pairs``: log-normal about a median pair of 409 tokens, prompt / answer 0.42; trl's
``max_length`` 1024), written as TRL conversational rows (``prompt`` a user turn, ``chosen`` and
``rejected`` an assistant turn, each about as many words of ``mfsdp.hf.random_model.WORDS`` as the
drawn tokens), or taken from ``--data ROWS.jsonl``. By default there are as many pairs as TRL's run
takes, so each row sees every pair once.

* trl: ``AutoModelForCausalLM`` in bf16 with SDPA attention, ``DPOTrainer(peft_config=LoraConfig(r 16,
  alpha 32, dropout 0, all linears))``, ``DPOConfig`` at trl's defaults but for what is stated: beta
  0.1, ``loss_type`` sigmoid, ``precompute_ref_log_probs`` off (the reference is the PEFT model with
  its adapters disabled, as trl does for a new adapter), ``max_length`` 1024, per-device batch
  ``--trl-batch`` (trl's default 8) x ``--trl-accum`` (4) pairs per step, trl's default gradient
  checkpointing (``--trl-gradient-checkpointing false`` turns it off), bf16 autocast, lr ``--lr``.
* mfsdp: ``mfsdp prepare-data`` (``--data.max_len 1024``, as trl's ``max_length``) on the same rows and
  model directory, then ``mfsdp train --peft.method lora`` (the same LoRA, beta and loss, lr ``--lr``):
  each pair once as [prompt | chosen | rejected], packed into windows of ``--seq-len``, the reference
  the base with the adapters off in the same step; 1 window a microbatch, and as many microbatches
  as make the pairs of a step, on average, trl's.

Each runs ``--warmup`` untimed steps, then ``--steps`` timed ones, in a process of its own (trl: this
script again; mfsdp: its CLI), so neither inherits the other's memory. Per row: pairs per step,
pairs/s, tokens computed/s (what goes through the model, padding included: trl's padded
[chosen; rejected] rows, mfsdp's whole windows), the median step time (trl: from one step's end
to the next, each bracketed by ``torch.cuda.synchronize()``; mfsdp: its ``metrics.jsonl``
``step_time_s``, CUDA events between step ends) and the peak GPU memory over the run
(``torch.cuda.max_memory_allocated``, as mfsdp's ``peak_mem_gib``). JSON lines go to ``--out``, a
table to stdout, last the line ``mfsdp / trl (pairs/s): N.NNx``.

The H200 row: random weights of the Llama-3-8B shape (``benchmarks/make_hf_dir.py`` writes them into
``--work``, 15 GB, kept for a rerun) and ``mfsdp.hf.random_model``'s tokenizer. The device has
no registry: carry trl 1.16.0 and what of its requirements (datasets, accelerate, ...) the image lacks
as wheels in ``.whl/`` (``EXTRA="trl==1.16.0 ..." bash benchmarks/fetch_wheels.sh``). About 7 minutes:

    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
    python benchmarks/dpo_trl.py --shape llama3-8b --trl-batch 8 --trl-accum 4 --seq-len 4096 \\
        --steps 10 --warmup 3 --work /tmp/dpo_trl --out $OUT/dpo_trl.jsonl

``--hf DIR`` takes a model directory (with its tokenizer) instead of ``--shape``. CPU smoke run
(also ``tests/test_bench_dpo_trl.py``): ``python benchmarks/dpo_trl.py --shape tiny --steps 2 --warmup 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mfsdp

from dpo_layout import synthetic_pairs  # noqa: E402  (benchmarks/ is this script's directory)
from mfsdp.hf.random_model import SHAPES, WORDS  # noqa: E402

SHAPE_DEFAULTS = {  # the CPU smoke run's lengths are a tenth, in a small window
    "tiny": dict(seq_len=256, length_scale=0.1, trl_batch=2, trl_accum=2, steps=2, warmup=1),
    "gpu": dict(seq_len=4096, length_scale=1.0, trl_batch=8, trl_accum=4, steps=10, warmup=3),
}
MAX_LENGTH = 1024  # trl's max_length; mfsdp prepare-data --data.max_len
PROMPT_EXTRA, ANSWER_EXTRA = 7, 2  # about the tokens ChatML adds around a user turn and an answer
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def write_rows(path: Path, pairs: int, sigma: float, scale: float, seed: int) -> None:
    """``pairs`` TRL conversational rows whose token lengths follow ``dpo_layout.synthetic_pairs``."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(max(1, n)))  # noqa: E731
    lengths = (synthetic_pairs(pairs, sigma, seed).double() * scale).round().long().tolist()
    with open(path, "w") as f:
        for prompt, chosen, rejected in lengths:
            f.write(json.dumps({"prompt": [{"role": "user", "content": words(prompt - PROMPT_EXTRA)}],
                                "chosen": [{"role": "assistant", "content": words(chosen - ANSWER_EXTRA)}],
                                "rejected": [{"role": "assistant", "content": words(rejected - ANSWER_EXTRA)}]})
                    + "\n")


def run_logged(cmd: list[str], log: Path) -> None:
    """``cmd`` from the root, this checkout's mfsdp first on its path, its output in ``log``; on failure
    the log's tail and an exit."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=path), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); the end of {log}:\n"
                 + "".join(log.read_text().splitlines(True)[-30:]))


def trl_trainer(args, counts: dict, callback):
    """trl's ``DPOTrainer`` on the rows, the model and LoRA of the docstring; ``counts`` gains the rows
    each training forward takes (padded, cut to max_length), counted at the loss: the collator runs a
    batch ahead (accelerate's look-ahead)."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa",
        device_map="cuda" if cuda else "cpu")
    config = trl.DPOConfig(
        output_dir=str(Path(args.work) / "trl"), per_device_train_batch_size=args.trl_batch,
        gradient_accumulation_steps=args.trl_accum, max_steps=args.warmup + args.steps, learning_rate=args.lr,
        beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=False, max_length=MAX_LENGTH,
        gradient_checkpointing=args.trl_gradient_checkpointing, bf16=cuda, use_cpu=not cuda, seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)

    class Counting(trl.DPOTrainer):
        def compute_loss(self, model, inputs, *rest, **kw):
            counts["pairs"] += inputs["input_ids"].shape[0] // 2
            counts["tokens"] += inputs["input_ids"].numel()
            counts["real"] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *rest, **kw)

    rows = datasets.Dataset.from_list([json.loads(line) for line in open(args.rows)])
    return Counting(model=model, args=config, train_dataset=rows, callbacks=[callback],
                    processing_class=transformers.AutoTokenizer.from_pretrained(args.model_dir),
                    peft_config=peft.LoraConfig(task_type="CAUSAL_LM", **LORA))


def trl_row(args) -> dict:
    """The trl + PEFT row, in this (child) process: each step timed from the previous one's end (data,
    forward, backward, optimizer, logging)."""
    import peft
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    counts, per_step, times, losses = {"pairs": 0, "tokens": 0, "real": 0}, [], [], []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, *_, **__):
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now
            per_step.append(dict(counts))
            counts.update(pairs=0, tokens=0, real=0)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trl_trainer(args, counts, Timer()).train()
    timed = per_step[args.warmup:]
    step_s = statistics.median(times[args.warmup:])
    pairs = statistics.mean(s["pairs"] for s in timed)
    tokens = statistics.mean(s["tokens"] for s in timed)
    checkpointing = ", gradient checkpointing" if args.trl_gradient_checkpointing else ""
    return dict(
        impl="trl", layout=f"padded [chosen; rejected] rows, {args.trl_batch} pairs x {args.trl_accum} "
        f"accumulated{checkpointing}", pairs_per_step=pairs, pairs_per_s=pairs / step_s, tokens_per_step=tokens,
        tokens_per_s=tokens / step_s, padding=1 - sum(s["real"] for s in timed) / sum(s["tokens"] for s in timed),
        step_s=step_s, step_times_s=times[args.warmup:],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                      trl=trl.__version__))


def mfsdp_row(args, tokens: Path) -> dict:
    """``mfsdp prepare-data`` has run; ``mfsdp train --peft.method lora`` and its metrics.jsonl."""
    from dpo_layout import mfsdp_packed
    from mfsdp.data.pair_packing import pair_lengths
    from mfsdp.data.token_file import TokenFile

    lengths = pair_lengths(TokenFile(tokens))
    per_window = len(lengths) / mfsdp_packed(lengths, args.seq_len)[1]
    microbatches = args.mfsdp_microbatches or max(1, round(args.trl_batch * args.trl_accum / per_window))
    run = Path(args.work) / "mfsdp"
    cmd = [sys.executable, "-m", "mfsdp.cli", "train", "--nproc-per-node", "1", "--model.hf", args.model_dir,
           "--data.path", str(tokens), "--data.seq_len", str(args.seq_len), "--data.local_batch", "1",
           "--data.microbatches", str(microbatches), "--data.val_fraction", "0", "--train.steps",
           str(args.warmup + args.steps), "--train.lr", str(args.lr), "--train.out_dir", str(run),
           "--train.overwrite", "true", "--train.checkpoint_every", "0", "--train.eval_every", "0",
           "--train.sample_tokens", "0", "--train.progress", "false", "--peft.method", "lora",
           "--peft.lora_r", str(LORA["r"]), "--peft.lora_alpha", str(LORA["lora_alpha"]),
           "--dpo.beta", "0.1", "--dpo.loss_type", "sigmoid", "--train.seed", str(args.seed)]
    run_logged(cmd, Path(args.work) / "mfsdp_train.log")
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in records if "step_time_s" in r]
    timed = steps[args.warmup:]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    pairs = statistics.mean(r["pairs"] for r in timed)
    tokens_per_step = microbatches * args.seq_len
    return dict(
        impl="mfsdp", layout=f"packed shared prompt, {microbatches} window(s) of {args.seq_len} "
        f"({per_window:.1f} pairs a window)", pairs_per_step=pairs, pairs_per_s=pairs / step_s,
        tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_step / step_s, padding=None, step_s=step_s,
        step_times_s=[r["step_time_s"] for r in timed],
        peak_gib=max(r["peak_mem_gib"] for r in steps) if _device_name() != "cpu" else None,
        loss_first=steps[0]["loss"], loss_last=steps[-1]["loss"], command=" ".join(cmd[1:]))


def table(rows: list[dict]) -> str:
    lines = ["| impl | layout | pairs/step | pairs/s | tokens computed/s | padding | step s (median) | peak GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pad = "-" if r["padding"] is None else f"{r['padding']:.1%}"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['impl']} | {r['layout']} | {r['pairs_per_step']:.1f} | {r['pairs_per_s']:,.2f} "
                     f"| {r['tokens_per_s']:,.0f} | {pad} | {r['step_s']:.3f} | {peak} |")
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--hf", help="a Hugging Face model directory (with its tokenizer) instead of --shape")
    p.add_argument("--data", help="TRL preference rows (JSONL) instead of the synthetic ones")
    p.add_argument("--pairs", type=int, help="synthetic pairs (default: what trl's run takes)")
    p.add_argument("--sigma", type=float, default=0.8, help="dpo_layout.py's log-normal spread")
    p.add_argument("--length-scale", type=float, help="multiply the drawn lengths (tiny: 0.1)")
    p.add_argument("--seq-len", type=int, help="mfsdp's window (default 4096; tiny 256)")
    p.add_argument("--trl-batch", type=int, help="trl's per_device_train_batch_size (default 8; tiny 2)")
    p.add_argument("--trl-accum", type=int, help="trl's gradient_accumulation_steps (default 4; tiny 2)")
    p.add_argument("--trl-gradient-checkpointing", type=lambda v: v.lower() in ("1", "true", "yes"), default=True,
                   help="trl's gradient_checkpointing (its default: true)")
    p.add_argument("--mfsdp-microbatches", type=int, help="mfsdp's windows a step (default: trl's pairs a step)")
    p.add_argument("--lr", type=float, default=1e-5, help="both rows (mfsdp's LoRA DPO recipe)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 3; tiny 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="where the model, rows, token file and runs go (default: a temporary directory)")
    p.add_argument("--out", help="append the two rows as JSON lines to this file")
    p.add_argument("--row", choices=("trl",), help=argparse.SUPPRESS)  # the child that runs trl
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in SHAPE_DEFAULTS["tiny" if args.shape == "tiny" else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> str:
    args = parse(argv)
    if args.row == "trl":
        print("RESULT " + json.dumps(trl_row(args)))
        return ""
    args.work = args.work or tempfile.mkdtemp(prefix="dpo_trl_")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.hf or str(work / "model")
    if not args.hf and not (work / "model" / "config.json").exists():
        run_logged([sys.executable, "benchmarks/make_hf_dir.py", args.model_dir, "--shape", args.shape],
                   work / "make_hf_dir.log")
    args.rows = args.data or str(work / "pairs.jsonl")
    if not args.data:
        write_rows(Path(args.rows), args.pairs or (args.warmup + args.steps) * args.trl_batch * args.trl_accum,
                   args.sigma, args.length_scale, args.seed)
    tokens = work / "pairs.tokens"
    run_logged([sys.executable, "-m", "mfsdp.cli", "prepare-data", args.rows, str(tokens), "--model.hf",
                args.model_dir, "--data.max_len", str(MAX_LENGTH)], work / "prepare_data.log")
    child = [sys.executable, __file__, "--row", "trl", "--model-dir", args.model_dir, "--rows", args.rows,
             "--work", args.work] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                                     ("shape", "trl_batch", "trl_accum", "trl_gradient_checkpointing", "lr",
                                      "steps", "warmup", "seed")]
    run_logged(child, work / "trl.log")
    trl = json.loads(next(line for line in open(work / "trl.log") if line.startswith("RESULT "))[7:])
    rows = [trl, mfsdp_row(args, tokens)]
    for r in rows:
        r.update(shape=args.hf or args.shape, device=_device_name(), data=args.data or "synthetic (dpo_layout.py)")
    ratio = rows[1]["pairs_per_s"] / rows[0]["pairs_per_s"]
    summary = next((line for line in open(work / "prepare_data.log") if line.startswith("wrote ")), "").strip()
    first = next((line for line in open(work / "mfsdp_train.log") if line.startswith("mfsdp train:")), "").strip()
    text = "\n".join([f"{args.rows}: {summary}", first, f"versions {trl['versions']}, device {rows[0]['device']}",
                      table(rows), "", f"mfsdp / trl (pairs/s): {ratio:.2f}x"])
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, mfsdp_over_trl_pairs_per_s=ratio)) + "\n")
    return text


def _device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
