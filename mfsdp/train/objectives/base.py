"""The base of training objectives (see ``mfsdp.train.objectives``) and the batch's way onto the device."""

from __future__ import annotations

import torch

from mfsdp.data import Batch
from mfsdp.memory.activations import StepRun


class Objective:
    """The base of every objective: its names, and no first pass over the data."""

    metrics: tuple[str, ...]
    """The names of the metric sums ``__call__`` returns, in order; the first is the headline (the
    progress bar's, the plot's first panel)."""
    count_name: str
    """What the count is, as the step record names it (and its rate, ``{count_name}_per_s``)."""
    line_names: dict[str, str] = {}
    """Shorter names of record keys in the log lines (by default the key itself)."""
    axis_names: dict[str, str] = {}
    """Each metric's axis label on the plot (by default its name)."""

    def global_count(self, sampler, step: int) -> int:
        """What the loss of ``step`` is normalised by: the count over the whole global batch."""
        raise NotImplementedError

    def step_run(self) -> StepRun | None:
        """What the memory planner measures of a step (``mfsdp.memory.StepRun``); None: the causal
        language model's loss, as the planner measures it by default."""
        return None

    def prepare(self, model, sampler, evaluator, log) -> None:
        """A first pass over the data before training (say, storing reference values); none here."""

    def __call__(self, model, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(the fp32 loss summed over ``batch``, with gradients where enabled; ``batch``'s count; ``{name:
        sum}`` for each of ``metrics``), 0-dim tensors on ``device``, after running the model on ``batch``.
        A forward without gradients (a reference) goes before the one with them: the step reads a
        mixture of experts' load-balancing loss off the latest forward."""
        raise NotImplementedError

    def summary(self, record: dict, digits: int) -> str:
        """The metrics of ``record`` as a log line shows them: the training ones, then the validation ones."""
        keys = [*self.metrics, *(f"val_{name}" for name in self.metrics)]
        return ", ".join(f"{self.line_names.get(k, k)} {record[k]:.{digits}f}" for k in keys if k in record)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy of a batch: from pinned memory and non-blocking on CUDA, so it overlaps
    the work already queued instead of waiting for it."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
