"""Cross-entropy as a (sum, count) pair, and a fused output head that never holds all the logits.

Both functions return the sum of the token losses over the counted tokens (labels other than
``ignore_index``) as an fp32 scalar, and the count of those tokens as an int64 scalar. A trainer
divides by the count of the whole global batch (over microbatches and ranks), so gradient
accumulation and data parallelism give the full-batch mean exactly.

``cross_entropy_sum(logits, labels)`` is the plain loss, for models that return logits anyway.
``linear_cross_entropy(hidden, weight, labels)`` takes the final norm's output and the head's
weight instead, and goes over the tokens in chunks. The unfused path holds the whole logits in
bf16 and fp32, the fp32 log-probabilities and their gradients; at a 128,256 vocabulary each fp32
copy is 2 GiB per 4,096 tokens.

Design: the gradients are made in the forward, one chunk of T tokens at a time:
``z = h_c @ W.T`` in the compute dtype; the fp32 log-softmax of ``z`` (the loss); ``g = softmax -
onehot`` written over ``z``'s storage in the compute dtype; then ``grad_h_c = g @ W`` and
``grad_W += g.T @ h_c``. That is three GEMMs, as in the unfused path. The backward only
multiplies the two held gradients by ``grad_output``, so ``loss_sum / global_count`` scales them
as it would the unfused ones.
- Trade-off: ``grad_W`` (V×D in the compute dtype, 1 GiB at the 8B shape) and ``grad_h`` (N×D)
  are held from the forward to the backward. In a training step the head's backward follows its
  forward at once, and the unfused path holds its fp32 log-probabilities over the same interval.
- Rejected: recomputing each chunk's logits in the backward, which holds only the per-token
  log-sum-exp in between. It costs a fourth GEMM, a third more work on the model's largest GEMM.
  It wins only where the forward and backward lie far apart (pipeline schedules) or the held V×D
  gradient does not fit.
- Costs: a forward under autograd always pays for the gradients, so evaluate under
  ``torch.no_grad()`` (only the logits GEMM runs there). No double backward. Activation
  checkpointing around this call would redo the gradient work.

``grad_W`` accumulates across chunks in the compute dtype, through the GEMM's ``beta=1``: cuBLAS
adds the running sum in fp32 and rounds once per chunk (two roundings at 4,096 tokens with the
default chunk, four at 8,192).
- Rejected: an fp32 accumulator. torch has no portable bf16 GEMM that accumulates into fp32
  (``addmm(out_dtype=...)`` is CUDA-only, and whether it takes an fp32 input depends on the
  version). The portable form, an fp32 V×D buffer plus an add per chunk, costs 2 GiB and a V×D
  pass per chunk.
- For the same reason ``grad_output`` is applied after the rounding to the compute dtype: one
  rounding more than the unfused path (2^-9 relative in bf16).

A chunk's transient is its logits in the compute dtype and its fp32 log-probabilities. In eager
bf16 torch's ``log_softmax(dtype=float32)`` also makes a passing fp32 upcast of its input: 2.5
GiB in all at the default chunk and a 128,256 vocabulary. Ignored tokens keep static shapes (no
data-dependent indexing, no host sync). Their logits are computed. Their rows of ``h_c`` are
zeroed for the ``grad_W`` GEMM and their rows of ``grad_h`` are zeroed, T×D work, not T×V.
``torch.compile`` traces the whole function without a graph break. The chunk loop unrolls, so
each token count compiles its own graph. This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# The fp32 logits of one chunk are kept at or under this many bytes.
CHUNK_LOGITS_BYTES = 1 << 30


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose fp32 logits fit ``CHUNK_LOGITS_BYTES``, rounded down to a multiple
    of 256 where that leaves any (GEMM-friendly row counts): 2,048 for a 128,256-token vocabulary."""
    tokens = max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))
    return tokens // 256 * 256 if tokens >= 256 else tokens


def cross_entropy_sum(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """(sum of the token cross-entropies in fp32, count of the counted tokens as int64) for
    ``logits`` (..., V) and ``labels`` (...). The logits are upcast to fp32 first."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")
    return loss, (labels != ignore_index).sum()


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100,
                         chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """(sum of the token cross-entropies over the counted tokens as an fp32 scalar, count of counted
    tokens as an int64 scalar)

    The same values and gradients as ``cross_entropy_sum(F.linear(hidden, weight), labels)``,
    computed ``chunk_tokens`` tokens at a time (default: ``default_chunk_tokens(V)``) so that
    no (N, V) fp32 tensor is ever made. ``hidden`` is (..., D) and ``weight`` (V, D), both in
    the compute dtype. ``labels`` (...) are integers, ``ignore_index`` for tokens not counted.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match hidden of shape "
                         f"{tuple(hidden.shape)} (labels must be hidden's shape without its last dimension)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} is not (vocab, {hidden.shape[-1]})")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: pass both in the compute dtype")
    if labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1).long()  # gather takes int64 indices
    count = (flat != ignore_index).sum()
    need_h = torch.is_grad_enabled() and hidden.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    if need_h or need_w:
        loss = _LinearCrossEntropy.apply(h, weight, flat, ignore_index, chunk, need_h, need_w)
    else:
        loss = _chunked(h, weight, flat, ignore_index, chunk, False, False)[0]
    return loss, count


class _LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss with its gradients made in the forward; the backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index, chunk, need_h, need_w):
        loss, grad_h, grad_w = _chunked(h, weight, labels, ignore_index, chunk, need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_output
        grad_w = None if grad_w is None else grad_w * grad_output
        return grad_h, grad_w, None, None, None, None, None


def _chunked(h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk: int,
             need_h: bool, need_w: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The fp32 loss sum over (N, D) ``h`` and (N,) ``labels``, and the gradients of that sum
    with respect to ``h`` and ``weight`` where asked for (None where not)."""
    loss = h.new_zeros((), dtype=torch.float32)
    grad_h_chunks: list[Tensor] = []
    grad_w = None
    for start in range(0, h.shape[0], chunk):
        h_c, labels_c = h[start:start + chunk], labels[start:start + chunk]
        counted = labels_c != ignore_index
        target = torch.where(counted, labels_c, 0).unsqueeze(1)
        z = h_c @ weight.t()  # (T, V), compute dtype
        logp = torch.log_softmax(z, dim=-1, dtype=torch.float32)
        logp_target = logp.gather(1, target)  # (T, 1)
        loss = loss + torch.where(counted, -logp_target.squeeze(1), 0.0).sum()
        if not (need_h or need_w):
            del z, logp  # this chunk's logits go before the next chunk's GEMM makes its own
            continue
        # g = softmax - onehot in the compute dtype, over z's storage: the target entry is
        # p - 1 taken in fp32 before its one rounding, as the unfused path does.
        g = torch.exp(logp, out=z)
        del logp, z
        g.scatter_(1, target, (logp_target.exp() - 1.0).to(g.dtype))
        mask = counted.unsqueeze(1)
        if need_h:
            grad_h_chunks.append(torch.where(mask, g @ weight, 0.0))
        if need_w:
            h_counted = torch.where(mask, h_c, 0.0)
            grad_w = g.t() @ h_counted if grad_w is None else grad_w.addmm_(g.t(), h_counted)
        del g  # as above: z's storage
    if h.shape[0] == 0:  # no tokens at all
        grad_h_chunks, grad_w = [torch.zeros_like(h)], torch.zeros_like(weight) if need_w else None
    grad_h = torch.cat(grad_h_chunks) if need_h else None
    return loss, grad_h, grad_w
