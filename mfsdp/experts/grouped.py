"""A rank's experts over the tokens routed to them: SwiGLU per expert on expert-sorted rows.

One grouped GEMM per projection (``_compat.grouped_mm``) where this torch has it and the operands
suit its kernels: fp32 or bf16 throughout, every non-unit stride and every data pointer on 16 bytes,
at least one row. Otherwise a per-expert loop. Both give an expert with no rows a zero gradient
slice (the weights are stacked, so the slice exists and is zero).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from mfsdp import _compat

_GROUPED_DTYPES = (torch.float32, torch.bfloat16)
# fp32 runs through the grouped GEMM only in eager CPU code: torch's CUDA kernel and its shape rule
# (what torch.compile traces with, on any device) accept bf16 alone.
_FP32_GROUPED = "cpu"


def expert_swiglu(x: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(x W_gate^T) * (x W_up^T) W_down^T`` for each expert over its rows of ``x``.

    ``x`` [N, D] holds the rows sorted by expert: ``counts[e]`` rows for expert ``e`` of ``gate_up``
    [E, 2F, D] and ``down`` [E, D, F], ``sum(counts) == N``. Returns [N, D], unweighted. An expert
    with no rows contributes nothing and gets a zero gradient slice.
    """
    counts = [int(c) for c in counts]
    if len(counts) != gate_up.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"expert_swiglu: counts {counts} must have one entry per expert "
                         f"({gate_up.shape[0]}) and sum to the rows of x ({x.shape[0]})")
    if grouped_mm_usable(x, gate_up, down):
        return _grouped(x, counts, gate_up, down, act)
    return _loop(x, counts, gate_up, down, act)


def grouped_mm_usable(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``expert_swiglu`` takes the grouped GEMM for these operands (else the loop).

    No rows at all goes to the loop: the weights' gradient would contract over an empty dimension,
    which some grouped-GEMM kernels refuse."""
    operands = (x, gate_up, down)
    if not _compat.has_grouped_mm() or x.dim() != 2 or x.shape[0] == 0:
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in operands):
        return False  # a tensor subclass (DTensor, a float8 tensor) has its own rules
    if x.dtype not in _GROUPED_DTYPES or any(t.dtype != x.dtype or t.device != x.device for t in operands):
        return False
    if x.dtype == torch.float32 and (x.device.type != _FP32_GROUPED or torch.compiler.is_compiling()):
        return False
    hidden_row = down.shape[-1] * x.element_size()  # the activation [N, F] between the projections
    return hidden_row % 16 == 0 and all(_aligned(t) for t in (x, gate_up.mT, down.mT))


def _aligned(t: torch.Tensor) -> bool:
    """A (batched) matrix the grouped GEMM accepts: row- or column-major in its last two dims, every
    non-unit stride and the data pointer on 16 bytes."""
    *_, rows, cols = t.shape
    *_, row_stride, col_stride = t.stride()
    major = (col_stride == 1 and row_stride >= max(1, cols)) or (row_stride == 1 and col_stride >= max(1, rows))
    size = t.element_size()
    return major and t.data_ptr() % 16 == 0 and all(s == 1 or s * size % 16 == 0 for s in t.stride())


def _grouped(x, counts, gate_up, down, act):
    # Built on the host, copied without blocking: torch.tensor(..., device=) would wait for the stream (at
    # ep > 1, for the token all-to-all) before the GEMMs could be queued. From pageable memory the copy is
    # staged at once, so the list may go. (Offsets made on the device from dispatch's counts would be
    # allocations the memory planner's fake run, taking the loop, does not make.)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(x.device, non_blocking=True)
    gate, up = _DenseGrad.apply(_compat.grouped_mm(x, gate_up.mT, offs)).chunk(2, dim=-1)
    return _DenseGrad.apply(_compat.grouped_mm(act(gate) * up, down.mT, offs))


def _loop(x, counts, gate_up, down, act):
    outs = []
    for e, rows in enumerate(x.split(counts)):  # an empty expert too: its slice's gradient is zero
        gate, up = torch.nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(torch.nn.functional.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense, 16-byte aligned gradient: the grouped GEMM's
    backward refuses an expanded one (zero strides, as ``y.sum()`` gives)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if grad.is_contiguous() and grad.data_ptr() % 16 == 0:
            return grad
        return grad.clone(memory_format=torch.contiguous_format)
