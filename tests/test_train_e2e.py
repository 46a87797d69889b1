"""`mfsdp train` end to end: real torchrun launches of two CPU processes (and one resume in two
ranks of a world of its own).

Two deterministic runs are shared by several checks (the first is the baseline run whose
outputs they read); every launch uses a very small model so the whole file stays well under
two minutes on two cores.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import World
from mfsdp.data import prepare
from mfsdp.data.prepare import stdlib_source

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--data.seq_len", "32",
         "--data.local_batch", "4", "--train.lr", "1e-2", "--train.warmup_steps", "2",
         "--train.sample_tokens", "16", "--train.progress", "false", "--train.device", "cpu",
         "--train.eval_every", "0"]  # the validation loss has its tests (test_eval_loss.py)


# Deterministic mode in bf16 (the GPU default; the CPU computes bf16 too): reruns and resumes must
# agree bit for bit, not merely closely.
DETERMINISTIC = [*SMALL, "--parallel.compute_dtype", "bf16", "--parallel.deterministic", "true",
                 "--train.sample_tokens", "0"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _torchrun_cmd(args, nproc=2, extra_launcher=()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", *extra_launcher,
           "--nproc-per-node", str(nproc), "-m", "mfsdp.train", *args]
    if not extra_launcher:
        cmd.insert(3, "--standalone")
    return cmd


def torchrun(*args, nproc=2, extra_launcher=(), timeout=120, **popen):
    return subprocess.run(_torchrun_cmd(args, nproc, extra_launcher), env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, **popen)


def single(*args):
    return subprocess.run([sys.executable, "-m", "mfsdp.train", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def in_process(capsys, *args) -> subprocess.CompletedProcess:
    """``python -m mfsdp.train ARGS`` as one process does it (a world of one), run in this one:
    ``main``'s exit code and what it printed. ``single`` runs a fresh interpreter instead (the
    entry point itself: tests below)."""
    import warnings

    from mfsdp.train.command.main import main

    capsys.readouterr()
    with warnings.catch_warnings():  # torch's errors.record: no fault handler on a captured stderr
        warnings.filterwarnings("ignore", "Unable to enable fault handler")
        code = main(list(args))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)


def losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small.tokens"
    prepare(stdlib_source(), out, glob="[a-c]*.py")
    return out


def start_deterministic_run(corpus: Path, out_dir: Path, *extra: str) -> subprocess.Popen:
    """8 deterministic bf16 steps with a checkpoint at step 4, launched; ``finished`` waits for it."""
    cmd = _torchrun_cmd([*DETERMINISTIC, "--data.path", str(corpus), "--train.steps", "8",
                         "--train.checkpoint_every", "4", "--train.out_dir", str(out_dir), *extra])
    return subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finished(launch: subprocess.Popen) -> str:
    """Rank 0's output of a deterministic run that ended well."""
    try:
        stdout, stderr = launch.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        launch.kill()
        raise
    assert launch.returncode == 0, stdout + stderr
    assert "deterministic mode: deterministic torch algorithms" in stdout
    return stdout


@pytest.fixture(scope="module")
def deterministic_runs(corpus, tmp_path_factory):
    """Two uninterrupted deterministic runs, each with a sample at the end: (directory, rank 0's
    output) of each, shared by the tests below; the first is also the baseline run whose outputs
    the next test checks. The two launches run at the same time (two independent jobs on one
    machine: each has its own rendezvous port), which a bit-for-bit agreement must survive too."""
    outs = [tmp_path_factory.mktemp(name) for name in ("first", "second")]
    launches = [start_deterministic_run(corpus, out, "--train.sample_tokens", "16") for out in outs]
    try:
        return [(out, finished(launch)) for out, launch in zip(outs, launches)]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
                launch.communicate()


def test_two_process_run_writes_metrics_checkpoints_plot_and_sample(deterministic_runs):
    out, stdout = deterministic_runs[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu",
                "peak_mem_gib"):
        assert key in records[0]
    assert records[0]["mfu"] is None  # no peak to compare with on CPU
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8"
    assert (out / "checkpoints" / "step_4" / ".metadata").is_file()
    assert (out / "loss.png").stat().st_size > 0
    assert "--- sample" in stdout and "2 process(es)" in stdout


