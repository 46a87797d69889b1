"""``mfsdp train --nproc-per-node N``: check the run, then start its workers through torch's
elastic launcher, as ``tune run`` and ``accelerate launch`` do.

Before any worker starts, the launching process parses the whole config and checks what it
can: keys and values, the model preset, the device, the mesh against the world size, the
token file and its vocabulary, the checkpoint ``--resume`` would load, and whether the
checkpoints fit on this node's disk (``disk.py``). A mistake is one line on stderr and exit
code 2; a doubt (the kept checkpoints will not all fit) is one warning line, and the run starts.

The workers run ``python -m mfsdp.train`` (``main.main``) under
``torch.distributed.launcher.api.elastic_launch``. Their stdout is the console; each rank's
stderr goes to ``OUT_DIR/logs/<run>/attempt_<n>/<local rank>/stderr.log``, so warnings and
tracebacks do not bury the output. When a worker fails, the launcher prints a short summary:
the rank that failed first (a rank killed by a signal is named as lost), its error, where
the full traceback is, and how to continue. Ctrl-C or SIGTERM is passed on to every rank,
which finishes its step and saves; the launcher then exits 0 and says to continue with
``--resume``. A rank that is lost or hangs gets the others stopped, and after
``--stop-timeout`` seconds killed, so the job never outlives its workers; and the workers die
with their launcher (``die_with_launcher``), so they never outlive the job.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from mfsdp import _compat
from mfsdp.train.command.args import LAUNCHER_FLAGS, RunConfig, flag_value, usage
from mfsdp.train.command.errors import LAUNCHED_ENV, USER_ERRORS, ConfigError, is_timeout, require, timeout_hint

if TYPE_CHECKING:
    from mfsdp.train.run.preflight import ResolvedRun

USER_ERROR_EXIT = 2
_ERROR_PREFIX = "mfsdp train: error: "
_WARNING_PREFIX = "mfsdp train: warning: "


@dataclass(frozen=True)
class LaunchOptions:
    """How many workers to start here and how the nodes find each other."""

    nproc_per_node: int
    """Worker processes on this node, normally one per GPU."""
    nnodes: int = 1
    """Nodes in the job; every node runs one `mfsdp train` with the same flags."""
    node_rank: int | None = None
    """This node's index. Node 0 hosts the rendezvous store; None decides by hostname."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous, the same on every node (required when nnodes > 1)."""
    rdzv_id: str | None = None
    """Job id shared by the nodes of one job; None uses $SLURM_JOB_ID, else "mfsdp"."""
    max_restarts: int = 0
    """How often the workers are restarted after a failure (each restart resumes only if
    --resume is given)."""
    stop_timeout_s: float = 50.0
    """Seconds the workers get to save and exit after Ctrl-C, SIGTERM or a lost rank before
    they are killed."""

    def __post_init__(self) -> None:
        require(self.nproc_per_node >= 1, "--nproc-per-node must be at least 1")
        require(self.nnodes >= 1, "--nnodes must be at least 1")
        require(self.nnodes == 1 or bool(self.rdzv_endpoint), f"--nnodes {self.nnodes} needs --rdzv-endpoint "
                "HOST:PORT, the same on every node (HOST: the first node)")
        require(self.node_rank is None or 0 <= self.node_rank < self.nnodes,
                f"--node-rank must lie in [0, {self.nnodes}), got {self.node_rank}")
        require(self.max_restarts >= 0, "--max-restarts must not be negative")
        require(self.stop_timeout_s > 0, "--stop-timeout must be positive")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def is_launch(argv: list[str]) -> bool:
    """Whether ``mfsdp train ARGV`` asks for worker processes (any launcher flag)."""
    return any(arg.partition("=")[0] in LAUNCHER_FLAGS for arg in argv)


def split_args(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """The launcher's options, and the arguments left for the workers."""
    values: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i].partition("=")[0] not in LAUNCHER_FLAGS:
            rest.append(argv[i])
            i += 1
            continue
        flag, text, i = flag_value(argv, i)
        name, kind = LAUNCHER_FLAGS[flag]
        try:
            values[name] = kind(text)
        except ValueError:
            raise ConfigError(f"{flag} expects {kind.__name__}, got {text!r}") from None
    if "nproc_per_node" not in values:
        raise ConfigError("launching workers needs --nproc-per-node N (one per GPU)")
    return LaunchOptions(**values), rest


