"""Context parallel: the sequence is split over the ``cp`` mesh dim; parameters shard over dp_shard x cp.

The manager flattens ``(dp_shard, cp)`` into one mesh dim named ``dp_shard_cp`` and shards (ZeRO
levels) over it, so gradients are averaged over every rank that saw different tokens: the
data-parallel ranks and the context-parallel ranks alike. What remains for the training loop is
the batch: each cp rank feeds its part of the sequence.

* :func:`shard_sequence` (any device): contiguous ``torch.chunk`` of every tensor along the
  sequence dim by cp coordinate, with global ``position_ids`` and globally shifted labels
  (``shift_labels``, which Hugging Face's causal-LM loss uses as given). Enough for models whose
  tokens only interact inside attention when attention is itself context-parallel; on CPU,
  correct for position-wise models.
* :func:`attention_context` (CUDA): torch's ``context_parallel`` over ``mesh["cp"]``, which
  shards the given buffers in place (load-balanced order) and makes SDPA exchange keys and
  values between cp ranks. torch has no CPU sharding rule for attention, so this needs CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

IGNORE_INDEX = -100
DP_SHARD_CP = "dp_shard_cp"


def cp_coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index along ``cp``, the cp size) of a manager mesh."""
    return mesh["cp"].get_local_rank(), mesh["cp"].size()


def shift_labels(labels: torch.Tensor, seq_dim: int = 1, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` moved one step left along ``seq_dim`` (the last position gets ``ignore_index``).

    Shift before sharding: after sharding, the label of a shard's last token lives on the next rank.
    """
    rolled = labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1)
    pad = torch.full_like(labels.narrow(seq_dim, 0, 1), ignore_index)
    return torch.cat([rolled, pad], dim=seq_dim)


def shard_sequence(mesh: DeviceMesh, batch: Mapping[str, torch.Tensor], seq_dim: int = 1,
                   labels_key: Optional[str] = "labels") -> dict[str, torch.Tensor]:
    """This cp rank's contiguous part of every tensor in ``batch`` along ``seq_dim``.

    Adds ``position_ids`` (global positions, unless given) so rotary embeddings see where the shard
    sits, and shifts ``labels`` on the whole sequence before sharding, returning them as both
    ``labels`` and ``shift_labels`` (HF's causal-LM loss needs ``labels`` to run and uses
    ``shift_labels`` without shifting again), so no label crosses a shard boundary. The sequence length must divide by the cp size (equal
    shards keep the per-rank mean losses an unbiased average). With cp = 1 the batch is returned
    with those two additions only.
    """
    rank, size = cp_coordinate(mesh)
    out = dict(batch)
    lengths = {k: v.shape[seq_dim] for k, v in out.items() if isinstance(v, torch.Tensor) and v.ndim > seq_dim}
    if not lengths:
        raise ValueError("shard_sequence: no tensor in the batch has a sequence dim")
    length = next(iter(lengths.values()))
    if any(n != length for n in lengths.values()):
        raise ValueError(f"shard_sequence: tensors disagree on the sequence length: {lengths}")
    if length % size:
        raise ValueError(f"sequence length {length} does not divide by the context-parallel size {size}; "
                         "pad the batch to a multiple of cp")
    ref = out[next(iter(lengths))]
    if "position_ids" not in out:
        shape = [1] * ref.ndim
        shape[seq_dim] = length
        positions = torch.arange(length, device=ref.device).view(shape)
        out["position_ids"] = positions.expand(*ref.shape[:seq_dim + 1]) if seq_dim else positions
    if labels_key and labels_key in out:
        # Both keys: HF computes a loss only when ``labels`` is given, and uses ``shift_labels`` as is.
        out["shift_labels"] = out[labels_key] = shift_labels(out[labels_key], seq_dim)
    return {k: (v.chunk(size, dim=seq_dim)[rank].contiguous()
                if isinstance(v, torch.Tensor) and v.ndim > seq_dim else v) for k, v in out.items()}


CAUSAL_SDPA = "mfsdp_causal_sdpa"


def _causal_sdpa(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None, **kwargs):
    """Hugging Face attention function: causal SDPA from ``is_causal`` alone, never a mask tensor.

    torch's context parallel shards q, k and v along the sequence and runs ring attention inside
    SDPA; it derives causality from ``is_causal`` but cannot shard an explicit mask, which is what
    Hugging Face's own SDPA path passes. Grouped-query heads are repeated as HF's ``repeat_kv`` does.
    """
    if attention_mask is not None:
        raise ValueError(f"{CAUSAL_SDPA} attention takes no attention mask (got one of shape "
                         f"{tuple(attention_mask.shape)}): pack sequences without padding")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{CAUSAL_SDPA} attention is for training: query length {query.shape[2]} differs from "
                         f"key length {key.shape[2]} (a KV cache); switch back to 'sdpa' to generate")
    repeat = query.shape[1] // key.shape[1]
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, attention_mask=None, **kwargs):
    """Mask function: causality comes from ``is_causal``; padding cannot be expressed, so refuse it."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{CAUSAL_SDPA} attention takes no padding mask (the attention_mask holds zeros): pack "
                         "sequences without padding, or use 'sdpa' attention without context parallel")
    return None


def use_causal_sdpa(model) -> None:
    """Switch a Hugging Face model to :data:`CAUSAL_SDPA` attention (what context parallel needs).

    Registers the attention function, and a mask function that builds no mask, under that name
    with ``transformers``; the model then computes causal attention without any mask tensor. Only
    for causal training without padding; the manager calls this when cp > 1.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"use_causal_sdpa needs a Hugging Face PreTrainedModel, got {type(model).__name__}")
    model.set_attn_implementation(CAUSAL_SDPA)


def attention_context(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                      no_restore_buffers: Optional[set] = None):
    """torch's ``context_parallel`` over ``mesh["cp"]`` for SDPA attention (CUDA only).

    ``buffers`` (input ids, position ids, shifted labels, ...) are sharded in place along
    ``seq_dims`` on entry. Hugging Face models need :func:`use_causal_sdpa` (the manager applies it
    when cp > 1): their own SDPA path passes a mask tensor, which context parallel cannot shard.
    """
    if mesh.device_type != "cuda":
        raise NotImplementedError(
            "context parallel attention needs CUDA: torch's context_parallel has no sharding rule for CPU "
            "attention kernels (on CPU use shard_sequence with position-wise models)")
    size = mesh["cp"].size()
    for buf, dim in zip(buffers, seq_dims):
        if buf.shape[dim] % (2 * size * 32):
            raise ValueError(
                f"context parallel: sequence length {buf.shape[dim]} must be a multiple of 2 x cp x 32 = "
                f"{2 * size * 32}: torch's load-balanced ring attention cuts it into 2 x cp chunks, and its "
                "memory-efficient kernel pads each chunk's logsumexp to 32 tokens. Pad the batch.")
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh["cp"], buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                            no_restore_buffers=no_restore_buffers or set(buffers))
