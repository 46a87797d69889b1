"""The optimizer recipes of ``mfsdp train``: the learning-rate schedule and AdamW's settings that a
run uses unless ``--train.*`` flags say otherwise.

Pretraining (a preset, or a Hugging Face architecture trained from random weights): one rate for
every size diverges (the tiny model's 3e-3 took an 8B run from a loss of 12.4 to 33 in three steps),
so the large presets follow the published recipes of their shapes and the tiny ones keep the demo's
schedule; a Hugging Face model takes the recipe of the dense preset nearest in size. A short run
warms up over at most ``WARMUP_FRACTION`` of its steps, so a 200-step trial of the 8b preset is not
all warm-up (2,000 steps in the recipe); torchtitan's 1000-step Llama 3 configs warm up for 200
steps, the same fifth.

Fine-tuning (``--model.hf DIR`` with pretrained weights): ``FINE_TUNING``, the same for every size,
since the published full fine-tuning recipes do not scale their rate with the model either. LoRA
(``--peft.method lora``) on pretrained weights: ``LORA``, the fine-tuning schedule at LoRA's rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mfsdp.models import flops
from mfsdp.models.llama import PRESETS, LlamaConfig

SCHEDULES = ("cosine", "linear", "constant")
"""How the rate decays after the warm-up (``mfsdp.train.loop.step.lr_at``): a half cosine or a straight
line from the peak down to ``lr * min_lr_ratio`` at the last step, or not at all."""


@dataclass(frozen=True)
class Recipe:
    """A peak learning rate, its warm-up and decay, and AdamW's second-moment decay and weight decay
    (the first-moment decay 0.9 and clipping at 1.0 are every recipe's: the TrainSection defaults)."""

    lr: float
    """Peak learning rate of AdamW."""
    warmup_steps: int
    """Steps of linear warm-up of a long run (a short one takes at most ``warmup_fraction`` of its
    steps)."""
    min_lr_ratio: float
    """The decay ends at ``lr * min_lr_ratio``."""
    warmup_fraction: float = 0.2
    """The largest share of a run spent warming up when ``warmup_steps`` is longer."""
    schedule: str = "cosine"
    """The decay after the warm-up, one of ``SCHEDULES``."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (of the matrices; norms and biases are never decayed)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Recipe.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    def warmup_for(self, steps: int) -> int:
        """The warm-up of a run of ``steps`` optimizer steps. (0.2 and 0.1 as doubles lie just above a
        fifth and a tenth, so this is ``steps // 5`` or ``steps // 10`` exactly.)"""
        return min(self.warmup_steps, int(self.warmup_fraction * steps))


WARMUP_FRACTION = 0.2
"""The largest share of a pretraining run spent warming up when the preset's warm-up is longer."""

# Llama 2 (Touvron et al. 2023, section 2.2): AdamW with betas 0.9/0.95, weight decay 0.1, clipping
# at 1.0, 2,000 warm-up steps and a cosine decay to 10 % of the peak: 3e-4 for 7B and 13B, 1.5e-4
# for 70B. torchtitan's Llama 3 configs keep those peaks (train_configs/llama3_1b.toml and
# llama3_8b.toml: lr 3e-4; llama3_70b.toml: 1.5e-4).
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

# Full fine-tuning of pretrained weights.
# * lr 2e-5: torchtune's llama3_1/8B_full.yaml (torch.optim.AdamW, lr 2e-5) and TRL's SFTConfig
#   default (learning_rate 2e-5, where HF's TrainingArguments has 5e-5).
# * Warm-up min(100, steps // 10): torchtune's fine-tuning schedule, get_cosine_schedule_with_warmup
#   with num_warmup_steps 100 (llama3_1/8B_lora.yaml); a tenth of a shorter run at most, as the
#   pretraining recipes take a fifth, so a 50-step trial is not all warm-up.
# * Cosine decay to 0: torchtune's get_cosine_schedule_with_warmup and HF's lr_scheduler_type
#   "cosine" both end at zero (HF's default, "linear" to 0, is --train.lr_schedule linear).
# * AdamW betas (0.9, 0.999), weight decay 0, clipping at 1.0: HF TrainingArguments' defaults
#   (adam_beta1, adam_beta2, weight_decay 0.0, max_grad_norm 1.0), which TRL's SFTConfig inherits.
# Where the anchors differ: NeMo Automodel's fine-tuning recipes use lr 5e-6 to 1e-5 and weight
# decay 0.01, and torchtune's full configs keep torch AdamW's weight decay of 0.01. We take the
# HF/TRL values: most published fine-tunes of Hugging Face checkpoints ran them, so a run here
# reproduces theirs by default; NeMo's more cautious rate is within a factor of 2 to 4 (--train.lr
# 1e-5 for it); and a decay of 0.01 at lr 2e-5 shrinks each weight by 2e-7 a step, 0.02 % over a
# thousand steps, too little to matter beside the rate (--train.weight_decay 0.01 for it).
FINE_TUNING = Recipe(lr=2e-5, warmup_steps=100, min_lr_ratio=0.0, warmup_fraction=0.1, schedule="cosine",
                     beta2=0.999, weight_decay=0.0)

# LoRA fine-tuning of pretrained weights (only the adapters train).
# * lr 2e-4: Axolotl's LoRA example configs (learning_rate 0.0002); TRL's
#   PEFT guidance, about 10x the full fine-tuning rate (SFTConfig's 2e-5); torchtune's
#   llama3_1/8B_lora.yaml takes 3e-4, within a factor of 1.5.
# * Warm-up min(100, steps // 10) and cosine decay to 0: the fine-tuning schedule above, which is
#   torchtune's LoRA configs' own (get_cosine_schedule_with_warmup, num_warmup_steps 100).
# * Weight decay 0: TRL/HF's TrainingArguments default, which PEFT LoRA runs inherit; decaying the
#   adapters would pull B towards zero, towards the base model. torchtune's LoRA configs take 0.01.
# * AdamW betas (0.9, 0.999), clipping at 1.0: HF TrainingArguments' defaults, as for FINE_TUNING.
LORA = dataclasses.replace(FINE_TUNING, lr=2e-4)

# Preference tuning (DPO and its kin, a file of preference pairs) of pretrained weights.
# * lr 1e-6: TRL's DPOConfig default (learning_rate 1e-6); beta 0.1 (--dpo.beta) is its default too.
# * LoRA lr 1e-5: about 10x the full rate, as TRL's DPO docs suggest for PEFT adapters (and as LORA is
#   10x FINE_TUNING); torchtune's Llama-3.1-8B LoRA DPO config takes 5e-4 at beta 0.1, far above.
# * Warm-up, cosine decay to 0, AdamW betas, weight decay 0: the fine-tuning schedule above
#   (TRL's DPOConfig inherits HF TrainingArguments' defaults, as SFTConfig does).
DPO = dataclasses.replace(FINE_TUNING, lr=1e-6)
DPO_LORA = dataclasses.replace(FINE_TUNING, lr=1e-5)


def recipe_for(preset: str, shape: LlamaConfig, by_size: bool, pretrained: bool = False,
               lora: bool = False, pairs: bool = False) -> tuple[str, Recipe]:
    """The name and recipe of a run's model: ``LORA`` for ``lora`` on ``pretrained`` weights,
    ``FINE_TUNING`` for other ``pretrained`` ones (``DPO_LORA`` and ``DPO`` on preference ``pairs``), else its preset's or (``by_size``: a Hugging Face
    model) that of the dense preset nearest in parameter count."""
    if pretrained and pairs:
        return ("LoRA DPO", DPO_LORA) if lora else ("DPO", DPO)
    if pretrained:
        return ("LoRA", LORA) if lora else ("fine-tuning", FINE_TUNING)
    if not by_size:
        return preset, RECIPES[preset]
    n = flops.param_counts(shape)["total"]
    dense = [name for name, cfg in PRESETS.items() if not cfg.num_experts]
    name = min(dense, key=lambda k: abs(math.log(flops.param_counts(PRESETS[k])["total"] / n)))
    return f"{name}-sized", RECIPES[name]
