"""Uneven rows where the optimizer shard is not mesh order (HFSDP) or where tensor parallelism split
dim 0 first: parity with an unsharded full-batch reference, well-formed DTensors (``full_tensor``,
``clip_grad_norm_``, DCP) with no mfsdp helper (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mfsdp
from _dist import World
from mfsdp import _compat
from models import (Net, full_params, global_batch, loss_fn, make_mesh, make_optimizer, make_placements,
                    max_rel_error, reference_copy, shard_net)

FP32_TOL = 1e-5
ordered_groups = pytest.mark.skipif(not _compat.supports_ordered_groups(),
                                    reason="needs torch.distributed.new_group(sort_ranks=False)")
MAX_NORM = 0.5  # small enough that clipping scales the gradients on every step


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _train(model, ref, rank, dp_rank, dp_size, opt, mb, steps=3):
    """Train both; per step: (max param error, max grad error, sharded clip norm, reference norm)."""
    optim = make_optimizer(opt, [p for p in model.parameters() if p.requires_grad])
    ref_optim = make_optimizer(opt, [p for p in ref.parameters() if p.requires_grad])
    batch = 12
    assert batch % (dp_size * mb) == 0
    out = []
    for step in range(steps):
        x, y = global_batch(step, batch, 5, ref.embed.num_embeddings)
        ref_optim.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        ref_optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        local_x, local_y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        for i, (mx, my) in enumerate(zip(local_x.chunk(mb), local_y.chunk(mb))):
            with mfsdp.microbatch(model, is_last=i == mb - 1):
                (loss_fn(model(mx), my) / mb).backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        norm = float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optim.step()
        out.append((max_rel_error(full_params(model), full_params(ref)), max_rel_error(grads, ref_grads),
                    norm, ref_norm))
    return out, optim


def _check(steps):
    for param_err, grad_err, norm, ref_norm in steps:
        assert param_err < FP32_TOL, steps
        assert grad_err < FP32_TOL, steps
        assert abs(norm - ref_norm) <= FP32_TOL * ref_norm, steps


def _shards_are_chunks(model, ref_state) -> list[str]:
    """Names of exposed parameters whose local tensor is not torch's reading of their own spec."""
    bad = []
    for name, p in model.named_parameters():
        shape, offset = _compat.local_shape_and_offset(p.shape, p.device_mesh, p.placements)
        want = ref_state[name]
        for dim, (size, start) in enumerate(zip(shape, offset)):
            want = want.narrow(dim, min(start, want.shape[dim]), size)
        if tuple(p.to_local().shape) != shape or not torch.equal(p.to_local().detach(), want):
            bad.append(name)
    return bad


def _dcp_round_trip(model, optim, path) -> dict:
    """Save model and optimizer state with DCP, scribble over both, load; True where bit-exact."""
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim)
    saved = {k: v.to_local().clone() for k, v in model_sd.items()}
    saved_optim = {(k, s): v.to_local().clone() for k, st in optim_sd["state"].items()
                   for s, v in st.items() if isinstance(v, DTensor)}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    with torch.no_grad():
        for v in model_sd.values():
            v.to_local().fill_(7.0)
        for k, s in saved_optim:
            optim_sd["state"][k][s].to_local().fill_(-3.0)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {
        "model": all(torch.equal(v.to_local(), saved[k]) for k, v in model_sd.items()),
        "optim": bool(saved_optim) and all(torch.equal(optim_sd["state"][k][s].to_local(), t)
                                           for (k, s), t in saved_optim.items()),
        # the values DCP wrote into the state dict are the parameters themselves
        "params": all(torch.equal(p.to_local(), saved[n]) for n, p in model.named_parameters()),
    }


