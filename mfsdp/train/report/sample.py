"""A short text sample from the trained model, to show what it learned."""

from __future__ import annotations

import torch

from mfsdp.models.outputs import logits_of


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int,
                  max_context: int, device: torch.device, seed: int = 0,
                  temperature: float = 0.8, stop_id: int | None = None, chat: bool = False) -> str:
    """The text of ``new_tokens`` sampled after ``prompt`` (the prompt not included); a collective
    when the model is sharded. ``stop_id`` ends the text at that token's first occurrence (every
    rank still runs all ``new_tokens`` forwards). ``chat``: ``prompt`` is a rendered conversation,
    encoded as the training samples were.

    Every rank runs the same number of forward passes, since each holds only a shard of
    the weights and must take part in gathering them. The ranks need not agree on the
    tokens for that (only rank 0 prints), so no token is exchanged; with the same seed
    they normally pick the same ones anyway. There is no KV cache: the whole context is
    recomputed per token, which is fine for a few hundred tokens of a small model.
    """
    ids = torch.tensor([tokenizer.encode(prompt, chat=chat)], dtype=torch.long, device=device)
    prompt_tokens = ids.shape[1]
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(new_tokens):
        logits = logits_of(model(ids[:, -max_context:]))[:, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        next_id = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, next_id], dim=1)
    new = ids[0, prompt_tokens:].tolist()
    return tokenizer.decode(new[:new.index(stop_id)] if stop_id in new else new)
