"""Hugging Face model directories out: a full model, a base model with updated weights (merged
LoRA) and a PEFT adapter, every file through ``mfsdp.hf.files.atomic``.

``export_model`` streams the weights (``write_weights``: one tensor in memory at a time),
``export_merged`` streams a base directory's weights with some of them replaced, and
``export_adapter`` writes ``adapter_model.safetensors`` and ``adapter_config.json`` as ``peft``
does. Each then calls ``finish``, the one writer of what goes beside the weights: the tokenizer
files (a ``--model.hf`` directory's as they are, else a tokenizer object's), ``config.json`` with
its ``dtype``/``torch_dtype`` stamped, and ``generation_config.json``, which ``generate`` reads
for the ids that start, end and pad a sequence. The caller supplies the weights and the config;
what a training checkpoint or a LoRA model holds is not this module's concern.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from mfsdp.hf.files import SHARD_BYTES, Entry, HFWeightsError, WeightFiles, write_bytes, write_file, write_weights

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
"""Hugging Face's file names of a tokenizer and its chat template, as ``save_pretrained`` writes them."""


@dataclasses.dataclass(frozen=True)
class Exported:
    path: Path
    architecture: str
    tensors: int
    files: int
    nbytes: int
    tokenizer: str | None
    """The directory whose tokenizer was copied, or None (the byte tokenizer, or a token file gone)."""
    base: str | None = None
    """A PEFT adapter directory's base model directory ("": none recorded); None: a whole model."""


def export_model(out: Path, entries: Sequence[Entry], read: Callable[[Entry], torch.Tensor], config: dict,
                 dtype: torch.dtype, source: str | None = None, tokenizer=None,
                 max_shard_bytes: int = SHARD_BYTES) -> Exported:
    """A model directory: ``entries`` (``read`` gives each tensor when its turn comes), then
    ``finish``."""
    files = write_weights(out, entries, read, max_shard_bytes)
    origin = finish(out, config, dtype, source, tokenizer)
    return Exported(out, config.get("architectures", ["?"])[0], len(entries), files,
                    sum(e.nbytes for e in entries), origin)


def export_merged(out: Path, base: str, updates: Mapping[str, Callable[..., torch.Tensor]], config: dict,
                  dtype: torch.dtype, source: str | None = None, tokenizer=None,
                  max_shard_bytes: int = SHARD_BYTES) -> Exported:
    """``base``'s weights read again one tensor at a time, floating ones in ``dtype``, each named in
    ``updates`` replaced by ``updates[name](weight, dtype=...)``; HFWeightsError when ``base``
    lacks one of those."""
    with WeightFiles(base) as files:
        missing = sorted(set(updates) - set(files.files))
        if missing:
            raise HFWeightsError(f"the base directory {base} has no {missing[:4]}, which the adapters were trained "
                                 "on; was it replaced by another model? Restore the run's base directory")
        views = {name: files.get_slice(name) for name in files.files}
        entries = [Entry(name, tuple(v.get_shape()), dtype if v.get_dtype().startswith(("F", "BF")) else v[:].dtype)
                   for name, v in views.items()]  # floating point in ``dtype``, any other in its own

        def read(entry: Entry) -> torch.Tensor:
            weight = files.get_slice(entry.name)[:]
            return updates[entry.name](weight, dtype=entry.dtype) if entry.name in updates else weight

        return export_model(out, entries, read, config, dtype, source, tokenizer, max_shard_bytes)


def export_adapter(out: Path, tensors: Mapping[str, torch.Tensor], adapter_config: dict,
                   dtype: torch.dtype | None = None, source: str | None = None, tokenizer=None) -> Exported:
    """A PEFT adapter directory: ``tensors`` (whole, under PEFT's keys) in ``dtype`` (None: their
    own) and ``adapter_config``, then the tokenizer files (``finish``)."""
    out.mkdir(parents=True, exist_ok=True)
    entries = [Entry(name, tuple(t.shape), dtype or t.dtype) for name, t in tensors.items()]
    write_file(out / ADAPTER_WEIGHTS, entries, lambda entry: tensors[entry.name])
    write_bytes(out / ADAPTER_CONFIG, (json.dumps(adapter_config, indent=2) + "\n").encode())
    origin = finish(out, None, dtype, source, tokenizer)
    return Exported(out, "PEFT LoRA adapter", len(entries), 1, (out / ADAPTER_WEIGHTS).stat().st_size, origin,
                    base=adapter_config.get("base_model_name_or_path") or "")


