"""The ``mfsdp`` console script: ``mfsdp train ...``, ``mfsdp plan ...``, ``mfsdp prepare-data ...``
and ``mfsdp export ...``."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mfsdp.data.prepare import RowOptions


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mfsdp {train,plan,prepare-data,export} ...\n\n"
              "  train         train a Llama-style model (see `mfsdp train --help`); start\n"
              "                several processes with `mfsdp train --nproc-per-node N ...`\n"
              "  plan          predict a train config's GPU memory and list the settings that fit\n"
              "  prepare-data  tokenize text, fine-tuning rows or preference pairs into a token file\n"
              "  export        write a checkpoint as a Hugging Face model directory (safetensors)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from mfsdp.train.command.launcher import is_launch
        if is_launch(rest):  # --nproc-per-node and friends: check, then start the workers
            from mfsdp.train.command.launcher import main as launch_main
            return launch_main(rest)
        from mfsdp.train.command.main import main as train_main  # one process, in this one
        return train_main(rest)
    if command == "plan":
        from mfsdp.train.command.plan import main as plan_main
        try:
            return plan_main(rest)
        except ModuleNotFoundError as err:  # drawing the plan's PNG, after the plan is printed
            if (err.name or "").partition(".")[0] != "matplotlib":
                raise
            from mfsdp.train.report.plotting import needs_matplotlib
            print(f"\nmemory over the step: {needs_matplotlib('the PNG')}")
            return 0
    if command in COMMANDS:
        return _run(command, rest)
    print(f"mfsdp: unknown command {command!r}; use train, plan, prepare-data or export", file=sys.stderr)
    return 2


PREPARE = """Tokenize text, fine-tuning rows or preference pairs into the token file that
`mfsdp train --data.path` reads. Rows are {"text": ...} documents (a token stream, as for pretraining),
samples, each row in any of the formats prompt/completion, messages (tools too), ShareGPT and Alpaca
(README: Fine-tuning, Data), or preference pairs: TRL's 'chosen' and 'rejected', with or without a
'prompt', tokenized as trl's DPOTrainer does. The loss counts the completion or every assistant turn
(tool calls too) and the token closing it. Chats go through the tokenizer's chat template, or mfsdp's
own when it has none. A bad row stops with FILE:LINE and writes nothing.
  INPUT   a UTF-8 text file; rows in JSONL or a JSON array (.jsonl, .json), Parquet (.parquet), Arrow
          (.arrow) or a directory saved by datasets.save_to_disk; a directory of data files; or
          'stdlib' for the demo corpus (this Python's standard library, its *.py files)
  OUT     the token file to write
"""
EXPORT = """Write a training checkpoint as a Hugging Face model directory (config.json, safetensors, the run's
tokenizer) that transformers' from_pretrained loads; a LoRA run's as a PEFT adapter directory, or merged
into its base with --peft.merge_on_export true.
  SOURCE  a checkpoint (OUT_DIR/checkpoints/step_N) or a run's OUT_DIR (its newest whole checkpoint)
  OUT     the directory to write
"""


@dataclass(frozen=True)
class PrepareSection(RowOptions):
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory; None: --model.hf DIR's when given, else bytes."""
    text_key: str = "text"
    """The JSONL field holding a text row's document."""
    glob: str | None = None
    """The files to read when INPUT is a directory; None: its data files (*.jsonl, *.json, *.txt,
    *.md), and *.py for stdlib."""


@dataclass(frozen=True)
class DataModel:
    hf: str | None = None
    """The Hugging Face model directory the data is for: its tokenizer is the default --data.tokenizer."""


@dataclass(frozen=True)
class ExportSection:
    dtype: str = "auto"
    """The weights' dtype: auto, bf16 or fp32; auto: the end-of-run export's (--train.save_dtype, else
    the run's compute dtype), as the checkpoint records it."""
    max_shard_gb: float = 5.0
    """The largest safetensors file, in GB."""

    def __post_init__(self):
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"export.dtype must be one of auto, bf16, fp32, got {self.dtype!r}")


@dataclass(frozen=True)
class ExportPeft:
    merge_on_export: bool | None = None
    """A LoRA run: write the merged model (true) or the PEFT adapter (false); None: the run's
    --peft.merge_on_export."""


@dataclass(frozen=True)
class ExportModel:
    hf: str | None = None
    """The base model directory, where the run's --model.hf has moved: the base of a merged LoRA export,
    its tokenizer files, the adapter's base_model_name_or_path; None: the run's (the checkpoint records it)."""


