"""``mfsdp train`` with optimizer offload, end to end on CPU (two gloo processes): the losses of a
run with half the units offloaded against the same run without (clipping on, two microbatches,
bf16 compute), a resume from its checkpoint, and ``--parallel.offload auto`` (none on CPU)."""

from __future__ import annotations

import pytest

from test_train_e2e import SMALL, corpus, losses, stopped_copy, torchrun  # noqa: F401 - corpus is a fixture

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = [*SMALL, "--parallel.compute_dtype", "bf16", "--data.microbatches", "2", "--train.steps", "6",
       "--train.grad_clip", "0.5", "--train.sample_tokens", "0"]
OFFLOAD = ["--parallel.offload", "optimizer", "--parallel.offload_fraction", "0.5"]


def test_offloaded_training_matches_and_resumes(corpus, tmp_path):  # noqa: F811
    plain = tmp_path / "plain"
    run = torchrun(*RUN, "--data.path", str(corpus), "--train.out_dir", str(plain), "--train.checkpoint_every", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    offloaded = tmp_path / "offloaded"
    run = torchrun(*RUN, *OFFLOAD, "--data.path", str(corpus), "--train.out_dir", str(offloaded),
                   "--train.checkpoint_every", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    want, got = losses(plain), losses(offloaded)
    assert sorted(got) == list(range(1, 7))
    for step in got:  # the host's fused AdamW against the device's foreach one: rounding only
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])
    resumed = stopped_copy(offloaded, 3, tmp_path / "resumed")
    run = torchrun(*RUN, *OFFLOAD, "--data.path", str(corpus), "--train.out_dir", str(resumed),
                   "--train.checkpoint_every", "3", "--resume")
    assert run.returncode == 0, run.stdout + run.stderr
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in again:  # the offloaded states came back from the checkpoint exactly
        assert again[step] == got[step], (step, again[step], got[step])


def test_offload_auto_is_none_on_cpu(corpus, tmp_path):  # noqa: F811
    run = torchrun(*RUN, "--parallel.offload", "auto", "--train.steps", "1", "--data.path", str(corpus),
                   "--train.out_dir", str(tmp_path), "--train.checkpoint_every", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--parallel.offload auto: no offload (CPU run)" in run.stdout
