"""Turn text into a token file: ``mfsdp prepare-data INPUT OUT``.

INPUT is a text file (one document), a ``.jsonl`` (or ``.json``) file of rows, one a line, or a
directory (its data files, ``DATA_FILES``, or those matching a glob: each read as one of those).
JSONL rows are plain documents (``{"text": ...}``), or fine-tuning samples, prompt/completion, chat messages, ShareGPT or Alpaca (``mfsdp.data.rows``): the first
row says which, and each sample row's format is read from its keys unless forced. Documents are joined with the tokenizer's end-of-document id, so the
model learns where one stops, into a version-1 token stream. Samples are written with their
bounds and loss mask (``mfsdp.data.chat``) as a version-2 file. Every row is checked before
anything is written, so a bad row (invalid UTF-8 too) leaves no output file behind, and an
existing one as it was.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

from mfsdp.data.chat import encode_sample
from mfsdp.data.packing import cut_counts
from mfsdp.data.rows import FORMATS, detect_format, parse_line, read_sample, read_text
from mfsdp.data.token_file import DataError, write_token_file
from mfsdp.data.tokenizer import load_tokenizer

STDLIB = "stdlib"
STDLIB_GLOB = "*.py"  # the demo corpus: the standard library's top-level modules
DATA_FILES = ("*.jsonl", "*.json", "*.txt", "*.md")
"""What a directory is read for without a pattern: its data files, not its code."""
JSONL = (".jsonl", ".json")  # files of JSON rows, one a line (Hugging Face datasets' to_json writes .json)
T = TypeVar("T")


@dataclass(frozen=True)
class RowOptions:
    """How JSONL rows become samples (prompt/completion and messages rows only)."""

    format: str | None = None
    """The format of every JSONL row: text, prompt_completion, messages, sharegpt or alpaca; None
    reads each row's from its keys."""
    train_on_prompt: bool = False
    """Count every token of a sample in the loss, prompts and user turns too, instead of the
    answers alone (the default, as in torchtune, TRL and NeMo Automodel)."""
    max_len: int | None = None
    """Keep at most this many tokens of each sample (its start) and count the samples and tokens
    cut; None keeps them whole (training then cuts a sample longer than its window, and says so)."""

    def __post_init__(self):
        if self.format is not None and self.format not in FORMATS:
            raise DataError(f"unknown format {self.format!r}; use one of {', '.join(FORMATS)}")
        if self.max_len is not None and self.max_len < 2:
            raise DataError(f"--data.max_len {self.max_len} leaves no token to predict; use 2 or more")


def iter_documents(source: str | Path, text_key: str = "text", glob: str | None = None) -> Iterator[str]:
    source = Path(source)
    if source.is_dir():
        patterns = DATA_FILES if glob is None else (glob,)
        files = sorted({p for pattern in patterns for p in source.glob(pattern) if p.is_file()})
        if not files:
            raise DataError(f"no files match {' '.join(patterns)} in {source}; pass --data.glob PATTERN")
        for path in files:
            yield from iter_documents(path, text_key)
    elif not source.is_file():
        raise DataError(f"input {source} does not exist; pass a .txt or .jsonl file or a "
                        "directory")
    elif source.suffix in JSONL:
        for line_no, row in _jsonl_rows(source):
            yield _at(source, line_no, read_text, row, text_key)
    else:
        yield source.read_text(encoding="utf-8", errors="replace")


def prepare(source: str | Path, out: str | Path, tokenizer: str | None = None,
            text_key: str = "text", glob: str | None = None, rows: RowOptions = RowOptions()) -> dict:
    """Tokenize every document or sample under ``source`` into the token file ``out``."""
    source = Path(source)
    fmt = rows.format or _first_row_format(source, text_key)
    if fmt != "text":
        return _prepare_samples(source, out, load_tokenizer(tokenizer), fmt, rows)
    if rows.train_on_prompt or rows.max_len is not None:
        raise DataError(f"--data.train_on_prompt and --data.max_len apply to samples (prompt/completion, "
                        f"messages, ShareGPT or Alpaca rows), and {source} holds text (every token "
                        "already counts); drop them, or pass --data.format")
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
    write_token_file(out, tokens, tok.vocab_size, tok.name, fingerprint=tok.fingerprint)
    return {"format": "text", "documents": documents, "tokens": tokens.numel(),
            "vocab_size": tok.vocab_size, "tokenizer": tok.name, "path": str(out)}


