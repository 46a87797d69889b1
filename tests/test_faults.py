"""Faults of `mfsdp train` on CPU: a rank killed mid-step, SIGTERM and Ctrl-C to the launcher,
a damaged newest checkpoint, a save that fails partway, a corrupt token file, a collective that
times out. Each ends with a named message and nothing lost or left running."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mfsdp.data import prepare, write_token_file
from mfsdp.data.prepare import stdlib_source
from mfsdp.data.token_file import HEADER_BYTES
from mfsdp.train.checkpoint import storage as ckpt
from mfsdp.train.checkpoint import (CheckpointError, CheckpointMeta, find_latest, find_resumable,
                                    load_checkpoint, save_checkpoint)

from test_eval_loss import run_trainer  # one `mfsdp train` run in a world's ranks
from test_train_checkpoint import make as _make  # a stepped Linear and its AdamW
from test_train_e2e import SMALL as E2E_SMALL  # the same small model; later flags win
from test_train_e2e import _env  # the same subprocess environment

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

REPO = Path(__file__).resolve().parents[1]
# Steps of a few tens of milliseconds, so a test can act between them.
SMALL = [*E2E_SMALL, "--data.seq_len", "64", "--data.local_batch", "8", "--train.sample_tokens", "0"]


def launch(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mfsdp.cli", "train", "--nproc-per-node", "2",
                             *SMALL, *args], env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(*args, timeout=120) -> subprocess.CompletedProcess:
    proc = launch(*args)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def wait_for_steps(proc, out_dir: Path, n: int, limit: float = 90) -> None:
    metrics, deadline = out_dir / "metrics.jsonl", time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {n} steps in {limit} s: {proc.poll()} {proc.stderr.read()}")


def alive(pid: int) -> bool:
    """Whether a process still runs (a zombie waiting for its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def workers(launcher_pid: int) -> dict[int, int]:
    """{global rank: pid} of a launcher's worker processes (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid:
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(entry.name)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small.tokens"
    prepare(stdlib_source(), out, glob="[a-c]*.py")
    return out


def test_a_rank_killed_mid_step_ends_the_job_and_resume_matches_an_uninterrupted_run(
        world, corpus, tmp_path):
    args = ["--data.path", str(corpus), "--train.steps", "10", "--train.checkpoint_every", "3"]
    # The uninterrupted run: the same trainer on two ranks of the shared world (what each worker of
    # a launch runs after joining its process group), no launch of its own.
    world(2).run(run_trainer, argv=[*SMALL, *args, "--train.out_dir", str(tmp_path / "reference")])

    out = tmp_path / "killed"
    proc = launch(*args, "--train.out_dir", str(out))
    wait_for_steps(proc, out, 4)  # step 3's checkpoint is complete before step 4 is logged
    pids = workers(proc.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    stdout, err = proc.communicate(timeout=60)
    assert time.time() - killed_at < 60
    # A launch's first line names the rate it trains with (the recipe's: test_train_defaults.py).
    first = stdout.splitlines()[0]
    assert first.startswith("mfsdp train: tiny model,") and "lr 0.01 (warm-up 2 steps" in first, stdout
    assert proc.returncode == 1
    assert "mfsdp train: error: rank 1 was lost: killed by SIGKILL" in err, err
    assert "continue from it with --resume" in err and "Traceback" not in err
    assert not any(alive(pid) for pid in pids.values())  # no orphan left behind

    resumed_from = find_latest(out / "checkpoints")
    start = int(resumed_from.name.split("_")[1])
    assert start >= 3
    resumed = run(*args, "--train.out_dir", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {resumed_from} at step {start}" in resumed.stdout
    expected, got = losses(tmp_path / "reference"), losses(out)
    assert sorted(got) == list(range(1, 11))
    for step in range(start + 1, 11):
        assert got[step] == pytest.approx(expected[step], abs=1e-6, rel=0)


def test_a_signal_to_the_launcher_saves_on_every_rank_and_exits_0(corpus, tmp_path,
                                                                   sig=signal.SIGTERM):
    # Ctrl-C (SIGINT) takes the same path through torch's agent; one signal keeps this short.
    proc = launch("--data.path", str(corpus), "--train.steps", "100000",
                  "--train.checkpoint_every", "0", "--train.out_dir", str(tmp_path))
    wait_for_steps(proc, tmp_path, 3)
    pids = workers(proc.pid)
    proc.send_signal(sig)  # SIGINT is what Ctrl-C sends
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    last = max(losses(tmp_path))
    assert f"stopped by signal after step {last}; continue with --resume" in out
    assert f"stopped by {sig.name}; every rank saved" in out and "continue with --resume" in out
    assert find_latest(tmp_path / "checkpoints").name == f"step_{last}"
    assert "Traceback" not in err and not any(alive(pid) for pid in pids.values())


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_resume_falls_back_from_a_damaged_newest_checkpoint_and_says_so(tmp_path, damage):
    model, optimizer = _make(0)
    older = save_checkpoint(tmp_path, 1, model, optimizer, CheckpointMeta(model={}))
    newest = save_checkpoint(tmp_path, 2, model, optimizer, CheckpointMeta(model={}))
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:10])
    path, notes = find_resumable(tmp_path)
    assert path == older and len(notes) == 1
    assert f"checkpoint {newest} is damaged (file {shard.name}" in notes[0]
    assert "skipping it" in notes[0]
    fresh, fresh_optimizer = _make(1)
    assert load_checkpoint(path, fresh, fresh_optimizer).step == 1


def test_a_save_that_fails_partway_keeps_the_previous_checkpoint_and_says_why(
        tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    model, optimizer = _make(0)
    good = save_checkpoint(tmp_path, 1, model, optimizer, CheckpointMeta(model={}))
    real_create_stream = FileSystem.create_stream

    class FullDisk:  # accepts 100 bytes, then the disk is full
        def __init__(self, stream):
            self.stream, self.written = stream, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    from contextlib import contextmanager

    @contextmanager
    def create_stream(self, path, mode):
        with real_create_stream(self, path, mode) as stream:
            yield FullDisk(stream) if "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(tmp_path, 2, model, optimizer, CheckpointMeta(model={}))
    monkeypatch.undo()
    message = str(raised.value)
    assert "saving checkpoint step_2 failed" in message and "No space left on device" in message
    assert f"the previous checkpoint {good} is intact" in message
    assert find_latest(tmp_path) == good and not (tmp_path / "step_2").exists()
    assert (tmp_path / ckpt.LATEST).read_text() == "step_1\n"
    assert not (tmp_path / ".tmp-step_2").exists()
    fresh, fresh_optimizer = _make(1)
    load_checkpoint(good, fresh, fresh_optimizer)
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)


def test_a_token_file_with_ids_outside_its_vocabulary_is_a_named_error(tmp_path):
    path = write_token_file(tmp_path / "t.tokens", torch.arange(20000) % 250, vocab_size=257,
                            tokenizer="bytes")
    raw = bytearray(path.read_bytes())
    for i in range(HEADER_BYTES, len(raw), 64):  # a corrupt id every 32 tokens
        raw[i:i + 2] = b"\xff\xff"
    path.write_bytes(bytes(raw))
    result = run("--data.path", str(path), "--train.steps", "3", "--train.out_dir",
                 str(tmp_path / "run"), timeout=90)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is corrupt: token" in lines[0], result.stderr
    assert "has id 65535, outside the vocabulary of 257" in lines[0]


def test_a_collective_timeout_names_the_debugging_tools(corpus, tmp_path):
    proc = launch("--data.path", str(corpus), "--train.steps", "100000",
                  "--parallel.collective_timeout_s", "3", "--train.out_dir", str(tmp_path))
    wait_for_steps(proc, tmp_path, 2)
    pids = workers(proc.pid)
    os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs: rank 0 waits in its next collective
    logs = tmp_path / "logs"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        rank0 = list(logs.glob("*/attempt_0/0/stderr.log"))
        if rank0 and "CollectiveTimeout" in rank0[0].read_text():
            break
        time.sleep(0.1)
    deadline = time.time() + 30
    while time.time() < deadline and alive(pids[0]):
        time.sleep(0.05)  # rank 0 has left: only then may rank 1 notice its closed socket
    os.kill(pids[1], signal.SIGCONT)  # let torch's agent stop it without waiting 30 s
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "rank 0 failed: CollectiveTimeout: rank 0: a collective timed out after 3 s" in err, err
    assert "MFSDP_CHECK_COLLECTIVES=1" in err and "TORCH_FR_BUFFER_SIZE" in err