def finish(out: Path, config: dict | None, dtype: torch.dtype | None, source: str | None, tokenizer=None) -> str | None:
    """What goes beside the weights in ``out``: the tokenizer files of ``source`` (a ``--model.hf``
    directory) as they are where it has any, else ``tokenizer``'s (``save`` and ``special_ids``,
    the latter into ``config``); then, given a ``config``, ``config.json`` with ``dtype`` stamped
    and ``generation_config.json``. Returns the directory the tokenizer came from, or None."""
    if config is not None:
        config.update(dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."))
    files = tokenizer_files(source)
    for file in files:
        write_bytes(out / file.name, file.read_bytes())
    if not files and tokenizer is not None:
        with tempfile.TemporaryDirectory() as saved:
            tokenizer.save(Path(saved))
            for file in sorted(Path(saved).iterdir()):
                write_bytes(out / file.name, file.read_bytes())
        if config is not None:
            config.update(tokenizer.special_ids())
    if config is not None:
        write_bytes(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
        _write_generation_config(config, source, out)
    return source if files else tokenizer.name if tokenizer is not None else None


def tokenizer_files(source: str | None) -> list[Path]:
    """The tokenizer files (``TOKENIZER_FILES``) directory ``source`` holds."""
    return [Path(source) / name for name in TOKENIZER_FILES if source and (Path(source) / name).is_file()]


def _write_generation_config(config: dict, source: str | None, out: Path) -> None:
    """``out``'s generation_config.json: a copy of ``source``'s (sampling defaults and several
    end-of-turn ids included), else the special ids of ``config`` and, for padding, of the
    tokenizer written into ``out``."""
    theirs = Path(source) / GENERATION_CONFIG if source else None
    if theirs is not None and theirs.is_file():
        write_bytes(out / GENERATION_CONFIG, theirs.read_bytes())
        return
    ids = {key: config[key] for key in SPECIAL_IDS if config.get(key) is not None}
    if "pad_token_id" not in ids and (pad := tokenizer_pad_id(out)) is not None:
        ids["pad_token_id"] = pad
    write_bytes(out / GENERATION_CONFIG, (json.dumps(ids, indent=2) + "\n").encode())


def tokenizer_pad_id(directory: Path) -> int | None:
    """The id of the padding token of the tokenizer saved in ``directory`` (tokenizer_config.json
    names it, tokenizer.json numbers it), or None."""
    try:
        pad = json.loads((directory / "tokenizer_config.json").read_text()).get("pad_token")
        tokens = json.loads((directory / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    pad = pad.get("content") if isinstance(pad, dict) else pad
    added = {t.get("content"): t.get("id") for t in tokens.get("added_tokens") or []}
    vocab = (tokens.get("model") or {}).get("vocab")
    return added.get(pad, vocab.get(pad) if isinstance(vocab, dict) else None) if pad else None


def exported_line(done: Exported) -> str:
    """What ``mfsdp export`` and ``--train.export_hf`` print; an adapter's load hint names its base
    directory only where it is there, and a base directory gone without a tokenizer adds a line."""
    tokenizer = f", tokenizer from {done.tokenizer}" if done.tokenizer else ""
    if done.base is not None:
        there = bool(done.base) and Path(done.base).is_dir()
        line = (f"wrote a PEFT LoRA adapter to {done.path}: {done.tensors} tensors, {done.nbytes / 1e6:,.1f} MB"
                f"{tokenizer}; load it with peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM."
                f"from_pretrained({repr(done.base) if there else 'BASE_MODEL_DIR'}), {str(done.path)!r})")
        if done.base and not there and not done.tokenizer:
            line += (f"\nthe base directory {done.base} is not there, so no tokenizer files were copied; give them "
                     "with `mfsdp export SOURCE OUT --model.hf DIR` (the base model's directory)")
        return line
    return (f"wrote {done.architecture} to {done.path}: {done.tensors} tensors, "
            f"{done.nbytes / 1e6:,.1f} MB in {done.files} safetensors file(s){tokenizer}; load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(done.path)!r})")
