"""Debug mode: compare a fingerprint of every collective across its group before issuing it.

A size mismatch between ranks hangs NCCL (or aborts gloo with a size error that names nothing), and
an equal-size mismatch silently mixes two modules' data. With ``check_collectives`` every rank first
all-gathers a fixed-size fingerprint (kind, module-name hash, element count, tensor count, dtype);
a fixed size can never hang on a size mismatch. When the fingerprints differ, every rank sees it at
the same collective, so the ranks then exchange readable descriptions (module and call path) and
all raise the same error naming each rank's side.
"""

from __future__ import annotations

import traceback
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from mfsdp import _compat
from mfsdp.runtime import collectives
from mfsdp.runtime.errors import MISMATCH_HELP, CollectiveMismatchError

_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_FIELDS = 5


class CollectiveIssuer:
    """Issues one parameter group's coalesced collectives; in debug mode (``check``), first checks
    that every rank of the group is about to issue the same one. A small object of its own, so the
    group's reducer can hold it without a reference cycle through the group."""

    def __init__(self, name: str, coalesce: bool, check: bool) -> None:
        self.name = name  # the owning module's name once its context is built
        self.coalesce = coalesce
        self.check = check

    def __call__(self, kind: str, outputs, inputs, process_group, stream=None) -> None:
        if self.check:
            verify(process_group, kind, self.name, outputs if inputs is None else inputs)
        if kind == "all_gather":
            collectives.all_gather(outputs, inputs, process_group, stream, self.coalesce)
        elif kind == "reduce_scatter":
            collectives.reduce_scatter(outputs, inputs, process_group, coalesce=self.coalesce)
        else:
            collectives.all_reduce(outputs, process_group, coalesce=self.coalesce)


def fingerprint(kind: str, name: str, tensors: Sequence[torch.Tensor]) -> list[int]:
    """(kind, crc32 of the module name, elements, tensors, dtype) of one coalesced collective."""
    return [_KINDS[kind], zlib.crc32(name.encode()), sum(t.numel() for t in tensors), len(tensors),
            zlib.crc32(str(tensors[0].dtype).encode())]


def verify(process_group, kind: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raise ``CollectiveMismatchError`` on every rank of ``process_group`` unless all of them are
    about to issue the same collective."""
    size = dist.get_world_size(process_group)
    if size == 1 or not tensors:
        return
    device = tensors[0].device
    mine = torch.tensor(fingerprint(kind, name, tensors), dtype=torch.int64, device=device)
    gathered = torch.empty(size * _FIELDS, dtype=torch.int64, device=device)
    _compat.all_gather_into_tensor(gathered, mine, process_group)
    rows = gathered.view(size, _FIELDS).tolist()
    if all(row == rows[0] for row in rows):
        return
    description = (f"{kind} of {name!r}: {sum(t.numel() for t in tensors)} elements in {len(tensors)} "
                   f"tensor(s) of {tensors[0].dtype}, called from\n{_call_path()}")
    descriptions: list = [None] * size
    dist.all_gather_object(descriptions, description, group=process_group)
    ranks = dist.get_process_group_ranks(process_group)
    lines = "\n".join(f"  rank {rank}: {text}" for rank, text in zip(ranks, descriptions))
    raise CollectiveMismatchError(
        f"mfsdp: ranks {ranks} are about to issue different collectives:\n{lines}\n{MISMATCH_HELP}")


def _call_path(limit: int = 6) -> str:
    """The user's frames (outside torch and mfsdp), newest last, then the mfsdp entry point (the
    hook or optimizer step that issued the collective)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "torch/" not in f.filename.replace("\\", "/")]
    inside = [i for i, f in enumerate(frames) if "mfsdp/" in f.filename.replace("\\", "/")]
    user = frames[:inside[0]] if inside else frames
    entry = [frames[inside[0]]] if inside else []
    return "\n".join(f"      {f.filename}:{f.lineno} in {f.name}" for f in user[-limit:] + entry)
