"""The errors a user of ``mfsdp train`` can fix, how every rank stops on one, and the hint for a
collective that timed out."""

from __future__ import annotations

import torch.distributed as dist

from mfsdp.data import DataError

# Set by `mfsdp train --nproc-per-node N` for its workers, to its pid: each rank's stderr then goes to a
# log file, so every rank prints its errors and the launcher shows one of them.
LAUNCHED_ENV = "MFSDP_LAUNCHED"


class ConfigError(Exception):
    """A configuration problem the user can fix; the message names the fix."""


class CheckpointError(Exception):
    """A checkpoint problem the user can fix; the message names the fix."""


class RunFailed(Exception):
    """Some rank hit a user error; carries that rank's message to every rank."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than --parallel.collective_timeout_s for the other ranks."""


USER_ERRORS = (ConfigError, DataError, CheckpointError)


def require(condition: bool, message: str) -> None:
    """ConfigError(``message``) unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def first_problem(problem: str | None, group=None) -> tuple[int, str] | None:
    """Every rank's ``problem`` (None: none), exchanged; the first rank that has one and its text.
    Collective over ``group``; a world of one exchanges nothing."""
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    return next(((rank, text) for rank, text in enumerate(problems) if text), None)


def agree(problem: str | None, group=None) -> None:
    """Raise ``RunFailed`` on every rank when any rank has a ``problem``, so that a file missing on
    one node stops all ranks instead of leaving the others waiting; collective."""
    first = first_problem(problem, group)
    if first:
        rank, text = first
        raise RunFailed(text if rank == 0 else f"(on rank {rank}) {text}")


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
