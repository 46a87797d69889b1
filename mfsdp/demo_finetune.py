"""``make finetune-demo``: fine-tune a Hugging Face directory on CPU, then chat with the export.

Builds a tiny random Llama directory with a ChatML tokenizer (``mfsdp.hf.random_model``) and chat rows of
a few fixed questions and answers, then runs the three steps of the README's first screen:
``mfsdp prepare-data``, ``mfsdp train --nproc-per-node 2 ... --train.export_hf true``, and
``transformers`` on the export, which answers a question from the rows by greedy decoding. Exits 1
when the loss did not fall to a quarter of its first value or the answer is not the trained one.

    python -m mfsdp.demo_finetune [--dir runs/finetune-demo] [extra `mfsdp train` flags]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

PAIRS = (("what is two plus three?", "two plus three is five."),
         ("what is four minus one?", "four minus one is three."),
         ("how many apples today?", "seven apples today, thanks."),
         ("tell me a good question.", "what is the answer, please?"),
         ("hello world", "hello! how many oranges?"),
         ("what is six plus four?", "six plus four is ten."))
"""The chat rows' questions and answers: few and fixed, so a model that starts from random weights
can learn them exactly within a few minutes on CPU."""
REPEATS = 40
"""How often each pair appears in the rows."""
LR = 3e-3
WHY_LR = (f"--train.lr {LR:g}, not the fine-tuning recipe's 2e-5: 2e-5 suits pretrained weights, which "
          "should move little; these are random and must learn the answers in a few hundred steps")
TRAIN_FLAGS = ("--train.device", "cpu", "--data.seq_len", "64", "--data.local_batch", "8",
               "--train.steps", "150", "--train.lr", str(LR), "--train.eval_every", "0",
               "--train.checkpoint_every", "0", "--train.save_only_model", "true",
               "--train.sample_tokens", "0", "--train.export_hf", "true")
"""`mfsdp train`'s flags besides the model, data and run directory."""
MARKER = ".mfsdp-finetune-demo"
"""The file that marks a directory as this demo's, so a rerun may replace it."""


def fresh_dir(path: Path) -> Path:
    """``path``, empty: a previous demo's directory is removed, anything else there is refused."""
    if path.exists():
        if not (path / MARKER).exists() and any(path.iterdir()):
            raise SystemExit(f"finetune-demo: {path} exists and is not this demo's; pass --dir NEW_DIR")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("written by python -m mfsdp.demo_finetune; removed by its next run\n")
    return path


def write_rows(path: Path) -> None:
    """The chat rows: every pair of ``PAIRS`` ``REPEATS`` times, as {"messages": [user, assistant]}."""
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for _ in range(REPEATS) for q, a in PAIRS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run(args: list[str]) -> None:
    """``mfsdp ARGS`` in this process, printed first; a non-zero exit ends the demo with it."""
    from mfsdp.cli import main as cli_main

    print("\n$ mfsdp", " ".join(args), flush=True)
    code = cli_main(args)
    if code:
        raise SystemExit(code)


def prepare_and_train(rows: Path, tokens: Path, model_dir: Path, out: Path, why_lr: str, flags: list[str]) -> None:
    """``mfsdp prepare-data`` of ``rows`` with ``model_dir``'s tokenizer, then ``mfsdp train`` of that
    model on 2 processes into ``out``, with ``flags``; ``why_lr`` says why the learning rate is not the
    recipe's."""
    run(["prepare-data", str(rows), str(tokens), "--model.hf", str(model_dir)])
    print(why_lr)
    run(["train", "--nproc-per-node", "2", "--model.hf", str(model_dir), "--data.path", str(tokens),
         "--train.out_dir", str(out), *flags])


def loss_fall(metrics: Path) -> tuple[float, float]:
    """The loss of the first step and the mean of the last ten steps', from ``metrics.jsonl``."""
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if line.strip()]
    last = losses[-10:]
    return losses[0], sum(last) / len(last)


def chat(export: Path, question: str) -> str:
    """The exported model's greedy answer to one user turn, through ``transformers`` alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfsdp.demo_finetune", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/finetune-demo"),
                        help="the demo's directory, replaced on each run (default: runs/finetune-demo)")
    args, extra = parser.parse_known_args(argv)
    from mfsdp.hf.random_model import make_model, make_tokenizer

    start, work = time.monotonic(), fresh_dir(args.dir)
    model_dir, rows, tokens, out = work / "model", work / "chats.jsonl", work / "chats.tokens", work / "run"
    make_model(model_dir, "tiny")
    make_tokenizer(model_dir)
    write_rows(rows)
    print(f"wrote a random tiny Llama directory {model_dir} and {len(PAIRS) * REPEATS} chat rows in {rows} "
          f"({len(PAIRS)} questions, each {REPEATS} times)")
    prepare_and_train(rows, tokens, model_dir, out, WHY_LR, [*TRAIN_FLAGS, *extra])
    first, last = loss_fall(out / "metrics.jsonl")
    question, expected = PAIRS[0]
    print(f"\nloading {out / 'hf'} with transformers (AutoModelForCausalLM, apply_chat_template, greedy generate)")
    answer = chat(out / "hf", question)
    print(f"question: {question}\nexpected: {expected}\nanswer:   {answer}\n"
          f"loss: {first:.3f} at step 1, {last:.3f} over the last 10 steps")
    failed = [why for bad, why in ((last > first / 4, "the loss did not fall to a quarter of its first value"),
                                   (answer != expected, "the answer is not the trained one")) if bad]
    print(f"finetune-demo: {'FAILED: ' + '; '.join(failed) if failed else 'passed'} "
          f"({time.monotonic() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
