"""The bound optimizer's step updates the next forward's first modules first and gathers them while it
updates the rest (``CommunicationPolicy.prefetch_across_step``, ``mfsdp.optimizer``): parity with an
unsharded reference, bit-equality with the one-call step, the cases that fall back to one call, and
gathers that a later write makes stale. CPU, gloo, the session's world of 2 ranks."""

from __future__ import annotations

import pytest
import torch

import mfsdp
from models import (Net, full_params, global_batch, loss_fn, make_mesh, make_placements, max_rel_error,
                    reference_copy, shard_net)

FP32_TOL = 1e-5


class SubclassedAdamW(torch.optim.AdamW):
    """Not one of torch's own classes: its step might read every parameter, so it steps in one call."""


def _optimizer(kind: str, params):
    if kind == "subclass":
        return SubclassedAdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


def _gathered(net) -> list[bool]:
    """Which FSDP modules hold their gathered weights (root first, then the blocks)."""
    return [m.is_unsharded() for m in [net, *net.blocks]]


def staged_training(rank, ws, kind="zero3", opt="adamw", variant="staged", steps=3, bf16=False, clip=None,
                    device="cpu", delay=False):
    """Three steps of the sharded model (bound optimizer) and of an unsharded reference on the full
    batch. Returns the worst relative error against the reference, the final full weights, which
    modules were gathered after each step, and how often the hooks registered after binding ran.

    ``delay`` (GPU): every collective's stream and, before the update, the compute stream stall,
    so a gather that does not wait for the update it must read, or a forward that does not wait
    for the gather, gives wrong numbers instead of passing by luck."""
    from test_core_parity import _injected_delays

    with _injected_delays(delay):
        return _staged_training(rank, ws, kind, opt, variant, steps, bf16, clip, device, delay)


def _staged_training(rank, ws, kind, opt, variant, steps, bf16, clip, device, delay):
    torch.manual_seed(0)
    model = Net(n_blocks=3).to(device)
    ref = reference_copy(model)
    comm = mfsdp.CommunicationPolicy(prefetch_across_step=variant != "off")
    if bf16:  # bf16 compute and gradients, fp32 main weights: the optimizer gets upcast gradients
        model.to(torch.bfloat16)
    shard_net(model, make_mesh(kind, ws, device), make_placements(kind), comm=comm)
    optim = _optimizer(opt, model.parameters())
    if delay:
        from mfsdp import _compat

        optim.register_step_pre_hook(lambda *a: _compat.gpu_spin(2_000_000))
    optim = mfsdp.fully_shard_optimizer(model, optim)
    ref_optim = _optimizer(opt, ref.parameters())
    calls = {"pre": 0, "post": 0}
    if variant == "late_pre_hook":  # may edit gradients after mfsdp's hook: one call
        optim.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    optim.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    errors, gathered = [], []
    extra = [torch.nn.Parameter(torch.ones(3, device=device)) for _ in range(2)]  # a plain parameter each
    for step in range(steps):
        if variant == "add_group" and step == 1:  # the staging's split of the parameters follows
            optim.add_param_group({"params": [extra[0]]})
            ref_optim.add_param_group({"params": [extra[1]]})
        x, y = global_batch(step, 4 * ws, 5, 13, device)
        (loss_fn(ref(x), y) + (extra[1] ** 2).sum()).backward()
        (loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]) + (extra[0] ** 2).sum()).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        ref_optim.step()
        optim.step((lambda: None) if variant == "closure" else None)
        gathered.append(_gathered(model))
        ref_optim.zero_grad()
        optim.zero_grad()
        errors.append(max_rel_error(full_params(model), full_params(ref)))
        errors.append(float((extra[0] - extra[1]).abs().max()))
    with torch.no_grad():  # the early gathers feed this forward
        x, _ = global_batch(steps, 4 * ws, 5, 13, device)
        out_err = float((model(x.chunk(ws)[rank]).float() - ref(x.chunk(ws)[rank])).abs().max())
    return max(errors), full_params(model), gathered, calls, out_err


