"""Preference losses: per-pair summed answer log-probs -> per-pair losses and rewards.

Pure functions of tensors, as trl 1.16 computes them (``DPOTrainer._compute_loss``, and
``CPOTrainer.cpo_loss`` for SimPO): no model, mask or batch. With ``mean`` of the returned
per-pair losses over a global batch of pairs the objective is trl's ``loss``.

* ``sigmoid``: DPO, -log sigmoid(beta * margin), the margin being the policy-minus-reference
  difference of the chosen and rejected sums; with ``label_smoothing`` e it is conservative DPO,
  -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m), as trl's CPO trainer and trl < 1.0's DPO
  apply it (trl 1.16's DPO trainer reads label_smoothing only for its robust/exo/aot losses).
* ``hinge``: relu(1 - beta * margin).
* ``ipo``: each answer's log-ratio divided by its token count, (mean margin - 1 / (2 beta))^2.
* ``simpo``: reference-free, on per-token means: conservative sigmoid of mean(chosen) -
  mean(rejected) - gamma / beta (trl's CPO trainer, loss_type simpo, cpo_alpha 0).
* ``sft``: trl's NLL of the chosen answers, a mean over the batch's chosen tokens; per pair,
  -sum(chosen) / (the batch's chosen tokens per pair), so that the mean over pairs is that.

Rewards (logged as trl's ``rewards/*``): beta * (policy - reference) of the sums; without a
reference (SimPO), beta times the policy's per-token means, as trl's CPO logs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mfsdp.models.answer_logps import PairLogps

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "sft")
"""Names ``loss_type`` takes; KTO and ORPO are not built (they need other data or terms)."""
REFERENCE_FREE = frozenset({"simpo", "sft"})


class PreferenceLosses(NamedTuple):
    losses: torch.Tensor
    """(pairs,): the weighted sum of each loss type's per-pair loss."""
    chosen_rewards: torch.Tensor
    """(pairs,), detached."""
    rejected_rewards: torch.Tensor


def conservative_sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(beta x), a fraction ``label_smoothing`` of it for the flipped label."""
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing)


def per_token(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed log-probs divided by their token counts (at least 1)."""
    return logps / tokens.clamp(min=1)


@dataclass(frozen=True)
class PreferenceLoss:
    """trl's preference-loss settings, with its names and defaults; called on per-pair log-probs."""

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    """One per loss type; None for 1 each."""
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self):
        unknown = [name for name in self.loss_type if name not in LOSS_TYPES]
        if unknown or not self.loss_type:
            raise ValueError(f"unknown dpo loss_type {', '.join(map(repr, unknown)) or '(none)'}; "
                             f"known: {', '.join(LOSS_TYPES)} (KTO and ORPO are not built)")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"dpo loss_weights has {len(self.loss_weights)} values for "
                             f"{len(self.loss_type)} loss types {', '.join(self.loss_type)}; give one each")
        if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo needs beta > 0 and 0 <= label_smoothing < 0.5, not "
                             f"{self.beta} and {self.label_smoothing}")

    @property
    def needs_reference(self) -> bool:
        """False for SimPO (with or without the sft term), which has no reference model."""
        return not ("simpo" in self.loss_type and set(self.loss_type) <= REFERENCE_FREE)

    def __call__(self, policy: PairLogps, reference: PairLogps | None = None,
                 chosen_tokens_per_pair: float | torch.Tensor | None = None) -> PreferenceLosses:
        """Per-pair losses and rewards. ``chosen_tokens_per_pair``: the global batch's chosen
        tokens over its pairs, which ``sft`` divides by (default: these pairs')."""
        if reference is None and self.needs_reference:
            raise ValueError(f"dpo loss_type {', '.join(self.loss_type)} needs the reference "
                             "model's log-probs")
        weights = self.loss_weights or (1.0,) * len(self.loss_type)
        losses = sum(weight * self._loss(name, policy, reference, chosen_tokens_per_pair)
                     for name, weight in zip(self.loss_type, weights))
        if reference is None:
            chosen = per_token(policy.chosen, policy.chosen_tokens)
            rejected = per_token(policy.rejected, policy.rejected_tokens)
        else:
            chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        return PreferenceLosses(losses, self.beta * chosen.detach(), self.beta * rejected.detach())

    def _loss(self, name: str, policy: PairLogps, reference: PairLogps | None,
              chosen_tokens_per_pair) -> torch.Tensor:
        beta = self.beta
        if name == "simpo":
            margin = (per_token(policy.chosen, policy.chosen_tokens)
                      - per_token(policy.rejected, policy.rejected_tokens) - self.simpo_gamma / beta)
            return conservative_sigmoid(margin, beta, self.label_smoothing)
        if name == "sft":
            per_pair = chosen_tokens_per_pair
            if per_pair is None:
                per_pair = policy.chosen_tokens.sum() / policy.chosen_tokens.numel()
            return -policy.chosen / per_pair
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if name == "sigmoid":
            return conservative_sigmoid(chosen - rejected, beta, self.label_smoothing)
        if name == "hinge":
            return torch.relu(1 - beta * (chosen - rejected))
        margin = per_token(chosen, policy.chosen_tokens) - per_token(rejected, policy.rejected_tokens)
        return (margin - 1 / (2 * beta)) ** 2  # ipo


def pair_metrics(policy: PairLogps, result: PreferenceLosses) -> dict[str, torch.Tensor]:
    """Per pair, detached, under trl's metric names; their means over pairs are trl's values."""
    chosen, rejected = result.chosen_rewards, result.rejected_rewards
    return {"rewards/chosen": chosen, "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected, "rewards/accuracies": (chosen > rejected).float(),
            "logps/chosen": policy.chosen.detach(), "logps/rejected": policy.rejected.detach()}
