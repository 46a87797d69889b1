"""Optimizer offload (``mfsdp.offload``): the chosen units' master weights and AdamW states live on
the host and step there: speculatively during backward, from the reduction hook, on a worker
thread, validated in ``step`` ("step"), or staged in backward and stepped in ``step`` ("copy"),
or all in ``step`` ("none"). On CPU the "host" is the same device, but the hook, every copy, the
staging ring, the worker thread and the separate CPU optimizer still run.

Parity against the same run without offload, with global-norm clipping that bites (speculation
redone) or not (kept), 2 microbatches, bf16 compute, on zero3/zero2/zero1/ddp: bit-identical with
fused AdamW (the host optimizer is fused too), ≤1e-6 relative with foreach AdamW; DCP resume
equals the uninterrupted run, and resharding (zero3 -> ddp) loads the states exactly; staging is
a ring of at most two group-sized buffers; delayed copies are waited for; a hook fired one
microbatch early is caught by the step's check (and without the check the run differs); a skipped
step leaves no trace. CPU, gloo, 2 ranks.
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


def _build(rank, ws, kind, opt="fused", offload=None, seed=0, device="cpu", grads=None):
    torch.manual_seed(seed)
    model = Net(vocab=16, dim=8, hidden=12, n_blocks=3).to(device, torch.bfloat16)  # bf16 compute, fp32 masters
    policy = None if grads is None else mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                   main_grads_dtype=grads)
    shard_net(model, make_mesh(kind, ws, device), make_placements(kind), policy=policy)
    kw = {"fused": True} if opt == "fused" else {"foreach": True}
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-2, **kw)
    return model, mfsdp.fully_shard_optimizer(model, optim, offload=offload)


def _step(model, optim, step, rank, ws, after_microbatch=None, clip=CLIP, edit=False):
    x, y = global_batch(step, 4 * ws, 5, model.embed.num_embeddings, model.embed.weight.device)
    x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
    for i, (mx, my) in enumerate(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))):
        with mfsdp.microbatch(model, is_last=i == MICROBATCHES - 1):
            (loss_fn(model(mx), my) / MICROBATCHES).backward()
        if after_microbatch is not None:
            after_microbatch(i)
    if edit:  # an in-place edit of one parameter's gradient (no version counter sees it on a DTensor)
        model.blocks[1].w1.weight.grad.mul_(0.5)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    assert float(norm) > CLIP
    torch.nn.utils.clip_grads_with_norm_(params, clip, norm)  # a coefficient of 1 leaves the bits
    optim.step()
    optim.zero_grad(set_to_none=step % 2 == 0)


def _counts(engine) -> dict:
    """The engine's counts with the speculations dropped before they started counted as undone
    (which of the two a late one is depends on timing)."""
    counts = dict(engine.counts)
    counts["redone"] += counts.pop("dropped")
    return counts


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


def parity(rank, ws, kind, opt, fraction, steps=3, overlap="step", clip=CLIP, device="cpu", grads=None):
    out = []
    for offload in (None, mfsdp.OffloadPolicy(fraction=fraction, overlap=overlap)):
        model, optim = _build(rank, ws, kind, opt, offload, device=device, grads=grads)
        for step in range(steps):
            _step(model, optim, step, rank, ws, clip=clip)
        out.append(_snapshot(model, optim))
    return out, _offloaded_units(model, optim), _counts(offload_mod.offload_of(optim))


def _compare(a, b, rel):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        if rel == 0:
            assert a[k].cpu().equal(b[k].cpu()), k
        else:
            # On CUDA the offloaded run's states live on the host (as FSDP2's CPU offload keeps them):
            # compare values, wherever they are.
            x, y = a[k].cpu(), b[k].cpu()
            scale = y.abs().max().clamp_min(1e-6)
            assert float((x - y).abs().max() / scale) <= rel, (k, x, y)


@pytest.mark.parametrize("kind", PLACEMENTS)
@pytest.mark.parametrize("clip, overlap", [(CLIP, "step"), (1e6, "step"), (CLIP, "copy"), (CLIP, "none")])
def test_offload_is_bit_identical_with_fused_adamw(world, kind, clip, overlap):
    """Clipping that bites (speculation redone) or not (kept), or no speculation."""
    (plain, offloaded), units, counts = world(2).run(parity, kind=kind, opt="fused", fraction=0.5,
                                                     overlap=overlap, clip=clip)[0]
    assert units == ["blocks.2", "blocks.1"], units  # the last blocks first: their gradients finish first
    for got, want in zip(offloaded, plain):
        _compare(got, want, 0)
    assert len(offloaded[1]) == 3 * len(offloaded[0])  # step, exp_avg, exp_avg_sq of every parameter
    kept = 6 if overlap == "step" and clip > 1 else 0  # two groups, three steps
    assert counts["kept"] == kept and counts["serialized"] == 6 - kept, counts


@pytest.mark.parametrize("overlap", ["step", "copy"])
def test_offload_with_bf16_main_gradients(world, overlap):
    """mfsdp train's default: bf16 main gradients, cast to fp32 on their way to the host."""
    (plain, offloaded), _, counts = world(2).run(parity, kind="zero3", opt="fused", fraction=1.0, overlap=overlap,
                                                 clip=1e6, grads=torch.bfloat16)[0]
    for got, want in zip(offloaded, plain):
        _compare(got, want, 0)
    assert counts["kept"] == (12 if overlap == "step" else 0), counts


