"""Two nodes' checkpoints: two launchers on this machine stand for two nodes
(`--nnodes 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT`, one worker each). With one shared
`--train.out_dir` their checkpoints hold both ranks' files and resume; with a directory of its own
on each (two nodes whose disks are not shared) the run is refused before step 1 in one line on both
nodes. And rank 0 never publishes a checkpoint whose other ranks' files it does not see."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp.data import prepare
from mfsdp.data.prepare import stdlib_source
from mfsdp.train.checkpoint import CheckpointError, CheckpointMeta, damage, find_latest
from mfsdp.train.checkpoint.storage import paths, publish_when_written

pytestmark = [pytest.mark.timeout(150), pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_dim", "128", "--data.seq_len", "32", "--data.local_batch", "4", "--train.lr", "1e-2",
         "--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu",
         "--train.eval_every", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small.tokens"
    prepare(stdlib_source(), out, glob="[a-c]*.py")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, cwd=REPO, output=subprocess.PIPE) -> subprocess.Popen:
    """`mfsdp train` of the small model with ``args`` (launcher flags among them), in a process group
    of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-m", "mfsdp.cli", "train", *SMALL, *args], env=env, cwd=cwd,
                            stdout=output, stderr=output, text=True, start_new_session=True)


def two_nodes(out_dirs, *args, cwd=REPO, timeout=120) -> list[subprocess.CompletedProcess]:
    """One launcher per node, each with its own --train.out_dir; both waited for, killed at ``timeout``."""
    port = _free_port()
    procs = [launch("--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--nproc-per-node", "1", *args, "--train.out_dir", str(out), cwd=cwd)
             for node, out in enumerate(out_dirs)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    return done


def test_two_nodes_sharing_the_out_dir_save_every_rank_and_resume(corpus, tmp_path):
    """The data path is given relative to the launchers' directory; meta.json records it absolute."""
    out = tmp_path / "shared"
    args = ["--data.path", corpus.name, "--train.checkpoint_every", "2"]
    first = two_nodes([out, out], *args, "--train.steps", "2", cwd=corpus.parent)
    assert [r.returncode for r in first] == [0, 0], first[0].stderr + first[1].stderr
    saved = out / "checkpoints" / "step_2"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in saved.iterdir()} and damage(saved) is None
    config = json.loads((saved / "meta.json").read_text())["config"]
    assert config["data"]["path"] == str(corpus.resolve())
    assert not list(out.glob(".shared-check*"))  # the check's file is removed

    resumed = two_nodes([out, out], *args, "--train.steps", "4", "--resume", cwd=corpus.parent)
    assert [r.returncode for r in resumed] == [0, 0], resumed[0].stderr + resumed[1].stderr
    assert f"resumed from {saved} at step 2" in resumed[0].stdout
    assert "the learning-rate schedule is rebuilt for --train.steps 4 (the checkpoint's run had 2)" in resumed[0].stdout
    assert find_latest(out / "checkpoints").name == "step_4"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_two_nodes_with_a_directory_each_are_refused_before_step_1(corpus, tmp_path):
    runs = two_nodes([tmp_path / "node0", tmp_path / "node1"], "--data.path", str(corpus), "--train.steps", "2")
    for node, run in enumerate(runs):
        assert run.returncode == 2, (node, run.stdout, run.stderr)
        errors = [line for line in run.stderr.splitlines() if line.startswith("mfsdp train: error:")]
        assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
        assert (f"--train.out_dir {tmp_path / 'node1'} is not one file system for all nodes: node "
                f"{socket.gethostname()} does not see the file .shared-check-") in errors[0]
        assert "give every node the same --train.out_dir on storage they all mount" in errors[0]
        assert "step 1" not in run.stdout
    for node in ("node0", "node1"):
        assert not (tmp_path / node / "metrics.jsonl").exists() and not (tmp_path / node / "checkpoints").exists()
        assert not list((tmp_path / node).glob(".shared-check*"))


def test_a_checkpoint_missing_another_ranks_file_is_not_published(tmp_path):
    """What the check above prevents, at the last gate: rank 0 lists the files DCP's .metadata names
    (every rank's) and publishes nothing when one is missing or short where it looks."""
    root = tmp_path / "checkpoints"
    _, temp = paths(root, 1)
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=temp)
    shard = next(temp.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])  # as if the rest were on another node's disk
    with pytest.raises(CheckpointError) as err:
        publish_when_written(root, 1, CheckpointMeta(model={}), keep=2, problem=None)
    assert f"saving checkpoint step_1 failed (rank 0 does not see all of {shard.name} in {temp}" in str(err.value)
    assert "every node must write into one --train.out_dir that all of them share" in str(err.value)
    assert not (root / "step_1").exists() and not (root / "latest").exists()
