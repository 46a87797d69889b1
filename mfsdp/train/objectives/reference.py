"""The reference of a full fine-tuning preference run: the initial model's summed answer log-probs,
computed once before the first step over every pair of the training file (held-out tail included)
and of the ``--data.val_path`` file, so no second model is held.

The pass is sharded as training is: every rank runs the same number of no-grad forwards of the
sharded model, each over its share of the pair windows, and an all-reduce joins the (pairs, 2)
table (each pair is in exactly one window). Rank 0 writes it atomically into the run directory
(``REFERENCE_FILE``) with the identity of the model and the data; a resumed run loads it and
refuses one of another identity. A run stopped during the pass has written nothing and recomputes
it; a checkpoint without the file cannot be resumed (its weights are no longer the initial ones).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp.data import PairWindows, TokenFile
from mfsdp.models.answer_logps import PairLogps
from mfsdp.train.checkpoint import complete_checkpoints
from mfsdp.train.command.errors import agree
from mfsdp.train.run.run_dir import identity as run_identity

REFERENCE_FILE = "reference_logps.pt"


class ReferenceLogps:
    """The stored reference of a run of ``cfg`` on ``data``: ``prepare`` before training, then ``of``."""

    def __init__(self, cfg, data: TokenFile):
        self.cfg, self.data = cfg, data
        self.path = Path(cfg.train.out_dir) / REFERENCE_FILE
        self.table: torch.Tensor | None = None
        """(pairs, 2) fp32 on the device: each pair's chosen and rejected sums, the val file's after."""

    def files(self) -> list[TokenFile]:
        """The files whose pairs the table holds, in the order of their pair numbers."""
        val = self.cfg.data.val_path
        return [self.data] + ([TokenFile(val)] if val is not None else [])

    def identity(self) -> dict:
        """What the stored values depend on: the model and its initial weights, the files."""
        record = {key: value for key, value in run_identity(self.cfg.to_dict()).items()
                  if key.startswith(("model.", "peft.", "parallel.compute_dtype")) or key == "train.seed"}
        record["files"] = [[str(Path(f.path).resolve()), os.path.getsize(f.path), f.num_samples, f.fingerprint]
                           for f in self.files()]
        return record

    def prepare(self, model, train_windows: PairWindows, log, pair_logps) -> None:
        """Load the stored table, or compute it with ``pair_logps(model, batch, device)`` and store it;
        collective."""
        device = next(model.parameters()).device
        problem, stored = None, None
        if self.path.is_file():
            stored = torch.load(self.path, map_location="cpu", weights_only=True)
            if stored.get("identity") != self.identity():
                problem = (f"{self.path} holds the reference log-probs of another model or data than this run's; "
                           "start afresh in another --train.out_dir (or --train.overwrite true)")
        elif complete_checkpoints(self.path.parent / "checkpoints"):
            problem = (f"{self.path} (the initial model's reference log-probs) is missing, and the checkpoints "
                       "hold trained weights; start afresh (--train.overwrite true)")
        agree(problem)
        if stored is not None:
            self.table = stored["logps"].to(device)
            log(f"reference log-probs of {self.table.shape[0]:,} pairs loaded from {self.path}")
            return
        self.table = self._compute(model, train_windows.packed, device, pair_logps)
        if dist.get_rank() == 0:
            partial = self.path.with_name(self.path.name + ".partial")
            torch.save({"identity": self.identity(), "logps": self.table.cpu()}, partial)
            os.replace(partial, self.path)
        dist.barrier()
        log(f"reference log-probs of the initial model: {self.table.shape[0]:,} pairs, stored in {self.path}")

    @torch.no_grad()
    def _compute(self, model, packed: bool, device: torch.device, pair_logps) -> torch.Tensor:
        d, rank, world = self.cfg.data, dist.get_rank(), dist.get_world_size()
        files, first = self.files(), 0
        table = torch.zeros(sum(f.num_samples for f in files), 2, device=device)
        was_training = model.training
        model.eval()
        try:
            for f in files:
                windows = PairWindows(f, d.seq_len, packed=packed, first_id=first)
                per_pass = world * d.local_batch
                for start in range(rank * d.local_batch, math.ceil(len(windows) / per_pass) * per_pass, per_pass):
                    slots = range(start, start + d.local_batch)
                    batch = windows.batch([w if w < len(windows) else None for w in slots])
                    logps = pair_logps(model, batch, device)
                    table[batch.pair_ids.to(device)] = torch.stack([logps.chosen, logps.rejected], 1)
                first += f.num_samples
        finally:
            model.train(was_training)
        dist.all_reduce(table)
        return table

    def of(self, pair_ids: torch.Tensor, policy: PairLogps) -> PairLogps:
        """The reference sums of the pairs ``pair_ids`` (their token counts: the policy's)."""
        rows = self.table[pair_ids]  # on the table's device (the step passes it there)
        return PairLogps(rows[:, 0], rows[:, 1], policy.chosen_tokens, policy.rejected_tokens)
