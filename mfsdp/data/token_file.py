"""The on-disk token file: a small self-describing header, then raw token ids.

Layout (little endian)::

    offset 0    8 bytes   magic b"MFSDPTOK"
    offset 8    uint32    format version (1)
    offset 12   uint32    bytes per token (2 for uint16, 4 for uint32)
    offset 16   uint64    number of tokens
    offset 24   uint64    vocabulary size of the tokenizer that wrote it
    offset 32   uint32    length of the tokenizer name, then the name in UTF-8
    offset 256            the token ids

The header exists so that a missing, truncated or foreign file fails with one sentence
saying what is wrong, instead of a model training on garbage. The ids are memory-mapped,
so every rank can open a corpus larger than memory and only touches the pages it samples.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from pathlib import Path

import torch

MAGIC = b"MFSDPTOK"
VERSION = 1
HEADER_BYTES = 256
_FIXED = struct.Struct("<8sIIQQI")
_DTYPES = {2: torch.uint16, 4: torch.uint32}


class DataError(Exception):
    """A data file problem the user can fix; the message names the fix."""


def _recreate_hint(path: Path) -> str:
    return f"re-create it with `mfsdp prepare-data INPUT {path}`"


def write_token_file(path: str | os.PathLike, tokens: torch.Tensor, vocab_size: int,
                     tokenizer: str) -> Path:
    """Write ``tokens`` (a 1-D integer tensor) atomically: a temp file, then a rename."""
    path = Path(path)
    itemsize = 2 if vocab_size <= 2**16 else 4
    name = tokenizer.encode()
    if _FIXED.size + len(name) > HEADER_BYTES:
        raise DataError(f"tokenizer name is too long for the header: {tokenizer!r}")
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise DataError(f"token id {int(tokens.max())} does not fit vocabulary size {vocab_size}")
    header = _FIXED.pack(MAGIC, VERSION, itemsize, tokens.numel(), vocab_size, len(name)) + name
    header = header.ljust(HEADER_BYTES, b"\0")
    ids = tokens.to(torch.int64).to(_DTYPES[itemsize]).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(temp, "wb") as f:
        f.write(header)
        if ids.numel():
            # One copy of the raw bytes, without a NumPy dependency.
            f.write(ctypes.string_at(ids.data_ptr(), ids.numel() * itemsize))
    os.replace(temp, path)
    return path


class TokenFile:
    """A read-only, memory-mapped view of a token file's ids, validated on open."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"data file {self.path} does not exist; create it with "
                            f"`mfsdp prepare-data INPUT {self.path}`, or set data.path to "
                            "'stdlib' for the built-in demo corpus")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
                raise DataError(f"{self.path} is not an mfsdp token file (bad header); "
                                f"{_recreate_hint(self.path)}")
            magic, version, itemsize, count, vocab_size, name_len = _FIXED.unpack_from(head)
            if version != VERSION:
                raise DataError(f"{self.path} has token-file version {version}, this mfsdp "
                                f"reads version {VERSION}; {_recreate_hint(self.path)}")
            if itemsize not in _DTYPES or _FIXED.size + name_len > HEADER_BYTES:
                raise DataError(f"{self.path} has a corrupt header; {_recreate_hint(self.path)}")
            expected = HEADER_BYTES + count * itemsize
            if size != expected:
                raise DataError(f"{self.path} is truncated or corrupt: its header promises "
                                f"{count} tokens ({expected} bytes) but the file has {size} "
                                f"bytes; {_recreate_hint(self.path)}")
            self.tokenizer = head[_FIXED.size:_FIXED.size + name_len].decode()
            self.vocab_size = vocab_size
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if count else None
        # ACCESS_COPY gives a writable (copy-on-write) mapping, which torch.frombuffer
        # wants; nothing ever writes to it, so no page is ever copied.
        self.tokens = (torch.frombuffer(self._map, dtype=_DTYPES[itemsize], offset=HEADER_BYTES,
                                        count=count)
                       if count else torch.empty(0, dtype=_DTYPES[itemsize]))

    def __len__(self) -> int:
        return self.tokens.numel()

    def window(self, start: int, length: int) -> torch.Tensor:
        """``length`` ids starting at ``start``, as int64.

        Raises DataError when an id lies outside the vocabulary the header declares: the
        file is corrupt, and an out-of-range id would otherwise crash the embedding (on a
        GPU, as a device-side assert that can leave the other ranks waiting).
        """
        ids = self.tokens[start:start + length].to(torch.int64)
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            offset = start + int(torch.argmax((ids >= self.vocab_size).to(torch.uint8)))
            raise DataError(f"{self.path} is corrupt: token {offset} has id "
                            f"{int(self.tokens[offset])}, outside the vocabulary of "
                            f"{self.vocab_size} its header declares; "
                            f"{_recreate_hint(self.path)}")
        return ids
