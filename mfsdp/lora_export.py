"""What leaves a LoRA model (``mfsdp.transforms.lora``): PEFT adapter directories and merged weights.

``save_peft_adapter`` writes ``adapter_model.safetensors`` and ``adapter_config.json`` as ``peft``
does, so ``PeftModel.from_pretrained(base, DIR)`` (and the servers that read PEFT adapters) load
them; it needs ``safetensors``, not ``peft``. ``merged_state_dict`` folds the adapters into the
weights, for a plain Hugging Face directory of the fine-tuned model.

The keys are PEFT's (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), in the
Hugging Face layout of the base model: the bundled Llama uses the same rotate-half rotary layout as
Hugging Face's Llama, Qwen2 and Mistral, so no adapter row is permuted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mfsdp.transforms.lora import ADAPTERS, LoraTransform, candidate_linears, hf_module_name, is_adapter, lora_linears

__all__ = ["ADAPTER_WEIGHTS", "ADAPTER_CONFIG", "adapter_state_dict", "merged_state_dict", "merge_weight", "peft_key",
           "hf_target_modules", "peft_adapter_config", "save_peft_adapter", "write_peft_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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
    return write_peft_adapter(adapters, config, out_dir, dtype)


def write_peft_adapter(adapters: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
                       dtype: torch.dtype | None = None) -> Path:
    """Write ``adapters`` (whole, under the model's names: ``layers.0.attention.wq.lora_A``) under
    PEFT's keys, in ``dtype`` (None: their own), and ``config`` (``peft_adapter_config``) as the PEFT
    adapter directory ``out_dir``; the one writer of both the live and the offline export."""
    from safetensors.torch import save_file

    tensors = {peft_key(name): t.to(dtype or t.dtype).cpu().contiguous() for name, t in adapters.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
