"""``mfsdp train`` with optimizer offload, end to end on CPU (two gloo processes, the trainer in the
test session's world; the launch itself is test_train_e2e.py's): the losses of a run with half the
units offloaded against the same run without (clipping on, two microbatches, bf16 compute), a resume
from its checkpoint, and ``--parallel.offload auto`` (none on CPU)."""

from __future__ import annotations

import pytest

from test_eval_loss import run_trainer
from test_train_e2e import SMALL, corpus, losses, stopped_copy  # noqa: F401 - corpus is a fixture

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = [*SMALL, "--parallel.compute_dtype", "bf16", "--data.microbatches", "2", "--train.steps", "6",
       "--train.grad_clip", "0.5", "--train.sample_tokens", "0"]
OFFLOAD = ["--parallel.offload", "optimizer", "--parallel.offload_fraction", "0.5"]


def train(world, corpus, out, *args) -> str:  # noqa: F811
    """The run on two ranks; returns what rank 0 printed."""
    return world(2).run(run_trainer, argv=[*RUN, *args, "--data.path", str(corpus), "--train.out_dir", str(out)],
                        stdout=True)[0][1]


@pytest.fixture(scope="module")
def plain(world, corpus, tmp_path_factory):  # noqa: F811
    """The run without offload, launched once for both tests below: ``--parallel.offload auto``,
    which on CPU resolves to no offload (the message says so, ``test_offload_auto_is_none_on_cpu``),
    so this is also the reference the offloaded run is held to."""
    out = tmp_path_factory.mktemp("plain")
    return out, train(world, corpus, out, "--parallel.offload", "auto", "--train.checkpoint_every", "0")


def test_offloaded_training_matches_and_resumes(world, corpus, plain, tmp_path):  # noqa: F811
    offloaded = tmp_path / "offloaded"
    train(world, corpus, offloaded, *OFFLOAD, "--train.checkpoint_every", "3")
    want, got = losses(plain[0]), losses(offloaded)
    assert "no offload (CPU run)" in plain[1]  # the reference did not offload
    assert sorted(got) == list(range(1, 7))
    for step in got:  # the host's fused AdamW against the device's foreach one: rounding only
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])
    resumed = stopped_copy(offloaded, 3, tmp_path / "resumed")
    train(world, corpus, resumed, *OFFLOAD, "--train.checkpoint_every", "3", "--resume")
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in again:  # the offloaded states came back from the checkpoint exactly
        assert again[step] == got[step], (step, again[step], got[step])


def test_offload_auto_is_none_on_cpu(plain):
    _, printed = plain
    assert "--parallel.offload auto: no offload (CPU run)" in printed
