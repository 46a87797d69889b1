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


def attention_context(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                      no_restore_buffers: Optional[set] = None):
    """torch's ``context_parallel`` over ``mesh["cp"]`` for SDPA attention (CUDA only).

    ``buffers`` (input ids, position ids, shifted labels, ...) are sharded in place along
    ``seq_dims`` on entry. Use SDPA attention (``attn_implementation="sdpa"``) with a causal mask
    and no padding mask.
    """
    if mesh.device_type != "cuda":
        raise NotImplementedError(
            "context parallel attention needs CUDA: torch's context_parallel has no sharding rule for CPU "
            "attention kernels (on CPU use shard_sequence with position-wise models)")
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh["cp"], buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                            no_restore_buffers=no_restore_buffers or set(buffers))
