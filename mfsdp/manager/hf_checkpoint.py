"""Hugging Face checkpoints for sharded models: load slice by slice, export consolidated.

* :func:`load_hf_weights` fills an mfsdp-sharded model (typically built on the meta device) from a
  local safetensors directory. Every rank opens the files itself and reads only the rows and
  columns of each tensor that its shards hold (``safe_open(...).get_slice(name)[a:b, c:d]``): no
  rank-0 broadcast, and no rank ever holds a whole model.
* :func:`save_hf_checkpoint` gathers one parameter at a time (``DTensor.full_tensor()``, a
  collective on every rank) and rank 0 writes consolidated safetensors plus ``config.json``, which
  ``transformers`` ``from_pretrained`` loads.
* :func:`init_weights_shard_local` initialises a meta-built sharded model without a checkpoint,
  shard by shard, with values that do not depend on the mesh (see its docstring).
* :func:`materialize_meta_buffers` re-creates buffers left on the meta device (RoPE ``inv_freq``).

Which global indices a rank owns is derived from each parameter's DTensor placements and this
rank's mesh coordinate, one index vector per sharded dimension (cheap: one integer per row or
column): FSDP over dp, TP colwise/rowwise, and TP then FSDP on the same dim (strided shards) are
handled alike, and the result is checked against ``to_local()``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat
from mfsdp.runtime.parameter_group import local_tensor

logger = logging.getLogger("mfsdp.manager")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


class CheckpointKeyError(KeyError):
    """The checkpoint lacks tensors the model needs (or has a different shape for one)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


# ------------------------------------------------------------------------------ ownership
def _is_shard(placement) -> bool:
    return hasattr(placement, "dim") and (placement.is_shard() or _compat.is_strided_shard(placement))


def local_indices(param: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Per dimension, the global indices of ``param``'s local block (None: this rank holds nothing).

    A plain tensor owns everything. For a DTensor, each sharded dim's ``arange`` is cut with
    ``torch.chunk`` semantics (DTensor's), mesh dim by mesh dim: first the plain ``Shard``
    placements, then the strided ones, which by definition split what the others left (tensor
    parallel first, then FSDP on the same dim). The result is checked against ``to_local()``.
    """
    shape = tuple(param.shape)
    full = [torch.arange(n) for n in shape]
    if not isinstance(param, DTensor):
        return full
    local_shape = tuple(param.to_local().shape)
    if 0 in local_shape:
        return None
    mesh, placements = param.device_mesh, param.placements
    coord = mesh.get_coordinate()
    shards = [(a, pl) for a, pl in enumerate(placements) if _is_shard(pl)]
    strided = [(a, pl) for a, pl in shards if _compat.is_strided_shard(pl)]
    plain = [(a, pl) for a, pl in shards if not _compat.is_strided_shard(pl)]
    for axis, pl in plain + strided:
        pieces = full[pl.dim].chunk(mesh.size(axis))
        full[pl.dim] = pieces[coord[axis]] if coord[axis] < len(pieces) else full[pl.dim][:0]
    if tuple(len(i) for i in full) != local_shape:
        raise NotImplementedError(
            f"cannot map the local shard of a parameter of shape {shape} with placements {placements} to global "
            f"indices (computed {tuple(len(i) for i in full)}, local shape {local_shape})")
    return full


def _span(idx: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
    """(start, stop, None) for a contiguous run, else the enclosing range and the offsets into it."""
    start, stop = int(idx.min()), int(idx.max()) + 1
    if stop - start == idx.numel() and bool((idx == torch.arange(start, stop)).all()):
        return start, stop, None
    return start, stop, idx - start


def _read_block(tensor_slice, indices: list[torch.Tensor]) -> torch.Tensor:
    """Read only the block ``indices`` describes from a safetensors slice."""
    spans = [_span(i) for i in indices]
    block = tensor_slice[tuple(slice(a, b) for a, b, _ in spans)] if spans else tensor_slice[:]
    for d, (_, _, offsets) in enumerate(spans):
        if offsets is not None:
            block = block.index_select(d, offsets)
    return block


# ----------------------------------------------------------------------------------- load
def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a local HF checkpoint directory (single file or index)."""
    index = os.path.join(path, SAFE_INDEX)
    single = os.path.join(path, SAFE_WEIGHTS)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (a local Hugging Face "
                            "safetensors directory is needed; .bin checkpoints are not supported)")


def has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SAFE_INDEX)) or os.path.isfile(os.path.join(path, SAFE_WEIGHTS))


