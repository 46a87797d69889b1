"""Will the checkpoints fit on disk? ``mfsdp train`` asks before its first step.

A save that fails for want of space comes after the training it was meant to keep, hours into a
long run (an 8b checkpoint is 96 GB: fp32 main weights and two AdamW moments; 16 GB with
``--train.save_only_model`` in bf16). So before any worker starts, the launcher sizes one
checkpoint (``checkpoint.checkpoint_bytes`` of the model's parameters; a LoRA run's of its adapters'
only, which is all its checkpoints hold), counts how many the run
holds at once, adds the export when one is asked for, and compares that with the free space of
``--train.out_dir`` (its nearest existing ancestor, when it does not exist yet). Not even one
checkpoint fits: ``ConfigError``, one line, exit 2. Not all of them fit: a warning line, and the run
starts. Either line says how many fit, and names ``--train.save_only_model true`` where the full
state does not fit but the model's weights would. ``--train.skip_disk_check true`` skips the check.

DCP writes each rank's shards where that rank runs, so every node's launcher checks its own disk for
its own ranks' share of each checkpoint. A directory that the nodes share is therefore checked for one
node's share only (the save still names a full disk, after the fact).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mfsdp.train.checkpoint import checkpoint_bytes, complete_checkpoints
from mfsdp.train.run.config import RunConfig, TrainSection, dtype_name
from mfsdp.train.command.errors import ConfigError

GIB = 1 << 30


def saves(t: TrainSection) -> int:
    """Checkpoints a run of ``t.steps`` writes: every ``checkpoint_every`` steps and at the end."""
    return -(-t.steps // t.checkpoint_every) if t.checkpoint_every else 1


def new_checkpoints_at_once(t: TrainSection, existing: int) -> int:
    """Checkpoints beyond the ``existing`` ones on disk at the run's fullest moment. A save is
    pruned to ``keep_checkpoints`` only once it is complete, so the kept ones and the one being
    written are on disk together; ``keep_checkpoints`` 0 keeps every save."""
    if not t.keep_checkpoints:
        return saves(t)
    return max(1, min(saves(t), t.keep_checkpoints + 1) - existing)


def checkpointed_params(cfg: RunConfig) -> int:
    """The parameters a checkpoint of ``cfg`` holds: a LoRA run's adapters, else every parameter."""
    return cfg.resolved.adapter_params if cfg.peft.lora else cfg.resolved.params


def export_bytes(cfg: RunConfig, device_type: str = "cuda") -> int:
    """Bytes of the model export the run writes besides its checkpoints: with ``--train.export_hf``,
    every parameter once in ``RunConfig.weights_dtype`` (the export's dtype; a LoRA run's adapters
    only, unless it merges them on export), else 0."""
    if not cfg.train.export_hf:
        return 0
    adapters = cfg.peft.lora and not cfg.peft.merge_on_export
    return (cfg.resolved.adapter_params if adapters else cfg.resolved.params) * cfg.weights_dtype(device_type).itemsize


def free_space(path: str | Path) -> tuple[Path, int]:
    """The nearest existing ancestor of ``path`` (or ``path``) and the bytes free on its file system."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, shutil.disk_usage(where).free


def check_disk(cfg: RunConfig, share: float = 1.0, device_type: str = "cuda") -> str | None:
    """Raise ConfigError when not even one checkpoint fits the free space of ``out_dir``; return a
    warning line when the checkpoints held at once (and the export) do not all fit, else None.
    ``share``: the part of each checkpoint this node writes (its ranks over the world);
    ``device_type``: the run's, whose compute dtype a model-only checkpoint's "auto" is."""
    t = cfg.train
    if t.skip_disk_check:
        return None
    params = checkpointed_params(cfg)
    one = int(checkpoint_bytes(params, cfg.save_dtype(device_type)) * share)
    root = Path(t.out_dir) / "checkpoints"
    where, free = free_space(root)
    count = new_checkpoints_at_once(t, len(complete_checkpoints(root)) if root.is_dir() else 0)
    export = export_bytes(cfg, device_type)
    smaller = _model_only_fix(cfg, params, share, device_type, free - export)
    what = "this node's share of one checkpoint" if share < 1 else "one checkpoint"
    if one > free:
        raise ConfigError(
            f"{what} of this run takes {one / GIB:.2f} GiB ({_contents(cfg, device_type)}) but {where} has "
            f"{free / GIB:.2f} GiB free, so its first save would fail and lose the "
            f"{min(t.checkpoint_every or t.steps, t.steps)} steps before it; {smaller + ', ' if smaller else ''}point "
            "--train.out_dir at a disk with room, or free space there (--train.skip_disk_check true trains anyway)")
    if count * one + export <= free:
        return None
    return _too_many(t, count, one, export, where, free, smaller)


def _too_many(t: TrainSection, count: int, one: int, export: int, where: Path, free: int,
              smaller: str | None) -> str:
    """The warning when ``count`` checkpoints of ``one`` byte each and the export do not all fit
    ``free``: how many do, and the fixes."""
    fits = max(0, free - export) // one
    fixes = ([f"keep fewer with --train.keep_checkpoints {fits - 1}"] if fits >= 2 else []) + (
        ["save only at the end with --train.checkpoint_every 0"] if count > 1 else []) + [
        *([smaller] if smaller else []), "point --train.out_dir elsewhere"]
    held = (f"{count} checkpoints on disk at once ({t.keep_checkpoints} kept plus the one being written)"
            if t.keep_checkpoints and count == t.keep_checkpoints + 1 else f"{count} checkpoint{'s' * (count > 1)}")
    plus, beside = (f" plus a {export / GIB:.2f} GiB export", " beside the export") if export else ("", "")
    return (f"this run writes {held} of {one / GIB:.2f} GiB{' each' * (count > 1)}{plus}, "
            f"{(count * one + export) / GIB:.2f} GiB in all, but {where} has {free / GIB:.2f} GiB free, room for "
            f"{fits}{beside}: a later save will fail; {', '.join(fixes[:-1])} or {fixes[-1]}")


def _contents(cfg: RunConfig, device_type: str) -> str:
    """What a checkpoint of ``cfg`` holds, in a few words."""
    dtype = cfg.save_dtype(device_type)
    if dtype is None:
        return f"{'the LoRA adapters: ' * cfg.peft.lora}fp32 main weights and AdamW moments"
    whose = "the LoRA adapters'" if cfg.peft.lora else "the model's"
    return f"{whose} weights in {dtype_name(dtype)}"


def _model_only_fix(cfg: RunConfig, params: int, share: float, device_type: str, room: int) -> str | None:
    """The --train.save_only_model fix, naming how many of its checkpoints fit in ``room`` bytes;
    None where checkpoints hold the model only already, or not even one of them would fit."""
    if cfg.train.save_only_model:
        return None
    dtype = cfg.compute_dtype(device_type)
    small = int(checkpoint_bytes(params, dtype) * share)
    if small > room:
        return None
    beside = " beside the export" if cfg.train.export_hf else ""
    return (f"save only the model with --train.save_only_model true ({room // small} of its "
            f"{small / GIB:.2f} GiB checkpoints in {dtype_name(dtype)} fit{beside})")