def _prepare_samples(source: Path, out: str | Path, tok, fmt: str, rows: RowOptions) -> dict:
    if not source.is_file():
        raise DataError(f"input {source} does not exist; pass a .jsonl file of {fmt} rows")
    if source.suffix not in JSONL:
        raise DataError(f"{fmt} rows are read from a .jsonl file, and {source} is not one; "
                        "pass a .jsonl file, or --data.format text")
    ids, masks, formats = [], [], {}
    for line_no, row in _jsonl_rows(source):
        row_fmt = rows.format or _at(source, line_no, _sample_format, row, fmt)
        sample = _at(source, line_no, read_sample, row, row_fmt)
        sample_ids, mask = _at(source, line_no, encode_sample, tok, sample, rows.train_on_prompt)
        ids.append(sample_ids)
        masks.append(mask)
        formats[row_fmt] = formats.get(row_fmt, 0) + 1
    if not ids:
        raise DataError(f"{source} holds no rows")
    lengths = torch.tensor([len(i) for i in ids])
    truncated, cut = cut_counts(lengths, rows.max_len) if rows.max_len is not None else (0, 0)
    if truncated:
        ids, masks = [i[:rows.max_len] for i in ids], [m[:rows.max_len] for m in masks]
        lengths = lengths.clamp(max=rows.max_len)
    starts = torch.cumsum(lengths, 0) - lengths
    tokens, mask = torch.cat(ids), torch.cat(masks)
    write_token_file(out, tokens, tok.vocab_size, tok.name, loss_mask=mask, sample_starts=starts,
                     fingerprint=tok.fingerprint)
    return {"format": " and ".join(formats), "samples": len(ids), "tokens": tokens.numel(),
            "counted": int(mask.sum()), "truncated": truncated, "cut_tokens": cut, "max_len": rows.max_len,
            "vocab_size": tok.vocab_size, "tokenizer": tok.name, "path": str(out)}


def _sample_format(row: dict, first: str) -> str:
    """A sample row's format; a text row among samples is refused (a file is one or the other)."""
    fmt = detect_format(row)
    if fmt == "text":
        raise DataError(f"a text row in a file of samples (the first row is {first}); a file holds "
                        "documents or samples, not both: give this row a sample format, or split the file")
    return fmt


def _first_row_format(source: Path, text_key: str) -> str:
    """The format of the first row of a .jsonl file; ``text`` for any other input."""
    if source.suffix not in JSONL or not source.is_file():
        return "text"
    for line_no, row in _jsonl_rows(source):
        return _at(source, line_no, detect_format, row, text_key)
    return "text"  # no rows: the text path says the file holds nothing


def _jsonl_rows(source: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line."""
    with open(source, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = _at(source, line_no, _decode, raw, line_no == 1)
            if line.strip():
                yield line_no, _at(source, line_no, parse_line, line)


def _decode(raw: bytes, first: bool) -> str:
    """A line's bytes as text: UTF-8 (JSONL's encoding), a BOM allowed on the first line."""
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"byte {raw[err.start]:#04x} at column {err.start + 1} is not UTF-8 text; "
                        "re-save the file as UTF-8, or fix or drop the line") from None


def _at(source: Path, line_no: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, a DataError it raises prefixed with ``FILE:LINE:``."""
    try:
        return fn(*args)
    except DataError as err:
        raise DataError(f"{source}:{line_no}: {err}") from None


def stdlib_source() -> Path:
    """The directory of this Python's standard library: a few MB of code that every
    machine already has, so the demo needs no download and ships no third-party text."""
    return Path(sysconfig.get_paths()["stdlib"])


def prepare_stdlib_corpus(out: str | Path) -> dict:
    """Byte-tokenize the standard library's top-level ``*.py`` files into ``out``."""
    return prepare(stdlib_source(), out, tokenizer=None, glob=STDLIB_GLOB)
