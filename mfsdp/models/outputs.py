"""What a language model's forward returns, read one way for every model kind."""

from __future__ import annotations

import torch


def logits_of(output) -> torch.Tensor:
    """The logits of a forward: the bundled models return them, Hugging Face models an output
    object that holds them."""
    return getattr(output, "logits", output)
