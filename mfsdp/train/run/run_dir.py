"""One run per output directory: ``--train.out_dir`` records the run that writes there, and another
run (another model, config or data) is refused there unless it resumes the run or says
``--train.overwrite true``, as the Hugging Face Trainer refuses an ``output_dir`` holding checkpoints.

``run.json`` holds the run's identity: its model and data sections and the settings that change
what it learns, not how long it runs or how it is logged, saved or sharded, so a resume may extend
the run or change its world size. A directory from before ``run.json`` existed is told by its
newest checkpoint's recorded config. Also here: what ``--resume`` does where there is no checkpoint
(an error; ``--resume auto`` starts afresh) or the run already ended.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from mfsdp.train.checkpoint import CheckpointError, CheckpointMeta, complete_checkpoints
from mfsdp.train.command.errors import ConfigError, agree
from mfsdp.train.loop.step import lr_at

RUN_FILE = "run.json"
METRICS = "metrics.jsonl"
OUTPUTS = ("checkpoints", METRICS, "tensorboard", "loss.png", "hf", "wandb-run-id", RUN_FILE, "reference_logps.pt")
"""What a run writes into its out_dir, removed by a fresh start there (logs/ and the demo corpus's
data/ stay: a log of each attempt, and a cache of the same file)."""
IDENTITY = {"model": None, "data": None, "peft": None,
            "train": ("lr", "lr_schedule", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "seed"),
            "parallel": ("compute_dtype", "main_grads_dtype")}
"""The keys (None: all) of each config section that make a run's identity. The warm-up is left out:
the recipe's depends on the number of steps. A run that trains preference pairs adds its ``dpo``
section (only then, so the identity of every other run stays as it was)."""
_PATHS = ("model.hf", "data.path", "data.val_path")


def identity(config: dict, pairs: bool = False) -> dict:
    """The identity of the run of ``config`` (``RunConfig.to_dict``, or a checkpoint's record), its
    paths absolute so that a run started from another directory compares equal; ``pairs``: the run
    trains preference pairs (``RunConfig.pairs``)."""
    config = absolute_paths(config)
    sections = {**IDENTITY, "dpo": None} if pairs else IDENTITY
    return {f"{section}.{key}": (config.get(section) or {}).get(key) for section, keys in sections.items()
            for key in keys or sorted(config.get(section) or {})}


def absolute_paths(config: dict) -> dict:
    """``config`` (``RunConfig.to_dict``) with the base directory and data paths made absolute, as
    checkpoints and ``run.json`` record them: an export or a resume run from elsewhere finds them."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, _, key in (name.partition(".") for name in _PATHS):
        if (value := (out.get(section) or {}).get(key)) not in (None, "stdlib"):
            out[section][key] = str(Path(value).resolve())
    return out


def recorded_identity(out_dir: Path) -> dict | None:
    """The identity of the run that wrote into ``out_dir``: {} for one with no record of it (only
    metrics), None where no run wrote there."""
    record = out_dir / RUN_FILE
    if record.is_file():
        try:
            return json.loads(record.read_text())["identity"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
    for checkpoint in reversed(complete_checkpoints(out_dir / "checkpoints")):
        try:
            return identity(CheckpointMeta.read(checkpoint).config or {})
        except CheckpointError:
            continue
    metrics = out_dir / METRICS
    return {} if metrics.is_file() and metrics.stat().st_size else None


def check_out_dir(cfg, resume_from: Path | None) -> None:
    """Refuse a ``--resume`` with nothing to resume, and a fresh run in the directory of another;
    ConfigError in one line naming the ways on."""
    out = Path(cfg.train.out_dir)
    if cfg.resume is True and resume_from is None:
        raise ConfigError(f"--resume: no checkpoint to continue from in {out / 'checkpoints'}; drop --resume to "
                          "start this run afresh (--resume auto starts afresh where there is none, for job "
                          "scripts that requeue)")
    if resume_from is not None or cfg.train.overwrite:
        return
    recorded = recorded_identity(out)
    if recorded is None:
        return
    now = identity(cfg.to_dict(), cfg.pairs)
    differences = [f"{key} {recorded[key]!r} there, {now[key]!r} now" for key in recorded
                   if key in now and recorded[key] != now[key]]
    if recorded and not differences:
        saved = complete_checkpoints(out / "checkpoints")
        if saved:  # the same run's checkpoints: a fresh start would delete what the user saved
            raise ConfigError(f"--train.out_dir {out} holds this run's checkpoints (the newest {saved[-1].name}); "
                              "continue it with --resume, start it over with --train.overwrite true (deletes "
                              "them), or give this run its own --train.out_dir")
        return
    what = "; ".join(differences[:3]) if recorded else f"{METRICS} with no record ({RUN_FILE}) of its config"
    raise ConfigError(f"--train.out_dir {out} holds another run's checkpoints or metrics ({what}); continue "
                      "that run with --resume, replace it with --train.overwrite true, or give this run its "
                      "own --train.out_dir")


def claim(cfg, resuming: bool, log) -> None:
    """Make ``out_dir`` this run's (rank 0, after ``check_out_dir``): a fresh start first removes
    what an earlier run wrote there (its checkpoints would otherwise be resumed or pruned in place of
    this run's), then the run's identity is recorded."""
    out = Path(cfg.train.out_dir)
    if not resuming:
        removed = [name for name in OUTPUTS if (out / name).exists()]
        for name in removed:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        if set(removed) - {RUN_FILE}:
            log(f"starting afresh in {out}: removed the earlier run's {', '.join(n for n in removed if n != RUN_FILE)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps({"identity": identity(cfg.to_dict(), cfg.pairs)}, indent=1) + "\n")


def finished_line(cfg, resume_from: Path | None) -> str | None:
    """The line a resume prints instead of training when its checkpoint is at the last step, or None."""
    if resume_from is None:
        return None
    step = CheckpointMeta.read(resume_from).step
    if step < cfg.train.steps:
        return None
    return (f"{resume_from} is at step {step}, the last of --train.steps {cfg.train.steps}: nothing left to "
            "train (raise --train.steps to continue)")


def check_shared(out_dir: Path) -> None:
    """Refuse, on every rank, a run over several nodes whose ``out_dir`` is not one directory for all
    of them: rank 0 writes a file of a random name into it and every rank looks for it. Each rank writes
    its checkpoint shards where it runs, so a checkpoint there would be split over the nodes' disks.
    Collective; a run on one node checks nothing."""
    if dist.get_world_size() == int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())):
        return
    name = [f".shared-check-{uuid.uuid4().hex}"]  # a name no node has looked up (and cached) before
    dist.broadcast_object_list(name)
    marker = out_dir / name[0]
    try:
        if dist.get_rank() == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            marker.touch()
        dist.barrier()
        agree(None if marker.is_file() else
              f"--train.out_dir {out_dir} is not one file system for all nodes: node {socket.gethostname()} "
              f"does not see the file {marker.name} that rank 0 wrote there, so each checkpoint would be split "
              "over the nodes' disks; give every node the same --train.out_dir on storage they all mount (NFS, "
              "Lustre, a cluster file system)")
    finally:
        if dist.get_rank() == 0:
            marker.unlink(missing_ok=True)


SCHEDULE = ("steps", "warmup_steps", "lr_schedule", "min_lr_ratio", "lr")
"""The ``--train`` keys that shape the learning-rate schedule (``step.lr_at``)."""


def schedule_change_line(meta: CheckpointMeta, cfg) -> str | None:
    """What a resume says when its ``--train`` schedule differs from the checkpoint's run (raised
    ``--train.steps`` on a finished run, say): the schedule is rebuilt for the new settings, the
    recipe's warm-up re-derived for the new length, and the lr jumps at the step after ``meta.step``.
    None where nothing changed or the checkpoint does not record its schedule."""
    recorded, now = (meta.config or {}).get("train") or {}, cfg.train
    if any(key not in recorded for key in SCHEDULE) or all(recorded[key] == getattr(now, key) for key in SCHEDULE):
        return None
    was = SimpleNamespace(**{key: recorded[key] for key in SCHEDULE})

    def shape(t) -> str:
        decay = "constant" if t.lr_schedule == "constant" else f"{t.lr_schedule} to {t.min_lr_ratio:g}x"
        return f"warm-up {t.warmup_steps} steps then {decay} over steps {t.warmup_steps + 1}-{t.steps} (lr {t.lr:g})"

    return (f"the learning-rate schedule is rebuilt for --train.steps {now.steps} (the checkpoint's run had "
            f"{was.steps}): was {shape(was)}, now {shape(now)}; lr {lr_at(was, meta.step):.3g} at step "
            f"{meta.step}, {lr_at(now, meta.step + 1):.3g} at step {meta.step + 1}")
