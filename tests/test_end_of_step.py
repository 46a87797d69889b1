"""One end-of-step path: the core's NaN/Inf check and gradient scaling, whichever way the optimizer
(or none) was built.

The manager only translates its config into core options; the check itself is the core's
(``CommunicationPolicy.check_finite_gradients``), which raises from ``loss.backward()`` on every
rank before any optimizer can step on a NaN. ``mfsdp train --model.hf`` binds its optimizer with
the core's ``fully_shard_optimizer`` and gets the check like every other loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mfsdp
from mfsdp.manager import MegatronFSDPConfig, communication_policy
from mfsdp.manager.mesh import MeshSizes

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[1]
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
# Loaded by every Python process of the launch (sitecustomize): in worker NAN_RANK, the NAN_AT_CALL-th
# training loss is multiplied by NaN. The loop itself is unchanged.
SITECUSTOMIZE = textwrap.dedent("""
    import os
    if os.environ.get("NAN_AT_CALL") and os.environ.get("RANK") == os.environ.get("NAN_RANK"):
        import torch
        import torch.nn.functional as F

        _cross_entropy, _calls = F.cross_entropy, [0]

        def cross_entropy(*args, **kwargs):
            loss = _cross_entropy(*args, **kwargs)
            if torch.is_grad_enabled():
                _calls[0] += 1
                if _calls[0] == int(os.environ["NAN_AT_CALL"]):
                    loss = loss * float("nan")
            return loss

        F.cross_entropy = cross_entropy
""")


def test_train_hf_stops_on_a_nan_loss_on_every_rank(tmp_path):
    from test_manager_models import make_hf
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    hf = tmp_path / "tiny-llama"
    make_hf("llama", vocab=260).save_pretrained(hf)  # the byte tokenizer has 257 ids
    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="a*.py")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out, logs = tmp_path / "run", tmp_path / "logs"
    env = dict(os.environ, OMP_NUM_THREADS="1", NAN_AT_CALL="2", NAN_RANK="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(inject), str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3",
           "-m", "mfsdp.train", "--model.hf", str(hf), "--model.hf_impl", "manager", "--data.path", str(corpus),
           "--data.seq_len", "16", "--data.local_batch", "2", "--train.steps", "4", "--train.warmup_steps", "1",
           "--train.lr", "1e-3", "--train.sample_tokens", "0", "--train.progress", "false", "--train.device", "cpu",
           "--train.out_dir", str(out)]
    run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode != 0, run.stdout + run.stderr
    stderr = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == ["0", "1"], (sorted(stderr), run.stderr)
    for rank, text in stderr.items():  # rank 1's loss was NaN; both ranks stop with the core's error
        assert "FloatingPointError" in text and NAN_MESSAGE in text and "after backward 2" in text, (rank, text)
    metrics = out / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert all(step < 2 for step in steps), steps  # step 2 never reached the optimizer, nor the log
