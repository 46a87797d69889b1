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


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):  # noqa: F811
    """The run without offload, launched once for both tests below: ``--parallel.offload auto``,
    which on CPU resolves to no offload (the message says so, ``test_offload_auto_is_none_on_cpu``),
    so this is also the reference the offloaded run is held to."""
    out = tmp_path_factory.mktemp("plain")
    run = torchrun(*RUN, "--parallel.offload", "auto", "--data.path", str(corpus), "--train.out_dir", str(out),
                   "--train.checkpoint_every", "0")
    assert run.returncode == 0, run.stdout + run.stderr
    return out, run


def test_offloaded_training_matches_and_resumes(corpus, plain, tmp_path):  # noqa: F811
    offloaded = tmp_path / "offloaded"
    run = torchrun(*RUN, *OFFLOAD, "--data.path", str(corpus), "--train.out_dir", str(offloaded),
                   "--train.checkpoint_every", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    want, got = losses(plain[0]), losses(offloaded)
    assert "no offload (CPU run)" in plain[1].stdout  # the reference did not offload
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


def test_offload_auto_is_none_on_cpu(plain):
    _, run = plain
    assert "--parallel.offload auto: no offload (CPU run)" in run.stdout