def test_first_modules_update_and_gather_before_the_rest(world):
    """Two steps of the root and the first block (prefetch depth 1): gathered right after each step,
    the weights they hold are the updated ones (the next forward matches the reference), and the
    whole run is bit-identical to the one-call step; the hooks ran once per step."""
    for kind in ("zero3", "zero2", "hsdp"):
        for opt in ("adamw", "fused", "sgd"):
            (err, params, gathered, calls, out_err), _ = world(2).run(staged_training, kind=kind, opt=opt)
            (_, one_call, off_gathered, _, _), _ = world(2).run(staged_training, kind=kind, opt=opt, variant="off")
            assert err < FP32_TOL and out_err < 1e-5, (kind, opt, err, out_err)
            assert all(params[k].equal(one_call[k]) for k in params), (kind, opt)
            assert calls == {"pre": 0, "post": 3}, calls
            if kind == "zero3":  # ZeRO-2 and HSDP keep whole weights: nothing to gather
                assert gathered == [[True, True, False, False]] * 3, gathered
                assert off_gathered == [[False] * 4] * 3, off_gathered


def test_exact_clipping_bf16_gradients_and_a_new_param_group(world):
    """Clipping before the step stays exact (the step reads the clipped gradients in both calls),
    the bf16 gradients upcast for the optimizer are the same objects in both calls, and a param
    group added later is stepped once."""
    err, params, gathered, _, _ = world(2).run(staged_training, clip=0.05)[0]
    assert err < FP32_TOL and gathered[-1][:2] == [True, True], (err, gathered)
    _, staged, gathered, _, _ = world(2).run(staged_training, bf16=True)[0]
    _, one_call, _, _, _ = world(2).run(staged_training, bf16=True, variant="off")[0]
    assert gathered[-1][:2] == [True, True] and all(staged[k].equal(one_call[k]) for k in staged)
    # A param group added after some steps: the split follows, the new parameter steps once.
    err, _, gathered, _, _ = world(2).run(staged_training, variant="add_group")[0]
    assert err < FP32_TOL and gathered[-1][:2] == [True, True], (err, gathered)


@pytest.mark.parametrize("variant,opt", [("late_pre_hook", "adamw"), ("closure", "adamw"), ("staged", "subclass")])
def test_one_call_where_two_could_differ(world, variant, opt):
    """A pre hook registered after binding (it may edit gradients), a closure, or an optimizer class
    that is not torch's own: one call, no early gather, still the reference's numbers."""
    err, _, gathered, calls, _ = world(2).run(staged_training, opt=opt, variant=variant)[0]
    assert err < FP32_TOL, err
    assert gathered == [[False] * 4] * 3, gathered
    assert calls["post"] == 3 and calls["pre"] == (3 if variant == "late_pre_hook" else 0)


def stale_early_gathers(rank, ws):
    """After a step has gathered the root early, the weights change again (a state-dict load; an
    in-place edit and ``refresh_model_weights``): the next forward uses the new weights."""
    torch.manual_seed(0)
    model = Net(n_blocks=2)
    other = Net(n_blocks=2)
    shard_net(model, make_mesh("zero3", ws), make_placements("zero3"))
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = global_batch(0, 2 * ws, 5, 13)
    local = x.chunk(ws)[rank]
    results = []
    for change in ("load", "edit"):
        loss_fn(model(local), y.chunk(ws)[rank]).backward()
        optim.step()
        early = _gathered(model)[:2]
        with torch.no_grad():
            if change == "load":
                state = {k: v.full_tensor() for k, v in model.state_dict().items()}
                state["embed.weight"] = other.embed.weight.detach().clone()
                full = {k: v for k, v in state.items()}
                from torch.distributed.checkpoint.state_dict import set_model_state_dict
                set_model_state_dict(model, full, options=_full_state_options())
            else:
                model.embed.weight.to_local().mul_(-1.0)
                model.refresh_model_weights()
        optim.zero_grad()
        expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
        ref = Net(n_blocks=2)
        ref.load_state_dict(expected)
        with torch.no_grad():
            results.append((change, early, float((model(local) - ref(local)).abs().max())))
    return results


def _full_state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)


def test_a_later_write_drops_the_early_gather(world):
    for change, early, err in world(2).run(stale_early_gathers)[0]:
        assert early == [True, True], (change, early)
        assert err < 1e-6, (change, err)


def test_planner_counts_the_early_gathers():
    """The planner's step: the first units' update, then the rest's beside their gathered weights."""
    from mfsdp.memory import estimate

    kwargs = dict(model_or_config="tiny", placements="zero3", world_size=2, local_batch=1, seq_len=64,
                  device="cpu")
    on = {p.name: p for p in estimate(**kwargs).phases}
    off = {p.name: p for p in estimate(**kwargs, communication_policy=mfsdp.CommunicationPolicy(
        prefetch_across_step=False)).phases}
    assert "optimizer step" in off and "optimizer step" not in on
    rest = on["optimizer step: the rest"].components
    assert rest["unsharded (forward)"] > 0
    assert on["optimizer step: first units"].components["unsharded (forward)"] == 0
