"""Installed without the `train` extra: no matplotlib. `mfsdp plan` and `mfsdp train` still do their
work and say that the PNG needs the extra. Each check runs in a fresh interpreter whose
``sys.modules`` blocks matplotlib, so that ``import matplotlib`` fails as on such an install."""

import subprocess
import sys

import pytest

from test_train_e2e import REPO, SMALL, _env, corpus  # noqa: F401

pytestmark = pytest.mark.timeout(120)

NEEDS = "needs matplotlib, part of the train extra: pip install 'mfsdp[train]'"


def without_matplotlib(call: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``call(list(args))`` (e.g. ``mfsdp.cli:main``) where matplotlib cannot be imported."""
    module, name = call.split(":")
    code = ("import sys; sys.modules['matplotlib'] = None  # import matplotlib: ModuleNotFoundError\n"
            f"from {module} import {name}; sys.exit({name}(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=100)


def test_plan_prints_the_plan_and_names_the_extra(tmp_path):
    png = tmp_path / "plan.png"
    run = without_matplotlib("mfsdp.cli:main", "plan", "--gpu-memory", "80GiB", "--out", str(png))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "this setting fits in" in run.stdout and "settings that fit" in run.stdout
    assert f"memory over the step: not drawn (the PNG {NEEDS})" in run.stdout
    assert "Traceback" not in run.stderr and not png.exists()


def test_train_names_the_extra_instead_of_none(corpus, tmp_path):
    run = without_matplotlib("mfsdp.train.main:main", *SMALL, "--data.path", str(corpus),
                             "--train.steps", "2", "--train.sample_tokens", "0",
                             "--train.out_dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"loss curve: not drawn (the PNG {NEEDS})" in run.stdout
    assert "loss curve: None" not in run.stdout and not (tmp_path / "loss.png").exists()
