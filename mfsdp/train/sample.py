"""A short text sample from the trained model, to show what it learned."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int,
                  max_context: int, device: torch.device, seed: int = 0,
                  temperature: float = 0.8) -> str:
    """Sample ``new_tokens`` continuing ``prompt``; a collective when the model is sharded.

    Every rank runs the same forward passes, since each holds only a shard of the weights
    and must take part in gathering them. Rank 0's choice of token is broadcast so all
    ranks extend the same text even if their logits differ in the last bit. There is no
    KV cache: the whole context is recomputed per token, which is fine for a few hundred
    tokens of a small model.
    """
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(new_tokens):
        logits = model(ids[:, -max_context:])[:, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        next_id = torch.multinomial(probs, 1, generator=generator)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(next_id, src=0)
        ids = torch.cat([ids, next_id], dim=1)
    return tokenizer.decode(ids[0].tolist())
