"""The files users keep rows in, read alike for documents, fine-tuning samples and preference pairs.

- JSON rows: one object a line (``.jsonl``, and the ``.json`` that ``datasets``' ``to_json``
  writes), or one JSON array of objects (a ``.json`` or ``.jsonl`` file opening with ``[``);
- Parquet (``.parquet``) and Arrow (``.arrow``, the IPC file format or the stream format that
  ``datasets`` writes), read with pyarrow;
- a directory saved by ``datasets.save_to_disk``, read with ``datasets`` (``mfsdp[datasets]``).

Each row comes with where it is, ``FILE:LINE`` for JSON and ``FILE, row N`` for tables, which
every error about it starts with. A column a table row leaves empty (null) is left out of the
row, as a JSON row would leave out the key. Any other file is text (``read_text_file``), and one
that is not UTF-8 text is refused rather than tokenised as bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from mfsdp.data.token_file import DataError

ROW_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
INSTALL = "pip install 'mfsdp[datasets]'"
ACCEPTED_FILES = ("JSONL or JSON rows (.jsonl, .json), Parquet (.parquet), Arrow (.arrow) and directories "
                  "saved by datasets.save_to_disk")
_MAGIC = {b"PAR1": ".parquet", b"ARROW1": ".arrow", b"\xff\xff\xff\xff": ".arrow"}
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's white space
T = TypeVar("T")


def saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def is_rows(path: Path) -> bool:
    """Whether ``path`` holds rows (rather than text): a file of a row suffix or a saved dataset."""
    return (path.is_file() and path.suffix.lower() in ROW_SUFFIXES) or saved_dataset(path)


def read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of ``path``, in order."""
    suffix = path.suffix.lower()
    if saved_dataset(path) or suffix in (".parquet", ".arrow"):
        rows = _dataset_rows(path) if saved_dataset(path) else _table_rows(path, suffix)
        for n, row in enumerate(rows, 1):
            yield f"{path}, row {n}", {key: value for key, value in row.items() if value is not None}
    elif _opens_array(path):
        yield from _array_rows(path)
    else:
        yield from _jsonl_rows(path)


def read_text_file(path: Path) -> str:
    """A text file's content; a file that is not UTF-8 text is one DataError."""
    raw = path.read_bytes()
    kind = next((suffix for magic, suffix in _MAGIC.items() if raw.startswith(magic)), None)
    if kind or b"\0" in raw:
        what = f"a {kind[1:].title()} file: name it *{kind}" if kind else "a binary file (it holds NUL bytes)"
        raise DataError(f"{path} is not text but {what}; prepare-data reads UTF-8 text and {ACCEPTED_FILES}")
    return _text(path, raw)


def _text(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{line}: byte {raw[err.start]:#04x} is not UTF-8 text; prepare-data reads UTF-8 "
                        f"text and {ACCEPTED_FILES}: re-save the file as UTF-8, or name it by its format") from None


def located(where: str, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, a DataError it raises prefixed with ``where``."""
    try:
        return fn(*args)
    except DataError as err:
        raise DataError(f"{where}: {err}") from None


def parse_line(line: str) -> dict:
    """One JSONL line as a JSON object, or a DataError saying what is wrong with it."""
    try:
        return _object(json.loads(line))
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON ({err}); fix the line") from None


def _object(row) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"a row must be a JSON object, not {type(row).__name__}; fix the line")
    return row


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, JSON object) for every non-blank line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            line = located(where, _decode, raw, line_no == 1)
            if line.strip():
                yield where, located(where, parse_line, line)


def _decode(raw: bytes, first: bool) -> str:
    """A line's bytes as text: UTF-8 (JSON's encoding), a BOM allowed on the first line."""
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"byte {raw[err.start]:#04x} at column {err.start + 1} is not UTF-8 text; "
                        "re-save the file as UTF-8, or fix or drop the line") from None


def _opens_array(path: Path) -> bool:
    """Whether the file's first character other than a BOM and white space is ``[``."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")


def _array_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(FILE:LINE, object) for every element of a file holding one JSON array."""
    text = _text(path, path.read_bytes()).removeprefix("\ufeff")
    try:
        count = len(json.loads(text))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg}); fix the file") from None
    decoder, at, line, start = json.JSONDecoder(), text.index("[") + 1, 1, 0
    for _ in range(count):  # the array again, element by element, for the line each starts on
        begin = _SPACE.match(text, at).end()
        line += text.count("\n", start, begin)
        row, end = decoder.raw_decode(text, begin)
        yield f"{path}:{line}", located(f"{path}:{line}", _object, row)
        start, at = begin, _SPACE.match(text, end).end() + 1  # past the comma


def _table_rows(path: Path, suffix: str) -> Iterator[dict]:
    """A Parquet or Arrow file's rows, one record batch in memory at a time."""
    try:
        import pyarrow as pa  # optional: `datasets` brings it
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow; install it with {INSTALL}") from None
    try:
        if suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches()
        else:
            try:
                reader = pa.ipc.open_file(path)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                batches = pa.ipc.open_stream(pa.memory_map(str(path)))
        for batch in batches:
            yield from batch.to_pylist()
    except pa.ArrowException as err:
        raise DataError(f"{path} is not a readable {suffix[1:].title()} file ({err}); re-save it, "
                        "or give it its format's suffix") from None


def _dataset_rows(path: Path) -> Iterator[dict]:
    try:
        import datasets  # optional and heavy, so imported here
    except ImportError:
        raise DataError(f"{path} is a dataset saved by datasets.save_to_disk, which needs the `datasets` "
                        f"package; install it with {INSTALL}") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        raise DataError(f"{path} holds the splits {', '.join(data)}; pass one of them, such as "
                        f"{path / next(iter(data))}")
    yield from data