def stopped_copy(out_dir: Path, step: int, into: Path) -> Path:
    """A run directory holding only ``out_dir``'s checkpoint of ``step``: that run as if it had
    stopped there, for ``--resume``."""
    name = f"step_{step}"
    shutil.copytree(out_dir / "checkpoints" / name, into / "checkpoints" / name)
    (into / "checkpoints" / "latest").write_text(name + "\n")
    return into


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_losses_exactly(corpus, tmp_path):
    """The fp32 resume of a run without deterministic mode. Checked by not-slow tests too, so `make
    test` leaves this one out: test_faults.py's rank-killed test
    (test_a_rank_killed_mid_step_ends_the_job_and_resume_matches_an_uninterrupted_run) resumes such
    a run and holds it to the same 1e-6, and the deterministic bf16 resume below, bit for bit."""
    out = tmp_path / "uninterrupted"
    args = [*SMALL, "--data.path", str(corpus), "--train.steps", "8", "--train.checkpoint_every", "4"]
    run = torchrun(*args, "--train.out_dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    resumed = stopped_copy(out, 4, tmp_path / "resumed")
    run = torchrun(*args, "--train.out_dir", str(resumed), "--resume")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "at step 4" in run.stdout
    expected, got = losses(out), losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-6, rel=0)


def loss_and_grad_norm(out_dir: Path) -> dict[int, tuple[float, float]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines)}


def test_deterministic_bf16_runs_agree_bit_for_bit(deterministic_runs):
    first, second = (loss_and_grad_norm(out) for out, _ in deterministic_runs)
    assert sorted(first) == list(range(1, 9))
    assert first == second  # exact float equality of every loss and gradient norm


def worker_run(rank, world_size, argv):
    """What each worker of ``mfsdp.train`` runs once it has joined its process group (``main``:
    the config, deterministic mode, the preflight, the trainer), in a world's rank; rank 0 returns
    what it printed."""
    import contextlib
    import io

    import torch

    from mfsdp.train.run import determinism
    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.run.preflight import preflight
    from mfsdp.train.loop.trainer import Trainer

    printed, cpu = io.StringIO(), torch.device("cpu")
    with contextlib.redirect_stdout(printed):
        cfg = load_config(argv)
        determinism.apply(cfg)
        assert Trainer(preflight(cfg, cpu, print), cpu).run() == 0
    return printed.getvalue() if rank == 0 else None


def test_deterministic_bf16_resume_matches_the_uninterrupted_run_bit_for_bit(
        deterministic_runs, corpus, tmp_path):
    """The resume runs in two fresh ranks of a world of its own (forks of the test worlds'
    forkserver, no launch; deterministic mode switches process-wide torch flags, which must not
    reach the shared worlds): the launched run's checkpoint, resumed there, gives its losses and
    gradient norms bit for bit. A launched resume: test_faults.py's rank-killed test."""
    uninterrupted = deterministic_runs[0][0]
    resumed = stopped_copy(uninterrupted, 4, tmp_path / "resumed")
    own = World(2)
    try:
        stdout = own.run(worker_run, argv=[*DETERMINISTIC, "--data.path", str(corpus), "--train.steps", "8",
                                           "--train.checkpoint_every", "4", "--train.out_dir", str(resumed),
                                           "--resume"])[0]
    finally:
        own.close()
    assert "deterministic mode: deterministic torch algorithms" in stdout and "at step 4" in stdout, stdout
    expected = {step: v for step, v in loss_and_grad_norm(uninterrupted).items() if step > 4}
    assert loss_and_grad_norm(resumed) == expected


@pytest.mark.parametrize("env, message", [
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
     "needs CUBLAS_WORKSPACE_CONFIG unset, :4096:8 or :16:8 (torch refuses cuBLAS calls"),
    ({"NCCL_NVLS_ENABLE": "1"}, "unset NCCL_NVLS_ENABLE=1"),
])
def test_the_deterministic_flag_is_checked_against_the_environment(env, message, monkeypatch):
    from mfsdp.train.run.config import ConfigError
    from mfsdp.train.run.resolve import load_config

    for name in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    assert load_config(["--parallel.deterministic", "true"]).parallel.deterministic
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        load_config(["--parallel.deterministic", "true"])
    assert message in str(raised.value)
    assert not load_config([]).parallel.deterministic  # off by default: the variables are free
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # torch's other accepted value
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert load_config(["--parallel.deterministic", "true"]).parallel.deterministic


