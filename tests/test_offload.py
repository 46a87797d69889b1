"""Optimizer offload (``mfsdp.offload``): the chosen units' master weights and AdamW states live on
the host and step there, after backward (the first, serialized version). On CPU the "host" is the
same device, but every copy, the staging buffer and the separate CPU optimizer still run.

Parity against the same run without offload, with global-norm clipping, 2 microbatches, bf16
compute and bf16 main gradients, on zero3/zero2/zero1/ddp: bit-identical with fused AdamW (the
host optimizer is fused too), ≤1e-6 relative with foreach AdamW; DCP resume equals the
uninterrupted run, and resharding (zero3 -> ddp) loads the states exactly; the staging buffer is
one group's; a delayed copy hook catches a gradient read before it is final. CPU, gloo, 2 ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mfsdp
from mfsdp import offload as offload_mod
from models import Net, full_params, global_batch, loss_fn, make_mesh, make_placements, shard_net

PLACEMENTS = ("zero3", "zero2", "zero1", "ddp")
CLIP = 0.05  # well below the gradients' norm: every step clips
MICROBATCHES = 2


def _build(rank, ws, kind, opt="fused", offload=None, seed=0):
    torch.manual_seed(seed)
    model = Net(vocab=16, dim=8, hidden=12, n_blocks=3).to(torch.bfloat16)  # bf16 compute, fp32 masters
    shard_net(model, make_mesh(kind, ws), make_placements(kind))
    kw = {"fused": True} if opt == "fused" else {"foreach": True}
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-2, **kw)
    return model, mfsdp.fully_shard_optimizer(model, optim, offload=offload)


def _step(model, optim, step, rank, ws, after_microbatch=None):
    x, y = global_batch(step, 4 * ws, 5, model.embed.num_embeddings)
    x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
    for i, (mx, my) in enumerate(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))):
        with mfsdp.microbatch(model, is_last=i == MICROBATCHES - 1):
            (loss_fn(model(mx), my) / MICROBATCHES).backward()
        if after_microbatch is not None:
            after_microbatch(i)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    assert float(norm) > CLIP
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm)
    optim.step()
    optim.zero_grad(set_to_none=step % 2 == 0)


def _full(v):
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()


def _snapshot(model, optim):
    states = {f"{name}.{key}": _full(v) for name, p in model.named_parameters()
              for key, v in optim.state[p].items()}
    return full_params(model), states


def _offloaded_units(model, optim):
    engine = offload_mod.offload_of(optim)
    names = {id(g): name for name, m in model.named_modules() if isinstance(m, mfsdp.FsdpModule)
             for g in m.parameter_groups}
    return [names[id(g)] for g in engine.groups]


def parity(rank, ws, kind, opt, fraction, steps=3):
    out = []
    for offload in (None, mfsdp.OffloadPolicy(fraction=fraction)):
        model, optim = _build(rank, ws, kind, opt, offload)
        for step in range(steps):
            _step(model, optim, step, rank, ws)
        out.append(_snapshot(model, optim))
    return out, _offloaded_units(model, optim)


def _compare(a, b, rel):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        if rel == 0:
            assert a[k].equal(b[k]), k
        else:
            scale = b[k].abs().max().clamp_min(1e-6)
            assert float((a[k] - b[k]).abs().max() / scale) <= rel, (k, a[k], b[k])


@pytest.mark.parametrize("kind", PLACEMENTS)
def test_offload_is_bit_identical_with_fused_adamw(world, kind):
    (plain, offloaded), units = world(2).run(parity, kind=kind, opt="fused", fraction=0.5)[0]
    assert units == ["blocks.2", "blocks.1"], units  # the last blocks first: their gradients finish first
    for got, want in zip(offloaded, plain):
        _compare(got, want, 0)
    assert len(offloaded[1]) == 3 * len(offloaded[0])  # step, exp_avg, exp_avg_sq of every parameter


def test_offload_everything_with_foreach_adamw(world):
    """The user's foreach AdamW against the host's fused kernel: the same math to rounding."""
    (plain, offloaded), units = world(2).run(parity, kind="zero3", opt="foreach", fraction=1.0)[0]
    assert units == ["blocks.2", "blocks.1", "blocks.0", ""], units
    for got, want in zip(offloaded, plain):
        _compare(got, want, 1e-6)


# ------------------------------------------------------------------------------- resume

def _save(model, optim, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
             checkpoint_id=path)


def _load(model, optim, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def resume(rank, ws, path, load_kind, load_fraction):
    policy = mfsdp.OffloadPolicy(fraction=0.5)
    model, optim = _build(rank, ws, "zero3", offload=policy)
    for step in range(4):
        _step(model, optim, step, rank, ws)
        if step == 1:
            _save(model, optim, path)
            saved = _snapshot(model, optim)
    uninterrupted = _snapshot(model, optim)
    out = []
    for load_offload in (mfsdp.OffloadPolicy(fraction=load_fraction), None):  # the same checkpoint twice
        model, optim = _build(rank, ws, load_kind, offload=load_offload, seed=1)
        _load(model, optim, path)
        loaded = _snapshot(model, optim)
        engine = offload_mod.offload_of(optim)
        on_host = engine is None or all(
            optim.state[p]["exp_avg"].to_local().untyped_storage().data_ptr()
            == engine._cpu().state[engine._host[id(g)].params[j]]["exp_avg"].untyped_storage().data_ptr()
            for g in engine.groups for j, p in enumerate(g.sharded_params))
        for step in range(2, 4):
            _step(model, optim, step, rank, ws)
        out.append((loaded, _snapshot(model, optim), on_host))
    return saved, uninterrupted, out


@pytest.mark.parametrize("load_kind, load_fraction", [("zero3", 0.5), ("ddp", 1.0)])
def test_resume_from_offloaded_states(world, tmp_path, load_kind, load_fraction):
    """zero3 with half the units offloaded saves; the same setting (bit-identical to the run that
    went on) or ddp with every unit offloaded (states resharded to whole tensors) loads."""
    saved, uninterrupted, [(loaded, resumed, on_host), (_, resumed_on_device, _)] = world(2).run(
        resume, path=str(tmp_path / "ckpt"), load_kind=load_kind, load_fraction=load_fraction)[0]
    assert on_host  # the loaded states are the host optimizer's tensors, exposed
    for got, want in zip(loaded, saved):
        _compare(got, want, 0)  # the load itself is exact, resharded or not
    for got, want in zip(resumed, resumed_on_device):
        _compare(got, want, 0)  # and what follows is the run that loaded the states on the device
    if load_kind == "zero3":
        for got, want in zip(resumed, uninterrupted):
            _compare(got, want, 0)  # which, in the same setting, is the run that went on


# ------------------------------------------------------------------------------- memory

def staging(rank, ws):
    model, optim = _build(rank, ws, "zero3", offload=mfsdp.OffloadPolicy(units=("blocks.2", "blocks.0", "")))
    engine = offload_mod.offload_of(optim)
    seen = []
    original = engine.copy_down

    def recording(sources, destinations, stream):
        seen.append({d.untyped_storage().data_ptr() for d in destinations if d.numel()})
        return original(sources, destinations, stream)

    engine.copy_down = recording
    for step in range(3):
        _step(model, optim, step, rank, ws)
    main_bytes = [g.main.tensor.numel() * 4 for g in engine.groups]
    return engine.host_nbytes(), main_bytes, len(seen), len(set().union(*seen)), \
        sum(p.to_local().numel() for g in engine.groups for p in g.sharded_params), \
        sum(len(g.sharded_params) for g in engine.groups)


def test_host_memory_is_masters_states_and_one_staging_buffer(world):
    nbytes, main_bytes, copies, storages, shard_numel, tensors = world(2).run(staging)[0]
    assert copies == 3 * len(main_bytes) and storages == 1  # every copy went through one buffer
    assert nbytes["staging"] == max(main_bytes) < sum(main_bytes)  # one group's, not all of them
    assert nbytes["master"] == sum(main_bytes)
    assert tensors == 12  # two blocks' w1, w2 (weights and biases); embedding, norm (2), head
    assert nbytes["states"] == 2 * 4 * shard_numel + 4 * tensors, nbytes  # exp_avg, exp_avg_sq, steps


# ------------------------------------------------------------------------------- gradient final

class _Delayed:
    """A copy that lands late: it reads the gradients when it is issued (as a copy queued on a
    stream does) and writes the staging buffer 50 ms later; ``synchronize`` checks that what it
    read is the gradient as it is now, when the group steps (the final, clipped one)."""

    def __init__(self, sources, destinations) -> None:
        self.sources = sources
        self.read = [None if s is None else s.clone() for s in sources]
        self.thread = threading.Thread(target=self._land, args=(destinations,))
        self.thread.start()

    def _land(self, destinations) -> None:
        time.sleep(0.05)
        for r, d in zip(self.read, destinations):
            if r is not None:
                d.copy_(r)

    def synchronize(self) -> None:
        self.thread.join()
        for r, s in zip(self.read, self.sources):
            assert (r is None) == (s is None) and (r is None or r.equal(s)), \
                "a unit was copied down before its gradient was final"


def delayed_copy(rank, ws, early):
    """With every copy delayed, offloading everything equals no offload (the step waits for each
    copy); ``early``: the seam is called for the last block after the first of two microbatches
    (as an overlapped step hooked one microbatch too early would), which must fail."""
    policy = mfsdp.OffloadPolicy(units=("blocks.2",)) if early else mfsdp.OffloadPolicy()
    model, optim = _build(rank, ws, "zero3", offload=policy)
    engine = offload_mod.offload_of(optim)
    engine.copy_down = lambda sources, destinations, stream: _Delayed(sources, destinations)
    if early:
        first = engine.groups[0]
        try:
            _step(model, optim, 0, rank, ws, after_microbatch=lambda i: i == 0 and engine.gradient_final(first))
        except AssertionError as e:
            return str(e)
        return None
    for step in range(3):
        _step(model, optim, step, rank, ws)
    got = _snapshot(model, optim)
    model, optim = _build(rank, ws, "zero3")
    for step in range(3):
        _step(model, optim, step, rank, ws)
    return got, _snapshot(model, optim)


def test_a_delayed_copy_is_waited_for_and_an_early_one_is_caught(world):
    got, want = world(2).run(delayed_copy, early=False)[0]
    for a, b in zip(got, want):
        _compare(a, b, 0)
    assert world(2).run(delayed_copy, early=True) == ["a unit was copied down before its gradient was final"] * 2


# ------------------------------------------------------------------------------- policy

def test_policy_is_validated():
    assert mfsdp.OffloadPolicy(units=["head", ""]).units == ("head", "")
    assert mfsdp.OffloadPolicy(fraction=1).fraction == 1.0
    for kwargs, message in [({"fraction": 0.0}, "fraction must be in"), ({"fraction": 1.5}, "fraction must be in"),
                            ({"fraction": 0.5, "units": ("a",)}, "not both"), ({"units": "blocks.0"}, "not one string"),
                            ({"units": ()}, "non-empty"), ({"threads": 0}, "threads must be"),
                            ({"pin_memory": "yes"}, "pin_memory must be")]:
        with pytest.raises(ValueError, match=message):
            mfsdp.OffloadPolicy(**kwargs)


def bad_bindings(rank, ws):
    torch.manual_seed(0)
    model = shard_net(Net(), make_mesh("zero3", ws), make_placements("zero3"))
    errors = []
    for make, policy in [(lambda: torch.optim.LBFGS(model.parameters()), mfsdp.OffloadPolicy()),
                         (lambda: torch.optim.AdamW(model.parameters()), mfsdp.OffloadPolicy(units=("nope",)))]:
        try:
            mfsdp.fully_shard_optimizer(model, make(), offload=policy)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_unsupported_optimizers_and_unknown_units_are_named(world):
    lbfgs, unknown = world(2).run(bad_bindings)[0]
    assert "elementwise optimizers" in lbfgs and "LBFGS" in lbfgs
    assert "['nope']" in unknown and "blocks.2" in unknown
