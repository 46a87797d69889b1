"""The on-disk token file: a small self-describing header, then raw token ids, and for
prompt/answer and chat data the sample boundaries and the per-token loss mask; for preference
pairs the pair boundaries and each token's segment.

Layout (little endian)::

    offset 0    8 bytes   magic b"MFSDPTOK"
    offset 8    uint32    format version: 1 (a token stream), 2 (samples with a loss mask) or
                          3 (preference pairs, laid out as version 2)
    offset 12   uint32    bytes per token (2 for uint16, 4 for uint32)
    offset 16   uint64    number of tokens
    offset 24   uint64    vocabulary size of the tokenizer that wrote it
    offset 32   uint32    length of the tokenizer name
    version 1:  offset 36 the tokenizer name in UTF-8
    version 2-3: offset 36 uint64 number of samples N
                offset 44 uint64 byte offset of the sample bounds
                offset 52 uint64 byte offset of the loss mask (version 3: the segments)
                offset 60 the tokenizer name in UTF-8
    after the name        optionally b"TKID" and 16 bytes: the tokenizer's fingerprint
    offset 256            the token ids
    version 2-3, from the next multiple of 8 after the ids:
                          N + 1 int64 sample bounds: sample i is tokens [bounds[i], bounds[i+1])
                          one uint8 per token: version 2, 1 where the token is a target the loss
                          counts; version 3, its segment (below)

A version-3 file holds one preference pair per sample, its tokens contiguous as
``[prompt | chosen answer | rejected answer]``, each part at least one token, and the byte of
each token is its segment: 0 prompt, 1 chosen answer, 2 rejected answer. The prompt is stored
once: each answer follows it as if alone (the ids are trl's, ``mfsdp.data.pairs``).

The header exists so that a missing, truncated or foreign file fails with one sentence
saying what is wrong, instead of a model training on garbage. The fingerprint (a hash of the
tokenizer's vocabulary and special tokens, ``mfsdp.data.tokenizer``) lets a run refuse a file
another tokenizer made; files written before it have zeros there and read with none. Everything is memory-mapped,
so every rank can open a corpus larger than memory and only touches the pages it samples.
The magic and version keep their offsets in every version, so an mfsdp that reads only
versions 1 and 2 refuses a version-3 file with its version sentence. The mask takes a byte per
token rather than a bit: it slices and indexes like the ids with no unpacking, for a third
to a half more disk, which fine-tuning sets (small next to pretraining corpora) can afford.
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
"""A plain token stream (pretraining text)."""
SAMPLES_VERSION = 2
"""Samples with a loss mask (prompt/answer and chat data)."""
PAIRS_VERSION = 3
"""Preference pairs: version 2's layout, a segment per token instead of the loss mask."""
PROMPT, CHOSEN, REJECTED = 0, 1, 2
"""The segments of a pair's tokens (version 3), and their branches in ``document_mask``."""
HEADER_BYTES = 256
_FIXED = struct.Struct("<8sIIQQI")
_SAMPLES = struct.Struct("<QQQ")  # version 2: samples, bounds offset, mask offset
_DTYPES = {2: torch.uint16, 4: torch.uint32}
_ID_TAG = b"TKID"
_ID_BYTES = 16
INPUT_SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet", ".arrow", ".md", ".py")
"""Suffixes of files ``prepare-data`` reads: a hint never suggests writing a token file over one."""


class DataError(Exception):
    """A data file problem the user can fix; the message names the fix."""


def prepare_command(source: str | os.PathLike, out: str | os.PathLike, model_hf: str | None = None) -> str:
    """The ``mfsdp prepare-data`` command that writes ``out``, with ``--model.hf DIR`` when the
    run has one (its tokenizer then makes the file)."""
    return f"`mfsdp prepare-data {source} {out}" + (f" --model.hf {model_hf}`" if model_hf else "`")


