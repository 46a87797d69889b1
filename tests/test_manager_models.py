"""Tiny Hugging Face causal LMs with random weights, built from configs (no hub access)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def make_hf(family: str = "llama", *, vocab: int = 62, tied: bool = False, dtype=torch.float32, seed: int = 0,
            heads: int = 4, kv_heads: int = 2, layers: int = 2):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied, use_cache=False,
                  max_position_embeddings=64)
    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise ValueError(family)
    return model.to(dtype)


def batch(step: int, size: int = 4, seq: int = 6, vocab: int = 62) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (size, seq), generator=g)


def optimizer_groups(model, lr=1e-2):
    """Two param groups with different settings, to prove the manager keeps them."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                                       "lr": lr * 0.5}], lr=lr)


