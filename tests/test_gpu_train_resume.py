"""`mfsdp train --resume` on GPUs: in deterministic mode, bf16 losses and gradient norms after the
resume equal an uninterrupted run's bit for bit (skipped without CUDA).

Without --parallel.deterministic two uninterrupted runs on H200s differ from step 2 (atomics in
attention and index backward kernels, cuDNN attention; mfsdp/train/run/determinism.py lists each
source and what the mode does about it), so exact equality can only be asked of this mode. As
many GPUs as are visible, at most two; the tiny preset, 8 steps with a checkpoint at step 4: three
launches of well under a minute each on an H200.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train_e2e import REPO, _env, loss_and_grad_norm, stopped_copy
from test_train_e2e import corpus  # noqa: F401  (a fixture: the small token file)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
# 256 x 16 = 4096 token ids per rank and step: the sort-based embedding backward that the 1b run
# (4096 x 2) takes too; 1025 to 3072 ids would take torch's racy kernel (see determinism.py).
ARGS = ["--model.preset", "tiny", "--data.seq_len", "256", "--data.local_batch", "16",
        "--parallel.compute_dtype", "bf16", "--parallel.deterministic", "true",
        "--train.device", "cuda", "--train.steps", "8", "--train.checkpoint_every", "4",
        "--train.sample_tokens", "0", "--train.progress", "false"]


def mfsdp_train(corpus: Path, out_dir: Path, *extra: str) -> str:
    run = subprocess.run([sys.executable, "-m", "mfsdp.cli", "train", "--nproc-per-node",
                          str(NPROC), *ARGS, "--data.path", str(corpus), "--train.out_dir",
                          str(out_dir), *extra],
                         env=_env(), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "deterministic mode: deterministic torch algorithms" in run.stdout
    return run.stdout


def side_by_side(expected: dict, got: dict) -> str:
    return "step: (loss, grad_norm) uninterrupted | other\n" + "\n".join(
        f"{step}: {expected.get(step)} | {got.get(step)}" for step in sorted({*expected, *got}))


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    mfsdp_train(corpus, out)
    return out


def test_two_uninterrupted_deterministic_runs_agree_bit_for_bit(uninterrupted, corpus,
                                                               tmp_path):
    mfsdp_train(corpus, tmp_path)
    expected, got = loss_and_grad_norm(uninterrupted), loss_and_grad_norm(tmp_path)
    assert sorted(got) == list(range(1, 9)) and got == expected, side_by_side(expected, got)


def test_resume_from_step_4_matches_the_uninterrupted_run_bit_for_bit(uninterrupted,
                                                                     corpus, tmp_path):
    resumed = stopped_copy(uninterrupted, 4, tmp_path / "resumed")
    assert "at step 4" in mfsdp_train(corpus, resumed, "--resume")
    expected = {s: v for s, v in loss_and_grad_norm(uninterrupted).items() if s > 4}
    got = loss_and_grad_norm(resumed)
    assert got == expected, side_by_side(expected, got)
