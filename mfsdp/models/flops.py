"""Parameter counts, training FLOPs per token and model FLOPs utilisation (MFU).

The counts are analytic, from the config alone, so they are the same however the
model is sharded and work for shapes too large to build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only for annotations: this file needs nothing but torch at run time
    from mfsdp.models.llama import LlamaConfig

# Dense bf16 tensor-core peak per GPU, in FLOP/s, from the vendors' data sheets (the
# figures without structured sparsity). Keys are matched against the CUDA device name;
# the longest matching key wins, so "H100 PCIe" beats "H100".
PEAK_FLOPS: dict[str, float] = {
    "GB200": 2500e12,
    "B200": 2250e12,
    "B300": 2250e12,
    "B100": 1750e12,
    "H200": 989e12,
    "H100": 989e12,  # SXM
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
}


def param_counts(cfg: LlamaConfig) -> dict[str, int]:
    """Parameters of the model, counted once each.

    ``embedding`` is the input table, a lookup with no matmul. ``non_embedding`` is every
    parameter that takes part in a matmul or norm, which includes the output head. With
    tied embeddings the one shared matrix is both, so it appears in both entries and
    ``total`` counts it once. ``active_non_embedding`` is the part of ``non_embedding`` one
    token computes with: for a mixture of experts, the router and ``top_k`` of the
    ``num_experts`` experts in each block; for a dense model, all of ``non_embedding``.
    """
    d, hd = cfg.dim, cfg.head_dim
    attention = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    if cfg.qkv_bias:
        attention += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    expert = 3 * d * cfg.ffn_dim
    router = d * cfg.num_experts
    feed_forward = expert * cfg.num_experts + router if cfg.num_experts else expert
    active_ffn = expert * cfg.top_k + router if cfg.num_experts else expert
    norms = 2 * d
    per_block = attention + feed_forward + norms
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    body = cfg.n_layers * per_block + d  # blocks plus the final norm
    total = body + embedding + (0 if cfg.tie_embeddings else head)
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": body + head,
        "active_non_embedding": body + head - cfg.n_layers * (feed_forward - active_ffn),
        "per_block": per_block,
    }


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * dim * seq_len``.

    ``N`` is ``param_counts(cfg)["active_non_embedding"]`` (all non-embedding parameters for a
    dense model; the router and ``top_k`` experts per block for a mixture of experts):
    forward costs 2 FLOPs per weight per token and backward twice that. The second term is the attention score and value
    matmuls, counted over the full square rather than the causal half, the common
    convention that keeps figures comparable across libraries. Recomputation from
    activation checkpointing is not counted, so the utilisation derived from this is
    model FLOPs utilisation, not hardware FLOPs utilisation.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n = param_counts(cfg)["active_non_embedding"]
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len


def device_name(device: torch.device | str | None = None) -> str:
    """A human-readable name: the CUDA product name, or "cpu"."""
    device = torch.device(device) if device is not None else None
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None when unknown (e.g. on CPU).

    ``device`` is a torch device, a device string such as "cuda:0", or a product name
    such as "NVIDIA H100 80GB HBM3".
    """
    name = device if isinstance(device, str) and not _is_device_string(device) else device_name(device)
    matches = [key for key in PEAK_FLOPS if key.upper() in name.upper()]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def mfu(tokens_per_s_per_gpu: float, cfg: LlamaConfig, seq_len: int,
        device: torch.device | str | None = None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the device's peak is unknown."""
    peak = peak_flops(device)
    return None if peak is None else tokens_per_s_per_gpu * flops_per_token(cfg, seq_len) / peak


def _is_device_string(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True
