"""Hugging Face (transformers) models, sharded by mfsdp: load slice by slice, save consolidated.

* :func:`load_hf_weights` fills an mfsdp-sharded model (typically built on the meta device) from a
  local safetensors directory. Every rank opens the files itself and reads only the rows and
  columns of each tensor that its shards hold (``mfsdp.hf.files.read_local``): no rank-0 broadcast,
  and no rank ever holds a whole model.
* :func:`save_hf_checkpoint` gathers one parameter at a time (``DTensor.full_tensor()``, a
  collective on every rank) and rank 0 streams it into consolidated safetensors
  (``mfsdp.hf.files.write_weights``) plus ``config.json``, which ``transformers`` ``from_pretrained``
  loads.
* :func:`init_weights_shard_local` initialises a meta-built sharded model without a checkpoint,
  shard by shard, with values that do not depend on the mesh (see its docstring).
* :func:`materialize_meta_buffers` re-creates buffers left on the meta device (RoPE ``inv_freq``).

Which global indices a rank owns is ``mfsdp.hf.files.local_indices``'s rule: FSDP over dp, TP
colwise/rowwise, and TP then FSDP on the same dim (strided shards) alike. The files themselves are
``mfsdp.hf.files``'s; this module holds the manager's rules for matching a model's names to a
checkpoint's (``candidate_keys``: tied aliases, the base-model prefix), which ``mfsdp export``
follows too.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp.transforms.adapter_names import is_adapter
from mfsdp.hf.files import SHARD_BYTES, Entry, HFWeightsError, WeightFiles, local_indices, read_local, write_weights
from mfsdp.hf.moe_names import ExpertLayout, by_expert, disk_name, exported_names, layout_of, on_disk, piece_reader
from mfsdp.runtime.parameter_group import local_tensor

logger = logging.getLogger("mfsdp.manager")


# ----------------------------------------------------------------------------------- load
def candidate_keys(names: list[str], prefix: str) -> list[str]:
    """Checkpoint keys that may hold a model tensor: its own names (tied aliases included), then the
    same with the base-model prefix added or removed (a base model saved, a head model loaded)."""
    out = list(names)
    if prefix:
        for n in names:
            out.append(n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}")
    return list(dict.fromkeys(out))


def file_keys(files: WeightFiles, names: list[str], shape, prefix: str, layout: Optional[ExpertLayout]) -> list[str]:
    """``candidate_keys``, then those as a mixture of experts' checkpoint spells them
    (``mfsdp.hf.moe_names``): renamed, or a stacked tensor's per-expert tensors (``files.stack``)."""
    keys = candidate_keys(names, prefix)
    stacks = [files.stack(by_expert(pieces)) for pieces in (on_disk(k, shape, layout) for k in keys) if pieces]
    return list(dict.fromkeys(keys + [disk_name(k, layout) for k in keys] + stacks))


def model_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Every parameter once (with all its names) and every persistent buffer."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    out = list(by_id.values())
    for mod_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if name not in skip and buf is not None:
                out.append(([f"{mod_name}.{name}" if mod_name else name], buf))
    return out


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, *, strict: bool = True) -> list[str]:
    """Fill a sharded model from a local HF safetensors directory; each rank reads only its slices.

    Works for a model sharded with :func:`mfsdp.fully_shard` (alone or through the manager, with or
    without tensor parallelism) and for a plain unsharded model. Tied weights are read once, under
    any of their names. Checkpoint keys may carry or lack the model's ``base_model_prefix``.
    The compute weights are refreshed afterwards. Returns the checkpoint keys nobody used.
    Raises :class:`mfsdp.hf.files.HFWeightsError` (a ``KeyError``; ``strict``) when a parameter has no
    tensor or a different shape, naming them, before anything is written. No collective is issued.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    param_ids = {id(p) for p in model.parameters()}
    # A persistent buffer may be absent (HF omits many), and LoRA adapters are not in a base checkpoint
    # (init_adapters draws them): neither is missing.
    layout = layout_of(model)
    with WeightFiles(path) as files:
        wanted = [(file_keys(files, names, tensor.shape, prefix, layout), tensor, names[0],
                   names[0] if id(tensor) in param_ids and not is_adapter(names[0]) else None)
                  for names, tensor in model_tensors(model)]
        plan, missing, mismatched, used = files.match(wanted, "the model's")
        if strict and (missing or mismatched):
            raise HFWeightsError.of(path, missing=missing, mismatched=mismatched)
        for tensor, found, name in plan:
            read_local(tensor, found, name)
        unused = sorted(set(files.files) - used)
    refresh_compute_weights(model)
    if unused:
        logger.info("load_hf_weights: %d checkpoint tensors not used: %s", len(unused), unused[:8])
    return unused


def refresh_compute_weights(model: nn.Module) -> None:
    """After writing main weights directly: re-derive every FsdpModule's compute weights."""
    from mfsdp import FsdpModule

    for module in model.modules():
        if isinstance(module, FsdpModule):
            module.refresh_model_weights()


