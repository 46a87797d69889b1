"""Hugging Face weight files: the one reader and writer of a model directory's safetensors, for
both ``--model.hf`` routes (the bundled Llama's ``mfsdp.hf.names`` and the manager's
``mfsdp.hf.sharded``), which keep only their tables of names, and for every export.

* The index: ``model.safetensors``, or numbered files and ``model.safetensors.index.json``
  (``weight_files``, ``has_weights``).
* The rank's slice: ``WeightFiles`` opens each file once, lazily; ``local_indices`` says which
  rows and columns of a (DTensor) parameter a rank holds, and ``read_block`` reads only those from
  ``safe_open(...).get_slice(name)``, never the whole tensor.
* The writers: ``atomic`` writes any file as a temporary file renamed into place (so a reader never
  sees half a file; mode 0644 under the usual umask); ``write_weights`` writes each file's header
  first (every name, dtype and shape is known in advance), then each tensor's bytes as it arrives,
  so one tensor is held at a time; files of at most ``SHARD_BYTES``, as
  ``save_pretrained(max_shard_size="5GB")`` cuts them.
* ``HFWeightsError``: a tensor missing, of another shape, or with no place in the model, named.

The file layout is the format's own (https://huggingface.co/docs/safetensors): an 8-byte
little-endian header length, a JSON header (padded with spaces to a multiple of 8 bytes) mapping
each name to its dtype, shape and byte range, then the raw little-endian data.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from mfsdp import _compat

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 10**9
"""The largest file the writer cuts: Hugging Face's ``max_shard_size="5GB"`` (decimal gigabytes)."""

SAFE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
               torch.float8_e5m2: "F8_E5M2"}


