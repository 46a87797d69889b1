"""Sharded training matches an unsharded reference trained on the full batch (CPU, gloo)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mfsdp
from models import (Net, full_params, global_batch, loss_fn, make_mesh, make_optimizer, make_placements,
                    max_rel_error, reference_copy, round_to_bf16, shard_net, step_both)

FP32_TOL = 1e-5


def _dims(kind: str) -> dict:
    """Net's uneven rows everywhere; HFSDP on a torch that cannot order a process group's ranks
    (no new_group(sort_ranks=False)) exposes strided shards, defined for even rows only."""
    from mfsdp import _compat

    return dict(vocab=16, dim=8, hidden=12) if kind == "hfsdp" and not _compat.supports_ordered_groups() else {}


def train_parity(rank, ws, kind="zero3", opt="adamw", steps=3, tied=False, mb=1, ckpt=None, frozen=False,
                 bind=False, device="cpu", delay=False, comm=None):
    torch.manual_seed(0)
    model = Net(tied=tied, checkpointing=ckpt, **_dims(kind))
    if frozen:
        model.blocks[1].requires_grad_(False)
    model.to(device)
    ref = reference_copy(model)
    shard_net(model, make_mesh(kind, ws, device), make_placements(kind),
              comm=mfsdp.CommunicationPolicy(**comm) if comm else None)
    with _injected_delays(delay):
        return _train_and_compare(rank, ws, model, ref, opt, steps, mb, bind, device)


def _train_and_compare(rank, ws, model, ref, opt, steps, mb, bind, device):
    optim = make_optimizer(opt, [p for p in model.parameters() if p.requires_grad])
    if bind:
        mfsdp.fully_shard_optimizer(model, optim)
    ref_optim = make_optimizer(opt, [p for p in ref.parameters() if p.requires_grad])
    errors, losses = [], []
    batch = 12
    # Unequal microbatches would each be weighted 1/mb: a wrong reference, not a wrong library.
    assert batch % (ws * mb) == 0, f"global batch {batch} does not split into {ws} ranks x {mb} microbatches"
    for step in range(steps):
        x, y = global_batch(step, batch, 5, model.embed.num_embeddings, device)
        ref_optim.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_optim.step()
        local_x, local_y = x.chunk(ws)[rank], y.chunk(ws)[rank]
        optim.zero_grad(set_to_none=step % 2 == 0)
        total = 0.0
        for i, (mx, my) in enumerate(zip(local_x.chunk(mb), local_y.chunk(mb))):
            with mfsdp.microbatch(model, is_last=i == mb - 1):
                loss = loss_fn(model(mx), my) / mb
                loss.backward()
            total += loss.item()
        optim.step()
        t = torch.tensor([total], device=device)
        torch.distributed.all_reduce(t)
        losses.append((float(t) / ws, ref_loss.item()))
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    return errors, losses


@contextlib.contextmanager
def _injected_delays(enabled: bool = True):
    """Stall every collective's stream before it runs (its callers already run on that stream):
    a missing wait shows up as wrong numbers instead of passing by luck (GPU only). Restored on
    exit: the worker process serves later cases, which must not inherit (or stack) the stalls."""
    from mfsdp import _compat
    from mfsdp.runtime import collectives

    names = ("all_gather", "reduce_scatter", "all_reduce") if enabled else ()
    originals = {name: getattr(collectives, name) for name in names}
    for name, original in originals.items():
        def delayed(*args, _original=original, **kwargs):
            _compat.gpu_spin(2_000_000)
            return _original(*args, **kwargs)

        setattr(collectives, name, delayed)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)


def _check(results):
    errors, losses = results[0]
    assert max(errors) < FP32_TOL, errors
    for got, want in losses:
        assert abs(got - want) <= 1e-5 * abs(want), losses


ONE_AXIS = ["zero3", "zero2", "zero1", "ddp"]
TWO_AXES = ["hsdp", "hsdp_deferred", "hfsdp", "zero3_2d"]


@pytest.mark.parametrize("kind", ONE_AXIS)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_parity_world2(world, kind, opt):
    _check(world(2).run(train_parity, kind=kind, opt=opt, tied=opt == "sgd", mb=3 if opt == "sgd" else 1))


@pytest.mark.parametrize("kind", ONE_AXIS + TWO_AXES)
def test_parity_world4(world, kind):
    _check(world(4).run(train_parity, kind=kind, opt="sgd", mb=3, tied=True, frozen=True))
    _check(world(4).run(train_parity, kind=kind, opt="adamw", ckpt="nonreentrant"))


def bf16_wire_gradients(rank, ws, kind):
    """fp32 gradients reduced in bf16 on the wire, over two microbatches: every reduction path
    (DDP's, the deferred all-reduce on the main gradient, HFSDP's accumulator) casts to bf16 and
    back, and still lands on the fp32 full-batch gradient to bf16 precision."""
    torch.manual_seed(0)
    model = Net(**_dims(kind))
    ref = reference_copy(model)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                        grad_comm_dtype=torch.bfloat16)
    shard_net(model, make_mesh(kind, ws), make_placements(kind), policy)
    x, y = global_batch(0, 16, 5, model.embed.num_embeddings)  # equal microbatches on 2 and 4 ranks
    loss_fn(ref(x), y).backward()
    for i, (mx, my) in enumerate(zip(x.chunk(ws)[rank].chunk(2), y.chunk(ws)[rank].chunk(2))):
        with mfsdp.microbatch(model, is_last=i == 1):
            (loss_fn(model(mx), my) / 2).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return max_rel_error(got, {n: p.grad for n, p in ref.named_parameters()})


@pytest.mark.parametrize("kind,ws", [("ddp", 2), ("zero1", 2), ("hsdp_deferred", 4), ("hfsdp", 4)])
def test_gradients_reduced_in_bf16(world, kind, ws):
    assert max(world(ws).run(bf16_wire_gradients, kind=kind)) < 2e-2


@pytest.mark.parametrize("kind", ["zero3", "zero1"])
def test_parity_world1(world, kind):
    _check(world(1).run(train_parity, kind=kind, opt="adamw", mb=3, tied=True, ckpt="reentrant"))


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_parity_activation_checkpointing(world, ckpt):
    _check(world(2).run(train_parity, kind="zero3", opt="sgd", ckpt=ckpt, mb=3))


def test_parity_bound_optimizer(world):
    _check(world(2).run(train_parity, kind="zero2", opt="adamw", bind=True, frozen=True))


def bf16_parity(rank, ws, kind="zero3"):
    """bf16 compute, fp32 main weights and fp32 gradients: close to fp32, equal to a bf16 twin."""
    torch.manual_seed(0)
    model = Net(dim=16, hidden=32, vocab=32)
    round_to_bf16(model)  # the sharded model's fp32 masters start from its bf16 weights
    fp32_ref = reference_copy(model)
    bf16_ref = reference_copy(model)
    model.to(torch.bfloat16)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    shard_net(model, make_mesh(kind, ws), make_placements(kind), policy)
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    fp32_optim = torch.optim.SGD(fp32_ref.parameters(), lr=0.5)
    bf16_optim = torch.optim.SGD(bf16_ref.parameters(), lr=0.5)
    bf16_twin = reference_copy(bf16_ref).to(torch.bfloat16)  # computes in bf16 from fp32 masters
    for step in range(3):
        x, y = global_batch(step, 8, 5, 32)
        for ref, opt in ((fp32_ref, fp32_optim),):
            opt.zero_grad()
            loss_fn(ref(x), y).backward()
            opt.step()
        # bf16 twin: bf16 forward/backward per rank slice, fp32 gradient average, fp32 step.
        bf16_optim.zero_grad()
        grads = None
        for r in range(ws):
            bf16_twin.zero_grad()
            loss_fn(bf16_twin(x.chunk(ws)[r]), y.chunk(ws)[r]).backward()
            g = [p.grad.float() / ws for p in bf16_twin.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(bf16_ref.parameters(), grads):
            p.grad = g
        bf16_optim.step()
        with torch.no_grad():
            for t, s in zip(bf16_twin.parameters(), bf16_ref.parameters()):
                t.copy_(s)
        optim.zero_grad()
        loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
        optim.step()
    got = full_params(model)
    for p in model.parameters():
        assert p.dtype == torch.float32
    return max_rel_error(got, full_params(fp32_ref)), max_rel_error(got, full_params(bf16_ref))


def test_bf16_mixed_precision(world):
    loose, tight = world(2).run(bf16_parity)[0]
    assert loose < 3e-2, loose
    assert tight < 2e-3, tight


def bf16_grads_adamw(rank, ws, kind="zero3"):
    """Default policy on a bf16 model: fp32 main weights, bf16 grads upcast for AdamW per step."""
    torch.manual_seed(0)
    model = Net(dim=16, hidden=32, vocab=32)
    round_to_bf16(model)
    ref = reference_copy(model)
    model.to(torch.bfloat16)
    shard_net(model, make_mesh(kind, ws), make_placements(kind))
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    dtypes = set()

    def record_dtypes():
        dtypes.clear()
        dtypes.update((p.dtype, p.grad.dtype) for p in model.parameters())

    def check_restored():
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())  # restored after the step

    for step in range(3):
        step_both(model, ref, optim, ref_optim, step, 8, rank, ws, after_backward=record_dtypes,
                  after_step=check_restored)
    got, want = full_params(model), full_params(ref)
    # Norm-wise: Adam turns a near-zero bf16 gradient's rounding into a full-size step, so single
    # elements may differ by 2*lr while the tensors agree closely.
    err = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in got)
    return err, sorted(map(str, dtypes))


@pytest.mark.parametrize("kind", ["zero3", "zero2"])
def test_bf16_grads_with_bound_adamw(world, kind):
    err, dtypes = world(2).run(bf16_grads_adamw, kind=kind)[0]
    assert dtypes == ["(torch.float32, torch.bfloat16)"], dtypes
    assert err < 3e-2, err