COMMANDS = {  # the sections, old spellings (kept for one release) and arguments of prepare-data and export
    "prepare-data": (PREPARE, {"data": PrepareSection, "model": DataModel},
                     {"--tokenizer": "data.tokenizer", "--format": "data.format", "--max-len": "data.max_len",
                      "--train-on-prompt": "data.train_on_prompt=true", "--text-key": "data.text_key",
                      "--glob": "data.glob"}, ("INPUT", "OUT")),
    "export": (EXPORT, {"export": ExportSection, "peft": ExportPeft, "model": ExportModel},
               {"--dtype": "export.dtype", "--max-shard-gb": "export.max_shard_gb"}, ("SOURCE", "OUT"))}


def _run(command: str, argv: list[str]) -> int:
    """``mfsdp prepare-data`` or ``mfsdp export``: its help, or its command line read as `mfsdp train`
    reads one, then the command; a user error is one line and exit code 2."""
    from mfsdp.train.command.args import parse_command, usage
    from mfsdp.train.command.errors import USER_ERRORS
    head, sections, aliases, positional = COMMANDS[command]
    if "-h" in argv or "--help" in argv:
        print(usage(f"usage: mfsdp {command} {' '.join(positional)} [--SECTION.KEY VALUE ...]\n\n{head}",
                    sections, aliases))
        return 0
    try:
        args, parsed = parse_command(argv, sections, aliases, positional)
        return (prepare_data if command == "prepare-data" else export)(*args, *parsed.values())
    except USER_ERRORS as err:
        return _error(command, err)


def _error(command: str, err: Exception) -> int:
    print(f"mfsdp {command}: error: {err}", file=sys.stderr)
    return 2


def prepare_data(source: str, out: str, data: PrepareSection, model: DataModel) -> int:
    from mfsdp.data.prepare import STDLIB, STDLIB_GLOB, prepare, stdlib_source
    stdlib = source == STDLIB
    info = prepare(stdlib_source() if stdlib else source, out, tokenizer=data.tokenizer or model.hf,
                   text_key=data.text_key, glob=data.glob or (STDLIB_GLOB if stdlib else None), rows=data)
    where = f"to {info['path']} (tokenizer {info['tokenizer']}, vocabulary {info['vocab_size']})"
    if info["format"] == "text":
        print(f"wrote {info['tokens']:,} tokens from {info['documents']:,} documents {where}")
    elif info["format"] == "preference":
        _print_pairs(info, where)
    else:
        limit = (f" to {info['max_len']:,} tokens ({info['cut_tokens']:,} tokens cut)"
                 if info["max_len"] else "")
        print(f"wrote {info['samples']:,} {info['format']} samples, {info['tokens']:,} tokens, "
              f"{info['counted']:,} answer tokens counted in the loss, {info['truncated']:,} "
              f"samples truncated{limit} {where}")
    return 0


def _print_pairs(info: dict, where: str) -> None:
    """prepare-data's lines about a preference file: what it holds, what the cap cut, equal answers."""
    prompt, chosen, rejected = info["parts"]
    print(f"wrote {info['pairs']:,} preference pairs, {info['tokens']:,} tokens ({prompt:,} prompt, {chosen:,} "
          f"chosen answer, {rejected:,} rejected answer) {where}")
    if info["max_len"]:
        print(f"--data.max_len {info['max_len']:,} (trl's max_length) cut {info['truncated']:,} of {info['pairs']:,} "
              f"pairs to {info['max_len']:,} tokens per prompt and answer ({info['cut_tokens']:,} tokens) and "
              f"dropped {info['dropped']:,} whose prompt alone fills it")
    if info["same"]:
        print(f"{info['same']:,} of {info['pairs']:,} pairs have the same chosen and rejected answer: kept, as trl "
              "keeps them, though they carry no signal")


def export(source: str, out: str, options: ExportSection, peft: ExportPeft, model: ExportModel) -> int:
    from mfsdp.hf.export import exported_line
    from mfsdp.train.checkpoint import CheckpointError
    from mfsdp.train.run.config import DTYPES
    from mfsdp.train.export import ExportError, export_hf
    try:
        done = export_hf(source, out, dtype=DTYPES.get(options.dtype),
                         max_shard_bytes=max(1, int(options.max_shard_gb * 1e9)), merge=peft.merge_on_export, base=model.hf)
    except (ExportError, CheckpointError) as err:
        return _error("export", err)
    print(exported_line(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
