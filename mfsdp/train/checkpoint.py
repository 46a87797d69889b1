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
function of the step, so ``meta.json``'s step counter is the entire data state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

LATEST = "latest"
META = "meta.json"
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
    """The newest complete checkpoint under ``root``, or None.

    ``latest`` is trusted when it names a complete checkpoint; otherwise (a hand-edited
    or missing marker) the complete ``step_N`` directory with the highest N is used.
    """
    root = Path(root)
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named.name.startswith(_PREFIX) and _is_complete(named):
            return named
    complete = _complete_checkpoints(root)
    return complete[-1] if complete else None


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
    if _rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)  # debris of an earlier crashed save
        temp.mkdir(parents=True)
    _barrier()
    state = {"model": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=temp)
    if _rank() == 0:
        (temp / META).write_text(json.dumps({**meta, "step": step}, indent=1))
        _publish(temp, final)
        _prune(root, keep)
    _barrier()
    return final


def _publish(temp: Path, final: Path) -> None:
    """Make ``temp`` the checkpoint ``final`` and point ``latest`` at it, in that order."""
    shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover of the same name
    os.replace(temp, final)
    marker = final.parent / LATEST
    marker_temp = final.parent / (LATEST + ".tmp")
    marker_temp.write_text(final.name + "\n")
    os.replace(marker_temp, marker)


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
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return meta
