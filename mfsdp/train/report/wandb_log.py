"""``--metrics.wandb true``: the scalars of metrics.jsonl logged to Weights & Biases as well.

wandb is an optional extra (``pip install mfsdp[wandb]``), imported only when asked for. It follows
wandb's own environment: ``WANDB_MODE=offline`` writes the run to disk for a later ``wandb sync``,
``WANDB_DIR`` says where (by default OUT_DIR). The W&B run's id is kept in OUT_DIR/wandb-run-id, so
a ``--resume`` continues the same W&B run instead of starting another.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from mfsdp.train.command.errors import ConfigError
from mfsdp.train.report.metrics import scalars

RUN_ID = "wandb-run-id"


class WandbLog:
    """A log of ``Trainer``'s tuple: each metrics record's numbers as W&B scalars at its step, under
    the names metrics.jsonl and TensorBoard use (rank 0 only)."""

    def __init__(self, cfg, resuming: bool, enabled: bool):
        self._run = None
        if not enabled:
            return
        try:
            import wandb
            from wandb.errors import Error as WandbError
        except ImportError:
            raise ConfigError("--metrics.wandb true needs the wandb package; pip install wandb "
                              "(or mfsdp[wandb])") from None
        out = Path(cfg.train.out_dir)
        id_file = out / RUN_ID
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else uuid.uuid4().hex[:12]
        m = cfg.metrics
        try:
            self._run = wandb.init(project=m.wandb_project, name=m.wandb_run_name or out.name, id=run_id,
                                   resume="allow", config=cfg.to_dict(), dir=os.environ.get("WANDB_DIR", str(out)))
        except WandbError as err:
            raise ConfigError(f"--metrics.wandb: {err} (log in with `wandb login`, or log offline with "
                              "WANDB_MODE=offline)") from None
        id_file.write_text(run_id + "\n")

    def write(self, record: dict) -> None:
        if self._run is None:
            return
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
