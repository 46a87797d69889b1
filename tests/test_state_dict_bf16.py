"""torch's state-dict helpers and DCP on mfsdp models that compute in bf16 (2 gloo ranks).

On GPUs ``mfsdp train`` computes in bf16 with fp32 main weights and bf16 main gradients, so the
sharded parameters carry gradients of another dtype than their own. A fresh optimizer given to
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` is initialised by torch with
``param.grad = torch.zeros_like(param)`` (fp32) and a step: resuming a run crashed there. CPU
supports bf16, so these cases run everywhere:

* every public helper round trip (sharded and full state dicts, ``dcp.save`` / ``dcp.load``), before
  and after the first step: the loaded model and optimizer hold exactly the source's values and
  take exactly the same next step;
* a run interrupted and resumed through ``mfsdp.train.checkpoint`` reproduces the uninterrupted
  run's losses bit for bit, and those stay close to an unsharded fp32 reference.

Each with and without ``fully_shard_optimizer``, for ZeRO-3 and ZeRO-2. A plain (unbound) torch
optimizer cannot step fp32 weights on bf16 gradients, so unbound cases keep fp32 main gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import mfsdp
from models import Net, global_batch, loss_fn, make_mesh, make_placements, shard_net

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

BATCH, SEQ, VOCAB = 4, 5, 13
FULL = StateDictOptions(full_state_dict=True)
CASES = [(kind, bound) for kind in ("zero3", "zero2") for bound in (True, False)]
IDS = [f"{kind}-{'bound' if bound else 'plain'}" for kind, bound in CASES]


def _policy(bound: bool) -> mfsdp.MixedPrecisionPolicy:
    # Bound: mfsdp train's GPU default (fp32 main weights, bf16 main gradients = the compute dtype).
    # Plain: torch's optimizers need gradients in the weights' dtype.
    return mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                      main_grads_dtype=None if bound else torch.float32)


def _unsharded(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16)


def _build(seed: int, kind: str, bound: bool, ws: int):
    net = shard_net(_unsharded(seed), make_mesh(kind, ws), make_placements(kind), policy=_policy(bound))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if bound:
        mfsdp.fully_shard_optimizer(net, opt)
    return net, opt


def _step(net, opt, step: int, rank: int, ws: int) -> float:
    """One training step on this rank's slice of the global batch; returns the global mean loss."""
    x, y = global_batch(step, BATCH, SEQ, VOCAB)
    loss = loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / ws


def _shared_dir(rank: int, base: str, name: str) -> str:
    path = f"{base}/{name}"
    if rank == 0:
        import os

        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _cloned(tree):
    """A copy of a state dict that shares no tensor with it, as one read back from a file would be:
    torch's optimizers keep loaded tensors that already have the right dtype and device (an AdamW
    ``step`` would otherwise count both models' steps)."""
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def _full_model(net) -> dict:
    return {k: v.detach().clone() for k, v in get_model_state_dict(net, options=FULL).items()}


def _full_optim(net, opt) -> dict:
    return get_optimizer_state_dict(net, opt, options=FULL)


