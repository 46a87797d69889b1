"""``mfsdp export`` of any checkpoint: a LoRA run's (``meta.json`` has ``peft``) as a PEFT adapter
directory, or with ``--peft.merge_on_export`` as the merged full Hugging Face model; any other as
``export.export_hf`` writes it.

Both read the checkpoint without a process group. The adapter directory is what
``mfsdp.lora_export.write_peft_adapter`` writes (the live ``save_peft_adapter`` writes the same), its
``adapter_config.json`` the PEFT config the run recorded. The merged model is the base directory's
weights, read again one tensor at a time, with ``scale * B @ A`` added to each target
(``lora_export.merge_weight``) and every other tensor as it is, plus the base's config.json,
tokenizer files, chat template and generation config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mfsdp.hf_io import SHARD_BYTES, Entry, WeightFiles, has_weights, write_weights
from mfsdp.transforms.lora import LoraTransform, hf_module_name, is_adapter
from mfsdp.lora_export import ADAPTER_WEIGHTS, merge_weight, write_peft_adapter
from mfsdp.train.checkpoint import CheckpointMeta
from mfsdp.train.export import (MODEL, Exported, ExportError, _dtype_name, _source_config, _write_tokenizer,
                                checkpoint_dtype, export_hf, read_tensors, recorded_run, resolve_checkpoint)
from mfsdp.train.generation_config import write_generation_config


def export_checkpoint(source: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = SHARD_BYTES, merge: bool | None = None) -> Exported:
    """Write checkpoint ``source`` (or a run directory's newest) to ``out_dir`` in ``dtype`` (None:
    ``checkpoint_dtype``): a LoRA run's as a PEFT adapter directory or, with ``merge`` (None: the
    run's ``--peft.merge_on_export``), the merged model; any other run's as ``export_hf``."""
    checkpoint = resolve_checkpoint(source)
    meta = CheckpointMeta.read(checkpoint)
    if meta.peft is None:
        return export_hf(checkpoint, out_dir, dtype, max_shard_bytes)
    run, dtype, out = recorded_run(checkpoint, meta), dtype or checkpoint_dtype(meta), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapters = read_adapters(checkpoint)
    if (run.get("peft") or {}).get("merge_on_export") if merge is None else merge:
        return _export_merged(run, meta, adapters, dtype, out, max_shard_bytes)
    write_peft_adapter(adapters, meta.peft, out, dtype)
    tokenizer = _write_tokenizer(run, {}, out)
    return Exported(out, "PEFT LoRA adapter", len(adapters), 1, (out / ADAPTER_WEIGHTS).stat().st_size,
                    tokenizer, base=meta.peft.get("base_model_name_or_path") or "BASE")


def read_adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every adapter matrix of a LoRA checkpoint, whole, under the model's names
    (``layers.0.attention.wq.lora_A``), read without a process group."""
    reader = dcp.FileSystemReader(checkpoint)
    saved = reader.read_metadata().state_dict_metadata
    keys = [key for key in saved if key.startswith(MODEL) and is_adapter(key)]
    if not keys:
        raise ExportError(f"checkpoint {checkpoint} is recorded as a LoRA checkpoint but holds no adapter "
                          "(lora_A, lora_B); export another checkpoint of the run")
    return {key[len(MODEL):]: tensor for key, tensor in read_tensors(reader, saved, keys).items()}


def _deltas(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of every adapted linear by its weight's Hugging Face name (``model.layers.0.self_attn.q_proj.weight``)."""
    modules = {name.rpartition(".")[0] for name in adapters}
    return {f"{hf_module_name(m)}.weight": (adapters[f"{m}.lora_A"], adapters[f"{m}.lora_B"]) for m in modules}


def _export_merged(run: dict, meta: CheckpointMeta, adapters: dict, dtype: torch.dtype, out: Path,
                   max_shard_bytes: int) -> Exported:
    """The base directory's model with the adapters merged in, as a Hugging Face model directory."""
    base = meta.peft.get("base_model_name_or_path")
    if not base or not has_weights(base):
        raise ExportError(f"merging the LoRA adapters needs the base model's weights, but the run's base "
                          f"directory {base!r} has none now; restore it, or export the adapter alone with "
                          "--peft.merge_on_export false")
    peft = meta.peft
    scale = LoraTransform(r=peft["r"], alpha=peft["lora_alpha"], use_rslora=peft["use_rslora"]).scale
    deltas = _deltas(adapters)
    with WeightFiles(base) as files:
        missing = sorted(set(deltas) - set(files.files))
        if missing:
            raise ExportError(f"the base directory {base} has no {missing[:4]}, which the adapters were trained "
                              "on; was it replaced by another model? Restore the run's base directory")
        entries = [_entry(files, name, dtype) for name in files.files]

        def read(entry: Entry) -> torch.Tensor:
            weight = files.get_slice(entry.name)[:]
            if entry.name in deltas:
                return merge_weight(weight, *deltas[entry.name], scale, entry.dtype)
            return weight

        count = write_weights(out, entries, read, max_shard_bytes)
    config = {**_source_config(run, meta), "dtype": _dtype_name(dtype), "torch_dtype": _dtype_name(dtype)}
    tokenizer = _write_tokenizer(run, config, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_generation_config(config, run["model"].get("hf"), out)
    return Exported(out, config.get("architectures", ["?"])[0], len(entries), count,
                    sum(e.nbytes for e in entries), tokenizer)


def _entry(files: WeightFiles, name: str, dtype: torch.dtype) -> Entry:
    """The written entry of base tensor ``name``: floating point in ``dtype``, any other in its own."""
    view = files.get_slice(name)
    floating = view.get_dtype().startswith(("F", "BF"))
    return Entry(name, tuple(view.get_shape()), dtype if floating else view[:].dtype)
