"""Attention within each document of a packed sequence: causal, and blind across documents.

Packed fine-tuning puts several samples in one window; a token may attend only to the earlier
tokens of its own sample. ``document_mask(document_ids)`` builds the mask once per forward (the
root's), every block's attention takes it (``masked_attention``), in one of two forms:

* ``flex``, the CUDA default: a flex_attention ``BlockMask``. Tiles that lie wholly above the
  diagonal or across two documents are skipped, so the cost follows the documents' own lengths
  rather than the window's. The mask is built by a compiled ``create_block_mask`` (the eager one
  evaluates the rule for every (batch, query, key) at once: gigabytes at 8k tokens), and
  flex_attention runs compiled (eager flex materialises the whole score matrix), except inside a
  graph that torch.compile is already tracing (a compiled block), where inductor fuses it.
* ``sdpa``, the default elsewhere: a (batch, 1, seq, seq) boolean mask for
  ``scaled_dot_product_attention``. torch 2.11 and 2.13 have no flex_attention backward on CPU,
  so CPU training (the tests) takes this; it computes the same attention, at the full window's
  cost.

Without document ids the model keeps its plain causal SDPA path; nothing here runs.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

DocumentMask = Union[BlockMask, torch.Tensor]
"""What ``document_mask`` returns: a flex ``BlockMask``, or a boolean (batch, 1, seq, seq) tensor."""

BACKENDS = ("auto", "flex", "sdpa")
"""``auto``: flex on CUDA, sdpa elsewhere; ``flex`` off CUDA runs eagerly (forward only on CPU)."""

_compiled: dict[str, Callable] = {}


def _compiled_fn(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once per process on first use."""
    if name not in _compiled:
        _compiled[name] = torch.compile(fn)
    return _compiled[name]


def resolve_backend(backend: str, device: torch.device) -> str:
    """"flex" or "sdpa" for ``backend`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown document mask backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def document_mask(document_ids: torch.Tensor, backend: str = "auto",
                  branch_ids: torch.Tensor | None = None) -> DocumentMask:
    """The mask letting token i see token j of the same row when j <= i and both carry the same id.

    ``document_ids``: (batch, seq) integers; any values, equal within a document (a padding tail
    may be one more document). ``branch_ids``, optional, (batch, seq): see ``branch_mask``.
    """
    if document_ids.ndim != 2:
        raise ValueError(f"document_ids must be (batch, seq), got shape {tuple(document_ids.shape)}")
    if branch_ids is not None:
        return branch_mask(document_ids, branch_ids, backend)
    batch, seq = document_ids.shape
    if resolve_backend(backend, document_ids.device) == "sdpa":
        same = document_ids[:, :, None] == document_ids[:, None, :]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
        return (same & causal)[:, None]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    build = (_compiled_fn("create_block_mask", create_block_mask) if document_ids.is_cuda
             else create_block_mask)
    return build(same_document_causal, batch, None, seq, seq, device=document_ids.device)


def branch_mask(document_ids: torch.Tensor, branch_ids: torch.Tensor, backend: str = "auto") -> DocumentMask:
    """``document_mask`` with branches: token i sees token j when j <= i, both are of one
    document, and j is shared (branch 0) or of i's own branch. A preference pair packed as
    [prompt | chosen | rejected] (branches 0, 1, 2) so computes its prompt once, and its
    rejected answer never sees the chosen one (``mfsdp.data.pair_packing``)."""
    if branch_ids.shape != document_ids.shape:
        raise ValueError(f"branch_ids must have the document ids' shape {tuple(document_ids.shape)}, "
                         f"got {tuple(branch_ids.shape)}")
    batch, seq = document_ids.shape
    if resolve_backend(backend, document_ids.device) == "sdpa":
        same = document_ids[:, :, None] == document_ids[:, None, :]
        seen = (branch_ids[:, None, :] == 0) | (branch_ids[:, :, None] == branch_ids[:, None, :])
        causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
        return (same & seen & causal)[:, None]

    def same_document_branch_causal(b, h, q_idx, kv_idx):
        key = branch_ids[b, kv_idx]
        return ((q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])
                & ((key == 0) | (key == branch_ids[b, q_idx])))

    build = (_compiled_fn("create_block_mask", create_block_mask) if document_ids.is_cuda
             else create_block_mask)
    return build(same_document_branch_causal, batch, None, seq, seq, device=document_ids.device)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                     expand_kv: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q over k, v (possibly fewer, grouped heads).

    A BlockMask goes to flex_attention, which takes grouped heads as they are (``enable_gqa``);
    a boolean mask goes to SDPA with the key/value heads repeated by ``expand_kv``, as the causal
    path does.
    """
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, expand_kv(k), expand_kv(v), attn_mask=mask)
    flex = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        flex = _compiled_fn("flex_attention", flex_attention)
    return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
