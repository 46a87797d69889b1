"""What a training step reports: the metrics record (metrics.jsonl, TensorBoard) and the progress bar."""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch

from mfsdp.models import flops
from mfsdp.train.metrics import peak_memory_gib


class Trainer(Protocol):
    """What a report reads off the loop's trainer (``mfsdp.train.loop.Trainer``), named here so
    that the loop imports the report and not the other way round."""

    cfg: Any  # RunConfig
    model_cfg: Any
    world: int
    device: torch.device
    stop_requested: bool

    def note(self, text: str) -> None: ...


class StepReport:
    """Turns a step's values, read off the device one step late, into the metrics record
    that metrics.jsonl, TensorBoard and the progress bar show; returns the stop vote."""

    def __init__(self, trainer: "Trainer", logs, progress):
        d = trainer.cfg.data
        self.trainer = trainer
        self.logs = logs
        self.progress = progress
        self.world = trainer.world
        self.tokens_per_step = self.world * d.microbatches * d.local_batch * d.seq_len
        self.flops_per_token = flops.flops_per_token(trainer.model_cfg, d.seq_len)
        self.peak_flops = flops.peak_flops(trainer.device)
        self.moe = trainer.cfg.model.hf is None and trainer.model_cfg.num_experts > 0
        self.compiling = trainer.cfg.compiles(trainer.device.type)  # until the first step is reported
        self.val_loss: float | None = None  # the latest, shown in the bar until the next one

    def __call__(self, done) -> bool:
        if done is None:
            return False
        step, (loss_total, stop_votes, aux_total, grad_norm), seconds, extra = done
        tokens_per_s = self.tokens_per_step / seconds
        per_gpu = tokens_per_s / self.world
        record = {
            "step": step, "loss": loss_total / self.world, "lr": extra["lr"],
            "grad_norm": grad_norm, "step_time_s": seconds,
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": per_gpu,
            "tflops_per_gpu": per_gpu * self.flops_per_token / 1e12,
            "mfu": per_gpu * self.flops_per_token / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_memory_gib(self.trainer.device),
        }
        if self.moe:  # the load-balancing loss, unweighted; "loss" stays the cross entropy
            record["aux_loss"] = aux_total / self.world
        if "val_loss" in extra:  # evaluated after this step (a device tensor until now)
            record["val_loss"] = self.val_loss = float(extra["val_loss"])
        for log in self.logs:
            log.write(record)
        if self.compiling:  # the first step's time is mostly torch.compile: say so, once
            self.compiling = False
            self.trainer.note(f"step {step}: {seconds:.1f} s, including torch.compile of the blocks")
        checkpointer = getattr(self.trainer, "checkpointer", None)
        self.progress.set_postfix_str(postfix(record, self.val_loss, checkpointer and checkpointer.writing),
                                      refresh=False)
        self.progress.update(1)
        stop = stop_votes > 0
        self.trainer.stop_requested = self.trainer.stop_requested or stop
        return stop


def postfix(record: dict, val_loss: float | None = None, saving: str | None = None) -> str:
    """The progress bar's text after the counter; ``saving`` names the checkpoint being written
    in the background, if one is."""
    parts = [f"loss {record['loss']:.3f}"]
    if val_loss is not None:
        parts.append(f"val {val_loss:.3f}")
    parts += [f"{record['tokens_per_s']:,.0f} tok/s",
              f"{record['tflops_per_gpu']:.2f} TFLOP/s/gpu"]
    if record["mfu"] is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    parts.append(f"peak {record['peak_mem_gib']:.2f} GiB")
    if saving:
        parts.append(f"saving {saving}")
    return ", ".join(parts)


def progress_bar(total: int, initial: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        return NoProgress()
    # stdout: under `mfsdp train --nproc-per-node`, the workers' stderr goes to log files.
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stdout)


class NoProgress:
    def update(self, n): pass
    def set_postfix_str(self, text, refresh=True): pass
    def close(self): pass
