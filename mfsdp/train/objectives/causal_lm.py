"""The causal language model's objective, for pretraining and fine-tuning alike: the cross entropy
of each next token, summed over the targets a batch counts (-100: not counted, as a fine-tuning
sample's prompt) and normalised by the count of them in the global batch."""

from __future__ import annotations

import torch

from mfsdp.data import Batch
from mfsdp.models.llama import Llama
from mfsdp.models.loss import cross_entropy_sum
from mfsdp.models.outputs import logits_of
from mfsdp.train.objectives.base import Objective, to_device


class CausalLM(Objective):
    """Reports ``loss`` (validation: ``val_loss``, ``val`` in the log lines), normalised by ``loss_tokens``."""

    metrics = ("loss",)
    count_name = "loss_tokens"
    line_names = {"val_loss": "val"}
    axis_names = {"loss": "cross-entropy loss (nats/token)"}

    def global_count(self, sampler, step: int) -> int:
        return sampler.loss_tokens(step)

    def __call__(self, model, batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The bundled model takes the positions and document ids of packed samples and computes the
        loss in its head (``Llama.loss_fn``); other models return logits."""
        bundled = isinstance(model, Llama)
        packed = ("positions", "document_ids") if bundled else ()  # what only the bundled model takes
        with torch.profiler.record_function("mfsdp.train.data"):
            inputs, targets = to_device(batch.inputs, device), to_device(batch.targets, device)
            extra = {name: to_device(value, device) for name in packed
                     if (value := getattr(batch, name)) is not None}
        if bundled:
            loss, count = model(inputs, labels=targets, **extra)
        else:
            logits = logits_of(model(inputs))
            with torch.profiler.record_function("mfsdp.train.loss"):
                loss, count = cross_entropy_sum(logits, targets)
        return loss, count, {"loss": loss}
