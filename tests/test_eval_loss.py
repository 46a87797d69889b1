"""The validation loss of `mfsdp train`: held-out windows, the same loss at every world size and
placement, no effect on training, and resumes of checkpoints written without a split."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp.data import EvalWindows, TokenFile, WindowSampler, held_out_tokens, prepare, write_token_file
from mfsdp.data.prepare import stdlib_source

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

SMALL = ["--model.n_layers", "2", "--model.dim", "32", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_dim", "64", "--data.seq_len", "16", "--train.lr", "1e-2", "--train.warmup_steps", "1",
         "--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu",
         "--train.eval_batches", "3"]


# ------------------------------------------------------------------------------ the windows
def test_held_out_windows_are_never_sampled_for_training(tmp_path):
    data = TokenFile(write_token_file(tmp_path / "t", torch.arange(3000) % 251, 257, "bytes"))
    held = held_out_tokens(len(data), 0.1, seq_len=16)
    assert held == 300 and held_out_tokens(len(data), 0.001, 16) == 17  # at least one window
    assert held_out_tokens(len(data), 0.0, 16) == 0
    limit = len(data) - held
    sampler = WindowSampler(data, 16, 4, 0, 1, seed=3, microbatches=2, limit=limit)
    ends = torch.cat([sampler._global_starts(step) for step in range(1, 400)]) + 16
    assert int(ends.max()) < limit  # the last token a window reads lies before the held-out tail
    assert int(ends.max()) > limit - 40  # ... and the sampler reaches right up to it
    whole = WindowSampler(data, 16, 4, 0, 1, seed=3, microbatches=2)  # no limit: as before
    assert whole.limit == len(data)


def test_eval_windows_are_the_same_at_every_world_size(tmp_path):
    data = TokenFile(write_token_file(tmp_path / "t", torch.arange(2000) % 251, 257, "bytes"))
    start = 1800

    def windows(world, local, micro):
        rows = []
        for rank in range(world):
            w = EvalWindows(data, 16, local, rank, world, micro, start=start)
            rows += [b.inputs for b in w.batches(2)]
        return sorted(map(tuple, torch.cat(rows).tolist()))

    one = windows(1, 8, 1)
    assert len(one) == 16 and one == windows(2, 4, 1) == windows(4, 1, 2)
    w = EvalWindows(data, 16, 8, 0, 1, start=start)
    assert w.count == (200 - 1) // 16
    first = next(w.batches(1))
    assert int(first.inputs[0, 0]) == int(data.tokens[start])  # from the tail's first token on
    assert torch.equal(first.targets[:, :-1], first.inputs[:, 1:])
    with pytest.raises(Exception, match="too short for one evaluation window"):
        EvalWindows(data, 16, 1, 0, 1, start=1990)


# --------------------------------------------------------------------------- whole runs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "small.tokens"
    prepare(stdlib_source(), path, glob="[a-b]*.py")
    return path


def run_trainer(rank, world_size, argv, stdout=False):
    """One `mfsdp train` run in this world's processes (what ``python -m mfsdp.train`` runs after
    joining the process group); rank 0 returns metrics.jsonl's records, and with ``stdout`` also
    what the run printed (rank 0 prints, as under torchrun)."""
    import contextlib
    import io
    from pathlib import Path

    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.run.preflight import preflight
    from mfsdp.train.loop.trainer import Trainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed) if stdout else contextlib.nullcontext():
        cfg = load_config(argv)
        Trainer(preflight(cfg, torch.device("cpu"), print), torch.device("cpu")).run()
    if rank != 0:
        return None
    path = Path(cfg.train.out_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return (records, printed.getvalue()) if stdout else records


def run_per_expert_trainer(rank, world_size, argv, stdout=False):
    """``run_trainer`` with the bundled MoE's experts one module per expert (the test-local
    ``conditional_models.PerExpertExperts``): an expert no token of a rank reached is skipped there;
    with ``--parallel.expert_units true`` each expert is a unit of its own."""
    import dataclasses
    from unittest import mock

    import mfsdp.train.build.model as built
    from conditional_models import per_expert_units, with_per_expert_modules
    from mfsdp.mesh import resolve_placements

    build, parallelize = built.build_model, built.parallelize

    def per_expert_parallelize(model, mesh, config):
        if config.expert_units:
            per_expert_units(model, mesh, resolve_placements(config.placements),
                             mixed_precision_policy=config.mixed_precision)
        return parallelize(model, mesh, dataclasses.replace(config, expert_units=False))

    with mock.patch.object(built, "build_model", lambda *a, **k: with_per_expert_modules(build(*a, **k))), \
            mock.patch.object(built, "parallelize", per_expert_parallelize):
        return run_trainer(rank, world_size, argv, stdout)


def train(world, n, corpus, out, *args, worker=run_trainer):
    return world(n).run(worker, argv=[*SMALL, "--data.path", str(corpus), "--train.out_dir", str(out),
                                      *args])[0]


def val_losses(records):
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_val_loss_is_the_same_at_every_world_size_and_placement(world, corpus, tmp_path):
    # One global batch of 8 windows: 1 x 8, 2 x 4 (zero3), 2 x 2 x 2 microbatches (ddp).
    steps = ["--train.steps", "3", "--train.eval_every", "2"]
    one = train(world, 1, corpus, tmp_path / "w1", *steps, "--data.local_batch", "8")
    two = train(world, 2, corpus, tmp_path / "w2", *steps, "--data.local_batch", "4")
    ddp = train(world, 2, corpus, tmp_path / "ddp", *steps, "--data.local_batch", "2",
                "--data.microbatches", "2", "--parallel.placements", "ddp")
    reference = val_losses(one)
    assert sorted(reference) == [2, 3]  # every eval_every steps, and after the last one
    for other in (val_losses(two), val_losses(ddp)):
        assert sorted(other) == [2, 3]
        for step, value in reference.items():
            assert math.isclose(other[step], value, rel_tol=1e-4), (step, other[step], value)
    assert all(math.isfinite(v) for v in reference.values())
    meta = json.loads((tmp_path / "w2" / "checkpoints" / "step_3" / "meta.json").read_text())
    assert meta["held_out"]["tokens"] == held_out_tokens(len(TokenFile(corpus)), 0.005, 16)


def test_evaluating_changes_nothing_in_training(world, corpus, tmp_path):
    # An evaluation after every step, between the optimizer step (which gathers the next forward's
    # first modules early: prefetch_across_step) and the next forward, with microbatches and a
    # mixture of experts whose ranks skip different experts (one module per expert, as the bundled MoE
    # had before its experts were stacked): the training losses stay bit for bit.
    args = ["--train.steps", "3", "--data.local_batch", "2", "--data.microbatches", "2",
            "--model.preset", "moe-tiny", "--model.num_experts", "4", "--model.top_k", "1"]
    with_eval = train(world, 2, corpus, tmp_path / "eval", *args, "--train.eval_every", "1",
                      worker=run_per_expert_trainer)
    without = train(world, 2, corpus, tmp_path / "plain", *args, "--train.eval_every", "0",
                    worker=run_per_expert_trainer)
    assert sorted(val_losses(with_eval)) == [1, 2, 3] and not val_losses(without)
    assert [r["loss"] for r in with_eval] == [r["loss"] for r in without]
    assert [r["grad_norm"] for r in with_eval] == [r["grad_norm"] for r in without]
    saved = dcp.FileSystemReader(tmp_path / "plain" / "checkpoints" / "step_3").read_metadata().state_dict_metadata
    assert "model.layers.0.feed_forward.experts.3.w1.weight" in saved  # the experts were modules of their own


def test_a_checkpoint_without_a_split_resumes_with_its_training_windows(world, corpus, tmp_path):
    args = ["--train.steps", "4", "--data.local_batch", "4", "--train.checkpoint_every", "2",
            "--train.keep_checkpoints", "0"]
    # The uninterrupted run of a checkpoint written before held-out splits: the whole file.
    whole = train(world, 2, corpus, tmp_path / "whole", *args, "--data.val_fraction", "0")
    # The same run cut after step 2, its checkpoint stripped of the split record, resumed with the
    # default --data.val_fraction: it keeps sampling the whole file.
    out = tmp_path / "old"
    shutil.copytree(tmp_path / "whole", out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    (out / "checkpoints" / "latest").write_text("step_2\n")
    meta_path = out / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["held_out"]
    meta_path.write_text(json.dumps(meta))
    resumed = train(world, 2, corpus, out, *args, "--resume")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert not val_losses(resumed)  # nothing is held out, so there is nothing to evaluate on
    # A fresh run with the default split samples other windows.
    fresh = train(world, 2, corpus, tmp_path / "fresh", *args)
    assert [r["loss"] for r in fresh][1:] != [r["loss"] for r in whole][1:]
    assert sorted(val_losses(fresh)) == [4]


def test_val_path_and_config_errors(world, corpus, tmp_path):
    from mfsdp.train.run.config import ConfigError
    from mfsdp.train.run.resolve import load_config

    with pytest.raises(ConfigError, match="val_fraction must lie in"):
        load_config(["--data.val_fraction", "1.5"])
    with pytest.raises(ConfigError, match="eval_every must not be negative"):
        load_config(["--train.eval_every", "-1"])
    val = tmp_path / "val.tokens"
    prepare(stdlib_source(), val, glob="c*.py")
    records = train(world, 1, corpus, tmp_path / "vp", "--train.steps", "2", "--train.eval_every", "1",
                    "--data.local_batch", "4", "--data.val_path", str(val))
    assert sorted(val_losses(records)) == [1, 2]
    meta = json.loads((tmp_path / "vp" / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["held_out"] == {"tokens": 0, "val_path": str(val), "val_fraction": 0.005}
