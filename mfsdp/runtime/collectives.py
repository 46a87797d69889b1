"""Collectives over lists of tensors, each list issued as one coalesced launch.

Free functions: they take the process group and the stream explicitly and keep no state, so they
run on CPU (gloo) without a model, and the runtime decides where and when they execute.

Why per-tensor collectives coalesced rather than one collective over a flat buffer: a parameter's
gathered rows must be contiguous for compute and its shard must be ``torch.chunk``-shaped for
DTensor. One flat all-gather lands rank-major and needs a copy-out per parameter; coalescing one
collective per parameter writes every parameter straight into place (no copy on the hot path) at
the cost of a few extra NCCL work items inside a single launch.
"""

from __future__ import annotations

import contextlib
import traceback
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mfsdp import _compat
from mfsdp.runtime.errors import MISMATCH_HELP, CollectiveMismatchError


def stream_context(stream: Optional[torch.Stream]):
    """``with`` the given stream current, or a no-op on devices without streams (CPU)."""
    on_cuda = stream is not None and stream.device.type == "cuda"
    return torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext()


def _native_average(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _coalesced(group, count: int, coalesce: bool):
    # No device argument: that selects the backends' fused "coalesced" entry points, which gloo
    # implements too, so CPU runs the very same code path.
    if count <= 1 or not coalesce:
        return contextlib.nullcontext()
    return _compat.coalescing_manager(group=group, async_ops=False)


def all_gather(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group,
               stream: Optional[torch.Stream] = None, coalesce: bool = True) -> None:
    """Gather each ``inputs[i]`` from every rank of ``group`` into ``outputs[i]`` (rank-major).

    Inputs in another dtype than their outputs (fp32 main weights gathered as bf16) are cast
    straight into this rank's block of each output in one fused launch, then gathered in place:
    no temporary for the cast, so an unshard allocates only the gathered buffer.
    """
    if not inputs:
        return
    with stream_context(stream):
        if dist.get_world_size(group) == 1:
            _compat.foreach_copy_(list(outputs), list(inputs))
            return
        if inputs[0].dtype != outputs[0].dtype:
            blocks = own_blocks(outputs, [inp.numel() for inp in inputs], group)
            _compat.foreach_copy_(blocks, list(inputs))
            inputs = blocks
        with _coalesced(group, len(inputs), coalesce):
            for out, inp in zip(outputs, inputs):
                _compat.all_gather_into_tensor(out, inp, group)


def own_blocks(outputs: Sequence[torch.Tensor], numels: Sequence[int], group) -> list[torch.Tensor]:
    """This rank's block of each all-gather output (``numels[i]`` elements of ``outputs[i]``): an
    input written there is gathered in place."""
    rank = dist.get_rank(group) if dist.get_world_size(group) > 1 else 0
    return [out.narrow(0, rank * n, n) for out, n in zip(outputs, numels)]


def reduce_scatter(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group,
                   stream: Optional[torch.Stream] = None, coalesce: bool = True) -> None:
    """Average each ``inputs[i]`` over ``group`` and keep this rank's block in ``outputs[i]``."""
    if not inputs:
        return
    with stream_context(stream):
        size = dist.get_world_size(group)
        if size == 1:
            _compat.foreach_copy_(list(outputs), list(inputs))
            return
        if dist.get_backend(group) == "gloo":
            _reduce_scatter_by_all_reduce(outputs, inputs, group, size)
            return
        op = dist.ReduceOp.AVG if _native_average(group) else dist.ReduceOp.SUM
        with _coalesced(group, len(inputs), coalesce):
            for out, inp in zip(outputs, inputs):
                _compat.reduce_scatter_tensor(out, inp, op, group)
        if op == dist.ReduceOp.SUM:
            _divide(outputs, size)


def _reduce_scatter_by_all_reduce(outputs, inputs, group, size: int) -> None:
    """gloo's reduce-scatter: one all-reduce over the inputs laid end to end (one per dtype), then
    each rank keeps its block. gloo runs a coalesced reduce-scatter as one slow operation per tensor
    (a block of nine tensors: 12 ms against 1.8 ms for this, on two CPU ranks); in host memory the
    extra bytes of an all-reduce cost less than the per-operation latency."""
    rank = dist.get_rank(group)
    for dtype in dict.fromkeys(inp.dtype for inp in inputs):
        batch = [(out, inp) for out, inp in zip(outputs, inputs) if inp.dtype == dtype]
        flat = torch.cat([inp.reshape(-1) for _, inp in batch])
        dist.all_reduce(flat, group=group)
        offset, blocks = 0, []
        for out, inp in batch:
            n = out.numel()
            blocks.append(flat[offset + rank * n : offset + (rank + 1) * n])
            offset += inp.numel()
        _compat.foreach_copy_([out for out, _ in batch], blocks)
    _divide(outputs, size)


def _divide(tensors: Sequence[torch.Tensor], size: int) -> None:
    """The average after a SUM: integer tensors (usage counts and tags, built to divide exactly)
    by exact division."""
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        _compat.foreach_div_(floats, float(size))
    for t in tensors:
        if not t.is_floating_point():
            t.floor_divide_(size)


def any_rank(flags: torch.Tensor, groups: Sequence = (None,)) -> list[bool]:
    """Per-entry logical OR of ``flags`` over the ranks of ``groups`` (each in turn; None is the
    default group): a MAX all-reduce per group, then one host read for all entries."""
    return [bool(f) for f in all_reduce_max(flags.to(torch.int32), groups).tolist()]


def all_reduce_max(tensor: torch.Tensor, groups: Sequence = (None,)) -> torch.Tensor:
    """Elementwise MAX of ``tensor`` over the ranks of ``groups`` (each in turn; None is the default
    group), in place; returns ``tensor``."""
    if dist.is_initialized():
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce(
    tensors: Sequence[torch.Tensor], group, stream: Optional[torch.Stream] = None, coalesce: bool = True
) -> None:
    """Average each tensor in place over ``group``."""
    if not tensors:
        return
    with stream_context(stream):
        size = dist.get_world_size(group)
        if size == 1:
            return
        op = dist.ReduceOp.AVG if _native_average(group) else dist.ReduceOp.SUM
        _all_reduce_by_dtype(tensors, group, op, coalesce)
        if op == dist.ReduceOp.SUM:
            _divide(tensors, size)


def sum_in_place(tensors: Sequence[torch.Tensor], group, coalesce: bool = True) -> None:
    """Sum each tensor in place over ``group`` (one coalesced launch per dtype), on the current stream."""
    if tensors and dist.get_world_size(group) > 1:
        _all_reduce_by_dtype(tensors, group, dist.ReduceOp.SUM, coalesce)


def _all_reduce_by_dtype(tensors: Sequence[torch.Tensor], group, op, coalesce: bool) -> None:
    """Coalesced all-reduces want one dtype (NCCL and gloo both check): the int64 usage counts beside
    the gradients get a launch of their own. Reduce-scatters mix dtypes in one launch."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        batch = [t for t in tensors if t.dtype == dtype]
        with _coalesced(group, len(batch), coalesce):
            for t in batch:
                dist.all_reduce(t, op=op, group=group)


# ------------------------------------------------------------------ the issuer and its debug check
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
            all_gather(outputs, inputs, process_group, stream, self.coalesce)
        elif kind == "reduce_scatter":
            reduce_scatter(outputs, inputs, process_group, coalesce=self.coalesce)
        else:
            all_reduce(outputs, process_group, coalesce=self.coalesce)


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
