"""Everything a user can get wrong, checked before anything is built: ``check_run`` in the launcher
and on every worker, then, on the workers, the offload choice and the memory check. The result is a
``ResolvedRun``: a config with nothing left to resolve, its open token file and the checkpoint to
resume from."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mfsdp.data import STDLIB, DataError, PairWindows, TokenFile, prepare_stdlib_corpus
from mfsdp.data.identity import check_tokenizer
from mfsdp.mesh import mesh_shape_error
from mfsdp.models.llama import LlamaConfig
from mfsdp.models.moe import EXPERTS_LAYOUT
from mfsdp.train.build.batches import steps_for_epochs
from mfsdp.train.checkpoint import CheckpointMeta, check_compatible, find_resumable
from mfsdp.train.run.config import ModelSection, RunConfig
from mfsdp.train.run.disk import check_disk
from mfsdp.train.loop.evaluate import held_out_split
from mfsdp.train.report.record import run_line
from mfsdp.train.run.resolve import check_expert_parallel, with_pairs, with_steps
from mfsdp.train.run.run_dir import check_out_dir
from mfsdp.train.command.errors import LAUNCHED_ENV, USER_ERRORS, CheckpointError, ConfigError, RunFailed, agree


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """A run ready to build: every check passed on every rank."""

    cfg: RunConfig
    """The config, with ``--parallel.offload auto`` resolved to a plain setting and
    ``--train.epochs`` to steps."""
    data: TokenFile | None
    """The training token file (None where the launcher leaves the demo corpus to the workers)."""
    resume_from: Path | None
    """The checkpoint to load, or None."""
    notes: tuple[str, ...] = ()
    """Lines for the user: damaged checkpoints skipped on the way to ``resume_from``."""
    disk_warning: str | None = None
    """Why the checkpoints held at once may not all fit on this node's disk (``disk.check_disk``)."""


def model_fingerprint(model_cfg: LlamaConfig) -> dict:
    """What a checkpoint must match to be loadable into a model of shape ``model_cfg``."""
    fingerprint = {k: getattr(model_cfg, k) for k in (
        "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")}
    if model_cfg.num_experts:  # only then: dense checkpoints written before MoE lack the keys
        fingerprint.update(num_experts=model_cfg.num_experts, experts=EXPERTS_LAYOUT)
    return fingerprint


def experts_layout_problem(path: Path, model: dict) -> str | None:
    """Why checkpoint ``path``, whose model fingerprint is ``model``, cannot load into the bundled
    mixture of experts: it stores one module per expert (written before the experts were stacked,
    so its fingerprint records no layout). None when that is not the problem."""
    if not model.get("num_experts") or "experts" in model:
        return None
    return (f"checkpoint {path} stores the experts one module per expert (mfsdp before the stacked layout), "
            "which this mfsdp cannot load into its stacked experts; finish the run with the mfsdp that wrote "
            "it (whose `mfsdp export` writes a Mixtral directory that --model.hf can train), or start fresh "
            "in another --train.out_dir")


def check_run(cfg: RunConfig, world: int, device_type: str, open_data: Callable[[], TokenFile] | None = None,
              disk_share: float | None = None) -> ResolvedRun:
    """Check what needs no GPU and no peers; raises a user error. ``open_data`` opens the token file
    (None skips the data checks); ``disk_share``: this node's share of each checkpoint, for the disk
    check (None skips it)."""
    p = cfg.parallel
    problem = mesh_shape_error(world, p.placements, p.replicate) or _float8_compile_problem(cfg, device_type)
    if problem:
        raise ConfigError(problem)
    check_expert_parallel(cfg, world)
    model_cfg = cfg.resolved.shape
    data = open_data() if open_data is not None else None
    if data is not None:
        check_tokenizer(data, cfg.model.hf, cfg.data.path)
    if data is not None and data.vocab_size > model_cfg.vocab_size:
        raise DataError(f"{data.path} was tokenized with a vocabulary of {data.vocab_size} but the model has "
                        f"{model_cfg.vocab_size} embeddings; set --model.vocab_size {data.vocab_size} or more")
    if cfg.data.val_path is not None:
        _check_val_file(cfg.data.val_path, data, model_cfg)
    resume_from, notes, meta = None, [], None
    if cfg.resume:
        resume_from, notes = find_resumable(Path(cfg.train.out_dir) / "checkpoints")
        if resume_from is not None:
            if problem := experts_layout_problem(resume_from, CheckpointMeta.read(resume_from).model):
                raise CheckpointError(problem)
            meta = check_compatible(resume_from, model_fingerprint(model_cfg))
            _check_route(resume_from, meta, cfg)
    if data is not None:
        cfg = _for_samples(cfg, data, world, meta)
    check_out_dir(cfg, resume_from)  # after the data: a pair file's run has the DPO recipe and section
    warning = check_disk(cfg, disk_share, device_type) if disk_share is not None else None
    return ResolvedRun(cfg, data, resume_from, tuple(notes), warning)


