"""Installed without the `train` extra: no matplotlib. `mfsdp plan` and `mfsdp train` still do their
work and say that the PNG needs the extra. Each check runs in a fresh interpreter whose
``sys.modules`` blocks matplotlib, so that ``import matplotlib`` fails as on such an install."""

import subprocess
import sys

import pytest

from test_train_e2e import REPO, SMALL, _env, corpus  # noqa: F401

pytestmark = pytest.mark.timeout(120)

NEEDS = "needs matplotlib, part of the train extra: pip install 'mfsdp[train]'"


def without_matplotlib(call: str, *args: str) -> subprocess.Popen:
    """Start ``call(list(args))`` (e.g. ``mfsdp.cli:main``) where matplotlib cannot be imported;
    ``finished`` waits for it."""
    module, name = call.split(":")
    code = ("import sys; sys.modules['matplotlib'] = None  # import matplotlib: ModuleNotFoundError\n"
            f"from {module} import {name}; sys.exit({name}(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Both checks' interpreters, started together: each is one process on one core, so the two
    cores run them side by side. {name: (its output directory or file, the finished run)}."""
    png = tmp_path_factory.mktemp("plan") / "plan.png"
    out = tmp_path_factory.mktemp("train")
    procs = {
        "plan": (png, without_matplotlib("mfsdp.cli:main", "plan", "--gpu-memory", "80GiB", "--out", str(png))),
        "train": (out, without_matplotlib("mfsdp.train.command.main:main", *SMALL, "--data.path", str(corpus),
                                          "--train.steps", "2", "--train.sample_tokens", "0",
                                          "--train.out_dir", str(out))),
    }
    try:
        return {name: (path, finished(proc)) for name, (path, proc) in procs.items()}
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_plan_prints_the_plan_and_names_the_extra(runs):
    png, run = runs["plan"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "this setting fits in" in run.stdout and "settings that fit" in run.stdout
    assert f"memory over the step: not drawn (the PNG {NEEDS})" in run.stdout
    assert "Traceback" not in run.stderr and not png.exists()


def test_train_names_the_extra_instead_of_none(runs):
    out_dir, run = runs["train"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"loss curve: not drawn (the PNG {NEEDS})" in run.stdout
    assert "loss curve: None" not in run.stdout and not (out_dir / "loss.png").exists()
