"""Conditional computation: ranks run different modules, and training still matches an unsharded
reference on the full batch (CPU, gloo). Each world has a short process-group timeout, so a
regression to a hang fails within seconds instead of stalling CI."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import mfsdp
from _dist import World
from conditional_models import VARIANTS, CondNet, cond_parity, shard_cond
from models import Block, global_batch, loss_fn, make_mesh, make_placements

TOL = 1e-5


@pytest.fixture(scope="module")
def cworld():
    cache: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in cache:
            cache[n] = World(n, pg_timeout_s=20)
        return cache[n]

    yield get
    for w in cache.values():
        w.close()


def _check(result):
    for variant, (err, loss_err) in result.items():
        assert err < TOL and loss_err < TOL, (variant, err, loss_err)


@pytest.mark.parametrize("kind", ["zero3", "zero2", "zero1", "ddp"])
@pytest.mark.parametrize("mb", [1, 2])
def test_every_variant_two_ranks(cworld, kind, mb):
    _check(cworld(2).run(cond_parity, timeout=120, variants=VARIANTS, kind=kind, mb=mb, pattern="even_ranks")[0])


@pytest.mark.parametrize("kind", ["zero3", "hsdp", "hfsdp", "zero2", "ddp"])
def test_every_variant_four_ranks(cworld, kind):
    _check(cworld(4).run(cond_parity, timeout=180, variants=VARIANTS, kind=kind, mb=2, pattern="even_ranks")[0])


@pytest.mark.parametrize("ws,mb", [(2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("kind", ["hsdp", "hsdp_deferred", "hfsdp"])
def test_two_axis_placements_with_a_single_user(cworld, kind, ws, mb):
    """One rank alone uses a module: its usage count passes two averages (shard axis, then
    replicate axis) and must not floor to zero there. On 2 ranks the mesh is (2, 1)."""
    _check(cworld(ws).run(cond_parity, timeout=180, variants=["nested", "skip_block", "vlm"], kind=kind,
                          mb=mb, pattern="sometimes")[0])


@pytest.mark.parametrize("kind", ["zero3", "zero1"])
def test_used_in_some_steps_and_microbatches_only(cworld, kind):
    _check(cworld(2).run(cond_parity, timeout=120, variants=["nested", "expert_module", "skip_block", "vlm"],
                         kind=kind, mb=2, pattern="sometimes", steps=4)[0])


@pytest.mark.parametrize("comm", [dict(overlap=False), dict(prefetch_depth=2), dict(double_buffer=True)])
def test_communication_options(cworld, comm):
    _check(cworld(2).run(cond_parity, timeout=120, variants=["nested", "skip_block", "passthrough"],
                         kind="zero3", mb=2, pattern="even_ranks", comm=comm)[0])


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_activation_checkpointing(cworld, ckpt):
    _check(cworld(2).run(cond_parity, timeout=120, variants=["nested", "skip_block"], kind="zero3", mb=2,
                         pattern="even_ranks", checkpointing=ckpt)[0])


# ------------------------------------------------------------------------------ mismatches
class _Renamed(nn.Module):
    """The same shapes as CondNet("skip_block") under other attribute names: a rank that built a
    different tree (a rank-dependent config, say)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.layers = nn.ModuleList(Block(6, 10) for _ in range(3))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 13, bias=False)

    def forward(self, tokens, flag=True):
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))


def desynchronized(rank, ws, mode, renamed):
    """Rank 1 builds a differently named tree, or one whose block 1 has another size; returns the
    error each rank saw."""
    torch.manual_seed(0)
    comm = mfsdp.CommunicationPolicy(check_collectives=mode == "policy")
    previous = os.environ.get("MFSDP_CHECK_COLLECTIVES")
    if mode == "env":
        os.environ["MFSDP_CHECK_COLLECTIVES"] = "1"
    try:
        mesh = make_mesh("zero3", ws)
        if rank == 1 and renamed:
            model = _Renamed()
            for block in model.layers:
                mfsdp.fully_shard(block, mesh, communication_policy=comm)
            mfsdp.fully_shard(model, mesh, communication_policy=comm)
        else:
            model = CondNet("skip_block")
            if rank == 1:
                model.blocks[1] = Block(6, 12)
            shard_cond(model, mesh, make_placements("zero3"), comm)
        x, y = global_batch(0, 2 * ws, 5, 13)
        try:
            loss_fn(model(x.chunk(ws)[rank], False), y.chunk(ws)[rank]).backward()
        except mfsdp.CollectiveMismatchError as err:
            return str(err)
        return None
    finally:
        if previous is None:
            os.environ.pop("MFSDP_CHECK_COLLECTIVES", None)
        else:
            os.environ["MFSDP_CHECK_COLLECTIVES"] = previous


def test_reduction_tags_name_the_mismatched_modules(cworld):
    errors = cworld(2).run(desynchronized, timeout=60, mode="off", renamed=True)
    assert all(e is not None and "collective mismatch in backward" in e for e in errors), errors
    assert "blocks.1" in errors[0] and "layers.1" in errors[1], errors
    assert "MFSDP_CHECK_COLLECTIVES" in errors[0]


