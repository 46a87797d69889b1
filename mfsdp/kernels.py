"""The library's Triton kernels for CUDA, each with a portable path at its caller.

Triton ships with torch's CUDA wheels. Without it, on other devices, or with
``MFSDP_TRITON_KERNELS=0``, the callers run their torch code instead.

* ``FusedEncode``: the float8 gather encode in one kernel (``mfsdp.float8``), see the first note.
* ``to_fp32``: a bf16/fp16 buffer widened to fp32 at copy bandwidth (``mfsdp.optimizer``'s lean
  step), see the second note.

[Note: the float8 encode as one kernel]
The portable encode (``Float8GatherCodec._cast_staged``) needs four torch kernels: a staging copy in
the compute dtype, a row-scale gather, a broadcast multiply that stores float8 and a copy out. On an
H200 those kernels moved about 11 bytes per element through TensorIterator's generic (unvectorized)
paths: 105 ms per step of the 8B layer shape at 16 layers, 2 x 8192, on the gather stream, where the
compute stream then waited 42 ms for it (``benchmarks/results/2026-12-01_h200x1_session2``). This
kernel reads each source element once and writes its float8 byte once (5 bytes per element from
fp32 main weights), with no staging memory, in one launch per encode whatever the number of
weights: each program casts one row of ``ENCODE_ROW`` elements of one member, and finds its member,
that member's offsets and its scale through the same cached row-to-member index the portable path
uses. The sources must be views of one storage (a group's main buffer) and the blocks views of one
storage (the gather buffer); ``FusedEncode.run`` says when they are not, and the portable path runs.
The arithmetic is torchao's ``to_fp8_saturated(w.to(compute).float() * scale)``: round to the
compute dtype to nearest even, multiply in fp32, clamp to the float8 range, convert to nearest even.
``tests/test_float8.py`` checks the bytes against torchao's cast on the GPU.

[Note: widening at copy bandwidth]
The lean optimizer step upcasts each group's bf16 main gradient to fp32 just before the group's
AdamW. ``Tensor.to`` does that through TensorIterator's dtype-converting copy, which is not
vectorized: 24.5 ms per step for Llama-3-8B on one H200, about 2 TB/s. A widening is exact (every
bf16 and fp16 value is an fp32 value), so a plain kernel that converts in registers gives the same
bits at the copy's bandwidth.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch


@functools.lru_cache(maxsize=None)
def _encode_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def encode_rows(src, dst, src_offset, dst_offset, sizes, first_row, row_member, scales, limit,
                    ROW: tl.constexpr, ROUND_TO_BF16: tl.constexpr, ROUND_TO_FP16: tl.constexpr):
        row = tl.program_id(0)
        member = tl.load(row_member + row)
        start = (row - tl.load(first_row + member)).to(tl.int64) * ROW
        offsets = start + tl.arange(0, ROW)
        valid = offsets < tl.load(sizes + member)
        x = tl.load(src + tl.load(src_offset + member) + offsets, mask=valid, other=0.0)
        if ROUND_TO_BF16:
            x = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
        if ROUND_TO_FP16:
            x = x.to(tl.float16, fp_downcast_rounding="rtne")
        y = x.to(tl.float32) * tl.load(scales + member)
        y = tl.minimum(tl.maximum(y, -limit), limit)
        tl.store(dst + tl.load(dst_offset + member) + offsets,
                 y.to(dst.dtype.element_ty, fp_downcast_rounding="rtne"), mask=valid)

    return encode_rows


@functools.lru_cache(maxsize=None)
def available(device_type: str) -> bool:
    """Whether this module's kernels run on devices of this type: CUDA with Triton importable."""
    if device_type != "cuda" or os.environ.get("MFSDP_TRITON_KERNELS", "1") == "0":
        return False
    try:
        _encode_kernel()
    except ImportError:
        return False
    return True


def _storage_offsets(tensors: Sequence[torch.Tensor]) -> Optional[list[int]]:
    """Each tensor's element offset in the storage they all view, or None if they view several
    storages, are not contiguous, or differ in dtype."""
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != base or t.dtype != first.dtype or not t.is_contiguous():
            return None
    return [t.storage_offset() for t in tensors]


class FusedEncode:
    """The device tables of one codec's encodes, made once per layout (the member sizes and the
    sources' and blocks' places in their storages), then one kernel launch per encode."""

    def __init__(self) -> None:
        self._tables: dict = {}

    def run(self, sources, blocks, scales: torch.Tensor, first_rows: list, row_member: torch.Tensor,
            row: int, compute_dtype: torch.dtype) -> bool:
        """Encode ``sources`` into ``blocks`` (float8) with per-member ``scales``; False (nothing done)
        where the views do not allow one launch, so that the caller takes the portable path."""
        src_offsets, dst_offsets = _storage_offsets(sources), _storage_offsets(blocks)
        if src_offsets is None or dst_offsets is None:
            return False
        device = sources[0].device
        key = (tuple(src_offsets), tuple(dst_offsets), tuple(s.numel() for s in sources), device)
        tables = self._tables.get(key)
        if tables is None:
            host = torch.tensor([src_offsets, dst_offsets, list(key[2]), first_rows], dtype=torch.int64)
            tables = self._tables[key] = host.to(device)
        src = _whole(sources[0])
        dst = _whole(blocks[0])
        limit = torch.finfo(blocks[0].dtype).max
        source_dtype = sources[0].dtype
        _encode_kernel()[(row_member.numel(),)](
            src, dst, tables[0], tables[1], tables[2], tables[3], row_member, scales, limit, ROW=row,
            ROUND_TO_BF16=compute_dtype == torch.bfloat16 and source_dtype == torch.float32,
            ROUND_TO_FP16=compute_dtype == torch.float16 and source_dtype == torch.float32,
            num_warps=4)
        return True


def _whole(view: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage ``view`` looks into (offset 0), in its dtype."""
    storage = view.untyped_storage()
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        storage, 0, (storage.nbytes() // view.element_size(),))


_WIDEN_BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _widen_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def widen(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=valid).to(tl.float32), mask=valid)

    return widen


def to_fp32(flat: torch.Tensor) -> torch.Tensor:
    """A new fp32 copy of ``flat``, bit for bit what ``flat.to(torch.float32)`` gives."""
    if flat.dtype in (torch.bfloat16, torch.float16) and flat.is_contiguous() and flat.numel() \
            and available(flat.device.type):
        out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
        _widen_kernel()[(-(-flat.numel() // _WIDEN_BLOCK),)](flat, out, flat.numel(), BLOCK=_WIDEN_BLOCK,
                                                             num_warps=8)
        return out
    return flat.to(torch.float32)