# ----------------------------------------------------------------------------------- save
def save_hf_checkpoint(model: nn.Module, path: str, *, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = SHARD_BYTES, save_config: bool = True) -> None:
    """Export consolidated HF safetensors (and ``config.json``) that ``from_pretrained`` loads.

    A collective: call it on every rank. Parameters are gathered one at a time with
    ``full_tensor()`` and rank 0 writes each as it arrives, into files of at most ``max_shard_bytes``
    (one ``model.safetensors``, or numbered files plus ``model.safetensors.index.json``). Tied
    weights are written once, under their first name, as ``save_pretrained`` does. ``dtype``
    defaults to ``model.dtype`` (the compute dtype for a managed model).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype, layout = dtype or getattr(model, "dtype", None), layout_of(model)
    sources = {key: (tensor, piece) for names, tensor in model_tensors(model)
               for key, piece in exported_names(names[0], tensor.shape, layout)}
    entries = [Entry(key, piece.shape(t.shape) if piece else tuple(t.shape),
                     dtype if dtype is not None and t.is_floating_point() else t.dtype)
               for key, (t, piece) in sources.items()]
    # Keyed by the tensor itself (hashed by identity): a stacked one is gathered once for its experts.
    gather = torch.no_grad()(piece_reader(sources, lambda t: t.full_tensor() if isinstance(t, DTensor) else t))

    if rank != 0:
        for entry in entries:  # the same collectives, in the same order, as rank 0's writer
            gather(entry)
    else:
        os.makedirs(path, exist_ok=True)
        write_weights(path, entries, gather, max_shard_bytes)
        config = getattr(model, "config", None)
        if save_config and config is not None and hasattr(config, "save_pretrained"):
            if dtype is not None and hasattr(config, "dtype"):
                config.dtype = dtype
            config.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------- meta-built models
def _target_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return local_tensor(p).device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def materialize_meta_buffers(model: nn.Module, device: Optional[torch.device] = None) -> list[str]:
    """Give buffers still on the meta device storage on ``device`` and recompute them.

    Hugging Face rotary embeddings (non-persistent ``inv_freq``) are recomputed by the model's own
    ``_init_weights`` on that buffer-only module; any other meta buffer is zero-filled if it is
    persistent (a checkpoint load then fills it), and is an error if it is not (nothing could ever
    set it). Parameters are never touched. Returns the names of the buffers handled.
    """
    device = device or _target_device(model)
    done, unknown = [], []
    for mod_name, module in model.named_modules():
        meta = [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not meta:
            continue
        for name, buf in meta:
            setattr(module, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
        has_params = next(module.parameters(recurse=False), None) is not None
        init = getattr(model, "_init_weights", None)
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        if "RotaryEmbedding" in type(module).__name__ and init is not None and not has_params:
            init(module)
        else:
            unknown += [f"{mod_name}.{n}" for n, _ in meta if n in non_persistent]
        done += [f"{mod_name}.{n}" for n, _ in meta]
    if unknown:
        raise NotImplementedError(
            f"non-persistent buffers {unknown} were built on the meta device and mfsdp does not know how to "
            "recompute them; build the model with them materialised, or set them after parallelize")
    return done


def _stable_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights_shard_local(model: nn.Module, *, seed: int = 0, std: Optional[float] = None,
                             rows_per_block: int = 64) -> None:
    """Initialise every parameter shard by shard, identically on any mesh (no communication).

    The documented simple init, matching what Hugging Face's default ``_init_weights`` gives Llama
    and Qwen models: matrices (>= 2-D) ~ N(0, std) with ``std = config.initializer_range`` (0.02
    if absent); 1-D parameters whose name contains ``norm`` = 1; other 1-D parameters (biases) = 0.
    The normal values of each block of ``rows_per_block`` global rows come from a generator seeded
    by (seed, parameter name, block), so a rank draws only the blocks its rows fall in, and the
    result is the same at every world size and layout, sharded or not.
    """
    if std is None:
        std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
    for name, p in model.named_parameters():  # each tied weight once, under its first name
        dst = local_tensor(p)
        if p.ndim < 2:
            dst.fill_(1.0 if "norm" in name.lower() else 0.0)
            continue
        indices = local_indices(p)
        if indices is None:
            continue
        rows, rest = indices[0], indices[1:]
        gen = torch.Generator(device="cpu")
        out = torch.empty(dst.shape, dtype=torch.float32)
        row_shape = p.shape[1:]
        for block in sorted({int(r) // rows_per_block for r in rows.tolist()}):
            lo = block * rows_per_block
            hi = min(lo + rows_per_block, p.shape[0])
            gen.manual_seed(_stable_seed(seed, name, block))
            values = torch.empty((hi - lo, *row_shape)).normal_(0.0, std, generator=gen)
            pick = ((rows >= lo) & (rows < hi)).nonzero().reshape(-1)
            sub = values.index_select(0, rows[pick] - lo)
            for d, idx in enumerate(rest, start=1):
                sub = sub.index_select(d, idx)
            out.index_copy_(0, pick, sub)
        dst.copy_(out.to(dst.device, dst.dtype))
    refresh_compute_weights(model)


def meta_model_from_config(config, *, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A Hugging Face causal LM built on the meta device from a config (or a local directory)."""
    import transformers

    if isinstance(config, (str, os.PathLike)):
        config = transformers.AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype is not None \
            else transformers.AutoModelForCausalLM.from_config(config)
    return model