def _candidate_keys(names: list[str], prefix: str) -> list[str]:
    """Checkpoint keys that may hold a model tensor: its own names (tied aliases included), then the
    same with the base-model prefix added or removed (a base model saved, a head model loaded)."""
    out = list(names)
    if prefix:
        for n in names:
            out.append(n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}")
    return list(dict.fromkeys(out))


def _model_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
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
    Raises :class:`CheckpointKeyError` (``strict``) when a parameter has no tensor or a different
    shape, naming them all. No collective is issued.
    """
    from safetensors import safe_open

    files = checkpoint_files(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan, missing, bad_shape = [], [], []
    param_ids = {id(p) for p in model.parameters()}
    for names, tensor in _model_tensors(model):
        key = next((k for k in _candidate_keys(names, prefix) if k in files), None)
        if key is None:
            if id(tensor) in param_ids:  # a persistent buffer may be absent (HF omits many)
                missing.append(names[0])
            continue
        plan.append((key, names[0], tensor))
    used = {key for key, _, _ in plan}
    handles: dict[str, object] = {}
    try:
        for key, name, tensor in plan:
            filename = files[key]
            if filename not in handles:
                handles[filename] = safe_open(filename, framework="pt", device="cpu")
            sl = handles[filename].get_slice(key)
            if tuple(sl.get_shape()) != tuple(tensor.shape):
                bad_shape.append(f"{name}: checkpoint {tuple(sl.get_shape())} vs model {tuple(tensor.shape)}")
                continue
            indices = local_indices(tensor)
            if indices is None:
                continue
            dst = local_tensor(tensor)
            if dst.is_meta:
                raise RuntimeError(f"{name} is still on the meta device; shard the model (fully_shard or the "
                                   "manager) or materialize its buffers before loading")
            dst.copy_(_read_block(sl, indices).to(dst.dtype))
    finally:
        handles.clear()
    if strict and (missing or bad_shape):
        raise CheckpointKeyError(
            f"{path}: " + "; ".join(filter(None, [
                f"no tensor for {missing}" if missing else "",
                f"shape mismatch: {bad_shape}" if bad_shape else ""])))
    refresh_compute_weights(model)
    unused = sorted(set(files) - used)
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
                       max_shard_bytes: int = 5 * 2**30, save_config: bool = True) -> None:
    """Export consolidated HF safetensors (and ``config.json``) that ``from_pretrained`` loads.

    A collective: call it on every rank. Parameters are gathered one at a time with
    ``full_tensor()``; rank 0 keeps them on the CPU and writes files of at most ``max_shard_bytes``
    (one ``model.safetensors``, or numbered files plus ``model.safetensors.index.json``). Tied
    weights are written once, under their first name, as ``save_pretrained`` does. ``dtype``
    defaults to ``model.dtype`` (the compute dtype for a managed model).
    """
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = dtype or getattr(model, "dtype", None)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for names, tensor in _model_tensors(model):
        with torch.no_grad():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank != 0:
            continue
        # One copy, owned by the file writer (never a view of a live parameter on CPU).
        value = full.detach().to("cpu", dtype if dtype is not None and full.is_floating_point() else full.dtype,
                                 copy=True).contiguous()
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][names[0]] = value
        size += nbytes
    if rank == 0:
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], os.path.join(path, SAFE_WEIGHTS), metadata=meta)
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(path, name), metadata=meta)
                for k, v in shard.items():
                    weight_map[k] = name
                    total += v.numel() * v.element_size()
            with open(os.path.join(path, SAFE_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
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