def test_offload_everything_with_foreach_adamw(world):
    """The user's foreach AdamW against the host's fused kernel: the same math to rounding."""
    (plain, offloaded), units, _ = world(2).run(parity, kind="zero3", opt="foreach", fraction=1.0)[0]
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
            == engine.host.cpu.state[engine.host.of(g).params[j]]["exp_avg"].untyped_storage().data_ptr()
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

def staging(rank, ws, overlap):
    policy = mfsdp.OffloadPolicy(units=("blocks.2", "blocks.0", ""), overlap=overlap)
    model, optim = _build(rank, ws, "zero3", offload=policy)
    engine = offload_mod.offload_of(optim)
    seen = []
    original = engine.ring.copy_down

    def recording(sources, destinations, stream, after=None):
        seen.append({d.untyped_storage().data_ptr() for d in destinations if d.numel()})
        return original(sources, destinations, stream, after)

    engine.ring.copy_down = recording
    for step in range(3):
        _step(model, optim, step, rank, ws)
    main_bytes = [g.main.tensor.numel() * 4 for g in engine.groups]
    return engine.host_nbytes(), main_bytes, len(seen), len(set().union(*seen)), \
        sum(p.to_local().numel() for g in engine.groups for p in g.sharded_params), \
        sum(len(g.sharded_params) for g in engine.groups), _counts(engine), engine.planned_host_bytes()


@pytest.mark.parametrize("overlap", ["step", "copy", "none"])
def test_host_memory_is_masters_states_and_a_staging_ring(world, overlap):
    nbytes, main_bytes, copies, storages, shard_numel, tensors, counts, planned = \
        world(2).run(staging, overlap=overlap)[0]
    # every step clips: the first speculation is redone, then the groups stop speculating
    redone = len(main_bytes) if overlap == "step" else 0
    restaged = 0 if overlap == "none" else 3 * len(main_bytes)  # staged in backward, again after the clip
    # every copy went through the ring (one staged in backward may be dropped before its copy)
    assert 3 * len(main_bytes) + (restaged if overlap == "copy" else 0) <= copies <= 3 * len(main_bytes) + restaged
    assert storages <= (1 if overlap == "none" else 2)  # serialized: the buffer is free again for the next
    assert nbytes["staging"] == storages * max(main_bytes) < sum(main_bytes)  # not one buffer per group
    assert nbytes["master"] == sum(main_bytes)
    assert tensors == 12  # two blocks' w1, w2 (weights and biases); embedding, norm (2), head
    assert nbytes["states"] == 2 * 4 * shard_numel + 4 * tensors, nbytes  # exp_avg, exp_avg_sq, steps
    # the backup was taken once, before the first speculation (no states yet); the clip bit, so the
    # groups stopped speculating and never backed up again (host memory: at most master + states)
    assert nbytes["backup"] == (nbytes["master"] if overlap == "step" else 0)
    assert counts == {"kept": 0, "redone": redone, "serialized": 3 * len(main_bytes)}, counts
    # the planner's rule (``policy.host_bytes``) over the same groups bounds what was held (but for
    # the 4-byte step counts)
    assert planned["master"] == nbytes["master"] and planned["staging"] == 2 * max(main_bytes)
    assert planned["states"] == 2 * planned["master"] and planned["backup"] == (
        planned["master"] + planned["states"] if overlap == "step" else 0)
    assert list(planned) == list(nbytes), (nbytes, planned)
    assert all(nbytes[k] <= planned[k] + 4 * tensors for k in planned), (nbytes, planned)


# ------------------------------------------------------------------------------- gradient final

class _Delayed:
    """A copy that lands late: it reads the gradients when it is issued (as a copy queued on a
    stream does) and writes the staging buffer 50 ms later; ``synchronize`` waits for it."""

    def __init__(self, sources, destinations) -> None:
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


