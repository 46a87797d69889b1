"""``meta.json``: what a checkpoint records beside its tensors, read and written here only.

It is written last and lists every file of the checkpoint with its size, so its presence marks the
checkpoint complete and the list lets a resume find a truncated one. ``format`` versions the
record: a checkpoint written before the field existed reads as format 0, and its missing entries
(the file list, the held-out split) are None, the one place where old layouts are told apart.
Formats 0 and 1 predate ``--train.save_only_model`` and read as the full state in fp32; a record
without ``export_dtype`` exports by the rule of its time (``mfsdp.train.export.checkpoint_dtype``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mfsdp.train.run.config import DTYPES, dtype_name
from mfsdp.train.command.errors import CheckpointError

META = "meta.json"
FORMAT = 2
CONTENTS = ("full", "model")


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The record of one checkpoint."""

    model: dict
    """The model's shape fingerprint (``build.model_fingerprint``): what a resume must match."""
    config: dict | None = None
    """The run's whole config (``RunConfig.to_dict``): what ``mfsdp export`` rebuilds the model from;
    its base directory and data paths absolute (``run_dir.absolute_paths``; older ones: as typed)."""
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
    contents: str = "full"
    """"full": the training state (fp32 main weights, optimizer state); "model": the weights only
    (``--train.save_only_model``), so a resume starts the optimizer afresh."""
    weights_dtype: str = "fp32"
    """The weights' dtype on disk, a key of ``config.DTYPES``."""
    export_dtype: str | None = None
    """The dtype its Hugging Face export writes the weights in (``RunConfig.weights_dtype``, the
    end-of-run export's), a key of ``config.DTYPES``; None: recorded before the field existed."""
    peft: dict | None = None
    """A LoRA run's PEFT adapter config (``adapters.adapter_record``): the checkpoint holds only the
    adapters (and their optimizer state), the frozen base being ``base_model_name_or_path``'s; an
    export writes this as ``adapter_config.json``. None: every parameter is in the checkpoint."""

    def __post_init__(self) -> None:
        for key, known in (("contents", CONTENTS), ("weights_dtype", DTYPES), ("export_dtype", (None, *DTYPES))):
            if getattr(self, key) not in known:
                raise ValueError(f"{key} {getattr(self, key)!r} (one of {', '.join(map(str, known))}) is unknown")

    @property
    def model_only(self) -> bool:
        return self.contents == "model"

    def published(self, step: int, files: dict[str, int], save_dtype: torch.dtype | None = None) -> "CheckpointMeta":
        """The record of the checkpoint of ``step``, holding ``files``: the whole training state, or
        with ``save_dtype`` the model's weights only, in that dtype."""
        held = {"contents": "full", "weights_dtype": "fp32"} if save_dtype is None else {
            "contents": "model", "weights_dtype": dtype_name(save_dtype)}
        return dataclasses.replace(self, step=step, files=files, format=FORMAT, **held)

    def write(self, directory: Path) -> None:
        (directory / META).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        """The record of checkpoint ``directory``; CheckpointError naming the fix if unreadable."""
        try:
            raw = json.loads((Path(directory) / META).read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{"config": None, "format": 0, **{k: v for k, v in raw.items() if k in known}})
        except (OSError, json.JSONDecodeError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"checkpoint {directory} has an unreadable {META} ({err}); delete "
                                  f"the directory to resume from an older checkpoint") from None


MAIN_WEIGHT_BYTES = 4
"""Bytes of one main weight: ``mfsdp train`` keeps them in fp32."""


def checkpoint_bytes(params: int, save_dtype: torch.dtype | None = None) -> int:
    """Bytes of a checkpoint of ``params`` parameters (a rank's shard: the host staging of an
    asynchronous save): fp32 main weights and AdamW's two fp32 moments, 12 per parameter, or with
    ``save_dtype`` (``--train.save_only_model``) the weights alone in that dtype."""
    return params * (save_dtype.itemsize if save_dtype is not None else MAIN_WEIGHT_BYTES + 2 * 4)
