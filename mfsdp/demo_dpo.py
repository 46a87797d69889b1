"""``make dpo-demo``: preference tuning (DPO) on CPU, from the fine-tuning demo's model to an export that
follows a rule it was never told.

Runs ``make finetune-demo``'s steps (``mfsdp.demo_finetune``) for a fine-tuned tiny Llama export, then
writes preference pairs on arithmetic and counting questions whose chosen answer ends with ", please."
and whose rejected one, otherwise the same, ends with ", thanks." (the fine-tuned model, which has seen
", thanks." end an answer, prefers the rejected one at first), and runs ``mfsdp prepare-data`` and
``mfsdp train --nproc-per-node 2 ... --train.export_hf true`` on them (full DPO, the reference the
initial model's stored log-probs). Exits 1 unless the held-out pairs' ``val_rewards/accuracies`` ends
above 0.9 and, on questions in no pair, the export (loaded by ``transformers``) gives the chosen
ending a higher log-prob than the rejected one in at least 90 % of cases.

    python -m mfsdp.demo_dpo [--dir runs/dpo-demo] [extra `mfsdp train` flags]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from mfsdp import demo_finetune
from mfsdp.demo_finetune import prepare_and_train

NUMBERS = "zero one two three four five six seven eight nine ten".split()
ENDINGS = (", please.", ", thanks.")
"""The chosen and the rejected ending."""
NEW_PROMPTS = 30
"""Questions kept out of the pair file, asked of the export."""
LR = 1e-3
WHY_LR = (f"--train.lr {LR:g}, not the DPO recipe's 1e-6: 1e-6 suits large pretrained models; this one has "
          "0.1M parameters and a few dozen steps to learn the rule")
TRAIN_FLAGS = ("--train.device", "cpu", "--data.seq_len", "64", "--data.local_batch", "4", "--data.val_fraction",
               "0.25", "--train.steps", "40", "--train.lr", str(LR), "--train.eval_every", "10",
               "--train.checkpoint_every", "0", "--train.save_only_model", "true", "--train.sample_tokens", "0",
               "--train.seed", "0", "--train.export_hf", "true")
"""`mfsdp train`'s flags besides the model, data and run directory."""


def questions() -> list[tuple[str, str]]:
    """Every question of the demo's three kinds with its answer, without the ending."""
    plus = [(f"what is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}")
            for a in range(1, 10) for b in range(1, 11 - a)]
    minus = [(f"what is {NUMBERS[a]} minus {NUMBERS[b]}?", f"{NUMBERS[a]} minus {NUMBERS[b]} is {NUMBERS[a - b]}")
             for a in range(2, 11) for b in range(1, a)]
    count = [(f"how many {fruit} today?", f"{NUMBERS[n]} {fruit} today") for fruit in ("apples", "oranges")
             for n in range(1, 11)]
    return plus + minus + count


def write_pairs(path: Path, qas: list[tuple[str, str]]) -> None:
    """TRL's conversational preference rows: the user turn, then each answer's assistant turn."""
    def turn(role, content):
        return [{"role": role, "content": content}]

    rows = [{"prompt": turn("user", q), "chosen": turn("assistant", a + ENDINGS[0]),
             "rejected": turn("assistant", a + ENDINGS[1])} for q, a in qas]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def gaps(export: Path, qas: list[tuple[str, str]]) -> list[float]:
    """For each question, the summed log-prob of the answer with the chosen ending minus that with the
    rejected one, under the model in ``export``, through ``transformers`` alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()

    def logp(question: str, answer: str) -> float:
        user = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=True)["input_ids"]
        ids = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": answer}],
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        targets = torch.tensor(ids[1:])
        return float(logps.gather(1, targets[:, None])[len(prompt) - 1:].sum())

    return [logp(q, a + ENDINGS[0]) - logp(q, a + ENDINGS[1]) for q, a in qas]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfsdp.demo_dpo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/dpo-demo"),
                        help="the demo's directory, replaced on each run (default: runs/dpo-demo)")
    args, extra = parser.parse_known_args(argv)
    start, work = time.monotonic(), args.dir
    print("the fine-tuning demo first: its export is the model that DPO tunes", flush=True)
    if demo_finetune.main(["--dir", str(work)]):
        return 1
    sft, rows, tokens, out = work / "run" / "hf", work / "pairs.jsonl", work / "pairs.tokens", work / "dpo"
    qas = questions()
    random.Random(0).shuffle(qas)
    new, paired = qas[:NEW_PROMPTS], qas[NEW_PROMPTS:]
    write_pairs(rows, paired)
    print(f"\nwrote {len(paired)} preference pairs in {rows}: the chosen answer ends with '{ENDINGS[0]}', the "
          f"rejected one with '{ENDINGS[1]}'; {NEW_PROMPTS} more questions are kept for the export")
    prepare_and_train(rows, tokens, sft, out, WHY_LR, [*TRAIN_FLAGS, *extra])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["val_rewards/accuracies"]) for r in records if "val_rewards/accuracies" in r]
    accuracy = evals[-1][1]
    print(f"\nloading {sft} and {out / 'hf'} with transformers: the log-prob of each ending on {len(new)} new "
          "questions")
    before, after = gaps(sft, new), gaps(out / "hf", new)
    wins = sum(g > 0 for g in after)
    print("held-out pairs: val_rewards/accuracies " + ", ".join(f"{a:.3f} at step {s}" for s, a in evals)
          + f" (must end > 0.9); val_rewards/margins {records[-1]['val_rewards/margins']:.3f}")
    print(f"new questions whose chosen ending is the likelier: {sum(g > 0 for g in before)}/{len(new)} before DPO, "
          f"{wins}/{len(new)} after (must be >= 90 %); chosen minus rejected log-prob {min(before):.1f} to "
          f"{max(before):.1f} before, {min(after):.1f} to {max(after):.1f} after")
    failed = [why for bad, why in ((accuracy <= 0.9, "val_rewards/accuracies is not above 0.9"),
                                   (wins < 0.9 * len(new), "the export prefers the chosen ending on < 90 % of new "
                                                             "questions")) if bad]
    print(f"dpo-demo: {'FAILED: ' + '; '.join(failed) if failed else 'passed'} ({time.monotonic() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