class HFWeightsError(ValueError, KeyError):
    """Weights that do not fit the model, in one line naming the directory and each tensor: missing,
    of another shape, or with no place in the model. A ValueError (bad input) and a KeyError (a
    name not found), so callers of either route catch it as they always have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

    @classmethod
    def of(cls, directory, *, missing: Sequence[str] = (), mismatched: Sequence[str] = (),
           extra: Sequence[str] = (), model: str = "the model") -> HFWeightsError:
        """``missing``: tensors no file holds; ``mismatched``: "NAME in FILE has shape S, the model's T";
        ``extra``: file tensors ``model`` has no place for (a trained weight would be dropped)."""
        parts = [f"no tensor {_few(missing)} in its safetensors files" if missing else "",
                 f"shape mismatch: {_few(mismatched, '; ')}" if mismatched else "",
                 f"tensor {_few(extra)} {'has' if len(extra) == 1 else 'have'} no place in {model}" if extra else ""]
        return cls(f"{directory}: {'; '.join(p for p in parts if p)}; does config.json describe these weights?")


class NoWeightsError(HFWeightsError, FileNotFoundError):
    """A directory with no safetensors weights at all."""


def _few(names: Sequence[str], sep: str = ", ", shown: int = 4) -> str:
    return sep.join(names[:shown]) + (f" (and {len(names) - shown} more)" if len(names) > shown else "")


# ------------------------------------------------------------------------------------ read
def has_weights(directory: str | os.PathLike) -> bool:
    """Whether a Hugging Face model directory holds safetensors weights (one file, or the index)."""
    return (Path(directory) / INDEX).is_file() or (Path(directory) / WEIGHTS).is_file()


def weight_files(directory: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(directory / WEIGHTS, framework="pt") as f:
            return {name: directory / WEIGHTS for name in f.keys()}
    raise NoWeightsError(f"{directory} holds neither {WEIGHTS} nor {INDEX}; a local Hugging Face directory "
                         "with safetensors weights is needed (.bin checkpoints are not read)")


class WeightFiles:
    """A weights directory open for reading: its tensor names, and each tensor's lazy slice, every
    file opened once on first use and closed on ``close`` (or leaving a ``with``)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.files = weight_files(self.directory)
        self.stacks: dict[str, list[list[str]]] = {}
        self.partial: dict[str, str] = {}  # a stacked key the files hold some parts of -> one they lack
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.stacks

    def stack(self, parts: list[list[str]]) -> str:
        """A key for the stacked tensor whose slab ``e`` is the file tensors ``parts[e]`` one after
        another on rows (``mfsdp.hf.moe_names``): in this directory when the files hold them all."""
        key = f"{parts[0][0]}..{parts[-1][-1]}"
        absent = [name for names in parts for name in names if name not in self.files]
        if not absent:
            self.stacks[key] = parts
        elif len(absent) < sum(map(len, parts)):
            self.partial[key] = absent[0]
        return key

    def sources(self, key: str) -> list[str]:
        """The file tensors behind ``key``: itself, or a stacked key's parts."""
        return [name for names in self.stacks[key] for name in names] if key in self.stacks else [key]

    def get_slice(self, name: str):
        """The file's lazy view of tensor ``name``: ``.get_shape()``, and indexing reads only that block."""
        if name in self.stacks:
            return StackedSlice([[self.get_slice(part) for part in parts] for parts in self.stacks[name]])
        path = self.files[name]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(path, framework="pt", device="cpu")
        return self._open[path].get_slice(name)

    def match(self, wanted, whose: str) -> tuple[list, list[str], list[str], set[str]]:
        """Each ``(candidate keys, tensor, name, label)`` of ``wanted`` found under its first key the
        files hold, its shape checked against the tensor's: ``(tensor, slice, name)`` to read, the
        labels of those not found (a None label: the tensor may be absent), the mismatches (``whose``
        names the tensor's owner) and the keys used; nothing is read yet."""
        plan, missing, mismatched, used = [], [], [], set()
        for keys, tensor, name, label in wanted:
            key = next((k for k in keys if k in self), None)
            if key is None:
                lacks = [f" (stored per expert; {self.partial[k]} is missing)" for k in keys if k in self.partial]
                missing += [label + "".join(lacks[:1])] if label else []
                continue
            used.update(self.sources(key))
            found, shape = self.get_slice(key), tuple(tensor.shape)
            if tuple(found.get_shape()) != shape:
                mismatched.append(f"{key} in {self.files[self.sources(key)[0]].name} has shape {tuple(found.get_shape())}, {whose} "
                                  f"{name} {shape}")
            else:
                plan.append((tensor, found, name))
        return plan, missing, mismatched, used

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StackedSlice:
    """A stacked ``[E, R, ...]`` tensor stored as per-expert tensors, lazily: ``parts[e]`` the file
    slices whose rows, one after another, make expert ``e``'s slab. Indexing (a slice per dim, as
    ``read_block`` asks) reads only the experts and rows asked for."""

    def __init__(self, parts: list[list]):
        self.parts = parts

    def get_shape(self) -> list[int]:
        first = self.parts[0]
        return [len(self.parts), sum(part.get_shape()[0] for part in first), *first[0].get_shape()[1:]]

    def get_dtype(self) -> str:
        return self.parts[0][0].get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        shape = self.get_shape()
        index = (*(index if isinstance(index, tuple) else (index,)), *[slice(None)] * len(shape))[:len(shape)]
        start, stop, _ = index[1].indices(shape[1])
        slabs = []
        for parts in self.parts[index[0]]:
            blocks, offset = [], 0
            for part in parts:
                lo, hi = max(start - offset, 0), min(stop - offset, part.get_shape()[0])
                if lo < hi:
                    blocks.append(part[(slice(lo, hi), *index[2:])])
                offset += part.get_shape()[0]
            slabs.append(torch.cat(blocks))
        return torch.stack(slabs)


