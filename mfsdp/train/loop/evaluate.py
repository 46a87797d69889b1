"""The validation pass of ``mfsdp train``: which tokens (or samples) are held out, and the objective's
metrics on them.

The split is part of a run's data state: the training windows depend on how many tokens (in a file
of samples: how many samples) the held-out tail takes, so each checkpoint records it (``meta.json`` key ``held_out``) and a resumed run keeps
the recorded split, whatever ``--data.val_fraction`` says now. A checkpoint without the record was
written before held-out splits existed and sampled the whole file: it resumes with none.
The note below is the choreography of evaluating through the sharded model.

[Note: evaluation through the sharded model]
Evaluation runs the same sharded model forward under ``torch.no_grad()``, between an optimizer step
and the next training forward, on every rank with the same number of batches (each rank its slice
of the same eval batches), so every FSDP module gathers in its static order on all ranks. A no-grad
forward registers no backward hooks, and its root reshards at the end of the forward (a training
forward keeps the root for backward), so no backward state is left behind. The optimizer step may
already have gathered the root and the next ``prefetch_depth`` modules for the next forward
(``CommunicationPolicy.prefetch_across_step``); the evaluation's first forward uses those gathers
(the weights are final for the step) and its last forward reshards them, so the next training
forward gathers afresh: correct, at the cost of that one step's early overlap. The metrics are the
objective's (no MoE load-balancing term) over what training counts (the targets of the answers only,
for samples), summed in fp32 per batch, accumulated in fp64 and all-reduced with their count: a
count-weighted mean over the same windows at every world size and placement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp.data import TokenFile, held_out_samples, held_out_tokens
from mfsdp.train.build.batches import eval_windows
from mfsdp.train.checkpoint import CheckpointMeta


def held_out_split(cfg, data: TokenFile, resumed_meta: CheckpointMeta | None) -> tuple[int, list[str]]:
    """How many tokens (in a file of samples: samples) at the end of the training file are held
    out, and notes for the user.

    A fresh run takes them from ``--data.val_fraction`` (none with ``--data.val_path``); a resumed
    run takes what its checkpoint recorded (none when it recorded nothing)."""
    d, unit = cfg.data, split_unit(data)
    wanted = 0 if d.val_path is not None else (
        held_out_samples(data.num_samples, d.val_fraction) if unit == "samples"
        else held_out_tokens(len(data), d.val_fraction, d.seq_len))
    if resumed_meta is None:
        return wanted, []
    record = resumed_meta.held_out
    held = int(record.get(unit, 0)) if isinstance(record, dict) else 0
    notes = []
    if record is None and wanted:
        notes.append("the checkpoint records no held-out split (written before they existed): "
                     "training keeps sampling the whole file; pass --data.val_path FILE for a "
                     "validation loss")
    elif held != wanted:
        notes.append(f"keeping the checkpoint's held-out split ({held:,} {unit} at the end of the "
                     f"training file, not the {wanted:,} the current flags give), so the training "
                     "windows do not change")
    return held, notes


def split_unit(data: TokenFile) -> str:
    """What a split of ``data`` counts: "samples" for a file of samples, else "tokens"."""
    return "tokens" if data.num_samples is None else "samples"


def split_record(cfg, data: TokenFile, held: int) -> dict:
    """What ``meta.json`` records of the split (``held_out_split`` reads it back)."""
    return {split_unit(data): held, "val_path": cfg.data.val_path, "val_fraction": cfg.data.val_fraction}


def make_evaluator(cfg, data: TokenFile, held: int, rank: int, world: int, device: torch.device, log,
                   objective) -> "Evaluator | None":
    """The run's evaluator over this rank's windows, from ``--data.val_path``, else the held-out tail;
    None (with a line saying why) when evaluation is off or nothing is held out."""
    d, t = cfg.data, cfg.train
    if t.eval_every == 0:
        return None
    source = TokenFile(d.val_path) if d.val_path is not None else data
    if d.val_path is None and not held:
        log(f"no held-out {split_unit(data)} (--data.val_fraction 0 and no --data.val_path): no validation loss")
        return None
    windows, batches, note = eval_windows(cfg, data, source, held, rank, world)
    where = (f"{source.path}" if d.val_path is not None else
             f"the last {held:,} {split_unit(data)} of {data.path}, never trained on")
    log(f"validation loss every {t.eval_every} steps and at the end: {batches} batches of "
        f"{world * d.local_batch * d.microbatches} windows from {where}{note}")
    return Evaluator(windows, batches, device, objective)


class Evaluator:
    """The objective's validation metrics over ``batches`` eval batches: a collective, every rank calls it."""

    def __init__(self, windows, batches: int, device: torch.device, objective):
        self.windows, self.batches, self.device, self.objective = windows, batches, device, objective

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``val_`` and each metric's name: its count-weighted mean over every rank's windows, a
        0-dim fp32 tensor on the device (read it without a sync where the caller can wait)."""
        was_training = model.training
        model.eval()  # no dropout in Hugging Face models (and no draws from the generators)
        names = self.objective.metrics
        totals = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
        try:
            for batch in self.windows.batches(self.batches):
                _, count, metrics = self.objective(model, batch, self.device)
                totals += torch.stack([value.double() for value in (*map(metrics.get, names), count)])
        finally:
            model.train(was_training)
        dist.all_reduce(totals)
        return {f"val_{name}": (total / totals[-1]).float() for name, total in zip(names, totals)}
