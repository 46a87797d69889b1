"""The ``mfsdp`` console script: ``mfsdp train ...``, ``mfsdp plan ...``, ``mfsdp prepare-data ...``
and ``mfsdp export ...``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mfsdp {train,plan,prepare-data,export} ...\n\n"
              "  train         train a Llama-style model (see `mfsdp train --help`); start\n"
              "                several processes with `mfsdp train --nproc-per-node N ...`\n"
              "  plan          predict a train config's GPU memory and list the settings that fit\n"
              "  prepare-data  tokenize a .txt/.jsonl file or a directory into a token file\n"
              "  export        write a checkpoint as a Hugging Face model directory (safetensors)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from mfsdp.train.launcher import is_launch
        if is_launch(rest):  # --nproc-per-node and friends: check, then start the workers
            from mfsdp.train.launcher import main as launch_main
            return launch_main(rest)
        from mfsdp.train.main import main as train_main  # one process, in this one
        return train_main(rest)
    if command == "plan":
        from mfsdp.train.plan import main as plan_main
        try:
            return plan_main(rest)
        except ModuleNotFoundError as err:  # drawing the plan's PNG, after the plan is printed
            if (err.name or "").partition(".")[0] != "matplotlib":
                raise
            from mfsdp.train.plotting import needs_matplotlib
            print(f"\nmemory over the step: {needs_matplotlib('the PNG')}")
            return 0
    if command == "prepare-data":
        return prepare_data(rest)
    if command == "export":
        return export(rest)
    print(f"mfsdp: unknown command {command!r}; use train, plan, prepare-data or export", file=sys.stderr)
    return 2


def prepare_data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mfsdp prepare-data",
        description="Tokenize text, or fine-tuning rows, into the token file that `mfsdp train "
                    '--data.path` reads. JSONL rows are {"text": ...} (a token stream, as for '
                    'pretraining), or samples, each row in any of: {"prompt": ..., "completion": ...} '
                    '(strings, or both lists of messages), {"messages": [{"role": ..., "content": ...}, '
                    '...]} (roles system, user, assistant and tool; assistant tool_calls and a row\'s '
                    '"tools" go to the chat template), ShareGPT {"conversations": [{"from": "human"|"gpt"|'
                    '"system"|"function_call"|"observation", "value": ...}]} and Alpaca {"instruction": '
                    '..., "input": ..., "output": ...}. The loss counts the completion or every '
                    "assistant turn (tool calls too) and the token closing it. Chats go through the "
                    "tokenizer's chat template, or mfsdp's own (<|user|>\\n...\\n<|assistant|>\\n"
                    "...<eos>) when it has none; a plain prompt/completion is the tokenizer's text "
                    "(its BOS too), then the end-of-sequence token. A bad row stops with FILE:LINE and "
                    "writes nothing.")
    parser.add_argument("input", help="a .txt file, a .jsonl file (one row per line), "
                                      "or a directory, or 'stdlib' for the demo corpus")
    parser.add_argument("out", help="the token file to write")
    parser.add_argument("--tokenizer", default=None,
                        help="a local Hugging Face tokenizer directory (default: --model.hf DIR "
                             "when given, else bytes)")
    parser.add_argument("--model.hf", dest="model_hf", default=None, metavar="DIR",
                        help="the Hugging Face model directory the data is for: its tokenizer "
                             "is the default --tokenizer")
    parser.add_argument("--format", choices=("text", "prompt_completion", "messages", "sharegpt", "alpaca"),
                        default=None, help="the format of every JSONL row (default: each row's, from "
                                           "its keys)")
    parser.add_argument("--train-on-prompt", action="store_true",
                        help="count every token in the loss, prompts and user turns too "
                             "(default: only the completion or the assistant turns)")
    parser.add_argument("--max-len", type=int, default=None, metavar="N",
                        help="keep at most N tokens of each sample, counting those cut "
                             "(default: no limit)")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--glob", default="*.py",
                        help="files to read when INPUT is a directory (default: *.py)")
    args = parser.parse_args(argv)
    from mfsdp.data import DataError, RowOptions, prepare
    from mfsdp.data.prepare import STDLIB, stdlib_source
    source = stdlib_source() if args.input == STDLIB else args.input
    try:
        rows = RowOptions(format=args.format, train_on_prompt=args.train_on_prompt,
                          max_len=args.max_len)
        info = prepare(source, args.out, tokenizer=args.tokenizer or args.model_hf,
                       text_key=args.text_key, glob=args.glob, rows=rows)
    except DataError as err:
        print(f"mfsdp prepare-data: error: {err}", file=sys.stderr)
        return 2
    where = f"to {info['path']} (tokenizer {info['tokenizer']}, vocabulary {info['vocab_size']})"
    if info["format"] == "text":
        print(f"wrote {info['tokens']:,} tokens from {info['documents']:,} documents {where}")
    else:
        limit = (f" to {info['max_len']:,} tokens ({info['cut_tokens']:,} tokens cut)"
                 if info["max_len"] else "")
        print(f"wrote {info['samples']:,} {info['format']} samples, {info['tokens']:,} tokens, "
              f"{info['counted']:,} answer tokens counted in the loss, {info['truncated']:,} "
              f"samples truncated{limit} {where}")
    return 0


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mfsdp export",
        description="Write a training checkpoint as a Hugging Face model directory (config.json, "
                    "safetensors, the run's tokenizer) that transformers' from_pretrained loads; a LoRA "
                    "run's as a PEFT adapter directory, or merged into its base with --peft.merge_on_export.")
    parser.add_argument("source", help="a checkpoint (OUT_DIR/checkpoints/step_N) or a run's OUT_DIR "
                                       "(its newest whole checkpoint)")
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="dtype of the weights written (default auto: the end-of-run export's, "
                             "--train.save_dtype, else the run's compute dtype)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="largest safetensors file, in GB (default: 5)")
    parser.add_argument("--peft.merge_on_export", dest="merge", choices=("true", "false"), default=None,
                        help="a LoRA run: write the merged model (true) or the PEFT adapter (false); "
                             "default: the run's --peft.merge_on_export")
    args = parser.parse_args(argv)
    from mfsdp.hf.export import exported_line
    from mfsdp.train.checkpoint import CheckpointError
    from mfsdp.train.config import DTYPES
    from mfsdp.train.export import ExportError, export_hf
    try:
        done = export_hf(args.source, args.out, dtype=DTYPES.get(args.dtype),
                         max_shard_bytes=max(1, int(args.max_shard_gb * 1e9)),
                         merge=None if args.merge is None else args.merge == "true")
    except (ExportError, CheckpointError) as err:
        print(f"mfsdp export: error: {err}", file=sys.stderr)
        return 2
    print(exported_line(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
