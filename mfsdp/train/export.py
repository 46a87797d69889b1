"""``mfsdp export``: a training checkpoint out as a Hugging Face model directory, read here and
written by ``mfsdp.hf.export``.

``export_hf(CHECKPOINT_OR_RUN_DIR, OUT_DIR)`` writes ``config.json``, ``generation_config.json``, the
weights as safetensors (``model.safetensors``, or numbered files of at most ``max_shard_bytes`` plus
``model.safetensors.index.json``; in ``checkpoint_dtype`` unless told) and a tokenizer: a
``--model.hf`` run's directory's tokenizer files and chat template as they are, where that
directory still has them, else the tokenizer the run's token file was made with (if any); that
directory is the run's, found from any directory (``recorded_run``), or ``base``, one that moved;
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads the trained model. A
model-only checkpoint (``--train.save_only_model``, bf16 or fp32) exports as a full one does. A LoRA
run's checkpoint (``meta.json`` has ``peft``) goes out as a PEFT adapter directory, its
``adapter_config.json`` the PEFT config the run recorded, or with ``merge`` (default: the run's
``--peft.merge_on_export``) as the base directory's model with ``scale * B @ A`` added to each
target (``mfsdp.transforms.lora_export``).

* ``--model.hf`` runs go back out as the architecture they came in as, with the config.json they
  came in with (recorded in the checkpoint). Through the manager the parameter names are the
  model's own, matched to the checkpoint by the manager's rules (``mfsdp.hf.sharded.candidate_keys``:
  tied weights written once under their first name, the base-model prefix added or removed), a
  mixture of experts' stacked experts under the per-expert names its checkpoints store them by
  (``mfsdp.hf.moe_names``, the rule they were loaded by); on
  the bundled route the bundled names go out under the Hugging Face ones
  (``mfsdp.hf.names.hf_weight_names``, the table the weights came in by), the stacked experts of a
  mixture of experts by the same rule, under Mixtral's per-expert names.
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

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mfsdp.transforms.adapter_names import is_adapter
from mfsdp.hf.config import ARCHITECTURES, bundled_config_from_hf, hf_config_of
from mfsdp.hf.export import Exported, export_adapter, export_merged, export_model, tokenizer_files
from mfsdp.hf.files import SHARD_BYTES, Entry, HFWeightsError, has_weights, write_bytes
from mfsdp.hf.moe_names import exported_names, layout_of, piece_reader
from mfsdp.hf.names import hf_layout, hf_weight_names
from mfsdp.transforms.lora_export import lora_of, merge_updates, peft_state_dict
from mfsdp.train.checkpoint import META, CheckpointMeta, find_latest, is_complete
from mfsdp.train.run.config import DTYPES
from mfsdp.train.run.preflight import experts_layout_problem
from mfsdp.train.run.run_dir import recorded_identity

MODEL = "model."  # the checkpoint's prefix of the model state (mfsdp.train.checkpoint)


class ExportError(Exception):
    """An export problem the user can fix; the message names the fix."""


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
              max_shard_bytes: int = SHARD_BYTES, merge: bool | None = None, base: str | Path | None = None) -> Exported:
    """Write checkpoint ``source`` (or a run directory's newest) to ``out_dir`` as a Hugging Face
    model directory, in ``dtype`` (None: ``checkpoint_dtype``); a LoRA run's as a PEFT adapter or,
    with ``merge`` (None: the run's ``--peft.merge_on_export``), merged; ``base``: the base model
    directory in place of the run's (``recorded_run``). No process group, one tensor in memory at a time."""
    checkpoint = resolve_checkpoint(source)
    meta = CheckpointMeta.read(checkpoint)
    run = recorded_run(checkpoint, meta, base)
    dtype, out, hf = dtype or checkpoint_dtype(meta), Path(out_dir), run["model"].get("hf")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None if tokenizer_files(hf) else _tokenizer(run)
    if meta.peft is not None:
        return _export_lora(checkpoint, run, meta, out, dtype, max_shard_bytes, merge, tokenizer)
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    if _section(run).uses_manager:
        config, plan, covered = _hf_plan(run, meta, saved, dtype, out)
    else:
        config, plan = _bundled_plan(run, meta, saved, checkpoint)
        covered = {key for _, key, _ in plan} | {MODEL + "output.weight"}  # a tied head: the embedding
    _refuse_unplaced(saved, plan, covered, config["architectures"][0], checkpoint)
    if not hf and tokenizer is None:
        config["eos_token_id"] = 256  # the byte tokenizer's end of document
    entries = [Entry(name, piece.shape(saved[key].size) if piece else tuple(saved[key].size),
                     dtype if saved[key].properties.dtype.is_floating_point else saved[key].properties.dtype)
               for name, key, piece in plan]
    reader = dcp.FileSystemReader(checkpoint)
    read = piece_reader({name: (key, piece) for name, key, piece in plan},
                        lambda key: read_tensors(reader, saved, [key])[key])
    return export_model(out, entries, read, config, dtype, hf, tokenizer, max_shard_bytes)


def recorded_run(checkpoint: Path, meta: CheckpointMeta, base: str | Path | None = None) -> dict:
    """The run config that checkpoint ``checkpoint`` (whose record is ``meta``) was written by, its
    base directory and data path absolute, so that an export from any directory finds them: a
    relative one (recorded before they were absolute) as the run directory's ``run.json`` has it.
    ``base`` (``mfsdp export --model.hf``) stands for the base directory, one that moved."""
    run = meta.config
    if not isinstance(run, dict) or "model" not in run:
        raise ExportError(f"{checkpoint / META} holds no run config (written by an older mfsdp); "
                          "resume the run for a step with this mfsdp to write a checkpoint that has one")
    recorded = recorded_identity(checkpoint.parent.parent if checkpoint.parent.name == "checkpoints"
                                 else checkpoint.parent) or {}
    run = {section: dict(values) if isinstance(values, dict) else values for section, values in run.items()}
    for section, key in (("model", "hf"), ("data", "path")):
        if not Path(run[section].get(key) or "/").is_absolute() and recorded.get(f"{section}.{key}"):
            run[section][key] = recorded[f"{section}.{key}"]
    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise ExportError(f"--model.hf {base} is not a Hugging Face model directory (it has no config.json); "
                              "give the directory of the base model the run trained on")
        if not run["model"].get("hf"):
            raise ExportError("the run trained a bundled model, not a --model.hf directory; leave out --model.hf")
        run["model"]["hf"] = str(Path(base).resolve())
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
    """The dtype an export of a checkpoint defaults to: the end-of-run export's, which the checkpoint
    records (``RunConfig.weights_dtype``); for a checkpoint from before that record, a model-only
    one's weights', else the run's --train.save_dtype where it named one, else bf16."""
    if meta.export_dtype is not None:
        return DTYPES[meta.export_dtype]
    if meta.model_only:
        return DTYPES[meta.weights_dtype]
    return DTYPES.get(((meta.config or {}).get("train") or {}).get("save_dtype"), torch.bfloat16)


# ------------------------------------------------------------------------- bundled models
def _section(run: dict):
    """The checkpoint's recorded ``--model`` section."""
    from mfsdp.train.run.config import ConfigError, ModelSection

    try:
        return ModelSection.recorded(run["model"])
    except (ConfigError, TypeError) as err:
        raise ExportError(f"the checkpoint's recorded model config is not one this mfsdp reads ({err})") from None


def model_config_of(run: dict, hf_config: dict | None = None):
    """The bundled model's LlamaConfig from a checkpoint's recorded run config; a --model.hf run on
    the bundled route's from its recorded ``hf_config`` (the source directory need not exist)."""
    from mfsdp.train.run.config import ConfigError

    try:
        seq_len = int(run["data"]["seq_len"])
        if hf_config is not None:
            return bundled_config_from_hf(hf_config, seq_len)
        return _section(run).llama_config(max_seq_len=seq_len)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        raise ExportError(f"the checkpoint's recorded model config does not build a model ({err})") from None


def _bundled_plan(run: dict, meta: CheckpointMeta, saved: dict, checkpoint: Path) -> tuple[dict, list[tuple]]:
    """The config.json of a run of the bundled model (a --model.hf run's: its source's), and (Hugging
    Face name, checkpoint key, piece) of every tensor written (``saved``: the checkpoint's metadata): a
    whole tensor (piece None), or one expert's rows of a stacked one (``mfsdp.hf.moe_names``)."""
    if problem := experts_layout_problem(checkpoint, meta.model):
        raise ExportError(problem)
    raw = _source_config(run, meta) if run["model"].get("hf") else None
    c = model_config_of(run, raw)
    config = hf_config_of(c) if raw is None else {**raw, "dtype": None, "torch_dtype": None}  # in key order
    config.setdefault("architectures", [ARCHITECTURES.get(config["model_type"])])
    shape = {key: saved[key].size for key in saved if key.startswith(MODEL)}
    return config, [(name, MODEL + key, piece) for hf, key in hf_weight_names(c)
                    for name, piece in exported_names(hf, shape.get(MODEL + key, ()), hf_layout(c))]


def _refuse_unplaced(saved: dict, plan: list[tuple], covered: set[str], architecture: str,
                     checkpoint: Path) -> None:
    """Refuse a plan that misses a tensor the architecture needs or leaves a trained one behind;
    ``covered``: every checkpoint key the plan accounts for (tied aliases included)."""
    missing = [key for _, key, _ in plan if key not in saved]
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
    """(name, checkpoint key, piece) of every tensor the export writes, by the Hugging Face model's own
    names (the manager's matching rules; a stacked expert tensor's ``piece`` of it under each expert's
    name), its config, and the checkpoint keys accounted for."""
    try:
        import transformers
    except ImportError:
        raise ExportError("exporting a --model.hf run needs the transformers package; "
                          "pip install transformers") from None
    from mfsdp.hf.sharded import candidate_keys, meta_model_from_config, model_tensors

    write_bytes(out / "config.json", json.dumps(_source_config(run, meta)).encode())
    config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
    model = meta_model_from_config(config)
    prefix, layout = getattr(model, "base_model_prefix", "") or "", layout_of(model)
    plan, missing, covered = [], [], set()
    for names, tensor in model_tensors(model):
        candidates = [MODEL + k for k in candidate_keys(names, prefix)]
        covered.update(candidates)
        key = next((k for k in candidates if k in saved), None)
        if key is None:
            if isinstance(tensor, torch.nn.Parameter):
                missing.append(names[0])
            continue  # a persistent buffer the checkpoint lacks keeps its default
        plan += [(name, key, piece) for name, piece in exported_names(names[0], tensor.shape, layout)]
    if missing:
        raise ExportError(f"the checkpoint lacks {missing[:4]} of {type(model).__name__}; export the run's "
                          "own checkpoint")
    config.dtype = dtype
    exported = config.to_dict()
    exported["architectures"] = [type(model).__name__]
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


# --------------------------------------------------------------------------------- LoRA runs
def _export_lora(checkpoint: Path, run: dict, meta: CheckpointMeta, out: Path, dtype: torch.dtype,
                 max_shard_bytes: int, merge: bool | None, tokenizer) -> Exported:
    """A LoRA checkpoint as a PEFT adapter directory, or with ``merge`` merged into its base."""
    adapters, hf = read_adapters(checkpoint), run["model"].get("hf")
    if not ((run.get("peft") or {}).get("merge_on_export") if merge is None else merge):
        return export_adapter(out, peft_state_dict(adapters), {**meta.peft, "base_model_name_or_path": hf}, dtype,
                              hf, tokenizer)
    if not hf or not has_weights(hf):
        raise ExportError(f"merging the LoRA adapters needs the base model's weights, but the base directory "
                          f"{hf} has none; give the base model's directory with --model.hf DIR, or export the "
                          "adapter alone with --peft.merge_on_export false")
    try:
        return export_merged(out, hf, merge_updates(adapters, lora_of(meta.peft)), dict(_source_config(run, meta)),
                             dtype, hf, tokenizer, max_shard_bytes)
    except HFWeightsError as err:
        raise ExportError(str(err)) from None


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


# ------------------------------------------------------------------------------ tokenizer
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
