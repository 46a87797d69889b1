"""``mfsdp train``: the training run, top to bottom.

The order is: parse the config, join the process group, check everything a user can
get wrong (on every rank, then agree), build and shard the model, resume if asked,
train, save, plot, and print a text sample. Each rank runs this same file; only rank 0
prints. ``main`` is the worker entry for ``mfsdp train --nproc-per-node N`` (see
``launcher.py``) and for ``torchrun -m mfsdp.train``; torch's ``errors.record`` hands an
uncaught error to the launcher's summary.
"""

from __future__ import annotations

import dataclasses

import math
import os
import signal
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import record

import mfsdp
from mfsdp.data import STDLIB, DataError, TokenFile, WindowSampler, prepare_stdlib_corpus
from mfsdp.data.tokenizer import load_tokenizer
from mfsdp.models import flops
from mfsdp.models.llama import Llama, LlamaConfig
from mfsdp.models.moe import MoELlama, build_model
from mfsdp.models.parallelize import ParallelizeConfig, build_mesh, parallelize
from mfsdp.train import determinism
from mfsdp.train.build import (adamw, build_hf, offload_policy, shard_numel, materialize_and_init,
                               model_fingerprint, validate_run)
from mfsdp.train.checkpoint import (CheckpointError, Checkpointer, async_staging_problem, load_checkpoint,
                                    planned_staging_bytes, read_meta)
from mfsdp.train.config import ConfigError, RunConfig, load_config, usage
from mfsdp.train.evaluate import HELD_OUT, Evaluator, eval_windows, held_out_split, split_record
from mfsdp.train.metrics import MetricsLog, StepReadout, TensorBoardLog, peak_memory_gib
from mfsdp.train.report import StepReport, progress_bar
from mfsdp.train.sample import generate_text

USER_ERRORS = (ConfigError, DataError, CheckpointError)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# Set by `mfsdp train --nproc-per-node N` for its workers: each rank's stderr then goes to a
# log file, so every rank prints its errors and the launcher shows one of them.
LAUNCHED_ENV = "MFSDP_LAUNCHED"


class RunFailed(Exception):
    """Some rank hit a user error; carries that rank's message to every rank."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than --parallel.collective_timeout_s for the other ranks."""


def timeout_hint(timeout_s: float | None = None) -> str:
    """What to do when a collective times out: the tools that find the rank and the call."""
    after = f" after {timeout_s:g} s" if timeout_s else ""
    return (f"a collective timed out{after}: some rank stopped, hung or issued a different "
            "collective. Rerun with MFSDP_CHECK_COLLECTIVES=1 (CommunicationPolicy("
            "check_collectives=True)) to name the mismatched module on each rank, and with "
            "TORCH_FR_BUFFER_SIZE=20000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 to have torch's flight "
            "recorder dump every rank's last collectives (read them with `python -m "
            "torch.distributed.flight_recorder.fr_trace`); raise --parallel.collective_timeout_s "
            "if a step or a save legitimately takes longer")


def is_timeout(text: str) -> bool:
    """Whether an error text from gloo or NCCL reports a collective timeout."""
    lowered = text.lower()
    return any(needle in lowered for needle in (
        "timed out", "timeout", "watchdog caught collective operation"))


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv)
        determinism.apply(cfg)  # before anything touches the GPU (see determinism.py)
        device = _pick_device(cfg.train.device)
    except USER_ERRORS as err:
        return _report(rank, err)
    timeout_s = cfg.parallel.collective_timeout_s
    _join_process_group(device, timeout_s)
    try:
        code = Trainer(cfg, device).run()
        # Tear down together: a rank that leaves while another still talks to it makes
        # gloo abort the latecomer at exit.
        dist.barrier()
        return code
    except RunFailed as err:
        code = _report(rank, err)
        # Every rank got here together (the failure was agreed on): leave together, so that
        # rank 0's line is out before a launcher stops the others.
        dist.barrier()
        return code
    except USER_ERRORS as err:
        code = _report(rank, err)
        if dist.get_world_size() > 1:
            # Only this rank failed (say, a corrupt window of the token file): the others
            # may be inside a collective with it, and tearing the group down would wait for
            # them. Leave at once; the launcher stops the rest.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except RuntimeError as err:  # torch.distributed's errors (DistBackendError...) included
        if is_timeout(str(err)):
            raise CollectiveTimeout(f"rank {rank}: {timeout_hint(timeout_s)}") from err
        raise
    finally:
        dist.destroy_process_group()


