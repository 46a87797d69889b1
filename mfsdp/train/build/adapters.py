"""What a LoRA run (``--peft.method lora``) saves: its checkpoints hold the adapters and their
optimizer state only (the frozen base is the ``--model.hf`` directory's, read again on resume and
export), so they, their host staging and the disk check are sized by the trainable parameters."""

from __future__ import annotations

import torch

from mfsdp.transforms.lora import LoraTransform, lora_linears
from mfsdp.transforms.lora_export import hf_target_modules, peft_adapter_config
from mfsdp.train.run.config import PeftSection, RunConfig


def lora_transform(peft: PeftSection) -> LoraTransform:
    """The LoraTransform of the ``--peft`` section (which must name ``--peft.method lora``)."""
    return LoraTransform(r=peft.lora_r, alpha=float(peft.lora_alpha), dropout=float(peft.lora_dropout),
                         target_modules=peft.target_modules, use_rslora=peft.use_rslora)


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters: its checkpoints then hold only its trainable state."""
    return bool(lora_linears(model))


def checkpointed_numel(model: torch.nn.Module) -> int:
    """This rank's elements of the parameters a checkpoint of ``model`` holds (a DTensor: its
    shard): the trainable ones of a LoRA model, else all."""
    adapters_only = has_adapters(model)
    return sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel()
               for q in model.parameters() if q.requires_grad or not adapters_only)


def adapter_record(cfg: RunConfig, model: torch.nn.Module) -> dict | None:
    """The PEFT adapter config that a LoRA run's checkpoints record (``CheckpointMeta.peft``), with
    the base directory and the adapted linears in Hugging Face names; None without adapters."""
    if not has_adapters(model):
        return None
    return peft_adapter_config(lora_transform(cfg.peft), hf_target_modules(model), cfg.model.hf)
