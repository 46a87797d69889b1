"""The worker process of ``mfsdp train``: the device, the process group, the run, the exit code.

``main`` is the worker entry for ``mfsdp train --nproc-per-node N`` (``launcher.py``) and for
``torchrun -m mfsdp.train``; torch's ``errors.record`` hands an uncaught error to the launcher's
summary. A user error is one line and exit code 2.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from mfsdp.train.run import determinism
from mfsdp.train.command.args import usage
from mfsdp.train.command.errors import (LAUNCHED_ENV, USER_ERRORS, CollectiveTimeout, ConfigError, RunFailed, is_timeout,
                                timeout_hint)
from mfsdp.train.command.launcher import die_with_launcher
from mfsdp.train.run.preflight import cuda_problem, preflight
from mfsdp.train.run.run_dir import check_shared
from mfsdp.train.run.resolve import load_config
from mfsdp.train.loop.trainer import Trainer


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    die_with_launcher()
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv)
        determinism.apply(cfg)  # before anything touches the GPU (see determinism.py)
        device = pick_device(cfg.train.device)
    except USER_ERRORS as err:
        return _report(rank, err)
    timeout_s = cfg.parallel.collective_timeout_s
    _join_process_group(device, timeout_s)
    log = (lambda message: print(message, flush=True)) if rank == 0 else (lambda message: None)
    try:
        check_shared(Path(cfg.train.out_dir))
        code = Trainer(preflight(cfg, device, log), device).run()
        # Tear down together: a rank that leaves while another still talks to it makes gloo
        # abort the latecomer at exit.
        dist.barrier()
        return code
    except RunFailed as err:
        code = _report(rank, err)
        # Every rank got here together (the failure was agreed on): leave together, so that rank
        # 0's line is out before a launcher stops the others.
        dist.barrier()
        return code
    except USER_ERRORS as err:
        code = _report(rank, err)
        if dist.get_world_size() > 1:
            # Only this rank failed (say, a corrupt window of the token file): the others may be
            # inside a collective with it, and tearing the group down would wait for them. Leave
            # at once (its line is out: _report flushed it); the launcher stops the rest.
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
    sys.stdout.flush()
    if rank == 0 or os.environ.get(LAUNCHED_ENV):
        print(f"mfsdp train: error: {err}", file=sys.stderr, flush=True)
    return 2


def pick_device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if problem := cuda_problem(local_rank=local_rank):
        raise ConfigError(problem)
    torch.cuda.set_device(local_rank)
    # fp32 runs (compute_dtype fp32) use TF32 tensor cores for matmuls: about 8x faster on recent
    # GPUs, at a precision that training tolerates.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.device("cuda", local_rank)


def _join_process_group(device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ:  # launched by torchrun or by `mfsdp train --nproc-per-node`
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    else:  # a plain single process: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