def _differences(a, b, where="") -> list[str]:
    """Every place where two nested state dicts differ (tensors compared bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return [f"{where}: tensors differ ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})"]
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


# ----------------------------------------------------------------------------- round trips
def round_trips(rank, ws, kind, bound, steps_before, tmp):
    """Copy a trained (or fresh) model + optimizer into fresh ones through every public helper."""
    src, src_opt = _build(0, kind, bound, ws)
    out = {}
    # Unsharded reference: the sharded fp32 main weights hold exactly the bf16 init values.
    out["init_vs_unsharded"] = _differences(_full_model(src),
                                            {k: v.float() for k, v in _unsharded(0).state_dict().items()})
    for step in range(steps_before):
        _step(src, src_opt, step, rank, ws)

    # Sharded (DTensor) state dicts, straight from one model to the other.
    model_sd = _cloned(get_model_state_dict(src))
    optim_sd = _cloned(get_optimizer_state_dict(src, src_opt))  # a fresh optimizer is initialised here
    sharded, sharded_opt = _build(1, kind, bound, ws)
    set_model_state_dict(sharded, model_sd)
    set_optimizer_state_dict(sharded, sharded_opt, optim_sd)

    # Full (unsharded) state dicts on every rank.
    full, full_opt = _build(2, kind, bound, ws)
    set_model_state_dict(full, _full_model(src), options=FULL)
    set_optimizer_state_dict(full, full_opt, _cloned(_full_optim(src, src_opt)), options=FULL)

    # DCP, into a model + optimizer that have never stepped (the resume path of mfsdp train).
    path = _shared_dir(rank, tmp, f"dcp-{kind}-{bound}-{steps_before}")
    dcp.save({"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)},
             checkpoint_id=path)
    loaded, loaded_opt = _build(3, kind, bound, ws)
    state = {"model": get_model_state_dict(loaded), "optim": get_optimizer_state_dict(loaded, loaded_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(loaded, state["model"])
    set_optimizer_state_dict(loaded, loaded_opt, state["optim"])

    want_model, want_optim = _full_model(src), _full_optim(src, src_opt)
    out["optim_has_state"] = len(want_optim["state"]) == len(list(src.parameters()))
    copies = {"sharded": (sharded, sharded_opt), "full": (full, full_opt), "dcp": (loaded, loaded_opt)}
    for name, (net, opt) in copies.items():
        out[f"{name}_model"] = _differences(_full_model(net), want_model)
        out[f"{name}_optim"] = _differences(_full_optim(net, opt), want_optim)
    # The next two steps (forward from the refreshed bf16 compute weights, backward, AdamW).
    out["losses"] = {name: [_step(net, opt, steps_before + s, rank, ws) for s in range(2)]
                     for name, (net, opt) in {"source": (src, src_opt), **copies}.items()}
    return out


@pytest.mark.parametrize("kind,bound", CASES, ids=IDS)
@pytest.mark.parametrize("steps_before", [0, 2], ids=["fresh", "trained"])
def test_state_dict_round_trips_in_bf16(world, tmp_path, kind, bound, steps_before):
    for out in world(2).run(round_trips, kind=kind, bound=bound, steps_before=steps_before, tmp=str(tmp_path)):
        assert out["init_vs_unsharded"] == [], out["init_vs_unsharded"]
        assert out["optim_has_state"]
        for name in ("sharded", "full", "dcp"):
            assert out[f"{name}_model"] == [], (name, out[f"{name}_model"])
            assert out[f"{name}_optim"] == [], (name, out[f"{name}_optim"])
        losses = out["losses"]
        assert all(v == losses["source"] for v in losses.values()), losses


# ----------------------------------------------------------------------------- resume
def resume_run(rank, ws, kind, bound, tmp, steps=4, stop_at=2):
    """Uninterrupted vs stopped at ``stop_at``, saved, resumed into a fresh model; plus an unsharded
    fp32 reference on the full batch."""
    from mfsdp.train.checkpoint import CheckpointMeta, find_latest, load_checkpoint, save_checkpoint

    net, opt = _build(0, kind, bound, ws)
    straight = [_step(net, opt, s, rank, ws) for s in range(steps)]

    root = _shared_dir(rank, tmp, f"ckpt-{kind}-{bound}")
    net, opt = _build(0, kind, bound, ws)
    first = [_step(net, opt, s, rank, ws) for s in range(stop_at)]
    save_checkpoint(root, stop_at, net, opt, CheckpointMeta(model={}))
    del net, opt
    resumed, resumed_opt = _build(1, kind, bound, ws)  # other initial weights: all must come from disk
    meta = load_checkpoint(find_latest(root), resumed, resumed_opt)
    rest = [_step(resumed, resumed_opt, s, rank, ws) for s in range(meta.step, steps)]

    ref = copy.deepcopy(_unsharded(0)).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    reference = []
    for s in range(steps):
        x, y = global_batch(s, BATCH, SEQ, VOCAB)
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.append(float(loss))
    return {"straight": straight, "resumed": first + rest, "step": meta.step, "reference": reference}


@pytest.mark.parametrize("kind,bound", CASES, ids=IDS)
def test_resume_reproduces_the_uninterrupted_run_in_bf16(world, tmp_path, kind, bound):
    for out in world(2).run(resume_run, kind=kind, bound=bound, tmp=str(tmp_path)):
        assert out["step"] == 2
        assert out["resumed"] == out["straight"], out  # bit for bit
        # bf16 compute against fp32: ~0.5 % apart; a lost optimizer state or a wrong weight is not.
        worst = max(abs(a - b) for a, b in zip(out["straight"], out["reference"]))
        assert worst < 2e-2, out
