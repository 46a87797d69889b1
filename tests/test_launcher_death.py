"""A launcher killed with its process group alone (a job script's `kill -9`, the OOM killer): torch's
agent starts each worker in a session of its own, so only the parent-death signal that each worker
asks for takes the workers down, within seconds, and nothing they had begun is published."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfsdp.train.checkpoint import complete_checkpoints, damage, find_latest

from test_faults import alive, workers  # a process's state, a launcher's workers (Linux /proc)
from test_multinode import corpus, launch  # noqa: F401: corpus, the token file fixture

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]


def listing(out: Path) -> tuple:
    """What a run has published and logged: the checkpoint directories, `latest`, the metrics."""
    root = out / "checkpoints"
    latest = (root / "latest").read_text() if (root / "latest").is_file() else None
    return sorted(p.name for p in root.iterdir()), latest, (out / "metrics.jsonl").read_text()


def test_workers_die_within_seconds_of_their_launchers_process_group(corpus, tmp_path):
    out = tmp_path / "run"
    # A save after every step, so the kill lands during or between saves.
    proc = launch("--nproc-per-node", "2", "--data.path", str(corpus), "--train.steps", "100000",
                  "--train.checkpoint_every", "1", "--train.out_dir", str(out), output=subprocess.DEVNULL)
    pids = {}
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None and find_latest(out / "checkpoints") is None:
            time.sleep(0.05)
        pids = workers(proc.pid)
        assert sorted(pids) == [0, 1] and proc.poll() is None
        assert all(os.getsid(pid) != os.getpgid(proc.pid) for pid in pids.values())  # not in the killed group
        os.killpg(proc.pid, signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=10)
        while any(alive(pid) for pid in pids.values()) and time.time() - killed < 10:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids.values()), f"workers alive {time.time() - killed:.1f} s after"
        assert time.time() - killed < 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids.values():  # never leave a failed test's workers training
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    after = listing(out)
    time.sleep(2)
    assert listing(out) == after  # nothing writes any more
    published = complete_checkpoints(out / "checkpoints")
    assert published and all(damage(p) is None for p in published)
    assert find_latest(out / "checkpoints") == out / "checkpoints" / after[1].strip()


@pytest.mark.parametrize("parent", ["alive", "dead"])
def test_a_worker_whose_launcher_died_before_it_asked_dies_at_once(parent, tmp_path):
    """The race the signal alone leaves: a launcher dead before its worker's prctl call."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    pid = os.getpid() if parent == "alive" else gone.pid
    code = "from mfsdp.train.command.launcher import die_with_launcher; die_with_launcher(); print('alive')"
    env = dict(os.environ, MFSDP_LAUNCHED=str(pid), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == ((0, "alive\n") if parent == "alive" else (-signal.SIGKILL, "")), run.stderr
