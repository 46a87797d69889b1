"""``estimate(model_or_config, ...)``: the public entry of the memory planner."""

from __future__ import annotations

import functools
import json
import os
from typing import Optional, Union

import torch
from torch import nn

from mfsdp.communication import CommunicationPolicy
from mfsdp.memory.activations import ActivationProfile, measure_hf, measure_llama
from mfsdp.memory.estimate import MemoryEstimate, StepSettings, simulate
from mfsdp.memory.model_state import Levels, describe_units
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.placement import Placements

PLACEMENT_NAMES = ("zero3", "zero2", "zero1", "ddp", "hsdp", "hfsdp")


def mesh_for(placements: str, world_size: int, replicate: int = 1) -> tuple[Placements, dict]:
    """The placements a name stands for and the mesh shape ``parallelize`` / the manager build."""
    if placements not in PLACEMENT_NAMES:
        raise ValueError(f"unknown placements {placements!r}; use one of {', '.join(PLACEMENT_NAMES)}")
    if placements in ("hsdp", "hfsdp"):
        if world_size % replicate:
            raise ValueError(f"replicate={replicate} must divide the world size {world_size}")
        return (getattr(Placements, placements)("dp_replicate", "dp_shard"),
                {"dp_replicate": replicate, "dp_shard": world_size // replicate})
    return getattr(Placements, placements)("dp"), {"dp": world_size}


def estimate(model_or_config, *, world_size: Optional[int] = None, mesh_shape: Optional[dict] = None,
             placements: Union[str, Placements] = "zero3", replicate: int = 1,
             mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
             communication_policy: Optional[CommunicationPolicy] = None,
             local_batch: int = 1, seq_len: int = 4096, microbatches: int = 1,
             activation_checkpointing: bool = False, optimizer: str = "adamw", foreach: bool = True,
             compute_dtype: torch.dtype = torch.bfloat16, expert_units: bool = False,
             device: str = "cuda") -> MemoryEstimate:
    """Predict one rank's memory over a training step and its peak.

    ``model_or_config``: a bundled preset name ("8b"), a ``LlamaConfig``, a model built on the meta
    device (the bundled Llama, or a Hugging Face causal LM), a Hugging Face config, or a local Hugging
    Face directory (its config.json; data-parallel only). ``placements``: a name with ``world_size``
    (and ``replicate`` for hsdp/hfsdp), or a ``Placements`` with ``mesh_shape`` ({axis: size}).
    ``device``: "cuda" counts the cuBLAS workspaces, the allocator reserve and the CUDA context.
    """
    if isinstance(placements, str):
        if world_size is None:
            raise ValueError("estimate: give world_size with a placement name (or a Placements and mesh_shape)")
        placements, mesh_shape = mesh_for(placements, world_size, replicate)
    elif mesh_shape is None:
        raise ValueError("estimate: a Placements object needs mesh_shape={axis: size}")
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    comm = communication_policy or CommunicationPolicy()
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer {optimizer!r} is not modelled; use 'adamw' or 'sgd'")
    levels = Levels.of(placements, mesh_shape)
    model, units, blocks, measure = _resolve(model_or_config, compute_dtype, seq_len, expert_units)
    unit_bytes = describe_units(model, units, policy, levels)
    acts = measure(local_batch, seq_len, activation_checkpointing)
    world = 1
    for size in mesh_shape.values():
        world *= size
    settings = StepSettings(placements.name, world, local_batch, seq_len, microbatches, activation_checkpointing,
                            optimizer, foreach, comm.prefetch_depth if comm.overlap else 0, comm.double_buffer,
                            device == "cuda")
    return simulate(unit_bytes, acts, settings, blocks)


def _resolve(obj, dtype, seq_len, expert_units):
    """(meta model, non-root units bottom-up, block names, activation measurement)."""
    from mfsdp.models import LlamaConfig, get_config

    if isinstance(obj, str) and not os.path.isdir(obj):
        obj = get_config(obj)
    if isinstance(obj, LlamaConfig):
        return _llama(obj, dtype, seq_len, expert_units)
    if isinstance(obj, nn.Module) and hasattr(obj, "cfg") and hasattr(obj, "layers"):
        return _llama(obj.cfg, dtype, seq_len, expert_units, model=obj)
    if isinstance(obj, (str, os.PathLike)) or hasattr(obj, "to_json_string") or isinstance(obj, nn.Module):
        return _hf(obj, dtype)
    raise TypeError(f"estimate: cannot size a {type(obj).__name__}; pass a preset name, a LlamaConfig, a "
                    "meta-device model, a Hugging Face config or a local Hugging Face directory")


def _llama(cfg, dtype, seq_len, expert_units, model=None):
    import dataclasses

    from mfsdp.models import build_model
    from mfsdp.models.parallelize import sharding_units

    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))
    if model is None:
        with torch.device("meta"):
            model = build_model(cfg, dtype=dtype)
    units = sharding_units(model, expert_units=expert_units)
    blocks = [f"layers.{i}" for i in range(len(model.layers))]
    dtype = next(model.parameters()).dtype
    return model, units, blocks, lambda b, s, ac: _llama_acts(cfg, dtype, b, s, ac)


@functools.lru_cache(maxsize=64)
def _llama_acts(cfg, dtype, batch, seq, ac) -> ActivationProfile:
    return measure_llama(cfg, dtype, batch, seq, ac)


def _hf(obj, dtype):
    from mfsdp.manager.core_options import resolve_unit_modules
    from mfsdp.manager.hf_checkpoint import meta_model_from_config

    model = obj if isinstance(obj, nn.Module) else meta_model_from_config(obj, dtype=dtype)
    units = [m for _, m in resolve_unit_modules(model)]
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(m)] for m in units[::-1]]
    config_json = model.config.to_json_string()
    dtype = next(model.parameters()).dtype
    return model, units, blocks, lambda b, s, ac: _hf_acts(config_json, dtype, b, s, ac)


@functools.lru_cache(maxsize=64)
def _hf_acts(config_json, dtype, batch, seq, ac) -> ActivationProfile:
    import transformers

    data = json.loads(config_json)
    config = transformers.AutoConfig.for_model(**data)
    return measure_hf(config, dtype, batch, seq, ac)