def overlapped(rank, ws, clip, early=False, trust=False, skip=None, steps=3, device="cpu", delay=True, edit=False,
               reference=None):
    """Every unit offloaded, every copy delayed, against ``reference`` (an offload policy; None:
    no offload). ``early``: the hook fires after the first of two microbatches instead of the last
    (an overlapped step hooked one microbatch too early); ``trust``: the step's check of the
    speculated steps is switched off (what a step that trusts its speculation would do); ``skip``:
    the step that is skipped (backward, then ``zero_grad``, as after a NaN check)."""
    out, counts = [], None
    for offload in (reference, mfsdp.OffloadPolicy()):
        model, optim = _build(rank, ws, "zero3", offload=offload, device=device)
        engine = None if offload is reference else offload_mod.offload_of(optim)
        hooked = None
        if engine is not None and delay:
            engine.ring.copy_down = lambda sources, destinations, stream, after=None: _Delayed(sources, destinations)
        if engine is not None and trust:
            engine.speculation.changed = lambda: set()
        if engine is not None and early:
            hooked = [(g, g.gradient_final_hooks[:]) for g in engine.groups]
            for g in engine.groups:
                g.gradient_final_hooks.clear()
        for step in range(steps):
            if step == skip:
                x, y = global_batch(step, 4 * ws, 5, model.embed.num_embeddings, device)
                loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
                optim.zero_grad()
                continue
            stream = torch.cuda.current_stream() if device == "cuda" else None
            fire = (lambda i: i == 0 and [h(g, stream) for g, hs in hooked for h in hs]) if hooked else None
            _step(model, optim, step, rank, ws, after_microbatch=fire, clip=clip, edit=edit)
        out.append(_snapshot(model, optim))
        counts = None if engine is None else _counts(engine)
    return out, counts


def _same(got, want) -> bool:
    return all(a[k].equal(b[k]) for a, b in zip(got, want) for k in b)


def test_an_unclipped_update_never_gets_through(world):
    """The clip bites every step: the first step's speculations are redone from the backup, and
    the groups then stop speculating (a clip that bit predicts the next), all bit-identical to no
    offload; where it does not bite (a coefficient of exactly 1), the speculation is kept."""
    (want, got), counts = world(2).run(overlapped, clip=CLIP)[0]
    assert _same(got, want) and counts == {"kept": 0, "redone": 4, "serialized": 12}, counts
    (want, got), counts = world(2).run(overlapped, clip=1e6)[0]
    assert _same(got, want) and counts == {"kept": 12, "redone": 0, "serialized": 0}, counts


def test_a_unit_stepped_before_its_gradient_is_final_is_caught(world):
    """Hooked one microbatch early, every speculated step read a gradient that was not final: the
    check redoes each, and the run is still exact. Trusting the speculation instead gives another
    run: the check is what catches it."""
    (want, got), counts = world(2).run(overlapped, clip=1e6, early=True)[0]
    assert _same(got, want) and counts == {"kept": 0, "redone": 4, "serialized": 12}, counts
    (want, got), counts = world(2).run(overlapped, clip=1e6, early=True, trust=True)[0]
    assert not _same(got, want) and counts["kept"] == 12


def test_an_edited_gradient_redoes_only_its_group(world):
    """One group's gradient edited in place between backward and step (every step): that group is
    redone in ``step``, then stops speculating, while the others' speculated steps are kept (and
    may still be running)."""
    (want, got), counts = world(2).run(overlapped, clip=1e6, edit=True)[0]
    assert _same(got, want) and counts == {"kept": 9, "redone": 1, "serialized": 3}, counts


def test_a_skipped_step_leaves_no_trace(world):
    """A backward whose step is skipped (zero_grad instead, as after a NaN check) undoes the
    speculated steps: the run equals the one without offload that skips the same step."""
    (want, got), counts = world(2).run(overlapped, clip=1e6, skip=1, steps=4)[0]
    assert _same(got, want) and counts == {"kept": 12, "redone": 4, "serialized": 0}, counts


# ------------------------------------------------------------------------------- policy

def test_policy_is_validated():
    assert mfsdp.OffloadPolicy(units=["head", ""]).units == ("head", "")
    assert mfsdp.OffloadPolicy(fraction=1).fraction == 1.0
    for kwargs, message in [({"fraction": 0.0}, "fraction must be in"), ({"fraction": 1.5}, "fraction must be in"),
                            ({"fraction": 0.5, "units": ("a",)}, "not both"), ({"units": "blocks.0"}, "not one string"),
                            ({"units": ()}, "non-empty"), ({"threads": 0}, "threads must be"),
                            ({"pin_memory": "yes"}, "pin_memory must be"), ({"overlap": "yes"}, "overlap must be"),
                            ({"staging_buffers": 0}, "staging_buffers must be")]:
        with pytest.raises(ValueError, match=message):
            mfsdp.OffloadPolicy(**kwargs)


def test_the_pure_rules():
    """The planner's and the runtime's one rule: the last-registered units first, the root last, whole
    units rounded up (0.1 of 30 is 3, though 0.1 * 30 is a little above 3 in floating point)."""
    from mfsdp.offload.policy import host_bytes, units_to_offload

    assert units_to_offload(["", "blocks.0", "blocks.1", "head"], 0.5) == ["head", "blocks.1"]
    assert units_to_offload(["", "blocks.0"], 0.1) == ["blocks.0"]
    assert units_to_offload(["", "blocks.0"], 1.0) == ["blocks.0", ""]
    assert len(units_to_offload(list(range(30)), 0.1)) == 3
    assert host_bytes([8, 4], 24, "step", staging_buffers=3) == {"master": 12, "states": 24, "backup": 36, "staging": 24}
    assert host_bytes([], 0, "copy") == {"master": 0, "states": 0, "backup": 0, "staging": 0}


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
