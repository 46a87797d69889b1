"""Checkpoints on disk: the layout, saving and publishing, finding the newest whole one, loading.

Layout under ``OUT_DIR/checkpoints``::

    step_200/          a complete checkpoint: DCP shards, .metadata, meta.json
    step_300/
    latest             the name of the newest complete checkpoint ("step_300")

Every rank writes its shards with ``torch.distributed.checkpoint`` into a hidden ``.tmp-step_N``
directory. Only once all shards and the metadata are on disk, and rank 0 sees every rank's files
whole (nodes that do not share the directory would leave them elsewhere), does rank 0 write
``meta.json`` (``meta.py``), rename the directory to ``step_N`` and rewrite ``latest`` (through a
temp file and a rename). A crash before the rename leaves ``latest`` and the previous checkpoint untouched, so a
resume always finds a whole one; a checkpoint with a missing or truncated file is skipped, with a
note, in favour of the newest whole one. Each rank's random generators are saved under a key of
that rank and restored on resume, so dropout in Hugging Face models continues where it stopped.

With ``--train.save_only_model`` (``save_dtype``) a checkpoint holds the model's weights in that
dtype and the generators, not the optimizer: loading it casts the weights back to the fp32 main
weights and leaves the optimizer as it is, fresh.

A LoRA model's checkpoint holds its adapters and their optimizer state only (``meta.json``'s
``peft`` says so): its frozen base comes from the base directory, on resume as at the start.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from mfsdp import _compat
from mfsdp.transforms.lora import lora_linears
from mfsdp.train.checkpoint.meta import META, CheckpointMeta
from mfsdp.train.command.errors import CheckpointError, first_problem

LATEST = "latest"
RNG = "rng"  # the state-dict key of the ranks' random generator states
_PREFIX = "step_"
_TEMP_PREFIX = ".tmp-"


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished (its files are not yet checked)."""
    return (path / ".metadata").is_file() and (path / META).is_file()


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete and undamaged checkpoint under ``root``, or None."""
    return find_resumable(root)[0]


def find_resumable(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest complete, undamaged checkpoint under ``root`` (or None), and one note for each
    newer one skipped because a file of it is missing or truncated. ``latest`` is tried first; a
    hand-edited or missing marker falls back to the ``step_N`` directories, newest first."""
    root = Path(root)
    candidates = list(reversed(complete_checkpoints(root)))
    marker = root / LATEST
    if marker.is_file() and (named := root / marker.read_text().strip()) in candidates:
        candidates.remove(named)
        candidates.insert(0, named)
    notes = []
    for path in candidates:
        problem = damage(path)
        if problem is None:
            return path, _incomplete_notes(root, _step_of(path)) + notes
        notes.append(f"checkpoint {path} is damaged ({problem}); skipping it")
    return None, _incomplete_notes(root, -1) + notes


def _incomplete_notes(root: Path, after: int) -> list[str]:
    """One note per save newer than step ``after`` whose write never finished (the run was killed
    during it, say): only its temporary directory is there."""
    notes = []
    for temp in sorted(root.glob(_TEMP_PREFIX + _PREFIX + "*")):
        step = temp.name[len(_TEMP_PREFIX + _PREFIX):]
        if step.isdigit() and int(step) > after and temp.is_dir():
            notes.append(f"checkpoint {_PREFIX}{step} is incomplete (the run stopped while it "
                         f"was being written; only {temp} is there); skipping it")
    return notes


def damage(path: Path) -> str | None:
    """What is wrong with the files of checkpoint ``path``, or None when they are whole: each file
    ``meta.json`` lists against its recorded size (format 0 has no list: only the two markers)."""
    if not is_complete(path):
        return "no .metadata or meta.json"
    try:
        files = CheckpointMeta.read(path).files
    except CheckpointError as err:
        return str(err)
    for name, size in (files or {}).items():
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        if file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, {size} were written"
    return None


def check_compatible(path: Path, fingerprint: dict) -> CheckpointMeta:
    """The checkpoint's record, after checking it was written for a model of this ``fingerprint``."""
    meta = CheckpointMeta.read(path)
    differences = [f"{key}: checkpoint {meta.model.get(key)!r}, now {value!r}"
                   for key, value in fingerprint.items() if meta.model.get(key) != value]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written for a different model ({'; '.join(differences)}); "
            "resume with the same --model.* settings, or start fresh in another --train.out_dir")
    return meta


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: CheckpointMeta, keep: int = 2,
                    save_dtype: torch.dtype | None = None) -> Path:
    """Save model and optimizer state as ``root/step_{step}`` (with ``save_dtype``: the model's
    weights only, in that dtype); collective over all ranks."""
    root = Path(root)
    final, temp = paths(root, step)
    if damage(final) is None:
        # Only reachable by stopping again at the step just resumed from: the state on disk is the
        # state in memory, and rewriting it would open a window with no checkpoint.
        return final
    make_temp(root, final, temp)
    problem = None
    try:
        # DCP gathers every rank's write errors and raises them on all ranks alike.
        state = state_of(model, optimizer, model_only=save_dtype is not None)
        dcp.save(state if save_dtype is None else on_host(state, save_dtype), checkpoint_id=temp)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        problem = describe(err)
    publish_when_written(root, step, meta, keep, problem, save_dtype=save_dtype)
    return final


