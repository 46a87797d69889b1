"""``meta.json``: what a checkpoint records beside its tensors, read and written here only.

It is written last and lists every file of the checkpoint with its size, so its presence marks the
checkpoint complete and the list lets a resume find a truncated one. ``format`` versions the
record: a checkpoint written before the field existed reads as format 0, and its missing entries
(the file list, the held-out split) are None, the one place where old layouts are told apart.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mfsdp.train.errors import CheckpointError

META = "meta.json"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The record of one checkpoint."""

    model: dict
    """The model's shape fingerprint (``build.model_fingerprint``): what a resume must match."""
    config: dict | None = None
    """The run's whole config (``RunConfig.to_dict``): what ``mfsdp export`` rebuilds the model from."""
    world_size: int = 1
    """The ranks that wrote it."""
    data_seed: int = 0
    """The sampler's seed: with the step, the whole data state."""
    held_out: dict | None = None
    """The held-out split (``evaluate.split_record``); None: written before splits existed."""
    hf_config: dict | None = None
    """A ``--model.hf`` run's config.json, so an export needs no access to that directory."""
    step: int = 0
    """The training step after which it was saved (set at publishing)."""
    files: dict[str, int] | None = None
    """Every file and its bytes (set at publishing); None: written before the list existed."""
    format: int = FORMAT
    """The version of this record."""

    def published(self, step: int, files: dict[str, int]) -> "CheckpointMeta":
        return dataclasses.replace(self, step=step, files=files, format=FORMAT)

    def write(self, directory: Path) -> None:
        (directory / META).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        """The record of checkpoint ``directory``; CheckpointError naming the fix if unreadable."""
        try:
            raw = json.loads((Path(directory) / META).read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{"config": None, "format": 0, **{k: v for k, v in raw.items() if k in known}})
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as err:
            raise CheckpointError(f"checkpoint {directory} has an unreadable {META} ({err}); delete "
                                  f"the directory to resume from an older checkpoint") from None


MAIN_WEIGHT_BYTES = 4
"""Bytes of one main weight: ``mfsdp train`` keeps them in fp32."""


def checkpoint_bytes(params: int) -> int:
    """Bytes of a checkpoint of ``params`` parameters: fp32 main weights and AdamW's two fp32
    moments, 12 per parameter (a rank's shard: the pinned staging of an asynchronous save)."""
    return params * (MAIN_WEIGHT_BYTES + 2 * 4)
