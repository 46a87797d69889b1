"""The LoRA math of what leaves a LoRA model (``mfsdp.transforms.lora``): PEFT's names and adapter config, and
the adapters merged into the weights. ``mfsdp.hf.export`` writes the files.

``save_peft_adapter`` writes a PEFT adapter directory (``mfsdp.hf.export.export_adapter``), so
``PeftModel.from_pretrained(base, DIR)`` (and the servers that read PEFT adapters) load it; it
needs ``safetensors``, not ``peft``. ``merged_state_dict`` folds the adapters into the weights, and
``merge_updates`` does so tensor by tensor for ``mfsdp.hf.export.export_merged``.

The keys are PEFT's (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), in the
Hugging Face layout of the base model: the bundled Llama uses the same rotate-half rotary layout as
Hugging Face's Llama, Qwen2 and Mistral, so no adapter row is permuted.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from mfsdp.transforms.adapter_names import ADAPTERS, is_adapter
from mfsdp.hf.export import export_adapter
from mfsdp.hf.names import hf_module_name
from mfsdp.transforms.lora import LoraTransform, candidate_linears, lora_linears

__all__ = ["adapter_state_dict", "merged_state_dict", "merge_weight", "merge_updates", "peft_key", "peft_state_dict",
           "hf_target_modules", "peft_adapter_config", "lora_of", "save_peft_adapter"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor is gathered: a collective every rank must join)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter matrix of ``model``, whole, under the model's names (``layers.0.attention.wq.lora_A``)."""
    return {f"{name}.{which}": _whole(getattr(m, which)) for name, m in lora_linears(model) for which in ADAPTERS}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, whole, with every LoRA linear's weight replaced by W + scale * B @ A
    (summed in fp32, cast to W's dtype) and no adapter tensors: the fine-tuned model as a plain
    one, under the model's own names. Untargeted parameters are the model's values unchanged."""
    merged = {id(m.weight): m for _, m in lora_linears(model)}
    out = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        weight = _whole(param)
        linear = merged.get(id(param))
        if linear is not None:
            weight = merge_weight(weight, _whole(linear.lora_A), _whole(linear.lora_B), linear.lora_scale)
        out[name] = weight
    return out


def merge_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """W + scale * B @ A, summed in fp32 and cast to ``dtype`` (None: W's own)."""
    delta = lora_B.float() @ lora_A.float()
    return (weight.float() + scale * delta).to(dtype or weight.dtype)


def merge_updates(adapters: dict[str, torch.Tensor], lora: LoraTransform) -> dict[str, Callable[..., torch.Tensor]]:
    """Per adapted weight's Hugging Face name (``model.layers.0.self_attn.q_proj.weight``), the
    ``merge_weight`` of its adapters (``adapters``: whole, under the model's names) with ``lora``'s scale."""
    modules = {name.rpartition(".")[0] for name in adapters}
    return {f"{hf_module_name(m)}.weight": functools.partial(
        merge_weight, lora_A=adapters[f"{m}.lora_A"], lora_B=adapters[f"{m}.lora_B"], scale=lora.scale)
        for m in modules}


def peft_key(name: str) -> str:
    """PEFT's state-dict key of the adapter ``name`` (``layers.0.attention.wq.lora_A`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), on either model."""
    module, _, which = name.rpartition(".")
    if which not in ADAPTERS:
        raise ValueError(f"{name!r} is not a LoRA adapter (its last name is not lora_A or lora_B)")
    return f"base_model.model.{hf_module_name(module)}.{which}.weight"


def hf_target_modules(model: nn.Module) -> list[str]:
    """PEFT's ``target_modules`` for the adapted linears of ``model``, in Hugging Face names: the
    short names (``q_proj``) when they select exactly the adapted linears, else the full names."""
    targets = {hf_module_name(name) for name, _ in lora_linears(model)}
    short = {t.rpartition(".")[2] for t in targets}
    selected = {hf_module_name(n) for n, _ in candidate_linears(model)
                if hf_module_name(n).rpartition(".")[2] in short}
    return sorted(short) if selected == targets else sorted(targets)


def peft_adapter_config(lora: LoraTransform, target_modules: list[str],
                        base_model_name_or_path: str | None = None) -> dict:
    """PEFT's ``LoraConfig`` keys for ``lora`` (those a PEFT LoRA adapter config carries; PEFT
    fills any other key with its default)."""
    return {"base_model_name_or_path": base_model_name_or_path, "peft_type": "LORA", "task_type": "CAUSAL_LM",
            "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.use_rslora,
            "target_modules": target_modules, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "revision": None}


def lora_of(config: dict) -> LoraTransform:
    """The LoraTransform a PEFT adapter config (``peft_adapter_config``) records, as its scale needs."""
    return LoraTransform(r=config["r"], alpha=config["lora_alpha"], use_rslora=config["use_rslora"])


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``adapters`` (whole, under the model's names: ``layers.0.attention.wq.lora_A``) under PEFT's keys."""
    return {peft_key(name): t for name, t in adapters.items()}


def save_peft_adapter(model: nn.Module, lora: LoraTransform, out_dir: str | Path,
                      base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``model``'s adapters (made by ``lora``) as a PEFT adapter directory ``out_dir`` and
    return it. ``dtype`` None keeps the adapters' own dtype (fp32 main weights under mfsdp).
    Sharded adapters are gathered whole (a collective: every rank calls; rank 0 writing is the
    caller's choice, as the files are the same on every rank)."""
    adapters = adapter_state_dict(model)
    if not adapters:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to save; apply LoraTransform first")
    config = peft_adapter_config(lora, hf_target_modules(model), base_model_name_or_path)
    return export_adapter(Path(out_dir), peft_state_dict(adapters), config, dtype).path
