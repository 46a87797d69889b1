"""Sharded checkpoints that an interrupted save can never corrupt.

Layout under ``OUT_DIR/checkpoints``::

    step_200/          a complete checkpoint: DCP shards, .metadata, meta.json
    step_300/
    latest             the name of the newest complete checkpoint ("step_300")

Every rank writes its shards with ``torch.distributed.checkpoint`` into a hidden
``.tmp-step_N`` directory. Only once all shards and the metadata are on disk does rank 0
rename it to ``step_N`` and then rewrite ``latest`` (itself through a temp file and a
rename). A crash at any point before the rename leaves ``latest`` and the previous
checkpoint untouched, so resuming always finds a whole one. The data sampler is a pure
function of the step, so ``meta.json``'s step counter is the entire data state. Each rank's
random generators (CPU, and CUDA when in use) are saved under a key of that rank and restored on
resume, so whatever draws from them (dropout in Hugging Face models) continues where it stopped.

``meta.json`` is written last and lists every file of the checkpoint with its size, so it
marks the checkpoint complete. Resuming checks that list: a checkpoint with a missing or
truncated file (a disk that filled, a copy cut short) is skipped, with a message saying so,
in favour of the newest one that is whole. A save that fails (a full disk, a failing
write) raises CheckpointError naming the cause and leaves the previous checkpoint and
``latest`` as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

LATEST = "latest"
META = "meta.json"
RNG = "rng"  # the state-dict key of the ranks' random generator states
_PREFIX = "step_"
_TEMP_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint problem the user can fix; the message names the fix."""


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META).is_file()


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete and undamaged checkpoint under ``root``, or None."""
    return find_resumable(root)[0]


def find_resumable(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest complete, undamaged checkpoint under ``root`` (or None), and one note for
    each newer checkpoint that was skipped because a file of it is missing or truncated.

    ``latest`` is tried first; a hand-edited or missing marker falls back to the complete
    ``step_N`` directories, newest first.
    """
    root = Path(root)
    candidates = list(reversed(_complete_checkpoints(root)))
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    notes = []
    for path in candidates:
        problem = damage(path)
        if problem is None:
            return path, notes
        notes.append(f"checkpoint {path} is damaged ({problem}); skipping it")
    return None, notes


def damage(path: Path) -> str | None:
    """What is wrong with the files of checkpoint ``path``, or None when they are whole.

    Checks each file that ``meta.json`` lists against its recorded size; checkpoints written
    before the list existed are only checked for ``.metadata`` and ``meta.json``.
    """
    if not _is_complete(path):
        return "no .metadata or meta.json"
    try:
        files = json.loads((path / META).read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        return f"unreadable {META}: {err}"
    for name, size in (files or {}).items():
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        if file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path} has an unreadable {META} ({err}); delete "
                              f"the directory to resume from an older checkpoint") from None


def check_compatible(path: Path, model_config: dict) -> dict:
    """The checkpoint's metadata, after checking it was written for this model shape."""
    meta = read_meta(path)
    saved = meta.get("model", {})
    differences = [f"{key}: checkpoint {saved.get(key)!r}, now {value!r}"
                   for key, value in model_config.items() if saved.get(key) != value]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written for a different model ({'; '.join(differences)}); "
            "resume with the same --model.* settings, or start fresh in "
            "another --train.out_dir")
    return meta


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict, keep: int = 2) -> Path:
    """Save model and optimizer state as ``root/step_{step}``; collective over all ranks."""
    root = Path(root)
    final = root / f"{_PREFIX}{step}"
    if _is_complete(final):
        # Only reachable by stopping again at the step just resumed from: the state on disk
        # is the state in memory, and rewriting it would open a window with no checkpoint.
        return final
    temp = root / f"{_TEMP_PREFIX}{final.name}"
    problem = None
    if _rank() == 0:
        try:
            shutil.rmtree(temp, ignore_errors=True)  # debris of an earlier crashed save
            temp.mkdir(parents=True)
        except OSError as err:
            problem = _describe(err)
    _raise_if_any(problem, root, final, temp)
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer), RNG: _rng_state()}
    try:
        # DCP gathers every rank's write errors and raises them on all ranks alike.
        dcp.save(state, checkpoint_id=temp)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        problem = _describe(err)
    else:
        if _rank() == 0:
            try:
                # meta.json is written last and lists every file: it marks the save complete.
                files = {p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()}
                (temp / META).write_text(json.dumps({**meta, "step": step, "files": files},
                                                    indent=1))
                _publish(temp, final)
            except OSError as err:
                problem = _describe(err)
    _raise_if_any(problem, root, final, temp)
    if _rank() == 0:
        _prune(root, keep)
    _barrier()
    return final


def _raise_if_any(problem: str | None, root: Path, final: Path, temp: Path) -> None:
    """Raise CheckpointError on every rank when any rank saw ``problem``; collective."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is None:
        return
    if _rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
    previous = find_latest(root)
    kept = (f"the previous checkpoint {previous} is intact and is what --resume will load"
            if previous else "there is no earlier checkpoint")
    raise CheckpointError(f"saving checkpoint {final.name} failed ({first}); {kept}. Free disk "
                          f"space or fix {root}'s permissions, then continue with --resume")


def _describe(err: BaseException) -> str:
    """The root cause of a failed save in one line: DCP wraps each rank's error."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_describe(inner)}"
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
    return _complete_checkpoints(Path(root))


def _complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step_N`` directories under ``root``, oldest first."""
    return sorted((p for p in root.glob(_PREFIX + "*") if p.name[len(_PREFIX):].isdigit() and _is_complete(p)),
                  key=_step_of)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (0 keeps everything)."""
    if keep <= 0:
        return
    for old in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict:
    """Load ``path`` into the (sharded) model and optimizer; returns its metadata."""
    path = Path(path)
    meta = read_meta(path)
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    rng = _saved_rng_state(path)
    if rng:
        state[RNG] = rng
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
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
