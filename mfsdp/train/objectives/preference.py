"""Preference tuning's objective: trl's losses (``mfsdp.models.preference_loss``: sigmoid/DPO, ipo,
hinge, simpo, sft) on the summed answer log-probs of a batch of pairs (``mfsdp.data.pair_packing``),
normalised by the pairs of the global batch, with trl's metric names.

The reference needs no second model in memory: with LoRA it is the same model with its adapters
off (``adapters_off``), run first in the same step under no_grad; with full fine-tuning it is the
initial model's log-probs, computed once before training (``reference.ReferenceLogps``); SimPO has
none."""

from __future__ import annotations

import functools

import torch

from mfsdp.data import Batch
from mfsdp.models.answer_logps import PairLogps, answer_logps
from mfsdp.models.llama import Llama
from mfsdp.models.outputs import logits_of
from mfsdp.models.preference_loss import pair_metrics
from mfsdp.memory.activations import StepRun
from mfsdp.train.objectives.base import Objective, to_device
from mfsdp.train.objectives.reference import ReferenceLogps
from mfsdp.transforms.lora import adapters_off

PACKED_ONLY = ("positions", "document_ids", "branch_ids")
"""The batch fields only the bundled model takes: the packed shared-prompt layout."""


def pair_logps(model, batch: Batch, device: torch.device) -> PairLogps:
    """The summed answer log-probs of ``batch``'s pairs under ``model``: the bundled model returns its
    logits when given no labels, a Hugging Face model an output object that holds them."""
    bundled = isinstance(model, Llama)
    with torch.profiler.record_function("mfsdp.train.data"):
        inputs, answers = to_device(batch.inputs, device), to_device(batch.answers, device)
        extra = {name: to_device(value, device) for name in PACKED_ONLY
                 if bundled and (value := getattr(batch, name)) is not None}
    logits = logits_of(model(inputs, **extra))
    with torch.profiler.record_function("mfsdp.train.loss"):
        return answer_logps(logits, answers, batch.pair_ids.numel())


def _planned_step(lora_reference: bool, packed: bool, tokens: torch.Tensor):
    """``StepRun.run`` of a DPO step on (fake) ``tokens``: every token an answer token, the rejected
    rows beside the chosen ones on the padded layout."""
    rows = tokens if packed else torch.cat([tokens, tokens])
    flat = torch.arange(rows.numel())
    answers = torch.stack([flat, rows.flatten(), flat % 2])
    batch = Batch(inputs=rows, targets=rows, answers=answers, pair_ids=torch.zeros(1, dtype=torch.int64))

    def run(model):
        policy = pair_logps(model, batch, rows.device)
        if lora_reference:
            with torch.no_grad(), adapters_off(model):
                pair_logps(model, batch, rows.device)
        return (policy.chosen - policy.rejected).sum()
    return run


class Preference(Objective):
    """Reports trl's ``loss``, ``rewards/*`` and ``logps/*`` (validation: ``val_`` before each), means
    over ``pairs``."""

    metrics = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
               "logps/chosen", "logps/rejected")
    count_name = "pairs"
    line_names = {"val_loss": "val", "rewards/accuracies": "acc", "val_rewards/accuracies": "val_acc",
                  "rewards/margins": "margin", "val_rewards/margins": "val_margin"}
    axis_names = {"loss": "preference loss (mean over pairs)"}

    def __init__(self, cfg, data):
        self.loss = cfg.dpo.loss()
        self.cfg, self.lora = cfg, cfg.peft.lora
        self.stored = ReferenceLogps(cfg, data) if self.loss.needs_reference and not self.lora else None
        self.chosen_per_pair = {True: None, False: None}
        """``sft``'s divisor (``PairWindows.chosen_per_pair``), by whether gradients are on: the step's
        global batch's (set by ``global_count``), the validation pairs' (``prepare``); None: the batch's."""

    def global_count(self, sampler, step: int) -> int:
        windows = sampler.global_windows(step)
        self.chosen_per_pair[True] = sampler.windows.chosen_per_pair(windows)
        return int(sampler.windows.counted[windows].sum())  # the pairs of the global batch

    def step_run(self) -> StepRun:
        """A window of seq_len tokens, all answer tokens (an upper bound on the fp32 log-softmax: answer
        tokens x vocabulary), two rows a pair on the manager's padded layout; with LoRA, the reference's
        no-grad forward, measured after the policy's (an upper bound: it runs first, before anything is
        saved). The stored reference's pass runs before training, a no-grad forward: less than a step."""
        return StepRun(f"DPO on preference pairs ({self.cfg.dpo.describe(self.lora).partition('(')[2]}",
                       functools.partial(_planned_step, self.lora and self.loss.needs_reference,
                                         not self.cfg.model.uses_manager),
                       "DPO: windows of preference pairs, all tokens counted as answer tokens (their fp32 "
                       "log-softmax), an upper bound" + (" with the base model's no-grad reference forward"
                                                         if self.lora and self.loss.needs_reference else ""))

    def prepare(self, model, sampler, evaluator, log) -> None:
        if evaluator is not None:
            self.chosen_per_pair[False] = evaluator.windows.windows.chosen_per_pair()
        log("preference pairs packed with a shared prompt, the rejected answer hidden from the chosen one"
            if sampler.windows.packed else
            "preference pairs one a window, padded: [prompt | chosen] and [prompt | rejected] rows as trl stacks "
            "them (a model trained through the manager has no document attention to pack them)")
        if self.stored is not None:
            self.stored.prepare(model, sampler.windows, log, pair_logps)

    def __call__(self, model, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        reference = None
        if self.loss.needs_reference and self.stored is None:  # LoRA: the base, before the policy's forward
            with torch.no_grad(), adapters_off(model):
                reference = pair_logps(model, batch, device)
        policy = pair_logps(model, batch, device)
        if self.stored is not None:
            reference = self.stored.of(to_device(batch.pair_ids, device), policy)  # pinned, no host stall
        result = self.loss(policy, reference, self.chosen_per_pair[torch.is_grad_enabled()])
        loss = result.losses.sum()
        sums = {name: values.sum() for name, values in pair_metrics(policy, result).items()}
        return loss, torch.full((), batch.pair_ids.numel(), device=device), {"loss": loss, **sums}  # no H2D copy
