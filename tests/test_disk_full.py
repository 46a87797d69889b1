"""A disk that fills during a run: the failed save's line names the full disk (its free bytes and
mount), keeps the rest of what it said (the previous checkpoint is intact, how to continue), and
the previous checkpoint is what `latest` names. On a small tmpfs, mounted where this machine lets
the tests mount one (root, CAP_SYS_ADMIN)."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mfsdp.train.checkpoint import find_latest
from mfsdp.train.checkpoint.storage import full_disk

from test_multinode import corpus, launch  # noqa: F401: corpus, the token file fixture

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture
def tmpfs(tmp_path) -> Path:
    mount = tmp_path / "mnt"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                          text=True) if shutil.which("mount") else None
    if made is None or made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() if made else 'no mount command'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path, chunk: int = 65536) -> None:
    """Fill ``mount`` (while the run writes there too) to its last 64 to 128 KiB: room for the metrics'
    lines, not for the next checkpoint (about 2 MB)."""
    fd = os.open(mount / "ballast", os.O_WRONLY | os.O_CREAT)
    try:
        while shutil.disk_usage(mount).free > 2 * chunk:
            os.write(fd, bytes(chunk))
    except OSError:  # the run's save took the rest first
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - chunk))
    finally:
        os.close(fd)


def test_a_save_on_a_full_disk_names_it(corpus, tmpfs):  # noqa: F811
    out = tmpfs / "run"
    proc = launch("--nproc-per-node", "1", "--data.path", str(corpus), "--train.steps", "100000",
                  "--train.checkpoint_every", "2", "--train.out_dir", str(out))
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None and find_latest(out / "checkpoints") is None:
            time.sleep(0.02)
        previous = find_latest(out / "checkpoints")
        assert previous is not None, proc.communicate(timeout=30)
        fill(tmpfs)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 2, stdout + stderr
    line = next(line for line in stderr.splitlines() if line.startswith("mfsdp train: error: saving checkpoint"))
    assert f" failed (the disk is full (" in line and f" bytes free on {tmpfs}): " in line, line
    latest = find_latest(out / "checkpoints")
    assert latest is not None and int(latest.name[5:]) >= int(previous.name[5:])
    assert f"; the previous checkpoint {latest} is intact and is what --resume will load" in line, line
    assert line.endswith("then continue with --resume"), line


def test_a_failure_with_room_left_is_not_called_a_full_disk(tmp_path):
    assert full_disk(tmp_path, "rank 0: PermissionError: [Errno 13] Permission denied") == "" or \
        shutil.disk_usage(tmp_path).free < 2**20
    assert full_disk(tmp_path, "rank 1: OSError: [Errno 28] No space left on device").startswith("the disk is full (")
