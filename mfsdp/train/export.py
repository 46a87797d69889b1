"""``mfsdp export``: a training checkpoint out as a Hugging Face model directory.

``export_hf(CHECKPOINT_OR_RUN_DIR, OUT_DIR)`` writes ``config.json``, ``generation_config.json``
(``generation_config.py``), the weights as safetensors (``model.safetensors``, or numbered files of at
most ``max_shard_bytes`` plus ``model.safetensors.index.json``; in ``checkpoint_dtype`` unless told) and
a tokenizer: a ``--model.hf`` run's directory's tokenizer files and chat template as they are, where that
directory still has them, else the tokenizer the run's token file was made with (if any);
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads the trained model. A model-only checkpoint (``--train.save_only_model``, bf16 or fp32)
exports as a full one does.

* ``--model.hf`` runs go back out as the architecture they came in as, with the config.json they
  came in with (recorded in the checkpoint). Through the manager the parameter names are the
  model's own, matched to the checkpoint by the manager's rules (``mfsdp.manager.hf_checkpoint``:
  tied weights written once under their first name, the base-model prefix added or removed); on
  the bundled route the bundled names go out under the Hugging Face ones
  (``mfsdp.models.hf_weights.hf_weight_names``, the table the weights came in by).
* The bundled Llama goes out as ``LlamaForCausalLM``: the same rotate-half RoPE (no q/k
  permutation is needed, unlike Meta's interleaved checkpoints), ``rope_theta``, ``rms_norm_eps``
  and tied embeddings carried over. The mixtures of experts go out as ``MixtralForCausalLM``, whose
  routing is theirs exactly: a bias-free router, softmax over all experts, the top k renormalised
  to sum to one, SwiGLU experts, no shared expert (``mfsdp.models.moe``). A checkpoint holding a
  tensor that neither architecture has a place for is refused, naming it.

The checkpoint is read without a process group (``torch.distributed.checkpoint.load`` with
``no_dist=True``), one tensor at a time, straight into the safetensors file being written, so the
export holds one tensor (plus its cast) in memory however large the model, and needs only one
process whatever world size saved it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mfsdp.hf_io import SHARD_BYTES, Entry, write_weights
from mfsdp.models.hf_config import ARCHITECTURES, bundled_config_from_hf, hf_config_of
from mfsdp.models.hf_weights import hf_weight_names
from mfsdp.train.checkpoint import META, CheckpointMeta, find_latest, is_complete
from mfsdp.train.generation_config import write_generation_config

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODEL = "model."  # the checkpoint's prefix of the model state (mfsdp.train.checkpoint)


class ExportError(Exception):
    """An export problem the user can fix; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Exported:
    path: Path
    architecture: str
    tensors: int
    files: int
    nbytes: int
    tokenizer: str | None
    """The directory whose tokenizer was copied, or None (the byte tokenizer, or a token file gone)."""
    base: str | None = None
    """A PEFT adapter directory's base model directory; None: a whole model."""


def resolve_checkpoint(source: str | Path) -> Path:
    """A checkpoint directory, or the newest whole one of a run directory (or its checkpoints/)."""
    source = Path(source)
    if is_complete(source):
        return source
    for root in (source / "checkpoints", source):
        if root.is_dir() and (found := find_latest(root)) is not None:
            return found
    raise ExportError(f"{source} is neither a checkpoint (a step_N directory with {META}) nor a run "
                      "directory holding a whole one under checkpoints/; pass --train.out_dir of a "
                      "run, or one of its checkpoints")