def _check_route(path: Path, meta: CheckpointMeta, cfg: RunConfig) -> None:
    """A checkpoint resumes on the route that wrote it: the bundled Llama's parameters and a Hugging
    Face model's have other names (and optimizer states), so a route change cannot load it."""
    was = "manager" if ModelSection.recorded((meta.config or {}).get("model") or {}).uses_manager else "bundled"
    now = "manager" if cfg.model.uses_manager else "bundled"
    if was != now:
        raise CheckpointError(f"checkpoint {path} was trained on the {was} route and this run takes the {now} "
                              f"one; resume with --model.hf_impl {was}, or start fresh in another --train.out_dir")


def preflight(cfg: RunConfig, device: torch.device, log: Callable[[str], None]) -> ResolvedRun:
    """The workers' checks, on every rank together (a problem on one rank stops all), then the
    offload choice and the memory check; collective."""
    world = dist.get_world_size()
    # The launcher's disk check, where no launcher of ours ran it: on each node's first rank.
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    share = None if os.environ.get(LAUNCHED_ENV) or not first_on_node else \
        min(1.0, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / world)
    problem, run = None, None
    try:
        run = check_run(cfg, world, device.type, lambda: open_data(cfg, log), share)
    except USER_ERRORS as err:
        problem = str(err)
    agree(problem)
    if run.disk_warning:  # on the rank that checked its node's disk
        print(f"mfsdp train: warning: {run.disk_warning}", flush=True)
    log(run_line(run.cfg, world, device, run.data))
    if note := run.cfg.route_note():
        log(note)
    cfg = resolve_kept_blocks(resolve_offload(run.cfg, world, device, log), world, device, log)
    check_memory(cfg, world, device, log)
    return dataclasses.replace(run, cfg=cfg)


def open_data(cfg: RunConfig, log: Callable[[str], None]) -> TokenFile:
    """The training token file; the demo corpus is built on first use, by one rank per node (nodes
    need not share a file system)."""
    path = cfg.data.path
    if path == STDLIB:
        path = Path(cfg.train.out_dir) / "data" / "stdlib.tokens"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not path.is_file():
            log(f"building the demo corpus from the standard library into {path}")
            prepare_stdlib_corpus(path)
        dist.barrier()
    return TokenFile(path, model_hf=cfg.model.hf)


def _for_samples(cfg: RunConfig, data: TokenFile, world: int, resumed) -> RunConfig:
    """The config for ``data``: preference pairs tune preferences (``_for_pairs``); ``--train.epochs``
    as steps; packed samples refused where the model has no document attention."""
    if data.is_pairs:
        cfg = _for_pairs(cfg, data)
    elif cfg.dpo_given:
        raise ConfigError(f"{', '.join(cfg.dpo_given)} applies to preference pairs, and {data.path} holds none "
                          "(prepare prompt/chosen/rejected rows with `mfsdp prepare-data`); drop the --dpo flags")
    elif data.num_samples is not None and cfg.data.packing and cfg.model.uses_manager:
        raise ConfigError(f"{data.path} holds samples, packed several to a window by default, and a "
                          "--model.hf model trained through the manager has no document attention to keep "
                          "them apart; use --data.packing false (one sample per window), or the bundled "
                          "route (--model.hf_impl auto or bundled) where the config allows it")
    if cfg.train.epochs is None:
        return cfg
    return with_steps(cfg, steps_for_epochs(cfg, data, held_out_split(cfg, data, resumed)[0], world))


def _for_pairs(cfg: RunConfig, data: TokenFile) -> RunConfig:
    """A file of preference pairs: the DPO recipe, and every pair (and the --data.val_path file's)
    checked to fit a window in the layout of the route (a DataError naming the longest and the fixes)."""
    packed = not cfg.model.uses_manager  # the manager's models have no document attention: padded pairs
    PairWindows(data, cfg.data.seq_len, packed=packed)
    if cfg.data.val_path is not None:
        val = TokenFile(cfg.data.val_path)
        if not val.is_pairs:
            raise DataError(f"--data.val_path {val.path} holds no preference pairs, and {data.path} does; "
                            "prepare both from preference rows")
        PairWindows(val, cfg.data.seq_len, packed=packed)
    return with_pairs(cfg)


def cuda_problem(nproc: int = 1, local_rank: int = 0) -> str | None:
    """Why ``nproc`` processes cannot each have a GPU here, or None; the launcher asks first."""
    if not torch.cuda.is_available():
        return "train.device is cuda but no CUDA device is visible; use --train.device cpu"
    if max(nproc, local_rank + 1) > torch.cuda.device_count():
        return (f"{'--nproc-per-node ' + str(nproc) if nproc > 1 else 'local rank ' + str(local_rank)} but this "
                f"node has {torch.cuda.device_count()} GPU(s); start at most one process per GPU")
    return None


