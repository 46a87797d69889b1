"""benchmarks/gpu_verify.sh keeps the reusable sections the GPU sessions call by name, stays short,
and it and the one-off sections beside the results (benchmarks/results/*/gpu.sh, which source it)
parse. Nothing here runs a GPU."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_verify.sh"
KEPT = {"smoke", "tests", "rows", "train", "peaks", "memory", "fp8_loss_curves", "ab_trees"}


def _sections(text: str) -> set[str]:
    return set(re.findall(r"^section_([a-z0-9_]+)\(\) \{", text, flags=re.M))


def test_gpu_verify_keeps_its_reusable_sections_in_at_most_400_lines():
    text = SCRIPT.read_text()
    assert len(text.splitlines()) <= 400
    assert _sections(text) == KEPT
    assert "NCCL_NVLS_ENABLE=0" in (ROOT / "benchmarks" / "gpu_env.sh").read_text() and "gpu_env.sh" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_scripts_parse_and_one_off_sections_live_beside_their_results():
    moved = sorted((ROOT / "benchmarks" / "results").glob("*/gpu.sh"))
    sourcing = [p for p in moved if "../../gpu_verify.sh" in p.read_text()]
    assert len(sourcing) >= 10
    for path in [SCRIPT, *moved]:
        subprocess.run(["bash", "-n", str(path)], check=True)
    for path in sourcing:
        text = path.read_text()
        assert _sections(text) and not _sections(text) & KEPT, path  # no second copy of a kept section
        assert text.rstrip().endswith('gpu_verify_main "$@"'), path