@pytest.mark.parametrize("mode", ["policy", "env"])
def test_debug_mode_stops_a_size_mismatch_at_once(cworld, mode):
    # Block 1 differs in size on rank 1: without the check this hangs (NCCL) or aborts unnamed (gloo).
    errors = cworld(2).run(desynchronized, timeout=60, mode=mode, renamed=False)
    for e in errors:
        assert e is not None and "about to issue different collectives" in e, errors
        assert "rank 0: all_gather of 'blocks.1': 68 elements" in e, e  # this rank's shard of each
        assert "rank 1: all_gather of 'blocks.1': 81 elements" in e, e
        assert "test_conditional.py" in e and "in pre_hook" in e  # the user's code, then mfsdp's hook


def late_backward(rank, ws):
    """Two forwards, one backward: the first forward's gradients would arrive after their reduction."""
    torch.manual_seed(0)
    model = shard_cond(CondNet("skip_block"), make_mesh("zero3", ws), make_placements("zero3"))
    x, y = global_batch(0, 2 * ws, 5, 13)
    loss = loss_fn(model(x, False), y) + loss_fn(model(x, False), y)
    try:
        loss.backward()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_backward_out_of_schedule_is_a_named_error(cworld):
    errors = cworld(2).run(late_backward, timeout=60)
    assert all(e and "mfsdp:" in e and "static order" in e for e in errors), errors



def plans(rank, ws):
    """Each placement's compiled reduction plan: (every backward, into, last microbatch), as
    (source, collectives, ranks averaged over)."""
    from mfsdp.runtime.geometry import ShardGeometry
    from mfsdp.runtime.reducer import ReductionPlan

    def show(path):
        return None if path is None else (path.source.value, [s.kind for s in path.stages], path.scale)

    out = {}
    for kind in ["zero3", "zero2", "zero1", "ddp", "hsdp", "hsdp_deferred", "hfsdp", "zero3_2d"]:
        plan = ReductionPlan.compile(ShardGeometry(make_mesh(kind, ws), make_placements(kind)))
        out[kind] = (show(plan.every_backward), "accumulator" if plan.into_accumulator else "main",
                     show(plan.last_microbatch))
    return out


def test_reduction_plans_per_placement(cworld):
    got = cworld(4).run(plans, timeout=60)[0]
    rs, ar = "reduce_scatter", "all_reduce"
    assert got == {
        "zero3": (("raw", [rs], 4), "main", None),
        "zero2": (("raw", [rs], 4), "main", None),
        "zero1": (None, "main", ("raw", [rs], 4)),
        "ddp": (None, "main", ("raw", [ar], 4)),
        "hsdp": (("raw", [rs, ar], 4), "main", None),
        "hsdp_deferred": (("raw", [rs], 2), "main", ("main", [ar], 2)),
        "hfsdp": (("raw", [rs], 2), "accumulator", ("accumulator", [rs], 2)),
        "zero3_2d": (("raw", [rs, rs], 4), "main", None),
    }, got


def test_reduction_plans_leave_out_one_rank_scatters(cworld):
    """A reduce-scatter over a mesh dimension of one rank is the identity, so the plan leaves it out
    and the gradients go straight onto their target (no staging copy per microbatch): on two ranks
    the 2-D meshes are (2, 1)."""
    got = cworld(2).run(plans, timeout=60)[0]
    rs, ar = "reduce_scatter", "all_reduce"
    assert got["zero3"] == (("raw", [rs], 2), "main", None), got
    assert got["hsdp"] == (("raw", [ar], 2), "main", None), got
    assert got["zero3_2d"] == (("raw", [rs], 2), "main", None), got
    assert got["hfsdp"] == (("raw", [], 1), "accumulator", ("accumulator", [rs], 2)), got


def freed_without_gc(rank, ws):
    """A trained model and its optimizer free every buffer by reference counting alone: no cycle
    (a recursive closure over the ownership walk, a group and its reducer, a hook holding its group)
    may keep them until the garbage collector runs. On the GPU such cycles held a whole model's
    memory into the next measurement."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        model = shard_cond(CondNet("nested"), make_mesh("zero3", ws), make_placements("zero3"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = global_batch(0, 2 * ws, 5, 13)
        loss_fn(model(x.chunk(ws)[rank], True), y.chunk(ws)[rank]).backward()
        opt.step()
        groups = [weakref.ref(g) for m in model.modules() if isinstance(m, mfsdp.FsdpModule)
                  for g in m.parameter_groups]
        context = weakref.ref(model.context)
        del model, opt
        return sum(g() is not None for g in groups), context() is not None
    finally:
        gc.enable()


def test_a_deleted_model_frees_its_memory_without_gc(cworld):
    assert cworld(2).run(freed_without_gc, timeout=60) == [(0, False), (0, False)]
