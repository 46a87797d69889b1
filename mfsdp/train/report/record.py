"""What a run reports: its first line, each step's metrics record (metrics.jsonl, TensorBoard) and
the progress bar."""

from __future__ import annotations

import sys

import torch

from mfsdp.models import flops
from mfsdp.train.report.metrics import peak_memory_gib
from mfsdp.train.loop.step import StepOutput


def run_line(cfg, world: int, device: torch.device, data) -> str:
    """The first line of a run: the model, its size, the method (LoRA), the schedule, the processes and
    the data; for a mixture of experts, a second line: how its experts are split (``experts_line``)."""
    method = f", {cfg.method_line()}" if cfg.peft.lora else ""
    experts = cfg.experts_line(world)
    return (f"mfsdp train: {cfg.model_line()}, {cfg.resolved.params / 1e6:.1f}M parameters{method}, {cfg.schedule_line()}, "
            f"{world} process(es) on {flops.device_name(device)}, {cfg.parallel.placements} placements, "
            f"{data_words(cfg, data)}") + (f"\n{experts}" if experts else "")


def data_words(cfg, data) -> str:
    """The training data in a few words: tokens, or samples (preference pairs: and the method) and epochs."""
    if data.num_samples is None:
        return f"{len(data):,} tokens in {data.path}"
    epochs = f", {cfg.train.epochs} epoch(s) of {cfg.train.steps // cfg.train.epochs} steps" if cfg.train.epochs else ""
    if data.is_pairs:
        return f"{data.num_samples:,} preference pairs ({len(data):,} tokens) in {data.path}{epochs}: " \
               f"{cfg.dpo.describe(cfg.peft.lora)}"
    return f"{data.num_samples:,} samples ({len(data):,} tokens) in {data.path}{epochs}"


class StepReport:
    """Turns a step's values, read off the device one step late, into the metrics record that
    metrics.jsonl, TensorBoard and the progress bar show; returns whether the ranks agreed to stop."""

    def __init__(self, model_cfg, data, world: int, device: torch.device, compiling: bool, moe: bool,
                 objective, logs, progress, note, checkpointer=None):
        self.logs, self.progress, self.note, self.checkpointer = logs, progress, note, checkpointer
        self.world, self.device, self.moe, self.objective = world, device, moe, objective
        self.tokens_per_step = world * data.microbatches * data.local_batch * data.seq_len
        self.flops_per_token = flops.flops_per_token(model_cfg, data.seq_len)
        self.peak_flops = flops.peak_flops(device)
        self.compiling = compiling  # until the first step is reported
        self.val_loss: float | None = None  # the latest, shown in the bar until the next one

    def __call__(self, done) -> bool:
        if done is None:
            return False
        step, values, seconds, extra = done
        names, counted = self.objective.metrics, self.objective.count_name
        out = StepOutput.unpack(values, names, self.world, extra["count"])
        tokens_per_s = self.tokens_per_step / seconds
        per_gpu = tokens_per_s / self.world
        record = {
            "step": step, **out.metrics, "lr": extra["lr"],
            "grad_norm": out.grad_norm, "step_time_s": seconds,
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": per_gpu,
            counted: extra["count"], f"{counted}_per_s": extra["count"] / seconds,
            "tflops_per_gpu": per_gpu * self.flops_per_token / 1e12,
            "mfu": per_gpu * self.flops_per_token / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        if self.moe:  # the load-balancing loss, unweighted; the objective's loss leaves it out
            record["aux_loss"] = out.aux_loss
        if extra.get("profiled"):
            record["profiled"] = True
        # Evaluated after this step (device tensors until now).
        record.update({name: float(value) for name, value in extra.get("val", {}).items()})
        self.val_loss = record.get(f"val_{names[0]}", self.val_loss)
        for log in self.logs:
            log.write(record)
        if self.compiling:  # the first step's time is mostly torch.compile: say so, once
            self.compiling = False
            self.note(f"step {step}: {seconds:.1f} s, including torch.compile of the blocks")
        saving = self.checkpointer.writing if self.checkpointer is not None else None
        self.progress.set_postfix_str(postfix(record, self.val_loss, saving, names[0]), refresh=False)
        self.progress.update(1)
        return out.stop_votes > 0


def postfix(record: dict, val_loss: float | None = None, saving: str | None = None, loss: str = "loss") -> str:
    """The progress bar's text after the counter: ``record``'s metric ``loss`` (the objective's headline),
    and ``saving``, the checkpoint being written in the background, if one is."""
    parts = [f"{loss} {record[loss]:.3f}"]
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
