"""Installing and importing mfsdp prints nothing that asks for no action: no torchao "Failed to load"
lines for extensions mfsdp never calls, no transformers deprecation from our own scripts, no pip
deprecation of the license field."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")
pytest.importorskip("torchao")

IMPORTS = """
import sys
from pathlib import Path
import mfsdp.cli  # what `mfsdp ...` imports first
import transformers, torchao.float8  # transformers imports torchao itself
sys.path.insert(0, "benchmarks")
import make_hf_dir
make_hf_dir.make_model(Path(sys.argv[1]), "tiny")
import logging
logging.getLogger("torchao").warning("Failed to load another thing: kept")
"""


def test_imports_and_the_hf_directory_script_are_quiet(tmp_path):
    run = subprocess.run([sys.executable, "-c", IMPORTS, str(tmp_path / "hf")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for noise in ("_C_mxfp8", "_C_cutlass_90a", "torch_dtype"):
        assert noise not in run.stderr + run.stdout, run.stderr
    assert "Failed to load another thing: kept" in run.stderr  # torchao's other warnings stay
    assert (tmp_path / "hf" / "config.json").is_file()


def test_the_license_is_an_spdx_string():
    """pip warns about a TOML table (``{text = ...}``) on every install; setuptools 77 reads the string."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]