def paths(root: Path, step: int) -> tuple[Path, Path]:
    """The checkpoint directory of ``step`` and the temporary one its save writes into."""
    final = root / f"{_PREFIX}{step}"
    return final, root / f"{_TEMP_PREFIX}{final.name}"


def make_temp(root: Path, final: Path, temp: Path, group=None) -> None:
    """Rank 0 deletes the temporary directories of earlier saves that never finished (no other
    save is in flight now) and creates ``temp``; collective, raises on every rank if it failed."""
    problem = None
    if _rank() == 0:
        try:
            for debris in root.glob(_TEMP_PREFIX + "*"):  # of an earlier crashed save
                shutil.rmtree(debris, ignore_errors=True)
            temp.mkdir(parents=True)
        except OSError as err:
            problem = describe(err)
    raise_if_any(problem, root, final, temp, group)


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_only: bool = False) -> dict:
    """What a checkpoint holds: the model's and (unless ``model_only``) the optimizer's state dicts
    and the generators (a LoRA model's trainable state only)."""
    return {**_train_state(model, optimizer, model_only), RNG: _rng_state()}


def _train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_only: bool) -> dict:
    """The model's state dict and, unless ``model_only``, the optimizer's: a fresh optimizer is not
    even asked for one there, since torch would give it a step of its own to make it. A LoRA model's
    frozen base is left out (it is the base directory's, loaded again on resume): the adapters and
    their optimizer state are megabytes where the model is gigabytes."""
    state = {"model": get_model_state_dict(model, options=_options(model))}
    if not model_only:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def _options(model: torch.nn.Module) -> StateDictOptions:
    """The state-dict options of ``model``: a LoRA model's hold its trainable parameters only, and
    load into a model whose frozen base is already in place."""
    adapters_only = bool(lora_linears(model))
    return StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)


def _check_contents(path: Path, meta: CheckpointMeta, model: torch.nn.Module) -> None:
    """CheckpointError when ``path`` holds LoRA adapters and ``model`` has none, or the reverse."""
    adapters = bool(lora_linears(model))
    if adapters != (meta.peft is not None):
        held, now = ("LoRA adapters only", "trains every weight") if meta.peft else (
            "every weight (no LoRA adapters)", "is a LoRA model")
        raise CheckpointError(f"checkpoint {path} holds {held} but this run {now}; resume with the --peft.* "
                              "settings it was written with, or start fresh in another --train.out_dir")


def on_host(state: dict, dtype: torch.dtype) -> dict:
    """``state`` with its model's floating-point tensors copied to the host in ``dtype`` (a DTensor's
    shard, keeping its spec), one at a time: a synchronous model-only save needs no second copy of
    the weights on the device."""
    def cast(value):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return value
        if hasattr(value, "to_local"):
            return _compat.dtensor_with_local(value, value.to_local().to("cpu", dtype))
        return value.to("cpu", dtype)
    return {**state, "model": {key: cast(value) for key, value in state["model"].items()}}


def publish_when_written(root: Path, step: int, meta: CheckpointMeta, keep: int, problem: str | None,
                         group=None, save_dtype: torch.dtype | None = None) -> None:
    """Finish the save of ``step`` once every rank's write has ended (``problem``: why this rank's
    failed): CheckpointError on every rank when any failed, else rank 0 writes meta.json (a
    model-only checkpoint's with ``save_dtype``), publishes the checkpoint and prunes old ones.
    Collective over ``group``."""
    final, temp = paths(root, step)
    raise_if_any(problem, root, final, temp, group)
    if _rank() == 0:
        try:
            files = {p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()}
            problem = unseen_shard(temp, files)
            if problem is None:
                meta.published(step, files, save_dtype).write(temp)  # last: it marks the save complete
                _publish(temp, final)
        except OSError as err:
            problem = describe(err)
    raise_if_any(problem, root, final, temp, group)
    if _rank() == 0:
        _prune(root, keep, step)
    if dist.is_initialized():
        dist.barrier(group)