def export_hf(source: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
              max_shard_bytes: int = SHARD_BYTES) -> Exported:
    """Write checkpoint ``source`` (or a run directory's newest) to ``out_dir`` as a Hugging Face
    model directory, in ``dtype`` (None: ``checkpoint_dtype``); no process group, one tensor in
    memory at a time."""
    checkpoint = resolve_checkpoint(source)
    meta = CheckpointMeta.read(checkpoint)
    run = recorded_run(checkpoint, meta)
    if meta.peft is not None:
        raise ExportError(f"checkpoint {checkpoint} holds LoRA adapters only; export it with `mfsdp export` "
                          "(mfsdp.train.export_lora.export_checkpoint), which writes a PEFT adapter or merges it")
    dtype = dtype or checkpoint_dtype(meta)
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if _section(run).uses_manager:
        config, plan, covered = _hf_plan(run, meta, saved, dtype, out)
    else:
        config, plan = _bundled_hf_plan(run, meta, dtype) if run["model"].get("hf") else _bundled_plan(run, dtype)
        covered = {key for _, key in plan} | {MODEL + "output.weight"}  # a tied head: the embedding
    _refuse_unplaced(saved, plan, covered, config["architectures"][0], checkpoint)
    tokenizer = _write_tokenizer(run, config, out)
    entries = [Entry(name, tuple(saved[key].size), dtype if saved[key].properties.dtype.is_floating_point
                     else saved[key].properties.dtype) for name, key in plan]
    keys, reader = dict(plan), dcp.FileSystemReader(checkpoint)

    def read(entry: Entry) -> torch.Tensor:
        return read_tensors(reader, saved, [keys[entry.name]])[keys[entry.name]]

    files = write_weights(out, entries, read, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_generation_config(config, run["model"].get("hf"), out)
    return Exported(out, config["architectures"][0], len(entries), files,
                    sum(e.nbytes for e in entries), tokenizer)


def recorded_run(checkpoint: Path, meta: CheckpointMeta) -> dict:
    """The run config that checkpoint ``checkpoint`` (whose record is ``meta``) was written by."""
    run = meta.config
    if not isinstance(run, dict) or "model" not in run:
        raise ExportError(f"{checkpoint / META} holds no run config (written by an older mfsdp); "
                          "resume the run for a step with this mfsdp to write a checkpoint that has one")
    return run


def read_tensors(reader: dcp.FileSystemReader, saved: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors ``keys`` (``saved``: the checkpoint's metadata), read without a
    process group."""
    state = {key: torch.empty(saved[key].size, dtype=saved[key].properties.dtype) for key in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def checkpoint_dtype(meta: CheckpointMeta) -> torch.dtype:
    """The dtype an export of a checkpoint defaults to: a model-only one's weights', else the run's
    --train.save_dtype where it named one, else bf16."""
    if meta.model_only:
        return DTYPES[meta.weights_dtype]
    return DTYPES.get(((meta.config or {}).get("train") or {}).get("save_dtype"), torch.bfloat16)


# ------------------------------------------------------------------------- bundled models
def _section(run: dict):
    """The checkpoint's recorded ``--model`` section."""
    from mfsdp.train.config import ConfigError, ModelSection

    try:
        return ModelSection.recorded(run["model"])
    except (ConfigError, TypeError) as err:
        raise ExportError(f"the checkpoint's recorded model config is not one this mfsdp reads ({err})") from None


def model_config_of(run: dict, hf_config: dict | None = None):
    """The bundled model's LlamaConfig from a checkpoint's recorded run config; a --model.hf run on
    the bundled route's from its recorded ``hf_config`` (the source directory need not exist)."""
    from mfsdp.train.config import ConfigError

    try:
        seq_len = int(run["data"]["seq_len"])
        if hf_config is not None:
            return bundled_config_from_hf(hf_config, seq_len)
        return _section(run).llama_config(max_seq_len=seq_len)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        raise ExportError(f"the checkpoint's recorded model config does not build a model ({err})") from None


def _bundled_plan(run: dict, dtype: torch.dtype) -> tuple[dict, list[tuple[str, str]]]:
    c = model_config_of(run)
    return hf_config_of(c, _dtype_name(dtype)), _bundled_names(c)


def _bundled_hf_plan(run: dict, meta: CheckpointMeta, dtype: torch.dtype) -> tuple[dict, list[tuple[str, str]]]:
    """A --model.hf run trained as the bundled Llama: its source's config.json, with the export's
    dtype, and the bundled names under the Hugging Face ones."""
    raw = _source_config(run, meta)
    c = model_config_of(run, raw)
    config = {**raw, "dtype": _dtype_name(dtype), "torch_dtype": _dtype_name(dtype)}
    config.setdefault("architectures", [ARCHITECTURES[raw["model_type"]]])
    return config, _bundled_names(c)


def _bundled_names(c) -> list[tuple[str, str]]:
    """(Hugging Face name, checkpoint key) of every tensor of the bundled model of ``c``."""
    return [(name, MODEL + key) for name, key in hf_weight_names(c)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _refuse_unplaced(saved: dict, plan: list[tuple[str, str]], covered: set[str], architecture: str,
                     checkpoint: Path) -> None:
    """Refuse a plan that misses a tensor the architecture needs or leaves a trained one behind;
    ``covered``: every checkpoint key the plan accounts for (tied aliases included)."""
    missing = [key for _, key in plan if key not in saved]
    if missing:
        raise ExportError(f"checkpoint {checkpoint} lacks {sorted(missing)[:4]} that {architecture} needs; "
                          "was it written for another model? Export the run's own checkpoint")
    extra = sorted(k for k in saved if k.startswith(MODEL) and k not in covered)
    if extra:
        raise ExportError(f"checkpoint {checkpoint} holds {extra[:4]}, which {architecture} has no place "
                          "for, so the export would drop trained weights; this model cannot be exported "
                          "to Hugging Face as it is")


# ------------------------------------------------------------------------- --model.hf runs
def _hf_plan(run: dict, meta: CheckpointMeta, saved: dict, dtype: torch.dtype, out: Path):
    """The Hugging Face model's own names (the manager's matching rules), and its config."""
    try:
        import transformers
    except ImportError:
        raise ExportError("exporting a --model.hf run needs the transformers package; "
                          "pip install transformers") from None
    from mfsdp.manager.hf_checkpoint import _candidate_keys, _model_tensors, meta_model_from_config

    (out / "config.json").write_text(json.dumps(_source_config(run, meta)))
    config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
    model = meta_model_from_config(config)
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan, missing, covered = [], [], set()
    for names, tensor in _model_tensors(model):
        candidates = [MODEL + k for k in _candidate_keys(names, prefix)]
        covered.update(candidates)
        key = next((k for k in candidates if k in saved), None)
        if key is None:
            if isinstance(tensor, torch.nn.Parameter):
                missing.append(names[0])
            continue  # a persistent buffer the checkpoint lacks keeps its default
        plan.append((names[0], key))
    if missing:
        raise ExportError(f"the checkpoint lacks {missing[:4]} of {type(model).__name__}; export the run's "
                          "own checkpoint")
    config.dtype = dtype
    exported = config.to_dict()
    exported["architectures"] = [type(model).__name__]
    exported["dtype"] = exported["torch_dtype"] = _dtype_name(dtype)
    return exported, plan, covered


def _source_config(run: dict, meta: CheckpointMeta) -> dict:
    """The config.json a --model.hf run trained: the checkpoint's record, else (a checkpoint from
    before it was recorded) the source directory's."""
    if meta.hf_config is not None:
        return meta.hf_config
    source = Path(run["model"]["hf"])
    if not (source / "config.json").is_file():
        raise ExportError(f"the run trained --model.hf {source}, whose config.json is gone, and the "
                          "checkpoint predates recording it; restore that directory to export")
    return json.loads((source / "config.json").read_text())


# ------------------------------------------------------------------------------ tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
"""Hugging Face's file names of a tokenizer and its chat template, as ``save_pretrained`` writes them."""


def _write_tokenizer(run: dict, config: dict, out: Path) -> str | None:
    """The run's tokenizer into ``out``: a ``--model.hf`` directory's tokenizer files as they are,
    where it still has any (its config.json has the special ids), else the token file's tokenizer,
    its special ids into ``config``. Returns the directory it came from, or None."""
    hf = run["model"].get("hf")
    files = [Path(hf) / name for name in TOKENIZER_FILES if hf and (Path(hf) / name).is_file()]
    for file in files:
        shutil.copyfile(file, out / file.name)
    if files:
        return hf
    tokenizer = _tokenizer(run)
    if tokenizer is not None:
        config.update(tokenizer.special_ids())
        tokenizer.save(out)
    elif not hf:
        config["eos_token_id"] = 256  # the byte tokenizer's end of document
    return tokenizer.name if tokenizer else None


def _tokenizer(run: dict):
    """The Hugging Face tokenizer the run's token file was made with, or None (bytes, or no file)."""
    from mfsdp.data import STDLIB, DataError, TokenFile
    from mfsdp.data.tokenizer import HuggingFaceTokenizer

    path = run.get("data", {}).get("path")
    try:
        name = TokenFile(path).tokenizer if path != STDLIB else None  # the demo corpus is bytes
    except (DataError, TypeError, OSError):
        return None
    return HuggingFaceTokenizer(name) if name and Path(name).is_dir() else None


def exported_line(done: Exported) -> str:
    """What ``mfsdp export`` and ``--train.export_hf`` print."""
    tokenizer = f", tokenizer from {done.tokenizer}" if done.tokenizer else ""
    if done.base is not None:
        return (f"wrote a PEFT LoRA adapter to {done.path}: {done.tensors} tensors, {done.nbytes / 1e6:,.1f} MB"
                f"{tokenizer}; load it with peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM."
                f"from_pretrained({done.base!r}), {str(done.path)!r})")
    return (f"wrote {done.architecture} to {done.path}: {done.tensors} tensors, "
            f"{done.nbytes / 1e6:,.1f} MB in {done.files} safetensors file(s){tokenizer}; load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(done.path)!r})")