def _report(rank: int, err: Exception) -> int:
    """One line (on rank 0, or on every rank under the mfsdp launcher), exit code 2."""
    if rank == 0 or os.environ.get(LAUNCHED_ENV):
        print(f"mfsdp train: error: {err}", file=sys.stderr, flush=True)
    return 2


def _pick_device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no CUDA device is visible; use "
                          "--train.device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} "
                          "visible); launch at most one process per GPU")
    torch.cuda.set_device(local_rank)
    # fp32 runs (compute_dtype fp32) use TF32 tensor cores for matmuls: about 8x faster on
    # recent GPUs, at a precision that training tolerates.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.device("cuda", local_rank)


def _join_process_group(device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ:  # launched by torchrun or by `mfsdp train --nproc-per-node`
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    else:  # a plain single process: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **kwargs)


class Trainer:
    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.out_dir = Path(cfg.train.out_dir)
        self.checkpoints = self.out_dir / "checkpoints"
        self.model_cfg: LlamaConfig = cfg.llama_config()
        self.stop_requested = False
        self.resume_notes: list[str] = []
        self.held_out = 0  # tokens at the end of the training file kept for the validation loss
        self._progress = None  # the progress bar, once training runs

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    # ------------------------------------------------------------------ checks

    def preflight(self) -> tuple[TokenFile, Path | None]:
        """Everything a user can get wrong, checked on every rank before any work.

        Ranks compare notes afterwards, so a problem seen by one rank (say a file missing
        on one node) stops all of them instead of leaving the others waiting forever.
        """
        problem, data, resume_from = None, None, None
        try:
            data, resume_from, self.resume_notes = validate_run(self.cfg, self.world, self._open_data,
                                                                device_type=self.device.type)
            self._check_disk()
        except USER_ERRORS as err:
            problem = str(err)
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem)
        first = next(((r, m) for r, m in enumerate(problems) if m), None)
        if first:
            rank, message = first
            raise RunFailed(message if rank == 0 else f"(on rank {rank}) {message}")
        return data, resume_from

    def _check_disk(self) -> None:
        """The launcher's disk check (``disk.py``) where no launcher of ours ran it: a single process
        or torchrun, on each node's first rank."""
        if os.environ.get(LAUNCHED_ENV) or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        from mfsdp.train.disk import check_disk

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        warning = check_disk(self.cfg, share=min(1.0, local / self.world))
        if warning:
            print(f"mfsdp train: warning: {warning}", flush=True)

    def resolve_offload(self) -> None:
        """``--parallel.offload auto``: the planner's smallest offload fraction with which the run
        fits this GPU (none where it fits without), written into the config as ``optimizer`` with
        that fraction (or ``none``), so the memory check and the build see a plain setting; on
        CPU, none. The core only ever sees the fraction."""
        p = self.cfg.parallel
        if p.offload != "auto":
            return
        fraction = None
        if self.device.type == "cuda":
            from mfsdp.memory.plan import offload_fraction_that_fits

            try:
                fraction = offload_fraction_that_fits(self.cfg, self.world, device_memory(self.device))
            except NotImplementedError as err:  # a model the planner cannot measure
                self.log(f"(--parallel.offload auto: no plan, {err}; no offload)")
                fraction = 0.0
            if fraction is None:
                fraction = 1.0  # the memory check says what else would fit
        chosen = dataclasses.replace(p, offload="optimizer", offload_fraction=fraction) if fraction else \
            dataclasses.replace(p, offload="none", offload_fraction=1.0)
        self.cfg = dataclasses.replace(self.cfg, parallel=chosen)
        self.log(f"--parallel.offload auto: {'offload ' + format(fraction, 'g') + ' of the units' if fraction else 'no offload'}"
                 f"{' (CPU run)' if self.device.type != 'cuda' else ''}")

    def check_memory(self) -> None:
        """Stop before anything is allocated when the predicted peak cannot fit the GPU, and warn
        when it is within the allocator's margin (every rank predicts the same, so all stop
        together). CPU runs skip it."""
        if self.device.type != "cuda" or self.cfg.train.skip_memory_check:
            return
        from mfsdp.memory.plan import memory_check

        try:
            verdict = memory_check(self.cfg, self.world, device_memory(self.device))
        except NotImplementedError as err:  # a model the planner cannot measure: train anyway
            self.log(f"(memory check skipped: {err})")
            return
        if verdict and verdict[0] == "refuse":
            raise RunFailed(verdict[1])
        if verdict:
            self.log(f"mfsdp train: warning: {verdict[1]}")

    def _open_data(self) -> TokenFile:
        path = self.cfg.data.path
        if path == STDLIB:
            path = self.out_dir / "data" / "stdlib.tokens"
            # One builder per node: nodes need not share a file system.
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not path.is_file():
                self.log(f"building the demo corpus from the standard library into {path}")
                prepare_stdlib_corpus(path)
            dist.barrier()
        return TokenFile(path)

    def _model_fingerprint(self) -> dict:
        return model_fingerprint(self.model_cfg)

    # ------------------------------------------------------------------ setup

    def build(self) -> tuple[Llama, torch.optim.Optimizer]:
        p = self.cfg.parallel
        compute = _DTYPES.get(p.compute_dtype) or (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.cfg.model.hf is not None:  # a Hugging Face model, through mfsdp.manager
            model = build_hf(self.cfg, self.device, compute, self.world)
            optimizer = mfsdp.fully_shard_optimizer(model, adamw(model, self.cfg.train), offload=offload_policy(p))
            self._describe_offload(optimizer)
            return model, optimizer
        policy = mfsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32,
            main_grads_dtype=_DTYPES.get(p.main_grads_dtype),
            grad_comm_dtype=_DTYPES.get(p.grad_comm_dtype))
        # Built on the meta device and sharded there: each rank allocates only its shards,
        # and the whole model never exists on any rank (a 70b one would not fit a GPU).
        with torch.device("meta"):
            model = build_model(self.model_cfg, dtype=compute)  # Llama, or MoELlama with experts
        mesh = build_mesh(self.device.type, self.world, p.placements, p.replicate)
        parallelize(model, mesh, ParallelizeConfig(
            placements=p.placements, mixed_precision=policy, float8=self.cfg.model.float8,
            compile=self.cfg.compiles(self.device.type),
            activation_checkpointing=p.activation_checkpointing, expert_units=p.expert_units))
        materialize_and_init(model, self.device, self.cfg.train.seed)
        self.log(f"model built and initialised shard by shard: "
                 f"{shard_numel(model) / 1e6:,.1f}M parameters on this rank, peak memory "
                 f"{peak_memory_gib(self.device):.2f} GiB")
        optimizer = mfsdp.fully_shard_optimizer(model, adamw(model, self.cfg.train),
                                                offload=offload_policy(p))
        self._describe_offload(optimizer)
        mfsdp.float8.precompute_fp8_scales_after(optimizer, model)  # FP8 all-gather's scales, if any
        return model, optimizer

    def _describe_offload(self, optimizer) -> None:
        engine = mfsdp.offload.offload_of(optimizer)
        if engine is None:
            return
        numel = sum(g.main.tensor.numel() for g in engine.groups)
        clip = self.cfg.train.grad_clip
        self.log(f"optimizer offload: {len(engine.groups)} parameter groups stepped on the host "
                 f"({numel / 1e6:,.1f}M parameters on this rank, about {numel * 24 / 2**30:.1f} GiB of host "
                 f"memory with their backup), speculatively during backward"
                 + (f"; a step whose gradient norm exceeds --train.grad_clip {clip:g} runs them after "
                    "backward instead, and the next one too until a step is not clipped" if clip > 0 else ""))

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
        t = self.cfg.train
        if step <= t.warmup_steps:
            return t.lr * step / max(1, t.warmup_steps)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        data, resume_from = self.preflight()
        n_params = flops.param_counts(self.model_cfg)["total"]
        self.log(f"mfsdp train: {self.cfg.model.preset} model, {n_params / 1e6:.1f}M "
                 f"parameters, {self.cfg.schedule_line()}, {self.world} process(es) on "
                 f"{flops.device_name(self.device)}, {self.cfg.parallel.placements} placements, "
                 f"{len(data):,} tokens in {data.path}")
        self.resolve_offload()
        self.check_memory()
        model, optimizer = self.build()
        start_step = 0
        for note in self.resume_notes:
            self.log(note)
        if resume_from is not None:
            try:
                start_step = load_checkpoint(resume_from, model, optimizer)["step"]
            except CheckpointException as err:  # a BaseException: DCP's, raised on every rank
                raise CheckpointError(
                    f"loading checkpoint {resume_from} failed ({_describe_load(err)}); move "
                    "it aside to resume from the one before it") from None
            fallback = " (the newest whole checkpoint)" if self.resume_notes else ""
            self.log(f"resumed from {resume_from}{fallback} at step {start_step}")
        elif self.cfg.resume:
            self.log(f"no checkpoint in {self.checkpoints}; starting from step 0")
        d = self.cfg.data
        self.held_out, split_notes = held_out_split(
            self.cfg, data, read_meta(resume_from) if resume_from is not None else None)
        for note in split_notes:
            self.log(note)
        sampler = WindowSampler(data, d.seq_len, d.local_batch, self.rank, self.world,
                                seed=d.seed, microbatches=d.microbatches,
                                limit=len(data) - self.held_out)
        evaluator = self._evaluator(data)
        metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.rank == 0,
                             keep_until_step=start_step)
        tensorboard = TensorBoardLog(self.out_dir / "tensorboard",
                                     enabled=self.rank == 0 and self.cfg.metrics.tensorboard,
                                     purge_step=start_step + 1 if start_step else None)
        self.checkpointer = self._checkpointer(model, optimizer)
        self._install_signal_handlers()
        last = self.train(model, optimizer, sampler, (metrics, tensorboard), start_step,
                          evaluator)
        metrics.close()
        tensorboard.close()
        if self.rank == 0:
            from mfsdp.train.plotting import needs_matplotlib, plot_loss  # matplotlib is slow to import
            plot = plot_loss(metrics.path, self.out_dir / "loss.png") or needs_matplotlib("the PNG")
            self.log(f"metrics: {metrics.path}\nloss curve: {plot}\n"
                     f"checkpoint: {self.checkpoints / f'step_{last}'}")
        if self.stop_requested:
            self.log(f"stopped by signal after step {last}; continue with --resume")
            return 0
        if self.cfg.train.export_hf:
            self._export_hf(self.checkpoints / f"step_{last}")
        if self.cfg.train.sample_tokens:
            self._print_sample(model, data)
        return 0

    def _export_hf(self, checkpoint: Path) -> None:
        """--train.export_hf: rank 0 writes the final checkpoint to OUT_DIR/hf (read from disk, one
        tensor at a time, as `mfsdp export` does) while the others wait; a failure stops them all."""
        problem = None
        if self.rank == 0:
            from mfsdp.train.export import ExportError, export_hf, exported_line

            try:
                self.log(exported_line(export_hf(checkpoint, self.out_dir / "hf")))
            except (ExportError, CheckpointError) as err:
                problem = (f"exporting {checkpoint} to Hugging Face failed: {err} (the checkpoint is "
                           f"intact; retry with `mfsdp export {checkpoint} OUT_DIR`)")
        problems = [problem]
        dist.broadcast_object_list(problems, src=0)
        if problems[0]:
            raise RunFailed(problems[0])

    def _evaluator(self, data: TokenFile) -> Evaluator | None:
        windows = eval_windows(self.cfg, data, self.held_out, self.rank, self.world)
        if windows is None:
            if self.cfg.train.eval_every:
                self.log("no held-out tokens (--data.val_fraction 0 and no --data.val_path): no "
                         "validation loss")
            return None
        d, t = self.cfg.data, self.cfg.train
        where = (f"{windows.data.path}" if d.val_path is not None else
                 f"the last {self.held_out:,} tokens of {data.path}, never trained on")
        self.log(f"validation loss every {t.eval_every} steps and at the end: {t.eval_batches} "
                 f"batches of {self.world * d.local_batch * d.microbatches} windows from {where}")
        return Evaluator(windows, t.eval_batches, self.device, _to_device)

    def train(self, model, optimizer, sampler, logs, start_step: int,
              evaluator: Evaluator | None = None) -> int:
        t, d = self.cfg.train, self.cfg.data
        params = list(model.parameters())
        progress = progress_bar(t.steps, start_step, enabled=self.rank == 0 and t.progress)
        self._progress = progress
        # Loss, stop votes and gradient norm reach the host one step late, through pinned
        # memory and an event: reading them at once would stall the host until the GPU
        # drained, so the next step could not be queued meanwhile.
        readout = StepReadout(self.device)
        report = StepReport(self, logs, progress)
        if self.cfg.compiles(self.device.type):
            progress.set_postfix_str("compiling the blocks (torch.compile, first step)")
        step, stop = start_step, False
        for step in range(start_step + 1, t.steps + 1):
            lr = self.learning_rate(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=self.device)
            aux_sum = torch.zeros((), device=self.device)
            for micro in range(d.microbatches):
                batch = sampler.batch(step, micro)
                inputs = _to_device(batch.inputs, self.device)
                targets = _to_device(batch.targets, self.device)
                # Without accumulation there is nothing to defer, so skip the context.
                accumulate = (mfsdp.microbatch(model, is_last=micro == d.microbatches - 1)
                              if d.microbatches > 1 else nullcontext())
                with accumulate:
                    logits = model(inputs)
                    logits = getattr(logits, "logits", logits)  # HF models return an output object
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                    objective = loss
                    if isinstance(model, MoELlama):  # plus the weighted load-balancing loss
                        aux = model.aux_loss()
                        objective = loss + self.model_cfg.moe_aux_loss_coef * aux
                        aux_sum += aux.detach() / d.microbatches
                    (objective / d.microbatches).backward()
                loss_sum += loss.detach() / d.microbatches
            # The norm is logged every step and clips only with grad_clip > 0. Over sharded
            # gradients it is a DTensor: reduce it once, then clip with that plain tensor.
            grad_norm = torch.nn.utils.get_total_norm(
                [q.grad for q in params if q.grad is not None])
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # One collective carries the loss for logging and every rank's stop request.
            # Every rank reads the votes at the same step (one late), so all leave the loop
            # after the same step.
            shared = torch.stack([loss_sum, torch.full((), float(self.stop_requested),
                                                       device=self.device), aux_sum])
            dist.all_reduce(shared)
            values = torch.cat([shared, grad_norm.to(self.device, torch.float32).reshape(1)])
            extra = {"lr": lr}
            stop = report(readout.push(step, values, extra)) or stop
            if evaluator is not None and (step % t.eval_every == 0 or step == t.steps):
                # Read with this step's record, one step late; see the note in evaluate.py.
                extra["val_loss"] = evaluator(model)
                readout.restart_clock()  # the next step's time leaves the evaluation out
            self.checkpointer.poll(step)  # publishes a finished background write, or raises
            due = t.checkpoint_every and step % t.checkpoint_every == 0
            if due or step == t.steps or stop:
                stop = report(readout.flush()) or stop
                self.checkpointer.save(step, model, optimizer, self._meta())
                readout.restart_clock()
            if stop:
                break
        report(readout.flush())
        self.checkpointer.close()  # the end of the run waits for the last background write
        progress.close()
        return step

    def _checkpointer(self, model, optimizer) -> Checkpointer:
        t = self.cfg.train
        asynchronous = t.async_checkpoint_on(self.device.type)
        held = planned_staging_bytes(shard_numel(model))
        if asynchronous and t.async_checkpoint == "auto":  # "true" forces it whatever it pins
            problem = async_staging_problem(held, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), host_memory())
            if problem:
                self.log(problem)
                asynchronous = False
        if asynchronous:
            size = f"{held / 2**30:.1f} GiB" if held >= 2**30 else f"{held / 2**20:.1f} MiB"
            self.log(f"checkpoints are written in the background (--train.async_checkpoint "
                     f"{t.async_checkpoint}), staged in about {size} of "
                     f"{'pinned ' if self.device.type == 'cuda' else ''}host memory per rank")
        return Checkpointer(self.checkpoints, t.keep_checkpoints, asynchronous,
                            pinned=self.device.type == "cuda",
                            timeout_s=self.cfg.parallel.collective_timeout_s, log=self.note,
                            model=model, optimizer=optimizer)  # to pin its staging early

    def note(self, message: str) -> None:
        """A line on rank 0 that leaves the progress bar (when there is one) intact."""
        if self.rank == 0:
            write = getattr(self._progress, "write", None)
            write(message) if write else print(message)
            sys.stdout.flush()

    def _meta(self) -> dict:
        return {"model": self._model_fingerprint(), "data_seed": self.cfg.data.seed,
                "world_size": self.world, "config": self.cfg.to_dict(),
                HELD_OUT: split_record(self.cfg, self.held_out), **self._hf_config()}

    def _hf_config(self) -> dict:
        """A --model.hf run's config.json, so that `mfsdp export` needs no access to that directory."""
        if self.cfg.model.hf is None:
            return {}
        import json

        return {"hf_config": json.loads((Path(self.cfg.model.hf) / "config.json").read_text())}

    def _install_signal_handlers(self) -> None:
        """First Ctrl-C or SIGTERM: finish the step, save, exit cleanly. Second: abort."""
        def request_stop(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True
            self.log(f"\nreceived {signal.Signals(signum).name}: saving after this step")
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    def _print_sample(self, model: Llama, data: TokenFile) -> None:
        try:
            tokenizer = load_tokenizer(data.tokenizer)
        except DataError as err:
            self.log(f"(no text sample: {err})")
            return
        prompt = "def "
        text = generate_text(model, tokenizer, prompt, self.cfg.train.sample_tokens,
                             max_context=self.cfg.data.seq_len, device=self.device,
                             seed=self.cfg.train.seed)
        self.log(f"\n--- sample (temperature 0.8, prompt {prompt!r}) ---\n{text}\n--- end ---")


def host_memory() -> int:
    """Bytes of this node's RAM; a function so tests can replace it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(device: torch.device) -> int:
    """Total bytes of the GPU (``torch.cuda.mem_get_info``); a function so tests can replace it."""
    return torch.cuda.mem_get_info(device)[1]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy of a batch: from pinned memory and non-blocking on CUDA, so it
    overlaps the work already queued instead of waiting for it."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _describe_load(err: BaseException) -> str:
    failures = getattr(err, "failures", None) or {}
    for rank, wrapped in failures.items():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return str(err).splitlines()[0]