def _float8_compile_problem(cfg: RunConfig, device_type: str) -> str | None:
    """Why the float8 setting cannot run as configured on ``device_type``, or None. Eager float8 on
    CUDA runs torchao's casts kernel by kernel, slower than bf16; CPU keeps it allowed (tests)."""
    if cfg.model.float8 == "none" or device_type != "cuda" or cfg.compiles(device_type):
        return None
    return (f"--model.float8 {cfg.model.float8} with --parallel.compile false runs torchao's float8 casts "
            "eagerly, slower than bf16 on CUDA; use --parallel.compile auto (or true), or --model.float8 none")


def _check_val_file(path: str, data: TokenFile | None, model_cfg: LlamaConfig) -> None:
    """The --data.val_path token file: readable, in the model's vocabulary, same tokenizer."""
    val = TokenFile(path)  # DataError naming the fix when missing or corrupt
    if val.vocab_size > model_cfg.vocab_size:
        raise DataError(f"--data.val_path {path} was tokenized with a vocabulary of {val.vocab_size} "
                        f"but the model has {model_cfg.vocab_size} embeddings; tokenize it as the "
                        "training file")
    if data is not None and not val.same_tokenizer(data):
        raise DataError(f"--data.val_path {path} was tokenized by {val.tokenizer!r}, the training file "
                        f"{data.path} by {data.tokenizer!r}; tokenize both with the same --tokenizer")


def resolve_offload(cfg: RunConfig, world: int, device: torch.device, log) -> RunConfig:
    """``--parallel.offload auto``: the planner's smallest offload fraction with which the run fits
    this GPU (none where it fits without; on CPU, none), as a plain setting."""
    p = cfg.parallel
    if p.offload != "auto":
        return cfg
    fraction = None
    if device.type == "cuda":
        from mfsdp.memory.plan import offload_fraction_that_fits

        fraction = _ask_planner(offload_fraction_that_fits, cfg, world, device, log,
                                "(--parallel.offload auto: no plan, {}; no offload)", 0.0)
        if fraction is None:
            fraction = 1.0  # the memory check says what else would fit
    chosen = (dataclasses.replace(p, offload="optimizer", offload_fraction=fraction) if fraction
              else dataclasses.replace(p, offload="none", offload_fraction=1.0))
    log(f"--parallel.offload auto: {'offload ' + format(fraction, 'g') + ' of the units' if fraction else 'no offload'}"
        f"{' (CPU run)' if device.type != 'cuda' else ''}")
    return dataclasses.replace(cfg, parallel=chosen)


def resolve_kept_blocks(cfg: RunConfig, world: int, device: torch.device, log) -> RunConfig:
    """``--parallel.keep_gathered_blocks auto``: on one GPU, the planner's most blocks that keep their
    gathers with the run still fitting (a gather there is a cast or an FP8 encode that the compute
    waits for); elsewhere, and for the manager's models, none. As a plain number."""
    p = cfg.parallel
    if p.keep_gathered_blocks != "auto":
        return cfg
    kept, blocks = 0, cfg.resolved.shape.n_layers if not cfg.model.uses_manager else 0
    if device.type == "cuda" and world == 1 and blocks:
        from mfsdp.memory.plan import kept_blocks_that_fit

        kept = _ask_planner(kept_blocks_that_fit, cfg, world, device, log,
                            "(--parallel.keep_gathered_blocks auto: no plan, {}; none kept)", 0, blocks)
        log(f"--parallel.keep_gathered_blocks auto: the last {kept} of {blocks} blocks keep their gathers "
            "through the step (one GPU: as many as fit)")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, keep_gathered_blocks=str(kept)))


def check_memory(cfg: RunConfig, world: int, device: torch.device, log) -> None:
    """Stop before anything is allocated when the predicted peak cannot fit the GPU, and warn when it
    is within the allocator's margin (every rank predicts the same, so all stop together). CPU runs
    skip it."""
    if device.type != "cuda" or cfg.train.skip_memory_check:
        return
    from mfsdp.memory.plan import memory_check

    verdict = _ask_planner(memory_check, cfg, world, device, log, "(memory check skipped: {})", None)
    if verdict and verdict[0] == "refuse":
        raise RunFailed(verdict[1])
    if verdict:
        log(f"mfsdp train: warning: {verdict[1]}")


def _ask_planner(ask, cfg: RunConfig, world: int, device: torch.device, log, skipped: str, otherwise, *args):
    """``ask(planned run, world, this GPU's bytes, *args)`` of the planner; for a model the planner
    cannot measure, the line ``skipped`` (its error in the braces) and ``otherwise``: train anyway."""
    from mfsdp.train.command.plan import planned_run

    try:
        return ask(planned_run(cfg), world, device_memory(device), *args)
    except NotImplementedError as err:
        log(skipped.format(err))
        return otherwise


def device_memory(device: torch.device) -> int:
    """Total bytes of the GPU (``torch.cuda.mem_get_info``); a function so tests can replace it."""
    return torch.cuda.mem_get_info(device)[1]
