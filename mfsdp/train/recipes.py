"""The learning-rate schedule of each model preset: what ``mfsdp train`` uses unless ``--train.lr``,
``--train.warmup_steps`` or ``--train.min_lr_ratio`` say otherwise.

One rate for every size diverges: the tiny model's 3e-3 took an 8B run from a loss of 12.4 to
33 in three steps. The large presets follow the published recipes of their shapes; the tiny ones
keep the demo's schedule. A short run warms up over at most ``WARMUP_FRACTION`` of its steps, so a
200-step trial of the 8b preset is not all warm-up (2,000 steps in the recipe); torchtitan's 1000-step
Llama 3 configs warm up for 200 steps, the same fifth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mfsdp.models import flops
from mfsdp.models.llama import PRESETS, LlamaConfig


@dataclass(frozen=True)
class Recipe:
    """A peak learning rate, its warm-up and where its cosine decay ends."""

    lr: float
    """Peak learning rate of AdamW."""
    warmup_steps: int
    """Steps of linear warm-up of a long run (a short one takes at most ``WARMUP_FRACTION`` of its
    steps)."""
    min_lr_ratio: float
    """The cosine decay ends at ``lr * min_lr_ratio``."""

    def warmup_for(self, steps: int) -> int:
        """The warm-up of a run of ``steps`` optimizer steps."""
        return min(self.warmup_steps, int(WARMUP_FRACTION * steps))


WARMUP_FRACTION = 0.2
"""The largest share of a run spent warming up when the preset's warm-up is longer."""

# Llama 2 (Touvron et al. 2023, section 2.2): AdamW with betas 0.9/0.95, weight decay 0.1, clipping
# at 1.0 (the TrainSection defaults), 2,000 warm-up steps and a cosine decay to 10 % of the peak:
# 3e-4 for 7B and 13B, 1.5e-4 for 70B. torchtitan's Llama 3 configs keep those peaks
# (train_configs/llama3_1b.toml and llama3_8b.toml: lr 3e-4; llama3_70b.toml: 1.5e-4).
RECIPES: dict[str, Recipe] = {
    # mfsdp's demo schedule (make demo, configs/tiny.yaml): a 3.4M-parameter model, 300 steps.
    "tiny": Recipe(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1),
    "moe-tiny": Recipe(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1),
    # Llama-3.2-1B shape: torchtitan's llama3_1b.toml peak.
    "1b": Recipe(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1),
    # 1.02B parameters, 0.49B per token: the schedule of the dense model of its size.
    "moe-1b": Recipe(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1),
    # Llama-3-8B shape: Llama 2 7B's recipe, torchtitan's llama3_8b.toml peak.
    "8b": Recipe(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1),
    # Llama-3-70B shape: Llama 2 70B's recipe, torchtitan's llama3_70b.toml peak.
    "70b": Recipe(lr=1.5e-4, warmup_steps=2000, min_lr_ratio=0.1),
}


def recipe_for(preset: str, shape: LlamaConfig, by_size: bool) -> tuple[str, Recipe]:
    """The name and recipe of a run's model: its preset's, or (``by_size``: a Hugging Face model)
    that of the dense preset nearest in parameter count."""
    if not by_size:
        return preset, RECIPES[preset]
    n = flops.param_counts(shape)["total"]
    dense = [name for name, cfg in PRESETS.items() if not cfg.num_experts]
    name = min(dense, key=lambda k: abs(math.log(flops.param_counts(PRESETS[k])["total"] / n)))
    return f"{name}-sized", RECIPES[name]