# ---------------------------------------------------------------------------------------- HFSDP
def hfsdp_uneven(rank, ws, opt="adamw", mb=1, vocab=13, path=None):
    torch.manual_seed(0)
    model = Net(vocab=vocab, dim=6, hidden=10)
    ref = reference_copy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_net(model, make_mesh("hfsdp", ws), make_placements("hfsdp"))
    meshes = {id(p.device_mesh) for p in model.parameters()}
    exposed = {(p.device_mesh.ndim, tuple(map(str, p.placements))) for p in model.parameters()}
    not_chunks = _shards_are_chunks(model, initial)
    # distribute_tensor reads the spec as DTensor does: each rank keeps its own block, no communication
    not_chunks += [n for n, p in model.named_parameters() if not torch.equal(
        distribute_tensor(initial[n], p.device_mesh, p.placements, src_data_rank=None).to_local(), p.to_local())]
    steps, optim = _train(model, ref, rank, rank, ws, opt, mb)
    result = dict(steps=steps, meshes=len(meshes), exposed=exposed, not_chunks=not_chunks)
    if path is not None:
        result["dcp"] = _dcp_round_trip(model, optim, path)
    return result


@ordered_groups
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("mb", [1, 3])
def test_hfsdp_uneven_parity(world, opt, mb):
    for r in world(4).run(hfsdp_uneven, opt=opt, mb=mb):
        _check(r["steps"])
        assert r["meshes"] == 1, r  # one mesh for every group: created once, cached
        assert r["exposed"] == {(1, ("S(0)",))}, r
        assert r["not_chunks"] == [], r


@ordered_groups
@pytest.mark.parametrize("vocab", [13, 3])  # 3 rows: one shard is empty
def test_hfsdp_uneven_checkpoint(world, tmp_path, vocab):
    for r in world(4).run(hfsdp_uneven, opt="adamw", vocab=vocab, path=str(tmp_path / "ckpt")):
        _check(r["steps"])
        assert r["dcp"] == {"model": True, "optim": True, "params": True}, r


def hfsdp_fallback_error(rank, ws):
    """Where torch cannot order a group's ranks, uneven HFSDP rows fail up front, naming the fix."""
    original = _compat.supports_ordered_groups
    _compat.supports_ordered_groups = lambda: False
    try:
        even = Net(vocab=16, dim=8, hidden=12)
        shard_net(even, make_mesh("hfsdp", ws), make_placements("hfsdp"))  # strided shards: fine
        try:
            shard_net(Net(), make_mesh("hfsdp", ws), make_placements("hfsdp"))
        except NotImplementedError as exc:
            return str(exc)
        return None
    finally:
        _compat.supports_ordered_groups = original


def test_hfsdp_uneven_error_without_ordered_groups(world):
    for message in world(4).run(hfsdp_fallback_error):  # every rank, not only those that see it
        assert message is not None and "sort_ranks=False" in message and "shape (" in message, message