def fresh_token_path(path: str | os.PathLike) -> Path:
    """Where to write the token file of the data ``path`` (never over ``path`` itself)."""
    path = Path(path)
    out = Path("data") / f"{path.stem}.tokens"
    return out if out.resolve() != path.resolve() else path.with_name(f"{path.stem}.prepared.tokens")


def _create_hint(path: Path, model_hf: str | None) -> str:
    """How to make the missing token file ``path``: at that path, unless it names an input."""
    if path.suffix.lower() not in INPUT_SUFFIXES:
        return f"create it with {prepare_command('INPUT', path, model_hf)}"
    out = fresh_token_path(path)
    return (f"data.path names a token file, not {path.suffix} rows: create one with "
            f"{prepare_command('INPUT', out, model_hf)} and pass --data.path {out}")


def _sections(count: int, itemsize: int, samples: int) -> tuple[int, int, int]:
    """Byte offsets of the sample bounds and the loss mask (or segments), and the file size, of
    versions 2 and 3."""
    bounds = -(-(HEADER_BYTES + count * itemsize) // 8) * 8  # int64s want 8-byte alignment
    mask = bounds + 8 * (samples + 1)
    return bounds, mask, mask + count


def _raw(tensor: torch.Tensor) -> bytes:
    # One copy of the raw bytes, without a NumPy dependency.
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def write_token_file(path: str | os.PathLike, tokens: torch.Tensor, vocab_size: int,
                     tokenizer: str, loss_mask: torch.Tensor | None = None,
                     sample_starts: torch.Tensor | None = None, fingerprint: str | None = None,
                     segments: torch.Tensor | None = None) -> Path:
    """Write ``tokens`` (a 1-D integer tensor) atomically: a temp file, then a rename.

    Without ``loss_mask``, ``segments`` and ``sample_starts`` this is a version-1 stream. With
    ``sample_starts`` (each sample's first token offset, starting at 0 and increasing) and
    ``loss_mask`` (one value per token, nonzero where the loss counts it) it is version 2; with
    ``segments`` instead (one per token, ``PROMPT``, ``CHOSEN`` or ``REJECTED``) version 3.
    ``fingerprint`` (32 hex digits) identifies the tokenizer.
    """
    path = Path(path)
    itemsize = 2 if vocab_size <= 2**16 else 4
    name = tokenizer.encode()
    identity = _ID_TAG + bytes.fromhex(fingerprint) if fingerprint else b""
    if fingerprint and len(identity) != len(_ID_TAG) + _ID_BYTES:
        raise ValueError(f"a fingerprint is {2 * _ID_BYTES} hex digits, not {fingerprint!r}")
    if loss_mask is not None and segments is not None:
        raise ValueError("pass loss_mask (version 2) or segments (version 3), not both")
    per_token = (loss_mask != 0) if segments is None and loss_mask is not None else segments
    if (per_token is None) != (sample_starts is None):
        raise ValueError("pass sample_starts with loss_mask or segments, or none of them")
    version = VERSION if per_token is None else SAMPLES_VERSION if segments is None else PAIRS_VERSION
    fixed = _FIXED.size + (_SAMPLES.size if version != VERSION else 0)
    if fixed + len(name) + len(identity) > HEADER_BYTES:
        raise DataError(f"tokenizer name is too long for the header: {tokenizer!r}")
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise DataError(f"token id {int(tokens.max())} does not fit vocabulary size {vocab_size}")
    header = _FIXED.pack(MAGIC, version, itemsize, tokens.numel(), vocab_size, len(name))
    sections = []
    if version != VERSION:
        count = tokens.numel()
        starts = sample_starts.to(torch.int64).flatten()
        bounds = torch.cat([starts, torch.tensor([count])])
        if per_token.numel() != count:
            raise ValueError(f"{'loss_mask' if segments is None else 'segments'} has {per_token.numel()} "
                             f"values for {count} tokens")
        if count and (int(starts[0]) != 0 or bool((bounds.diff() <= 0).any())):
            raise ValueError("sample_starts must start at 0 and increase, each below the token count")
        bounds_at, mask_at, _ = _sections(count, itemsize, starts.numel())
        header += _SAMPLES.pack(starts.numel(), bounds_at, mask_at)
        sections = [(bounds_at, bounds.contiguous()),
                    (mask_at, per_token.flatten().to(torch.uint8).contiguous())]
    header = (header + name + identity).ljust(HEADER_BYTES, b"\0")
    ids = tokens.to(torch.int64).to(_DTYPES[itemsize]).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(temp, "wb") as f:
        f.write(header)
        f.write(_raw(ids))
        for offset, values in sections:
            f.write(b"\0" * (offset - f.tell()))
            f.write(_raw(values))
    os.replace(temp, path)
    return path


class TokenFile:
    """A read-only, memory-mapped view of a token file, validated on open.

    ``tokens`` holds the ids. A version-2 file also has ``sample_starts`` (int64, each
    sample's first token), ``sample_lengths`` and ``loss_mask`` (uint8, one per token, 1 where
    the loss counts the token as a target); they are None for a version-1 stream. A version-3
    file (``is_pairs``) has the sample bounds of its pairs and ``segments`` (uint8, one per token:
    ``PROMPT``, ``CHOSEN``, ``REJECTED``) instead of ``loss_mask``; ``pair(i)`` splits pair i.
    ``tokenizer`` names the tokenizer that wrote it and ``fingerprint`` identifies it (None in a
    file written before files recorded one).
    """

    def __init__(self, path: str | os.PathLike, model_hf: str | None = None):
        """``model_hf``: the run's ``--model.hf DIR``, which the hints' prepare-data command names."""
        self.path, self._model_hf = Path(path), model_hf
        if not self.path.is_file():
            stdlib = "" if model_hf else ", or set data.path to 'stdlib' for the built-in demo corpus"
            raise DataError(f"data file {self.path} does not exist; {_create_hint(self.path, model_hf)}{stdlib}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_BYTES)
            version, itemsize, count, samples, sections = self._header(head, size)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > HEADER_BYTES else None
        # ACCESS_COPY gives a writable (copy-on-write) mapping, which torch.frombuffer
        # wants; nothing ever writes to it, so no page is ever copied.
        self.tokens = self._view(HEADER_BYTES, count, _DTYPES[itemsize])
        self.sample_starts = self.sample_lengths = self.loss_mask = self.segments = None
        if samples is not None:
            bounds = self._view(sections[0], samples + 1, torch.int64)
            lengths = bounds.diff()
            if int(bounds[0]) != 0 or int(bounds[-1]) != count or bool((lengths <= 0).any()):
                raise DataError(f"{self.path} is corrupt: its sample bounds do not split its "
                                f"{count} tokens into {samples} samples; {self._hint()}")
            self.sample_starts, self.sample_lengths = bounds[:-1], lengths
            per_token = self._view(sections[1], count, torch.uint8)
            self.loss_mask, self.segments = (per_token, None) if version == SAMPLES_VERSION else (None, per_token)

    def _header(self, head: bytes, size: int) -> tuple[int, int, int, int | None, tuple[int, int]]:
        """Check the header against the file's ``size``; set the version, tokenizer name,
        fingerprint and vocabulary; (version, bytes per id, ids, samples, section offsets)."""
        if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
            out = fresh_token_path(self.path)
            raise DataError(f"{self.path} is not an mfsdp token file (bad header); if it holds your "
                            f"rows or text, tokenize it with {prepare_command(self.path, out, self._model_hf)} "
                            f"and pass --data.path {out}")
        _, version, itemsize, count, vocab_size, name_len = _FIXED.unpack_from(head)
        if version not in (VERSION, SAMPLES_VERSION, PAIRS_VERSION):
            raise DataError(f"{self.path} has token-file version {version}, this mfsdp reads versions "
                            f"{VERSION}, {SAMPLES_VERSION} and {PAIRS_VERSION}; {self._hint()}")
        name_at, samples, sections = _FIXED.size, None, (0, 0)
        expected = HEADER_BYTES + count * itemsize
        if version != VERSION:
            samples, *sections = _SAMPLES.unpack_from(head, _FIXED.size)
            name_at += _SAMPLES.size
        if itemsize not in _DTYPES or name_at + name_len > HEADER_BYTES or (
                samples is not None and tuple(sections) != _sections(count, itemsize, samples)[:2]):
            raise DataError(f"{self.path} has a corrupt header; {self._hint()}")
        if samples is not None:
            expected = _sections(count, itemsize, samples)[2]
        if size != expected:
            raise DataError(f"{self.path} is truncated or corrupt: its header promises {count} tokens "
                            f"({expected} bytes) but the file has {size} bytes; {self._hint()}")
        name_end = name_at + name_len
        self.version, self.vocab_size = version, vocab_size
        self.tokenizer = head[name_at:name_end].decode()
        tagged = head[name_end:name_end + len(_ID_TAG)] == _ID_TAG
        at = name_end + len(_ID_TAG)
        self.fingerprint = head[at:at + _ID_BYTES].hex() if tagged else None
        return version, itemsize, count, samples, tuple(sections)

    def _hint(self) -> str:
        return f"re-create it with {prepare_command('INPUT', self.path, self._model_hf)}"

    def same_tokenizer(self, other: "TokenFile") -> bool:
        """Whether ``other`` was made by this file's tokenizer: by fingerprint where both have one."""
        if self.fingerprint and other.fingerprint:
            return self.fingerprint == other.fingerprint
        return self.tokenizer == other.tokenizer

    def _view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        if not count:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, offset=offset, count=count)

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def num_samples(self) -> int | None:
        """How many samples (or pairs) a version-2 (or 3) file holds; None for a version-1 stream."""
        return None if self.sample_starts is None else self.sample_starts.numel()

    @property
    def is_pairs(self) -> bool:
        """Whether the file holds preference pairs (version 3)."""
        return self.version == PAIRS_VERSION

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pair ``i`` of a version-3 file: its prompt, chosen and rejected ids (int64), checked."""
        if not self.is_pairs:
            raise DataError(f"{self.path} holds no preference pairs (token-file version {self.version})")
        start, length = int(self.sample_starts[i]), int(self.sample_lengths[i])
        segments = self.segments[start:start + length].to(torch.int64)
        sizes = torch.bincount(segments, minlength=3)
        if sizes.numel() != 3 or bool((sizes == 0).any()) or bool((segments.diff() < 0).any()):
            raise DataError(f"{self.path} is corrupt: pair {i} is not a prompt, a chosen and a rejected "
                            f"answer in that order; {self._hint()}")
        return tuple(self.window(start, length).split(sizes.tolist()))

    def window(self, start: int, length: int) -> torch.Tensor:
        """``length`` ids starting at ``start``, as int64.

        Raises DataError when an id lies outside the vocabulary the header declares: the
        file is corrupt, and an out-of-range id would otherwise crash the embedding (on a
        GPU, as a device-side assert that can leave the other ranks waiting).
        """
        return self._checked(self.tokens[start:start + length].to(torch.int64),
                             lambda i: start + i)

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """The ids at the token offsets ``index`` (int64), as int64, checked as ``window``
        checks them: one gather for many scattered pieces (the samples of packed windows)."""
        return self._checked(self.tokens[index].to(torch.int64), lambda i: int(index[i]))

    def _checked(self, ids: torch.Tensor, offset_of) -> torch.Tensor:
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            offset = offset_of(int(torch.argmax((ids >= self.vocab_size).to(torch.uint8))))
            raise DataError(f"{self.path} is corrupt: token {offset} has id "
                            f"{int(self.tokens[offset])}, outside the vocabulary of "
                            f"{self.vocab_size} its header declares; {self._hint()}")
        return ids
