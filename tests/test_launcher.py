"""`mfsdp train --nproc-per-node N`: checks before any worker starts, the crash summary, torch's
error record under plain torchrun, and the Slurm script as two launchers on localhost."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mfsdp.cli import main as cli_main
from mfsdp.data import prepare, write_token_file
from mfsdp.data.prepare import stdlib_source
from mfsdp.train.run.config import TrainSection

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--data.seq_len", "32",
         "--data.local_batch", "4", "--train.lr", "1e-2", "--train.warmup_steps", "2",
         "--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu"]
# Makes rank 1 raise inside the training step: a worker crash without a hook in mfsdp.
CRASH_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    import torch.nn.utils
    def _crash(*args, **kwargs):
        raise RuntimeError("injected failure on rank 1")
    torch.nn.utils.get_total_norm = _crash
"""


def env(*extra_paths) -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [*map(str, extra_paths), str(REPO), out.get("PYTHONPATH")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return out


def mfsdp_train(*args, timeout=120, extra_paths=(), **kwargs):
    return subprocess.run([sys.executable, "-m", "mfsdp.cli", "train", *args],
                          env=env(*extra_paths), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small.tokens"
    prepare(stdlib_source(), out, glob="[a-c]*.py")
    return out


def test_a_bad_flag_is_one_line_and_exit_code_2_before_any_worker_starts(tmp_path):
    run = mfsdp_train("--nproc-per-node", "2", "--train.stepz", "3", "--train.out_dir",
                      str(tmp_path), timeout=60)
    assert run.returncode == 2
    keys = ", ".join(f.name for f in dataclasses.fields(TrainSection))
    assert run.stderr.strip().splitlines() == [
        f"mfsdp train: error: unknown config key train.stepz; did you mean --train.steps? known keys of train: {keys}"
    ], run.stderr
    assert keys.startswith("steps, ") and "skip_disk_check" in keys
    assert run.stdout == "" and not (tmp_path / "logs").exists()  # no worker ever started


@pytest.mark.parametrize("args, message", [
    (["--model.preset", "13b"], "unknown model preset '13b'; known presets"),
    (["--train.steps", "many"], "--train.steps expects int, got 'many'"),
    (["--train.lr", "-1"], "train.lr must be positive"),
    (["--parallel.placements", "hsdp", "--parallel.replicate", "3"],
     "world size 2 does not fit a mesh of 3 replicas"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--stop-timeout", "soon"], "--stop-timeout expects float, got 'soon'"),
    (["--parallel.collective_timeout_s", "0"], "collective_timeout_s must be positive"),
    (["--model.float8", "tensorwise", "--parallel.placements", "zero2"],
     "--parallel.placements zero2 keeps them whole. Use --model.float8 rowwise"),
    (["--data.pth", "x.tokens"], "unknown config key data.pth; did you mean --data.path?"),
    (["--nproc-per-nod", "2"], "unknown flag --nproc-per-nod; did you mean the launcher flag --nproc-per-node?"),
    (["--train.lr", "--train.steps", "3"], "--train.lr needs a value, but the next argument is the flag --train.steps"),
    (["--train.steps"], "--train.steps needs a value"),
])
def test_user_errors_are_named_by_the_launcher(args, message, tmp_path, capsys):
    code = cli_main(["train", "--nproc-per-node", "2", "--train.device", "cpu",
                     "--train.out_dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_data_problems_are_found_before_the_workers_start(tmp_path, capsys):
    big_vocab = write_token_file(tmp_path / "big.tokens", __import__("torch").arange(500),
                                 vocab_size=70000, tokenizer="some-tokenizer")
    assert cli_main(["train", "--nproc-per-node", "2", "--train.device", "cpu",
                     "--data.path", str(big_vocab), "--train.out_dir", str(tmp_path)]) == 2
    assert "vocabulary of 70000 but the model has 512 embeddings; set --model.vocab_size" in \
        capsys.readouterr().err
    truncated = tmp_path / "cut.tokens"
    truncated.write_bytes(big_vocab.read_bytes()[:600])
    assert cli_main(["train", "--nproc-per-node", "2", "--train.device", "cpu",
                     "--data.path", str(truncated), "--train.out_dir", str(tmp_path)]) == 2
    assert "is truncated or corrupt" in capsys.readouterr().err


def test_launcher_flags_given_to_a_torchrun_worker_are_named():
    from mfsdp.train.run.config import ConfigError
    from mfsdp.train.run.resolve import load_config
    with pytest.raises(ConfigError, match="--nproc-per-node is a flag of the `mfsdp train` "
                                          "launcher"):
        load_config(["--nproc-per-node", "2"])


def test_a_worker_crash_ends_with_a_short_summary_and_the_traceback_in_a_log(corpus,
                                                                             tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(CRASH_ON_RANK_1)
    out = tmp_path / "run"
    run = mfsdp_train("--nproc-per-node", "2", *SMALL, "--data.path", str(corpus),
                      "--train.steps", "3", "--train.out_dir", str(out),
                      extra_paths=[tmp_path / "inject"])
    assert run.returncode == 1
    first = run.stderr.strip().splitlines()[0]
    assert first.startswith("mfsdp train: error: rank 1 failed: RuntimeError: injected "
                            "failure on rank 1"), run.stderr
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    assert len(run.stderr.strip().splitlines()) <= 5, run.stderr
    logs = list((out / "logs").glob("*/attempt_0/1/stderr.log"))
    assert len(logs) == 1 and "Traceback" in logs[0].read_text()
    assert "get_total_norm" in logs[0].read_text()  # the full traceback
    assert f"full tracebacks: {logs[0].parent.parent}" in run.stderr


def test_plain_torchrun_shows_the_real_error_through_errors_record(corpus, tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(CRASH_ON_RANK_1)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "mfsdp.train", *SMALL, "--data.path", str(corpus), "--train.steps", "3",
         "--train.out_dir", str(tmp_path / "run")],
        env=env(tmp_path / "inject"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    summary = run.stderr[run.stderr.index("Failures:") if "Failures:" in run.stderr else 0:]
    assert "injected failure on rank 1" in run.stderr
    assert "To enable traceback" not in run.stderr, summary


def test_the_slurm_script_as_two_launchers_on_localhost(corpus, tmp_path):
    """examples/slurm/train.sbatch with stand-ins for srun and scontrol: srun starts one copy
    of its command per node, as Slurm does, and the first node's name is 127.0.0.1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/bin/bash
        while [[ "$1" == --* ]]; do shift; done   # srun's own options
        pids=()
        for ((node = 0; node < SLURM_NNODES; node++)); do
            SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SRUN_LOG.$node" 2>&1 &
            pids+=($!)
        done
        rc=0
        for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
        exit $rc
        """))
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "run"
    slurm_env = dict(env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                     SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242",
                     GPUS_PER_NODE="1", MFSDP_RDZV_PORT=str(_free_port()),
                     MFSDP=f"{sys.executable} -m mfsdp.cli", SRUN_LOG=str(tmp_path / "node"))
    run = subprocess.run(["bash", str(REPO / "examples" / "slurm" / "train.sbatch"), *SMALL,
                          "--data.path", str(corpus), "--train.steps", "3",
                          "--train.out_dir", str(out)],
                         env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=150)
    outputs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("node.*")))
    assert run.returncode == 0, run.stdout + run.stderr + outputs
    assert "rendezvous at 127.0.0.1:" in run.stdout
    assert "2 process(es)" in outputs
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_config_leaves_out_fields_this_torch_lacks():
    """torch 2.11's LaunchConfig has no shutdown_timeout (found on the GPU machines: the launcher
    died with a TypeError there); the launcher must build it all the same."""
    import dataclasses

    from mfsdp import _compat

    @dataclasses.dataclass
    class OldLaunchConfig:  # the 2.11 shape: no shutdown_timeout
        min_nodes: int
        max_nodes: int

    config = _compat.launch_config(OldLaunchConfig, min_nodes=1, max_nodes=1, shutdown_timeout=5)
    assert config == OldLaunchConfig(1, 1)
    from torch.distributed.launcher.api import LaunchConfig

    current = _compat.launch_config(LaunchConfig, min_nodes=1, max_nodes=1, nproc_per_node=2)
    assert current.nproc_per_node == 2


def test_the_summary_names_the_cause_before_the_ranks_that_lost_their_peer(tmp_path, capsys):
    """Rank 0 timed out and left; rank 1, resumed, failed on the closed connection and was
    seen first in the same poll. The summary must still lead with rank 0's timeout."""
    import signal
    from types import SimpleNamespace

    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.command.launcher import _summarize

    def failure(local_rank, exitcode, message):
        return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, timestamp=100,
                               message={"message": message}, pid=10 + local_rank,
                               signal_name=lambda: signal.Signals(-exitcode).name
                               if exitcode < 0 else "")

    failures = {1: failure(1, 1, "RuntimeError: [pair.cc:553] Connection closed by peer "
                                 "[127.0.0.1]:54482."),
                0: failure(0, 1, "CollectiveTimeout: rank 0: a collective timed out after 3 s")}
    cfg = load_config(["--train.out_dir", str(tmp_path)])
    assert _summarize(failures, cfg, {}) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("mfsdp train: error: rank 0 failed: CollectiveTimeout"), err
    assert err[1].startswith("  then rank 1: RuntimeError: [pair.cc:553] Connection closed"), err
