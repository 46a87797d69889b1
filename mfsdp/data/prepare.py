"""Turn text into a token file: ``mfsdp prepare-data INPUT OUT``.

INPUT is a UTF-8 text file (one document), a file of rows (JSONL, a JSON array, Parquet, Arrow, or
a directory saved by ``datasets``: ``mfsdp.data.readers``), or a directory (its data files,
``DATA_FILES``, or those matching a glob: each read as one of those). Rows are plain documents
(``{"text": ...}``), fine-tuning samples (prompt/completion, chat messages, ShareGPT or Alpaca:
``mfsdp.data.rows``) or preference pairs (``mfsdp.data.pairs``): the first row says which, and each
sample row's format is read from its keys unless forced. Documents are joined with the tokenizer's
end-of-document id, so the model learns where one stops, into a version-1 token stream. Samples
are written with their bounds and loss mask (``mfsdp.data.chat``) as a version-2 file, pairs as a
version-3 file. Every row is checked before anything is written, so a bad row (invalid UTF-8 too)
leaves no output file behind, and an existing one as it was.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from mfsdp.data.chat import encode_sample
from mfsdp.data.packing import cut_counts
from mfsdp.data.pairs import prepare_pairs
from mfsdp.data.readers import ACCEPTED_FILES, is_rows, located, read_rows, read_text_file, saved_dataset
from mfsdp.data.rows import FORMATS, detect_format, read_sample, read_text
from mfsdp.data.token_file import DataError, write_token_file
from mfsdp.data.tokenizer import load_tokenizer

STDLIB = "stdlib"
STDLIB_GLOB = "*.py"  # the demo corpus: the standard library's top-level modules
DATA_FILES = ("*.jsonl", "*.json", "*.txt", "*.md")
"""What a directory is read for without a pattern: its data files, not its code."""


@dataclass(frozen=True)
class RowOptions:
    """How rows become samples or preference pairs (not documents)."""

    format: str | None = None
    """The format of every row: text, prompt_completion, messages, sharegpt, alpaca or preference;
    None reads each row's from its keys."""
    train_on_prompt: bool = False
    """Count every token of a sample in the loss, prompts and user turns too, instead of the
    answers alone (the default, as in torchtune, TRL and NeMo Automodel)."""
    max_len: int | None = None
    """Keep at most this many tokens of each sample (its start), or of each prompt + answer of a
    preference pair (trl's max_length), and count what is cut; None keeps them whole (training then
    cuts a sample longer than its window, and says so)."""

    def __post_init__(self):
        if self.format is not None and self.format not in FORMATS:
            raise DataError(f"unknown format {self.format!r}; use one of {', '.join(FORMATS)}")
        if self.max_len is not None and self.max_len < 2:
            raise DataError(f"--data.max_len {self.max_len} leaves no token to predict; use 2 or more")


def iter_documents(source: str | Path, text_key: str = "text", glob: str | None = None) -> Iterator[str]:
    source = Path(source)
    if source.is_dir() and not saved_dataset(source):
        patterns = DATA_FILES if glob is None else (glob,)
        files = sorted({p for pattern in patterns for p in source.glob(pattern) if p.is_file()})
        if not files:
            raise DataError(f"no files match {' '.join(patterns)} in {source}; pass --data.glob PATTERN")
        for path in files:
            yield from iter_documents(path, text_key)
    elif not source.exists():
        raise DataError(f"input {source} does not exist; pass a text file, {ACCEPTED_FILES}, or a directory")
    elif is_rows(source):
        for where, row in read_rows(source):
            yield located(where, read_text, row, text_key)
    else:
        yield read_text_file(source)


def prepare(source: str | Path, out: str | Path, tokenizer: str | None = None,
            text_key: str = "text", glob: str | None = None, rows: RowOptions = RowOptions()) -> dict:
    """Tokenize every document or sample under ``source`` into the token file ``out``."""
    source = Path(source)
    fmt = rows.format or _first_row_format(source, text_key)
    if fmt == "preference":
        if rows.train_on_prompt:
            raise DataError("--data.train_on_prompt applies to fine-tuning samples, and a preference pair's "
                            "answers are what counts (as in trl); drop it")
        pairs = ((where, row) for where, row, _ in _sample_rows(source, fmt, rows.format))
        return prepare_pairs(source, pairs, out, load_tokenizer(tokenizer), rows.max_len)
    if fmt != "text":
        return _prepare_samples(source, out, load_tokenizer(tokenizer), fmt, rows)
    if rows.train_on_prompt or rows.max_len is not None:
        raise DataError(f"--data.train_on_prompt and --data.max_len apply to samples (prompt/completion, "
                        f"messages, ShareGPT or Alpaca rows), and {source} holds text (every token "
                        "already counts); drop them, or pass --data.format")
    tok = load_tokenizer(tokenizer)
    pieces = []
    for text in iter_documents(source, text_key, glob):
        ids = tok.encode(text)
        if tok.end_of_document is not None:
            ids.append(tok.end_of_document)
        pieces.append(torch.tensor(ids, dtype=torch.int64))
    tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    if tokens.numel() == 0:
        raise DataError(f"{source} holds no text to tokenize")
    write_token_file(out, tokens, tok.vocab_size, tok.name, fingerprint=tok.fingerprint)
    return {"format": "text", "documents": len(pieces), "tokens": tokens.numel(),
            "vocab_size": tok.vocab_size, "tokenizer": tok.name, "path": str(out)}


def _prepare_samples(source: Path, out: str | Path, tok, fmt: str, rows: RowOptions) -> dict:
    ids, masks, formats = [], [], {}
    for where, row, row_fmt in _sample_rows(source, fmt, rows.format):
        sample = located(where, read_sample, row, row_fmt, rows.format is not None)
        sample_ids, mask = located(where, encode_sample, tok, sample, rows.train_on_prompt)
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


def _sample_rows(source: Path, first: str, forced: str | None) -> Iterator[tuple[str, dict, str]]:
    """(where, row, format) of each row of a file of samples or of pairs, as the first row's kind."""
    if not source.exists():
        raise DataError(f"input {source} does not exist; pass a file of {first} rows")
    if not is_rows(source):
        raise DataError(f"{first} rows are read from {ACCEPTED_FILES}, and {source} is none of those; "
                        "pass one, or --data.format text")
    for where, row in read_rows(source):
        yield where, row, forced or located(where, _row_format, row, first)


def _row_format(row: dict, first: str) -> str:
    """A row's format in a file whose first row is ``first``: a file holds one kind of row."""
    fmt = detect_format(row)
    if fmt == "text" or (fmt == "preference") != (first == "preference"):
        kind = "preference pairs" if first == "preference" else "samples"
        raise DataError(f"a {fmt} row in a file of {kind} (the first row is {first}); a file holds documents, "
                        "samples or preference pairs, one kind only: give this row the first row's kind, "
                        "or split the file")
    return fmt


def _first_row_format(source: Path, text_key: str) -> str:
    """The format of the first row of a file of rows; ``text`` for any other input."""
    for where, row in read_rows(source) if is_rows(source) else ():
        return located(where, detect_format, row, text_key)
    return "text"  # no rows: the text path says the file holds nothing


def stdlib_source() -> Path:
    """The directory of this Python's standard library: a few MB of code that every
    machine already has, so the demo needs no download and ships no third-party text."""
    return Path(sysconfig.get_paths()["stdlib"])


def prepare_stdlib_corpus(out: str | Path) -> dict:
    """Byte-tokenize the standard library's top-level ``*.py`` files into ``out``."""
    return prepare(stdlib_source(), out, tokenizer=None, glob=STDLIB_GLOB)