def test_a_bad_deterministic_value_is_one_line(capsys):
    _one_error_line(in_process(capsys, "--parallel.deterministic", "maybe"),
                    "--parallel.deterministic expects bool, got 'maybe'")


def test_ctrl_c_saves_and_exits_cleanly_on_every_rank(corpus, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "mfsdp.train", *SMALL, "--data.path", str(corpus),
           "--train.steps", "100000", "--train.checkpoint_every", "0",
           "--train.out_dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    output, _ = proc.communicate(timeout=90)
    last = max(losses(tmp_path))
    assert f"stopped by signal after step {last}" in output, output
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{last}"
    assert (tmp_path / "checkpoints" / f"step_{last}" / ".metadata").is_file()
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output


def test_two_nodes_on_localhost(corpus, tmp_path):
    port = free_port()
    launcher = ["--nnodes", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "mfsdp-test"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", "1",
           "-m", "mfsdp.train", *SMALL, "--data.path", str(corpus), "--train.steps", "3",
           "--train.out_dir", str(tmp_path), "--train.sample_tokens", "0"]
    nodes = [subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=150)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert any("2 process(es)" in out for out in outputs)
    assert sorted(losses(tmp_path)) == [1, 2, 3]


def test_the_demo_runs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mfsdp.demo", "--train.steps", "3",
                          "--train.out_dir", str(tmp_path), "--train.progress", "false",
                          "--train.sample_tokens", "16"],
                         env=_env(), cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--- sample" in run.stdout and (tmp_path / "loss.png").is_file()
    assert "tiny model" in run.stdout


def _one_error_line(run, expected: str) -> None:
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "mfsdp train: error:" in line]
    assert len(errors) == 1 and expected in errors[0], run.stderr
    assert "Traceback" not in run.stderr.split("mfsdp train: error:")[0] + run.stdout


def test_missing_and_corrupt_data_files(tmp_path, capsys):
    """The first in a fresh interpreter (``python -m mfsdp.train``: the process group joined, the
    data found missing, one line and no traceback on the way out), the second in this one."""
    _one_error_line(single(*SMALL, "--data.path", str(tmp_path / "none.tokens"),
                           "--train.out_dir", str(tmp_path)),
                    "does not exist; create it with `mfsdp prepare-data")
    bad = tmp_path / "bad.tokens"
    bad.write_bytes(b"\0" * 1000)
    _one_error_line(in_process(capsys, *SMALL, "--data.path", str(bad), "--train.out_dir", str(tmp_path)),
                    "not an mfsdp token file")


def test_unknown_key_and_unknown_preset(capsys):
    _one_error_line(in_process(capsys, "--train.stepz", "3"), "unknown config key train.stepz")
    _one_error_line(in_process(capsys, "--model.preset", "13b"), "known presets: tiny, 1b, 8b, 70b")


def test_checkpoint_of_another_shape_is_refused(deterministic_runs, corpus, capsys):
    out, _ = deterministic_runs[0]
    args = [a if a != "64" else "96" for a in SMALL]  # a wider model
    _one_error_line(in_process(capsys, *args, "--data.path", str(corpus), "--train.out_dir", str(out),
                               "--resume"), "was written for a different model (dim: checkpoint 64")


def test_world_size_that_does_not_fit_the_mesh(corpus, tmp_path):
    run = torchrun(*SMALL, "--data.path", str(corpus), "--train.out_dir", str(tmp_path),
                   "--parallel.placements", "hsdp", "--parallel.replicate", "4")
    _one_error_line(run, "world size 2 does not fit a mesh of 4 replicas")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_run_in_bf16_reports_mfu_and_memory(corpus, tmp_path):
    args = [a if a != "cpu" else "cuda" for a in SMALL]
    run = single(*args, "--data.path", str(corpus), "--train.steps", "4",
                 "--train.out_dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["peak_mem_gib"] > 0 and records[-1]["loss"] < records[0]["loss"]
    if __import__("mfsdp.models.flops", fromlist=["peak_flops"]).peak_flops("cuda") is not None:
        assert records[-1]["mfu"] > 0
