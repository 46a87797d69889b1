"""``generation_config.json`` of an exported model directory, which ``generate`` reads for the ids
that start, end and pad a sequence: the ``--model.hf`` directory's own where it has one (sampling
defaults and several end-of-turn ids included), else one made of the special token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def write_generation_config(config: dict, source: str | None, out: Path) -> None:
    """Write ``out``'s generation_config.json: a copy of ``source``'s (the run's --model.hf
    directory), else the special ids of the exported ``config`` and, for padding, of the tokenizer
    written into ``out``."""
    theirs = Path(source) / GENERATION_CONFIG if source else None
    if theirs is not None and theirs.is_file():
        shutil.copyfile(theirs, out / GENERATION_CONFIG)
        return
    ids = {key: config[key] for key in SPECIAL_IDS if config.get(key) is not None}
    if "pad_token_id" not in ids and (pad := tokenizer_pad_id(out)) is not None:
        ids["pad_token_id"] = pad
    (out / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")


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