def unseen_shard(temp: Path, files: dict[str, int]) -> str | None:
    """Which file of another rank, of those DCP's ``.metadata`` names, rank 0 does not see whole
    among ``files`` (name: bytes) in ``temp``: on nodes that do not share the directory, it is on
    another node's disk, and publishing would make a checkpoint that cannot be loaded."""
    for item in (dcp.FileSystemReader(temp).read_metadata().storage_data or {}).values():
        if files.get(item.relative_path, -1) < item.offset + item.length:
            return (f"rank 0 does not see all of {item.relative_path} in {temp}: every node must write "
                    "into one --train.out_dir that all of them share")
    return None


def raise_if_any(problem: str | None, root: Path, final: Path, temp: Path, group=None) -> None:
    """CheckpointError on every rank when any rank saw ``problem`` (headed by a full disk, where
    its directory has next to nothing left); collective over ``group``."""
    first = first_problem(problem and full_disk(root, problem) + problem, group)
    if first is None:
        return
    if _rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
    previous = find_latest(root)
    kept = (f"the previous checkpoint {previous} is intact and is what --resume will load"
            if previous else "there is no earlier checkpoint")
    raise CheckpointError(f"saving checkpoint {final.name} failed ({first[1]}); {kept}. Free disk "
                          f"space or fix {root}'s permissions, then continue with --resume")


def full_disk(path: Path, problem: str) -> str:
    """"the disk is full (N bytes free on MOUNT): " when the file system of ``path`` has under 1 MiB
    free or ``problem`` says so (a full disk often surfaces as a short write, not as ENOSPC), else ""."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if free >= 2**20 and os.strerror(errno.ENOSPC) not in problem:
        return ""
    mount = Path(os.path.abspath(path))
    while not os.path.ismount(mount):
        mount = mount.parent
    return f"the disk is full ({free} bytes free on {mount}): "


def describe(err: BaseException) -> str:
    """The root cause of a failed save or load in one line: DCP wraps each rank's error."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {describe(inner)}"
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


def _publish(temp: Path, final: Path) -> None:
    """Make ``temp`` the checkpoint ``final`` and point ``latest`` at it, in that order."""
    shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover of the same name
    os.replace(temp, final)
    marker = final.parent / LATEST
    marker_temp = final.parent / (LATEST + ".tmp")
    marker_temp.write_text(final.name + "\n")
    os.replace(marker_temp, marker)


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete ``step_N`` directories under ``root``, oldest first (what pruning counts)."""
    return sorted((p for p in Path(root).glob(_PREFIX + "*")
                   if p.name[len(_PREFIX):].isdigit() and is_complete(p)), key=_step_of)


def _prune(root: Path, keep: int, published: int) -> None:
    """After publishing the checkpoint of step ``published`` (the one ``latest`` names, never deleted):
    delete those of later steps, left by a timeline this run abandoned (a damaged newest one skipped
    on resume), then all but the ``keep`` newest (0 keeps everything)."""
    saved = complete_checkpoints(root)
    older = [p for p in saved if _step_of(p) < published]
    stale = [p for p in saved if _step_of(p) > published]
    for old in stale + (older[:max(0, len(older) - keep + 1)] if keep > 0 else []):
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> CheckpointMeta:
    """Load ``path`` into the (sharded) model and optimizer (a model-only checkpoint: the model,
    the optimizer left untouched); returns its record. A failed load is a CheckpointError naming
    the rank and cause, on every rank (DCP raises on all)."""
    path = Path(path)
    meta = CheckpointMeta.read(path)
    _check_contents(path, meta, model)
    state = _train_state(model, optimizer, meta.model_only)
    rng = _saved_rng_state(path)
    if rng:
        state[RNG] = rng
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # a BaseException
        raise CheckpointError(f"loading checkpoint {path} failed ({describe(err)}); move it aside to "
                              "resume from the one before it") from None
    set_model_state_dict(model, state["model"], options=_options(model))
    if not meta.model_only:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    generators = rng.get(_rng_key(), {})
    if "cpu" in generators:
        torch.set_rng_state(generators["cpu"])
    if "cuda" in generators:
        torch.cuda.set_rng_state(generators["cuda"])
    return meta


def _rng_key() -> str:
    # One key per rank: DCP writes a key that several ranks hold only once, as replicated.
    return f"rank_{_rank()}"


def _rng_state() -> dict:
    """This rank's generator states: the CPU one, and the current GPU's once CUDA is in use."""
    generators = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators["cuda"] = torch.cuda.get_rng_state()
    return {_rng_key(): generators}


def _saved_rng_state(path: Path) -> dict:
    """The part of ``_rng_state()`` that checkpoint ``path`` holds for this rank, to load into:
    nothing for checkpoints written before the states were saved or by fewer ranks."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    mine = {key: value for key, value in _rng_state()[_rng_key()].items()
            if f"{RNG}.{_rng_key()}.{key}" in saved}
    return {_rng_key(): mine} if mine else {}
