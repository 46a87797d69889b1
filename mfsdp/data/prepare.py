"""Turn text into a token file: ``mfsdp prepare-data INPUT OUT``.

INPUT is a text file (one document), a ``.jsonl`` file (one document per line, read from
a text field), or a directory (every file matching a glob, one document each). Documents
are joined with the tokenizer's end-of-document id, so the model learns where one stops.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from mfsdp.data.token_file import DataError, write_token_file
from mfsdp.data.tokenizer import load_tokenizer

STDLIB = "stdlib"


def iter_documents(source: str | Path, text_key: str = "text",
                   glob: str = "*.py") -> Iterator[str]:
    source = Path(source)
    if source.is_dir():
        files = sorted(p for p in source.glob(glob) if p.is_file())
        if not files:
            raise DataError(f"no files match {glob!r} in {source}; pass --glob PATTERN")
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")
    elif not source.is_file():
        raise DataError(f"input {source} does not exist; pass a .txt or .jsonl file or a "
                        "directory")
    elif source.suffix == ".jsonl":
        with open(source, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    yield record[text_key]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise DataError(f"{source}:{line_no} is not a JSON object with a "
                                    f"{text_key!r} field ({err}); fix the line or pass "
                                    "--text-key FIELD") from None
    else:
        yield source.read_text(encoding="utf-8", errors="replace")


def prepare(source: str | Path, out: str | Path, tokenizer: str | None = None,
            text_key: str = "text", glob: str = "*.py") -> dict:
    """Tokenize every document under ``source`` into the token file ``out``."""
    tok = load_tokenizer(tokenizer)
    pieces, documents = [], 0
    for text in iter_documents(source, text_key, glob):
        ids = tok.encode(text)
        if tok.end_of_document is not None:
            ids.append(tok.end_of_document)
        pieces.append(torch.tensor(ids, dtype=torch.int64))
        documents += 1
    tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    if tokens.numel() == 0:
        raise DataError(f"{source} holds no text to tokenize")
    write_token_file(out, tokens, tok.vocab_size, tok.name)
    return {"documents": documents, "tokens": tokens.numel(), "vocab_size": tok.vocab_size,
            "tokenizer": tok.name, "path": str(out)}


def stdlib_source() -> Path:
    """The directory of this Python's standard library: a few MB of code that every
    machine already has, so the demo needs no download and ships no third-party text."""
    return Path(sysconfig.get_paths()["stdlib"])


def prepare_stdlib_corpus(out: str | Path) -> dict:
    """Byte-tokenize the standard library's top-level ``*.py`` files into ``out``."""
    return prepare(stdlib_source(), out, tokenizer=None, glob="*.py")