def local_indices(param: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Per dimension, the global indices of ``param``'s local block (None: this rank holds nothing).

    A plain tensor owns everything. For a DTensor, each sharded dim's ``arange`` is cut with
    ``torch.chunk`` semantics (DTensor's), mesh dim by mesh dim: first the plain ``Shard``
    placements, then the strided ones, which by definition split what the others left (tensor
    parallel first, then FSDP on the same dim). The result is checked against ``to_local()``.
    """
    shape = tuple(param.shape)
    full = [torch.arange(n) for n in shape]
    if not isinstance(param, DTensor):
        return full
    local_shape = tuple(param.to_local().shape)
    if 0 in local_shape:
        return None
    mesh, placements = param.device_mesh, param.placements
    coord = mesh.get_coordinate()
    shards = [(a, pl) for a, pl in enumerate(placements)
              if hasattr(pl, "dim") and (pl.is_shard() or _compat.is_strided_shard(pl))]
    for axis, pl in sorted(shards, key=lambda shard: _compat.is_strided_shard(shard[1])):  # plain ones first
        pieces = full[pl.dim].chunk(mesh.size(axis))
        full[pl.dim] = pieces[coord[axis]] if coord[axis] < len(pieces) else full[pl.dim][:0]
    if tuple(len(i) for i in full) != local_shape:
        raise NotImplementedError(
            f"cannot map the local shard of a parameter of shape {shape} with placements {placements} to global "
            f"indices (computed {tuple(len(i) for i in full)}, local shape {local_shape})")
    return full


@torch.no_grad()
def read_local(tensor: torch.Tensor, tensor_slice, name: str) -> None:
    """Copy this rank's block of the file's tensor (``tensor_slice``) into ``tensor``'s local
    shard, cast: the one copy of both loaders."""
    indices = local_indices(tensor)
    if indices is None:
        return
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.is_meta:
        raise HFWeightsError(f"{name} is still on the meta device; materialise the model first "
                             "(model.to_empty(device=...), or shard it with fully_shard or the manager) "
                             "and then load")
    local.copy_(read_block(tensor_slice, indices))


def read_block(tensor_slice, index: Sequence[slice | torch.Tensor]) -> torch.Tensor:
    """The block of a file's tensor that ``index`` picks, per dim a slice or the ascending global
    indices a rank holds (strided shards are not one range): a range is read as it is, an index
    vector as its enclosing range and then picked from, so the rest is never read."""
    spans, picks = [], []
    for i in index:
        if isinstance(i, slice):
            spans.append(i)
            picks.append(None)
            continue
        start, stop = int(i.min()), int(i.max()) + 1
        spans.append(slice(start, stop))
        whole = stop - start == i.numel() and bool((i == torch.arange(start, stop)).all())
        picks.append(None if whole else i - start)
    block = tensor_slice[tuple(spans)] if spans else tensor_slice[:]
    for dim, pick in enumerate(picks):
        if pick is not None:
            block = block.index_select(dim, pick)
    return block


# ----------------------------------------------------------------------------------- write
@dataclass(frozen=True)
class Entry:
    name: str
    """The tensor's name in the file."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype written (the writer casts to it)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_files(entries: Sequence[Entry], max_file_bytes: int) -> list[list[Entry]]:
    """``entries`` cut, in order, into files of at most ``max_file_bytes`` (a larger tensor gets a
    file of its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


@contextlib.contextmanager
def atomic(path: str | os.PathLike) -> Iterator:
    """A binary file open for writing at ``path``'s temporary name, renamed onto ``path`` when the
    block ends (removed if it raises): the one way an export writes a file."""
    path = Path(path)
    temp = path.with_name(path.name + ".tmp")
    try:
        with open(temp, "wb") as f:
            yield f
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``data`` into ``path``, atomically (a text's ``encode()``, a small file's ``read_bytes()``)."""
    with atomic(path) as f:
        f.write(data)


def write_file(path: Path, entries: Sequence[Entry], read: Callable[[Entry], torch.Tensor]) -> None:
    """Write ``entries`` to ``path`` (through a temp file and a rename); ``read(entry)`` gives each
    tensor when its turn comes, in any dtype (cast here) and of the entry's shape."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFE_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with atomic(path) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            tensor = read(e)
            if tuple(tensor.shape) != e.shape:
                raise ValueError(f"{e.name}: read a tensor of shape {tuple(tensor.shape)}, planned {e.shape}")
            tensor = tensor.detach().to("cpu", e.dtype).contiguous()
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy
            del tensor  # one tensor alive at a time


def write_weights(out: str | os.PathLike, entries: Sequence[Entry], read: Callable[[Entry], torch.Tensor],
                  max_file_bytes: int = SHARD_BYTES) -> int:
    """A Hugging Face directory's weights: ``model.safetensors``, or numbered files of at most
    ``max_file_bytes`` and their index, replacing an earlier export's; ``read`` is called once per
    entry, in order. Returns the file count."""
    out = Path(out)
    files = plan_files(entries, max_file_bytes)
    names = [WEIGHTS] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        stale.unlink(missing_ok=True)  # a previous export's files would shadow or mix with these
    for name, file_entries in zip(names, files):
        write_file(out / name, file_entries, read)
    if len(files) > 1:
        weight_map = {e.name: name for name, fe in zip(names, files) for e in fe}
        write_bytes(out / INDEX, json.dumps({"metadata": {"total_size": sum(e.nbytes for e in entries)},
                                             "weight_map": weight_map}, indent=2).encode())
    return len(files)
