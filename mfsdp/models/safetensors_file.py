"""Safetensors files written tensor by tensor: the header first (every name, dtype and shape is
known in advance), then each tensor's bytes as it arrives, so no more than one tensor is ever held.

The layout is the format's own (https://huggingface.co/docs/safetensors): an 8-byte little-endian
header length, a JSON header (padded with spaces to a multiple of 8 bytes) mapping each name to its
dtype, shape and byte range in the data that follows, then the raw little-endian data.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

SAFE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Entry:
    name: str
    """The tensor's name in the file."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype written (the reader casts to it)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_files(entries: list[Entry], max_file_bytes: int) -> list[list[Entry]]:
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


def write_file(path: Path, entries: list[Entry], read: Callable[[Entry], torch.Tensor]) -> None:
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
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            tensor = read(e)
            if tuple(tensor.shape) != e.shape:
                raise ValueError(f"{e.name}: read a tensor of shape {tuple(tensor.shape)}, planned {e.shape}")
            tensor = tensor.detach().to("cpu", e.dtype).contiguous()
            if tensor.numel():
                f.write(ctypes.string_at(tensor.data_ptr(), e.nbytes))
            del tensor  # one tensor alive at a time
    os.replace(temp, path)


SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def has_weights(directory: str | os.PathLike) -> bool:
    """Whether a Hugging Face model directory holds safetensors weights: ``model.safetensors``, or
    the index of numbered files (what ``write_weights`` writes and ``hf_weights`` reads)."""
    return (Path(directory) / SAFE_INDEX).is_file() or (Path(directory) / SAFE_WEIGHTS).is_file()


def write_weights(out: Path, entries: list[Entry], read: Callable[[Entry], torch.Tensor],
                  max_file_bytes: int) -> int:
    """A Hugging Face directory's weights: ``model.safetensors``, or numbered files of at most
    ``max_file_bytes`` and their index, replacing an earlier export's; returns the file count."""
    files = plan_files(entries, max_file_bytes)
    names = [SAFE_WEIGHTS] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for stale in [*out.glob("model*.safetensors"), out / SAFE_INDEX]:
        stale.unlink(missing_ok=True)  # a previous export's files would shadow or mix with these
    for name, file_entries in zip(names, files):
        write_file(out / name, file_entries, read)
    if len(files) > 1:
        weight_map = {e.name: name for name, fe in zip(names, files) for e in fe}
        (out / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": sum(e.nbytes for e in entries)},
                                                  "weight_map": weight_map}, indent=2))
    return len(files)