# ------------------------------------------------------------------------------ tensor parallel
def _tensor_parallel(model, tp_mesh) -> dict:
    """w1/w2 of every block and the head split over ``tp_mesh``; returns the full initial weights."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    parallelize_module(model, tp_mesh, {"head": ColwiseParallel(output_layouts=Replicate())})
    return {n: p.detach().full_tensor().clone() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()}


def tp_uneven(rank, ws, kind="zero3", opt="sgd", mb=1, path=None):
    """(dp, tp) mesh; w1 and the head split dim 0 over tp, then mfsdp splits it over dp, unevenly:
    w1 has 10 rows (5 per tp rank: 3 + 2 over dp), the head 13 (7 and 6: 4 + 3 and 3 + 3)."""
    torch.manual_seed(0)
    model = Net(vocab=13, dim=6, hidden=10)
    ref = reference_copy(model)
    mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    initial = _tensor_parallel(model, mesh["tp"])
    shard_net(model, mesh, make_placements(kind))
    placements = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()}
    not_chunks = _shards_are_chunks(model, initial)
    steps, optim = _train(model, ref, rank, mesh["dp"].get_local_rank(), mesh["dp"].size(), opt, mb)
    result = dict(steps=steps, placements=placements, not_chunks=not_chunks)
    if path is not None:
        result["dcp"] = _dcp_round_trip(model, optim, path)
    return result


@pytest.mark.parametrize("kind,opt,mb", [("zero3", "sgd", 1), ("zero3", "adamw", 3), ("zero2", "adamw", 1),
                                         ("zero1", "sgd", 3)])
def test_tensor_parallel_uneven_dim0(world, kind, opt, mb):
    for r in world(4).run(tp_uneven, kind=kind, opt=opt, mb=mb):
        _check(r["steps"])
        assert r["placements"]["head.weight"] == ["_S(0, 2)", "S(0)"], r["placements"]
        assert r["placements"]["blocks.0.w1.weight"] == ["_S(0, 2)", "S(0)"], r["placements"]
        assert r["not_chunks"] == [], r


def test_tensor_parallel_uneven_checkpoint(world, tmp_path):
    for r in world(4).run(tp_uneven, kind="zero3", opt="adamw", path=str(tmp_path / "ckpt")):
        _check(r["steps"])
        assert r["dcp"] == {"model": True, "optim": True, "params": True}, r


def tp_two_dp_axes(rank, ws, kind="hfsdp", opt="adamw", mb=1, path=None):
    """(replicate, shard, tp) mesh: HFSDP or ZeRO-3 over both dp axes of TP blocks and head, whose
    exposed mesh is (the dp axes flattened in shard order, tp)."""
    torch.manual_seed(0)
    model = Net(vocab=13, dim=6, hidden=10)
    ref = reference_copy(model)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    initial = _tensor_parallel(model, mesh["tp"])
    shard_net(model, mesh, make_placements(kind))
    exposed = {n: (p.device_mesh.mesh_dim_names, [str(pl) for pl in p.placements])
               for n, p in model.named_parameters()}
    not_chunks = _shards_are_chunks(model, initial)
    dp_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("shard")
    steps, optim = _train(model, ref, rank, dp_rank, 4, opt, mb)
    result = dict(steps=steps, exposed=exposed, not_chunks=not_chunks)
    if path is not None:
        result["dcp"] = _dcp_round_trip(model, optim, path)
    return result


_TWO_DP_AXES_EXPOSED = {  # kind: (head.weight's exposed mesh and placements, embed.weight's)
    "hfsdp": ((("shard_replicate_in_shard_order", "tp"), ["_S(0, 2)", "S(0)"]),
              (("shard_replicate_in_shard_order", "tp"), ["S(0)", "R"])),
    "zero3_2d": ((("replicate_shard_in_shard_order", "tp"), ["_S(0, 2)", "S(0)"]),
                 (("replicate_shard_in_shard_order", "tp"), ["S(0)", "R"])),
    "hsdp": ((("replicate", "shard", "tp"), ["R", "_S(0, 2)", "S(0)"]),
             (("replicate", "shard", "tp"), ["R", "S(0)", "R"])),
}


@pytest.fixture(scope="module")
def world8():
    """Eight ranks for this module only: the only test that needs them. Left running in the session's
    worlds, their gloo groups' socket threads polled (~0.1 core) through every later test."""
    w = World(8)
    yield w
    w.close()


@pytest.mark.parametrize("kind,opt,mb", [pytest.param("hfsdp", "adamw", 3, marks=ordered_groups),
                                         pytest.param("zero3_2d", "sgd", 1, marks=ordered_groups),
                                         ("hsdp", "sgd", 3)])
def test_tensor_parallel_with_two_dp_axes(world8, tmp_path, kind, opt, mb):
    for r in world8.run(tp_two_dp_axes, kind=kind, opt=opt, mb=mb, path=str(tmp_path / "ckpt")):
        _check(r["steps"])
        assert r["not_chunks"] == [], r
        assert r["dcp"] == {"model": True, "optim": True, "params": True}, r
        head, embed = _TWO_DP_AXES_EXPOSED[kind]
        assert r["exposed"]["head.weight"] == head and r["exposed"]["embed.weight"] == embed, r["exposed"]
