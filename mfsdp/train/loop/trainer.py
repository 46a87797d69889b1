"""The training loop of ``mfsdp train``: a ``ResolvedRun``'s model trained from its start step to the
last, with evaluation, metrics and checkpoints on the way. Each rank runs it; only rank 0 prints."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp.data.packing import cut_note
from mfsdp.models.moe import MoELlama
from mfsdp.train.build.batches import make_sampler
from mfsdp.train.build.adapters import adapter_record, checkpointed_numel
from mfsdp.train.build.model import build
from mfsdp.train.checkpoint import CheckpointMeta, load_checkpoint
from mfsdp.train.checkpoint.async_save import make_checkpointer
from mfsdp.train.run.config import dtype_name
from mfsdp.train.report.epilogue import finish
from mfsdp.train.loop.evaluate import held_out_split, make_evaluator, split_record
from mfsdp.train.report.metrics import MetricsLog, StepReadout, TensorBoardLog
from mfsdp.train.objectives import objective_for
from mfsdp.train.run.preflight import ResolvedRun, model_fingerprint
from mfsdp.train.loop.profile import StepProfiler
from mfsdp.train.report.record import NoProgress, StepReport, progress_bar
from mfsdp.train.run.run_dir import absolute_paths, claim, finished_line, schedule_change_line
from mfsdp.train.report.step_lines import StepLines
from mfsdp.train.report.wandb_log import WandbLog
from mfsdp.train.loop.step import lr_at, train_step


class StopSignal:
    """Ctrl-C or SIGTERM: the first asks every rank to stop after this step and save; the second
    aborts. ``requested`` is this rank's vote; the ranks agree through the step's collective."""

    def __init__(self, log):
        self.requested, self.log = False, log
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.log(f"\nreceived {signal.Signals(signum).name}: saving after this step")


class Trainer:
    def __init__(self, run: ResolvedRun, device: torch.device):
        self.cfg, self.data, self.device = run.cfg, run.data, device
        self.resume_from, self.resume_notes = run.resume_from, run.notes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out_dir = Path(self.cfg.train.out_dir)
        self.model_cfg = self.cfg.resolved.shape
        self.objective = objective_for(self.cfg, self.data)
        self.progress = NoProgress()

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def note(self, message: str) -> None:
        """A line on rank 0 that leaves the progress bar (when there is one) intact."""
        if self.rank == 0:
            getattr(self.progress, "write", print)(message)
            sys.stdout.flush()

    def run(self) -> int:
        cfg, d = self.cfg, self.cfg.data
        if done := finished_line(cfg, self.resume_from):  # every rank: nothing is built
            self.log(done)
            return 0
        if self.rank == 0:
            claim(cfg, self.resume_from is not None, self.log)
        dist.barrier()  # the directory is this run's before any rank writes into it
        model, optimizer = build(cfg, self.device, self.world, self.log, resuming=self.resume_from is not None)
        start_step, resumed = self._resume(model, optimizer)
        held, notes = held_out_split(cfg, self.data, resumed)
        for line in notes:
            self.log(line)
        sampler = make_sampler(cfg, self.data, held, self.rank, self.world)
        if note := cut_note(self.data, d.seq_len):
            self.log(note)
        evaluator = make_evaluator(cfg, self.data, held, self.rank, self.world, self.device, self.log, self.objective)
        self.objective.prepare(model, sampler, evaluator, self.log)
        logs = (MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.rank == 0, keep_until_step=start_step),
                TensorBoardLog(self.out_dir / "tensorboard", enabled=self.rank == 0 and cfg.metrics.tensorboard,
                               purge_step=start_step + 1 if start_step else None),
                StepLines(cfg, start_step, self.objective, enabled=self.rank == 0 and not cfg.train.progress,
                          log=self.note),
                WandbLog(cfg, resumed is not None, enabled=self.rank == 0 and cfg.metrics.wandb))
        checkpointer = make_checkpointer(self.out_dir / "checkpoints", cfg, self.device.type, checkpointed_numel(model),
                                         self.note, model, optimizer)
        meta = CheckpointMeta(model=model_fingerprint(self.model_cfg), config=absolute_paths(cfg.to_dict()),
                              world_size=self.world, data_seed=d.seed, held_out=split_record(cfg, self.data, held),
                              hf_config=cfg.resolved.hf_config, peft=adapter_record(cfg, model),
                              export_dtype=dtype_name(cfg.weights_dtype(self.device.type)))  # the export's
        last, stopped = self.train(model, optimizer, sampler, evaluator, logs, checkpointer, start_step, meta)
        for log in logs:
            log.close()
        finish(cfg, model, self.data, last, stopped, self.device, self.log, self.objective)
        return 0

    def _resume(self, model, optimizer) -> tuple[int, CheckpointMeta | None]:
        """The step to start after and the checkpoint's record (None for a fresh start)."""
        for line in self.resume_notes:
            self.log(line)
        if self.resume_from is None:
            if self.cfg.resume:  # "auto" (a plain --resume with none stopped in preflight)
                self.log(f"--resume auto: no checkpoint in {self.out_dir / 'checkpoints'}; starting from step 0")
            return 0, None
        meta = load_checkpoint(self.resume_from, model, optimizer)
        fallback = " (the newest whole checkpoint)" if self.resume_notes else ""
        self.log(f"resumed the weights from {self.resume_from}{fallback} at step {meta.step}; the optimizer state "
                 "starts fresh (the checkpoint holds the model only)" if meta.model_only else
                 f"resumed from {self.resume_from}{fallback} at step {meta.step}")
        if line := schedule_change_line(meta, self.cfg):
            self.log(line)
        return meta.step, meta

    def train(self, model, optimizer, sampler, evaluator, logs, checkpointer, start_step: int,
              meta: CheckpointMeta) -> tuple[int, bool]:
        """Steps ``start_step + 1`` to the last; returns the last step run and whether a signal
        stopped the run. The metrics, stop votes and gradient norm reach the host one step late, through
        pinned memory and an event (``StepReadout``), so the next step is queued meanwhile."""
        t, d, objective = self.cfg.train, self.cfg.data, self.objective
        compiling = self.cfg.compiles(self.device.type)
        self.progress = progress_bar(t.steps, start_step, enabled=self.rank == 0 and t.progress)
        readout = StepReadout(self.device)
        # A load-balancing loss: the bundled MoE's, or a Hugging Face MoE's whose config asks for it (the manager's).
        aux_coef = (self.model_cfg.moe_aux_loss_coef if isinstance(model, MoELlama)
                    else getattr(model, "aux_loss_coef", None))
        report = StepReport(self.model_cfg, d, self.world, self.device, compiling, aux_coef is not None,
                            objective, logs, self.progress, self.note, checkpointer)
        if compiling:
            self.progress.set_postfix_str("compiling the blocks (torch.compile, first step)")
        stop_signal = StopSignal(self.log)
        profiler = StepProfiler(self.out_dir, t.profile_step, self.rank, self.device, self.note)
        step, stop = start_step, False
        for step in range(start_step + 1, t.steps + 1):
            lr, count = lr_at(t, step), objective.global_count(sampler, step)
            evaluated = evaluator is not None and (step % t.eval_every == 0 or step == t.steps)
            if count:
                with profiler.around(step):
                    out = train_step(model, optimizer, objective, lambda micro: sampler.batch(step, micro),
                                     d.microbatches, count, lr, t.grad_clip, aux_coef, stop_signal.requested,
                                     self.device)
                end, extra = readout.mark(), {"lr": lr, "count": count}
                if step == profiler.step:  # its time includes the profiler's
                    extra["profiled"] = True
                if evaluated:  # read with this step's record, one step late; see the note in evaluate.py
                    extra["val"] = evaluator(model)
                stop = report(readout.push(step, out.pack(), extra, end)) or stop
            else:  # every rank sees the same global batch, so all skip it
                self.note(f"step {step}: the global batch counts no target (only prompts or padding); skipped")
            if evaluated:
                readout.restart_clock()  # the next step's time leaves the evaluation out
            checkpointer.poll(step)  # publishes a finished background write, or raises
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or stop:
                stop = report(readout.flush()) or stop
                checkpointer.save(step, model, optimizer, meta)
                readout.restart_clock()
            if stop:
                break
        report(readout.flush())
        checkpointer.close()  # the end of the run waits for the last background write
        self.progress.close()
        return step, stop