def main(argv: list[str]) -> int:
    """``mfsdp train`` with launcher flags; returns the exit code."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage())
        return 0
    try:
        options, rest = split_args(argv)
        checked = check(options, rest)
    except USER_ERRORS as err:
        return _error(str(err))
    from mfsdp.train.run.run_dir import finished_line

    if done := finished_line(checked.cfg, checked.resume_from):  # a resume with nothing left to train
        print(done, flush=True)
        return 0
    return run(options, checked.cfg, rest)


def check(options: LaunchOptions, rest: list[str]) -> ResolvedRun:
    """Everything the workers would refuse, checked here first (``preflight.check_run``); raises a
    user error, else returns the checked run."""
    import torch

    from mfsdp.data import STDLIB, TokenFile
    from mfsdp.train.run.preflight import check_run, cuda_problem
    from mfsdp.train.run.resolve import load_config

    cfg = load_config(rest)
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and (problem := cuda_problem(options.nproc_per_node)):
        raise ConfigError(problem)
    path = cfg.data.path
    run = check_run(cfg, options.world_size, "cuda" if cuda else "cpu",
                    None if path == STDLIB else (lambda: TokenFile(path, model_hf=cfg.model.hf)),
                    disk_share=options.nproc_per_node / options.world_size)
    if run.disk_warning:
        print(f"{_WARNING_PREFIX}{run.disk_warning}", file=sys.stderr, flush=True)
    return run


def run(options: LaunchOptions, cfg: RunConfig, rest: list[str]) -> int:
    """Start the workers and wait for them; a summary on failure."""
    from torch.distributed.elastic.multiprocessing import SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out_dir = Path(cfg.train.out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if options.nnodes == 1 and not options.rdzv_endpoint:  # as torchrun --standalone
        endpoint, run_id, rdzv_configs = "localhost:0", uuid.uuid4().hex[:12], {}
    else:
        endpoint = options.rdzv_endpoint
        run_id = options.rdzv_id or os.environ.get("SLURM_JOB_ID") or "mfsdp"
        rdzv_configs = ({} if options.node_rank is None
                        else {"is_host": options.node_rank == 0})
    os.environ[LAUNCHED_ENV] = str(os.getpid())  # see die_with_launcher
    # Several workers share the node's cores: one OpenMP thread each, as torchrun sets.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_torch_elastic()
    config = _compat.launch_config(
        LaunchConfig, min_nodes=options.nnodes, max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node, run_id=run_id, rdzv_backend="c10d",
        rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
        max_restarts=options.max_restarts, monitor_interval=0.1,
        logs_specs=_LogsSpecs(log_dir=str(log_dir), redirects=Std.ERR),
        shutdown_timeout=max(1, round(options.stop_timeout_s)))
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "mfsdp.train", *rest)
        return 0
    except ChildFailedError as err:
        return _summarize(err.failures, cfg, config.logs_specs.stderrs)
    except SignalException as err:
        return _after_signal(err.sigval.name, cfg)
    except Exception as err:  # noqa: BLE001: rendezvous problems, reported in one line
        name = type(err).__name__
        if "Rendezvous" in name:
            return _error(f"rendezvous at {endpoint} failed ({name}: {err}); check that "
                          "--rdzv-endpoint names the first node, that its port is free and "
                          "reachable, and that every node uses the same --nnodes and --rdzv-id",
                          code=1)
        raise


def die_with_launcher() -> None:
    """In a worker of ``mfsdp train --nproc-per-node``: have Linux SIGKILL it when its launcher (the
    elastic agent, its parent) dies. The agent starts each worker in a session of its own, so a kill
    of the launcher's process group (a job script's ``kill -9``, the OOM killer) would leave it
    training and writing into the run directory. SIGKILL, not SIGTERM: its console is gone, and a
    save it had begun stays in its ``.tmp-`` directory, unpublished."""
    launcher = os.environ.get(LAUNCHED_ENV, "")
    if not (launcher.isdigit() and int(launcher) > 1 and sys.platform.startswith("linux")):
        return  # not a worker of the mfsdp launcher
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(launcher) and not Path(f"/proc/{launcher}").exists():  # it died before the call
        os.kill(os.getpid(), signal.SIGKILL)


class _LogsSpecs(DefaultLogsSpecs):
    """torch's layout (OUT_DIR/logs/<run>/attempt_<n>/<local rank>/stderr.log), remembering the
    paths of the latest attempt for the summary."""

    stderrs: dict[int, str] = {}

    def reify(self, envs):
        dest = super().reify(envs)
        self.stderrs = dict(dest.stderrs)
        return dest


def _error(message: str, code: int = USER_ERROR_EXIT) -> int:
    print(f"{_ERROR_PREFIX}{message}", file=sys.stderr, flush=True)
    return code


def _quiet_torch_elastic() -> None:
    """torch's agent logs each step of a shutdown, and the failure, in its own format; the
    summary says what matters.
    LOGLEVEL=INFO (torch's own switch) brings them back."""
    if "LOGLEVEL" in os.environ:
        return
    import torch.distributed.elastic.agent.server.api  # noqa: F401: creates the loggers
    import torch.distributed.launcher.api  # noqa: F401
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _summarize(failures: dict, cfg: RunConfig, stderrs: dict[int, str]) -> int:
    """A few lines on the failed ranks: the first one, what it said, where its logs are."""
    for failure in failures.values():  # where _log_tail finds each rank's stderr
        failure.stderr_log = stderrs.get(failure.local_rank)

    # torch lists failures in the order it saw them, then stops the rest with SIGTERM (and
    # SIGKILL 30 s later). So the first failure is the cause, except that in one poll a rank
    # killed by a signal (lost) and a rank whose collective failed because of it show up
    # together: prefer the signal there. Timestamps are whole seconds.
    # A rank that failed only because a peer left ("connection closed by peer") is an
    # effect as well, so it ranks after the rank whose own error explains it.
    earliest = min(f.timestamp for f in failures.values())
    index = {rank: i for i, rank in enumerate(failures)}

    def order(item):
        rank, failure = item
        return (failure.timestamp > earliest + 2, failure.exitcode == -signal.SIGTERM,
                _peer_left(failure), failure.exitcode >= 0, index[rank])

    ranked = sorted(failures.items(), key=order)
    if ranked[0][1].exitcode == USER_ERROR_EXIT and _user_error(ranked[0][1]):
        # A user error found by the workers (a file missing on one node, a corrupt window of
        # the token file): show its line once, as the launcher's own; the rest were stopped.
        return _error(_user_error(ranked[0][1]))
    host = socket.gethostname()
    rank, first = ranked[0]
    if first.exitcode < 0:
        head = (f"rank {rank} was lost: killed by {first.signal_name()} (pid {first.pid} on "
                f"{host}); the other ranks were stopped")
    else:
        head = f"rank {rank} failed: {_what(first)}"
    lines = [f"{_ERROR_PREFIX}{head}", *(f"  then rank {other_rank}: {_what(failure)}"
                                          for other_rank, failure in ranked[1:])]
    texts = [_what(f) + "\n" + _log_tail(f) for _, f in ranked]
    if any(is_timeout(text) for text in texts) and not any("MFSDP_CHECK_COLLECTIVES" in text
                                                           for text in texts[:1]):
        lines.append(f"  {timeout_hint(cfg.parallel.collective_timeout_s)}")
    logs = sorted({str(Path(f.stderr_log).parent.parent) for _, f in ranked if f.stderr_log})
    if logs:
        lines.append(f"  full tracebacks: {', '.join(logs)}/<local rank>/stderr.log")
    from mfsdp.train.checkpoint import find_latest
    latest = find_latest(Path(cfg.train.out_dir) / "checkpoints")
    if latest is not None:
        lines.append(f"  the newest complete checkpoint is {latest}; continue from it with "
                     "--resume")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


def _what(failure) -> str:
    """A failed worker's error in one line."""
    if failure.exitcode == -signal.SIGTERM:
        return "stopped (SIGTERM)"
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    if user := _user_error(failure):
        return user
    message = failure.message
    if isinstance(message, dict):  # as errors.record writes it
        message = message.get("message", "")
    if not message or message.startswith("To enable traceback"):
        tail = [line for line in _log_tail(failure).splitlines() if line.strip()]
        message = tail[-1].strip() if tail else ""
    message = " ".join(str(message).split())
    return f"{message[:400]} (exit code {failure.exitcode})"


_PEER_LEFT = ("closed by peer", "reset by peer", "broken pipe", "remote process exited",
              "connection refused")


def _peer_left(failure) -> bool:
    """Whether a rank failed only because another rank's process went away."""
    if failure.exitcode < 0:
        return False
    text = _what(failure).lower()
    return any(needle in text for needle in _PEER_LEFT)


def _user_error(failure) -> str | None:
    """The `mfsdp train: error:` line a worker printed into its stderr log, if any."""
    for line in reversed(_log_tail(failure).splitlines()):
        if line.startswith(_ERROR_PREFIX):
            return line[len(_ERROR_PREFIX):].strip()
    return None


def _log_tail(failure, size: int = 20000) -> str:
    if not getattr(failure, "stderr_log", None):
        return ""
    path = Path(failure.stderr_log)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _after_signal(name: str, cfg: RunConfig) -> int:
    """The launcher got Ctrl-C or SIGTERM and passed it on; did every rank save?"""
    from mfsdp.train.checkpoint import find_latest
    from mfsdp.train.report.metrics import read_metrics

    out_dir = Path(cfg.train.out_dir)
    latest = find_latest(out_dir / "checkpoints")
    metrics = out_dir / "metrics.jsonl"
    last = max((r.get("step", 0) for r in read_metrics(metrics)), default=0) if \
        metrics.is_file() else 0
    if latest is not None and int(latest.name.rpartition("_")[2]) >= last:
        print(f"mfsdp train: stopped by {name}; every rank saved {latest}; continue with "
              "--resume", flush=True)
        return 0
    where = f"the newest complete checkpoint is {latest}" if latest else "no checkpoint exists"
    return _error(f"stopped by {name} before the ranks could save step {last} (raise "
                  f"--stop-timeout if saving takes longer); {where}", code=1)
