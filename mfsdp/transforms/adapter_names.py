"""The names of LoRA's adapter parameters, apart from ``lora`` so that the weight loaders (which
``lora``'s imports reach) can tell an adapter, which no base checkpoint holds, from a missing
weight."""

from __future__ import annotations

ADAPTERS = ("lora_A", "lora_B")
"""The attribute names of the two adapter matrices on a LoRA linear (PEFT's)."""


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA adapter matrix (``...wq.lora_A``)."""
    return name.rpartition(".")[2] in ADAPTERS
