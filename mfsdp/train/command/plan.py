"""``mfsdp plan``: the memory of a ``mfsdp train`` config per GPU, and the settings that fit.

Reads the same config as ``mfsdp train`` (``--config FILE.yaml`` and ``--section.key value`` flags,
``--model.hf DIR`` included), plus ``--nproc-per-node`` / ``--nnodes`` for the world size and
``--gpu-memory`` for the device (default: this machine's GPU, else an H200's 141 GiB). The search
itself is the planner's (``mfsdp.memory.plan``); this module turns a config into its ``PlannedRun``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from mfsdp.data import DataError, TokenFile
from mfsdp.memory import plan
from mfsdp.memory.tensor_parallel import TensorParallel
from mfsdp.train.build.model import transforms_for
from mfsdp.train.checkpoint.meta import MAIN_WEIGHT_BYTES, checkpoint_bytes
from mfsdp.train.command.args import parse_config, usage
from mfsdp.train.run.config import DTYPES, RunConfig
from mfsdp.train.run.resolve import check_expert_parallel, resolve
from mfsdp.train.command.errors import ConfigError
from mfsdp.train.objectives import objective_for

USAGE = """usage: mfsdp plan [--config FILE.yaml] [--nproc-per-node N] [--nnodes N] [--gpu-memory 141GiB]
                  [--tp N [--sequence-parallel true|false] [--loss-parallel true|false]]
                  [--out PNG (default: OUT_DIR/plan.png)] [--SECTION.KEY VALUE ...]

Predicts one GPU's memory for a `mfsdp train` run (peak of allocated memory, the phase where it
occurs, every component), lists the settings that fit, fastest first, and draws the step's memory.
A --model.hf DIR that the bundled Llama can run is planned as that Llama (--model.hf_impl auto), the
model `mfsdp train` builds for it. A --data.path of preference pairs is planned as DPO. --tp N plans a Hugging Face model through the manager with tensor
parallel over N of the GPUs (sequence parallel and the vocabulary-parallel loss on unless turned off).
"""


def planned_run(cfg: RunConfig) -> plan.PlannedRun:
    """What the planner needs of ``cfg``, planned for GPUs (``--parallel.offload auto`` as none). A
    --model.hf model on the bundled route is planned as the bundled Llama of its config, the model
    that trains (compiled blocks included); through the manager, as the Hugging Face model."""
    p, d = cfg.parallel, cfg.data
    setting = plan.Setting(p.placements, p.activation_checkpointing, d.local_batch, d.microbatches,
                           p.main_grads_dtype, p.offload_fraction if p.offload == "optimizer" else 0.0,
                           d.local_batch * d.microbatches * d.seq_len)
    grads = {name: cfg.main_grads_dtype(name) for name in ("auto", *DTYPES)}
    return plan.PlannedRun(
        cfg.resolved.transformers_config if cfg.model.uses_manager else cfg.resolved.shape, setting, d.seq_len, grads,
        cfg.main_grads_name("cuda"), p.replicate, cfg.compute_dtype("cuda"), cfg.grad_comm_dtype(),
        p.expert_units, transforms_for(cfg), not cfg.train.fused_adamw("cuda"), cfg.compiles("cuda"),
        cfg.train.async_checkpoint_on("cuda"), cfg.model.head_loss, flat_adamw=cfg.train.flat_adamw("cuda"),
        keep_gathered_blocks=p.kept_blocks(), step_run=objective_for(cfg, None).step_run(), ep=p.ep)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage(USAGE))
        return 0
    own = {"--nproc-per-node": "1", "--nnodes": "1", "--gpu-memory": None, "--out": None, "--tp": "1",
           "--sequence-parallel": "true", "--loss-parallel": "true"}
    rest, args = [], iter(argv)
    for arg in args:
        key, eq, value = arg.partition("=")
        if key not in own:
            rest.append(arg)
            continue
        own[key] = value if eq else next(args, None)
        if own[key] is None:
            return _error(f"{key} needs a value")
    try:
        cfg, tp = parse_config(rest), _tensor_parallel(own)
        if tp.enabled and cfg.model.hf is not None:  # tensor parallel is the manager's
            cfg = dataclasses.replace(cfg, model=cfg.model.on_manager())
        cfg = resolve(cfg)
        if Path(cfg.data.path).is_file() and TokenFile(cfg.data.path).is_pairs:  # DPO, as `mfsdp train` finds it
            cfg = dataclasses.replace(cfg, pairs=True)
        world = int(own["--nproc-per-node"]) * int(own["--nnodes"])
        check_expert_parallel(cfg, world, tp.size)
        run = planned_run(cfg)
        if own["--gpu-memory"]:
            gpu, source = plan.parse_bytes(own["--gpu-memory"]), "--gpu-memory"
        elif torch.cuda.is_available():
            gpu, source = torch.cuda.mem_get_info()[1], torch.cuda.get_device_name()
        else:
            gpu, source = plan.DEFAULT_GPU, "assumed (an H200; set --gpu-memory)"
        e = plan.estimate_run(run, world, tp=tp, tp_in_process=True)
    except (ConfigError, DataError, ValueError, NotImplementedError) as err:
        return _error(str(err))
    # A LoRA checkpoint holds the adapters alone: all of them, an upper bound of a rank's shard.
    params = cfg.resolved.adapter_params if cfg.peft.lora else e.breakdown.get("main weights", 0) // MAIN_WEIGHT_BYTES
    staging = checkpoint_bytes(params, cfg.save_dtype("cuda")) if run.async_checkpoint else 0
    model = cfg.model.preset if cfg.model.hf is None else \
        cfg.model.hf + ("" if cfg.model.uses_manager else " (the bundled Llama)")
    print(plan.report(run, e, model, world, tp, gpu, source,
                      int(own["--nproc-per-node"]), staging))
    out = Path(own["--out"] or Path(cfg.train.out_dir) / "plan.png")  # the run's directory, never a tracked file
    print(f"\nmemory over the step: {plan.plot_phases(e, out)}")
    return 0


def _tensor_parallel(own: dict) -> TensorParallel:
    keys = ("--sequence-parallel", "--loss-parallel")
    for key in keys:
        if own[key].lower() not in ("true", "false"):
            raise ValueError(f"{key} {own[key]!r}: give true or false")
    size = int(own["--tp"])
    return TensorParallel(size, *(own[key].lower() == "true" for key in keys)) if size > 1 else TensorParallel()


def _error(message: str) -> int:
    print(f"mfsdp plan: error: {message}", file=sys.stderr)
    return 2
