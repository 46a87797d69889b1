"""CommunicationPolicy: each option changes what it says and keeps training exact."""

from __future__ import annotations

import pytest
import torch

import mfsdp
from models import Net, global_batch, loss_fn, make_mesh, make_placements, reference_copy, shard_net
from test_core_parity import _check, train_parity


@pytest.mark.parametrize("comm", [
    {"prefetch_depth": 0}, {"prefetch_depth": 2}, {"overlap": False}, {"unify_streams": True}, {"coalesce": False},
])
def test_options_keep_parity(world, comm):
    _check(world(2).run(train_parity, kind="zero3", opt="sgd", mb=2, tied=True, comm=comm))
    _check(world(2).run(train_parity, kind="zero1", opt="adamw", comm=comm))


@pytest.mark.parametrize("comm", [
    {"double_buffer": True}, {"double_buffer": True, "prefetch_depth": 0}, {"double_buffer": True, "prefetch_depth": 2},
])
def test_double_buffer_keeps_parity(world, comm):
    _check(world(2).run(train_parity, kind="zero3", opt="adamw", mb=2, tied=True, ckpt="nonreentrant", comm=comm))
    _check(world(2).run(train_parity, kind="zero3", opt="sgd", frozen=True, ckpt="reentrant", comm=comm))


def test_double_buffer_keeps_parity_hsdp(world):
    _check(world(4).run(train_parity, kind="hsdp", opt="adamw", mb=3, comm={"double_buffer": True}))  # 3 rows a rank


def gather_slot_layout(rank, ws, depth):
    torch.manual_seed(0)
    net = shard_net(Net(n_blocks=5), make_mesh("zero3", ws), make_placements("zero3"),
                    comm=mfsdp.CommunicationPolicy(double_buffer=True, prefetch_depth=depth))
    x, y = global_batch(0, 4, 5, 13)
    loss_fn(net(x), y).backward()
    slots = net.context.gather_slots.slots
    block_groups = [b.parameter_groups[0] for b in net.blocks]
    # Module k gathers into slot k % (depth + 1), and its parameters live in that slot for good.
    bound = [slots.index(g._slot) for g in block_groups]
    in_slot = all(
        p.untyped_storage().data_ptr() == g._slot.tensor.untyped_storage().data_ptr()
        for g in block_groups for p in g.params
    )
    root_unbound = all(g._slot is None for g in net.parameter_groups)
    # A busy slot: a prefetch is skipped, a just-in-time unshard raises.
    first, clash = net.blocks[0], net.blocks[depth + 1]
    first.unshard()
    clash.unshard(prefetch=True)
    skipped = not clash.is_unsharded()
    try:
        clash.unshard()
        raised = ""
    except RuntimeError as exc:
        raised = str(exc)
    first.reshard()
    return len(slots), bound, in_slot, root_unbound, skipped, raised


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_double_buffer_binds_fixed_slots(world, depth):
    n, bound, in_slot, root_unbound, skipped, raised = world(2).run(gather_slot_layout, depth=depth)[0]
    assert n == depth + 1
    assert bound == [k % (depth + 1) for k in range(5)]
    assert in_slot and root_unbound and skipped
    assert "still holds" in raised and "double_buffer=False" in raised, raised


def symm_mem_needs_cuda(rank, ws):
    net = Net()
    with pytest.raises(ValueError, match="CUDA mesh"):
        mfsdp.fully_shard(net.blocks[0], make_mesh("zero3", ws), use_symm_mem=True,
                          communication_policy=mfsdp.CommunicationPolicy(double_buffer=True))
    return True


def test_use_symm_mem_needs_cuda(world):
    assert world(2).run(symm_mem_needs_cuda)[0]


def test_policy_validation():
    with pytest.raises(ValueError, match="prefetch_depth"):
        mfsdp.CommunicationPolicy(prefetch_depth=-1)
    with pytest.raises(ValueError, match="gradient_divide_factor"):
        mfsdp.CommunicationPolicy(gradient_divide_factor=0)


def unsharded_during_forward(rank, ws, depth):
    torch.manual_seed(0)
    net = shard_net(Net(n_blocks=4), make_mesh("zero3", ws), make_placements("zero3"),
                    comm=mfsdp.CommunicationPolicy(prefetch_depth=depth))
    seen = []
    for b in net.blocks:
        b.register_forward_pre_hook(lambda m, a: seen.append(
            sum(g.unsharded.is_allocated for blk in net.blocks for g in blk.parameter_groups)))
    x, y = global_batch(0, 4, 5, 13)
    loss_fn(net(x), y).backward()
    return seen


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_depth_bounds_unsharded_modules(world, depth):
    seen = world(2).run(unsharded_during_forward, depth=depth)[0]
    assert max(seen) == depth + 1, seen  # this block plus `depth` prefetched ones


def coalescing_launches(rank, ws, coalesce):
    from mfsdp import _compat

    calls = {"coalesced": 0}
    original = _compat.coalescing_manager

    def counting(*args, **kwargs):
        calls["coalesced"] += 1
        return original(*args, **kwargs)

    _compat.coalescing_manager = counting
    try:
        torch.manual_seed(0)
        net = shard_net(Net(), make_mesh("zero3", ws), make_placements("zero3"),
                        comm=mfsdp.CommunicationPolicy(coalesce=coalesce))
        x, y = global_batch(0, 4, 5, 13)
        loss_fn(net(x), y).backward()
    finally:
        _compat.coalescing_manager = original
    return calls["coalesced"]


def test_coalesce_off_issues_one_launch_per_parameter(world):
    assert world(2).run(coalescing_launches, coalesce=True)[0] > 0
    assert world(2).run(coalescing_launches, coalesce=False)[0] == 0


def divided_gradients(rank, ws, kind, factor):
    torch.manual_seed(0)
    net = Net()
    ref = reference_copy(net)
    shard_net(net, make_mesh(kind, ws), make_placements(kind),
              comm=mfsdp.CommunicationPolicy(gradient_divide_factor=factor))
    x, y = global_batch(0, 4, 5, 13)
    for i, (mx, my) in enumerate(zip(x.chunk(ws)[rank].chunk(2), y.chunk(ws)[rank].chunk(2))):
        with mfsdp.microbatch(net, is_last=i == 1):
            (loss_fn(net(mx), my) / 2).backward()
    loss_fn(ref(x), y).backward()
    return max(float((p.grad.full_tensor() * factor - q.grad).abs().max() / q.grad.abs().max())
               for p, q in zip(net.parameters(), ref.parameters()))


@pytest.mark.parametrize("kind", ["zero3", "zero1", "ddp"])
def test_gradient_divide_factor(world, kind):
    assert world(2).run(divided_gradients, kind=kind, factor=4.0)[0] < 1e-5


def nonfinite_check(rank, ws):
    torch.manual_seed(0)
    net = shard_net(Net(), make_mesh("zero3", ws), make_placements("zero3"),
                    comm=mfsdp.CommunicationPolicy(check_finite_gradients=True))
    x, y = global_batch(0, 4, 5, 13)
    loss_fn(net(x), y).backward()  # finite: no error
    net.zero_grad()
    loss = loss_fn(net(x), y)
    if rank == 0:
        loss = loss * float("nan")
    try:
        loss.backward()
    except Exception as exc:  # raised on every rank, naming the backward and the groups
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_check_finite_gradients_raises_on_every_rank(world):
    for message in world(2).run(nonfinite_check):
        assert "NaN or Inf" in message and "after backward 2" in message, message
