"""One end-of-step path: the core's NaN/Inf check and gradient scaling, whichever way the optimizer
(or none) was built.

The manager only translates its config into core options; the check itself is the core's
(``CommunicationPolicy.check_finite_gradients``), which raises from ``loss.backward()`` on every
rank before any optimizer can step on a NaN. ``mfsdp train --model.hf`` binds its optimizer with
the core's ``fully_shard_optimizer`` and gets the check like every other loop.
"""

from __future__ import annotations

import json

import pytest
import torch

import mfsdp
from mfsdp.manager import MegatronFSDPConfig, communication_policy
from mfsdp.manager.mesh import MeshSizes

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

NAN_MESSAGE = "NaN or Inf in the reduced gradients"


# ------------------------------------------------------------------------------ config -> core
def test_manager_flags_become_core_options():
    sizes = MeshSizes(1, 2, 1, 1)
    assert communication_policy(MegatronFSDPConfig(), sizes).check_finite_gradients is True
    assert communication_policy(MegatronFSDPConfig(check_for_nan_in_grad=False), sizes).check_finite_gradients is False
    assert communication_policy(MegatronFSDPConfig(check_for_nan_in_grad=False, report_nan_in_param_grad=True),
                                sizes).check_finite_gradients is True
    # Loss scaling is a core option too: sums over dp = the core's mean divided by 1/dp.
    assert communication_policy(MegatronFSDPConfig(calculate_per_token_loss=True), sizes).gradient_divide_factor == 0.5


def test_manager_names_are_the_core_ones():
    from mfsdp.manager import NonFiniteGradientError, fully_shard_optimizer

    assert issubclass(NonFiniteGradientError, FloatingPointError)
    assert fully_shard_optimizer.__doc__ and "mfsdp.fully_shard_optimizer" in fully_shard_optimizer.__doc__


# ----------------------------------------------------------------------- every way, one check
def nan_every_way(rank, ws, way):
    """Two steps; step 1's loss is NaN on rank 0 only. Returns (error, weights changed by step 1)."""
    from test_manager_models import batch, make_hf
    from mfsdp.manager import (MegatronFSDPManager, build_device_mesh, fully_shard_optimizer,
                               maybe_shard_optimizer)

    manager = MegatronFSDPManager(MegatronFSDPConfig(), build_device_mesh("cpu"))
    model = make_hf("llama")
    if way == "parallelize":  # built before parallelize, bound by it
        model, opt = manager.parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, _ = manager.parallelize(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if way == "core":
            mfsdp.fully_shard_optimizer(model, opt)
        elif way == "manager":
            assert fully_shard_optimizer(model, opt) is opt
        elif way == "maybe":
            assert maybe_shard_optimizer(model, opt, MegatronFSDPConfig()) is opt
        else:
            assert way == "plain"  # an unbound torch optimizer (fp32 model: no upcast needed)
    hooks = len(opt._optimizer_step_pre_hooks)
    error, before = None, None
    for step in range(2):
        local = batch(step).chunk(ws)[rank]
        loss = model(input_ids=local, labels=local).loss
        if step == 1:
            before = [p.detach().clone() for p in model.parameters()]
            if rank == 0:
                loss = loss * float("nan")
        try:
            loss.backward()
        except FloatingPointError as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
        opt.step()
        opt.zero_grad()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return error, unchanged, hooks


@pytest.mark.parametrize("way", ["core", "manager", "maybe", "parallelize", "plain"])
def test_nan_raises_on_every_rank_whichever_way_the_optimizer_was_built(world, way):
    for error, unchanged, hooks in world(2).run(nan_every_way, way=way):
        assert error is not None and NAN_MESSAGE in error, error
        assert unchanged  # nothing stepped on the NaN
        assert hooks == (0 if way == "plain" else 1)  # the core's binding only: no second pre-step hook


# ------------------------------------------------------------------------ mfsdp train --model.hf
def train_hf_with_a_nan(rank, ws, argv, nan_rank, nan_at_call):
    """``mfsdp train`` (the trainer, in this world's processes) where, on rank ``nan_rank``, the
    ``nan_at_call``-th training loss is multiplied by NaN; the loop itself is unchanged. Returns the
    error the run stopped with on this rank (None if it finished)."""
    import torch.nn.functional as F

    from test_eval_loss import run_trainer

    cross_entropy, calls = F.cross_entropy, [0]

    def nan_cross_entropy(*args, **kwargs):
        loss = cross_entropy(*args, **kwargs)
        if rank == nan_rank and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == nan_at_call:
                loss = loss * float("nan")
        return loss

    F.cross_entropy = nan_cross_entropy
    try:
        run_trainer(rank, ws, argv)
    except FloatingPointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        F.cross_entropy = cross_entropy
    return None


def test_train_hf_stops_on_a_nan_loss_on_every_rank(world, tmp_path):
    from test_manager_models import make_hf
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    hf = tmp_path / "tiny-llama"
    make_hf("llama", vocab=260).save_pretrained(hf)  # the byte tokenizer has 257 ids
    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="a*.py")
    out = tmp_path / "run"
    argv = ["--model.hf", str(hf), "--model.hf_impl", "manager", "--data.path", str(corpus),
            "--data.seq_len", "16", "--data.local_batch", "2", "--train.steps", "4", "--train.warmup_steps", "1",
            "--train.lr", "1e-3", "--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu",
            "--train.out_dir", str(out)]
    errors = world(2).run(train_hf_with_a_nan, argv=argv, nan_rank=1, nan_at_call=2)
    for rank, error in enumerate(errors):  # rank 1's loss was NaN; both ranks stop with the core's error
        assert error is not None and NAN_MESSAGE in error and "after backward 2" in error, (rank, error)
    metrics = out / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert all(step < 2 for step in steps), steps  # step 2 never reached the optimizer, nor the log
