"""The bound optimizer steps group by group (``mfsdp.optimizer``): with bf16 main gradients each
group's gradients are upcast to fp32 just before its own update and freed right after it, so the
step's extra memory is one group's, not the model's. Bit-identical to the one-call step (the same
torch optimizer math per parameter) on every placement, fused and foreach AdamW; the transient
measured on CPU by the storages the step creates and still holds; the planner's rule is the
optimizer's own (``step_transient_bytes``). CPU, gloo, the session's world of 2 ranks."""

from __future__ import annotations

import weakref

import pytest
import torch

import mfsdp
from mfsdp import _compat
from mfsdp.optimizer import step_transient_bytes
from models import Net, full_params, global_batch, loss_fn, make_mesh, make_placements, shard_net

PLACEMENTS = ("zero3", "zero2", "zero1", "ddp")


def _optimizer(kind: str, params):
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


def _bf16_gradients_model(rank, ws, kind, opt, one_call, prefetch_across_step=True, **net):
    """A bf16 model (bf16 compute and main gradients, fp32 main weights: the default policy) and its
    bound optimizer; ``one_call``: a pre hook registered after binding (it may still edit the
    gradients), so the step upcasts every group at once and runs the optimizer's body once."""
    torch.manual_seed(0)
    model = Net(**net).to(torch.bfloat16)
    shard_net(model, make_mesh(kind, ws), make_placements(kind),
              comm=mfsdp.CommunicationPolicy(prefetch_across_step=prefetch_across_step))
    optim = mfsdp.fully_shard_optimizer(model, _optimizer(opt, model.parameters()))
    if one_call:
        optim.register_step_pre_hook(lambda *a: None)
    groups = [g for m in model.modules() if isinstance(m, mfsdp.FsdpModule) for g in m.parameter_groups]
    assert all(g.dtypes.grads == torch.bfloat16 and g.dtypes.main == torch.float32 for g in groups)
    return model, optim, groups


def _train_step(model, optim, step, rank, ws, measure=None):
    x, y = global_batch(step, 4 * ws, 5, model.embed.num_embeddings)
    loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    if measure is None:
        optim.step()
    else:
        with measure:
            optim.step()
    optim.zero_grad()


def lean_against_one_call(rank, ws, kind, opt, steps=3):
    """Weights and AdamW states (full tensors) after ``steps`` steps, group by group and in one call."""
    out = []
    for one_call in (False, True):
        model, optim, _ = _bf16_gradients_model(rank, ws, kind, opt, one_call)
        for step in range(steps):
            _train_step(model, optim, step, rank, ws)
        states = {f"{name}.{key}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                  for name, p in model.named_parameters() for key, v in optim.state[p].items()}
        out.append((full_params(model), states))
    return out


@pytest.mark.parametrize("kind", PLACEMENTS)
def test_group_by_group_is_bit_identical_to_one_call(world, kind):
    for opt in ("fused", "foreach"):
        (lean, lean_states), (one_call, one_call_states) = world(2).run(lean_against_one_call, kind=kind,
                                                                         opt=opt)[0]
        assert lean.keys() == one_call.keys() and lean_states.keys() == one_call_states.keys()
        assert len(lean_states) == 3 * len(lean), sorted(lean_states)  # step, exp_avg, exp_avg_sq
        assert all(lean[k].equal(one_call[k]) for k in lean), (kind, opt)
        assert all(lean_states[k].equal(one_call_states[k]) for k in lean_states), (kind, opt)


class LiveStorages(_compat.dispatch_mode_base()):
    """Bytes of the storages created by ops while it is active (a DTensor's by its local shard)
    and still alive, and their peak: the step's transient, since whatever the step frees before it
    returns comes off again (storages keep their Python object while any tensor uses them)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = storage.data_ptr()
            if key and key not in inputs and key not in self.live:
                self.live[key] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def _storages(tree) -> list:
    leaves, _ = _compat.tree_flatten(tree)
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in leaves if isinstance(t, torch.Tensor)]
    return [t.untyped_storage() for t in tensors if t.device.type == "cpu"]


def measured_step_transient(rank, ws, kind, opt, one_call=False, prefetch_across_step=False):
    """The peak of live bytes the third step creates (states exist by then), against each group's
    fp32 gradient bytes (its main gradient's elements, padding included, the cast's size). The
    groups here are far below ``STEP_CALL_BYTES``, which would step them in one call: it is 0 here,
    so that each group's bound shows."""
    from mfsdp import optimizer as optimizer_module

    kept, optimizer_module.STEP_CALL_BYTES = optimizer_module.STEP_CALL_BYTES, 0
    try:
        model, optim, groups = _bf16_gradients_model(rank, ws, kind, opt, one_call, prefetch_across_step,
                                                     vocab=512, dim=64, hidden=256, n_blocks=4)
        for step in range(2):
            _train_step(model, optim, step, rank, ws)
        mode = LiveStorages()
        _train_step(model, optim, 2, rank, ws, measure=mode)
        fp32_grads = [g.reducer.main_grad.tensor.numel() * 4 for g in groups if g.requires_grad]
        bound = step_transient_bytes([(n, True) for n in fp32_grads], opt == "foreach")
    finally:
        optimizer_module.STEP_CALL_BYTES = kept
    return mode.peak, fp32_grads, len(mode.live), bound


SMALL = 4096
"""What the step may add besides the gradients (AdamW's scalar step tensors, lists)."""


@pytest.mark.parametrize("kind", ["zero3", "zero1"])
def test_the_step_transient_is_one_groups_fp32_gradient(world, kind):
    for opt, foreach_temporary in (("fused", False), ("foreach", True)):
        peak, fp32_grads, left, bound = world(2).run(measured_step_transient, kind=kind, opt=opt)[0]
        assert bound == max(fp32_grads) * (2 if foreach_temporary else 1)
        assert max(fp32_grads) < sum(fp32_grads) / 2  # a bound of one group means something here
        assert peak <= bound + SMALL, (kind, opt, peak, fp32_grads)
        assert peak >= max(fp32_grads), (kind, opt, peak)  # the measurement sees the upcast
        assert left == 0, left  # nothing the step made outlives it
        # The one-call step (a later pre hook) still upcasts every group at once.
        peak, fp32_grads, *_ = world(2).run(measured_step_transient, kind=kind, opt=opt, one_call=True)[0]
        assert peak >= sum(fp32_grads), (kind, opt, peak, fp32_grads)


def test_the_staged_step_transient_is_one_groups_too(world):
    """With ``prefetch_across_step`` (ZeRO-3) the step also gathers the root and the first block,
    into the unsharded buffers they keep (no new storage): still one group's upcast at a time."""
    peak, fp32_grads, left, bound = world(2).run(measured_step_transient, kind="zero3", opt="fused",
                                                 prefetch_across_step=True)[0]
    assert max(fp32_grads) <= peak <= bound + SMALL, (peak, fp32_grads)
    assert left == 0, left


def test_the_planner_calls_the_optimizers_rule():
    """The planner's step phases: the largest group's upcast, not the model's (8b on one GPU)."""
    from mfsdp.memory import estimate

    e = estimate("8b", world_size=1, placements="zero3", local_batch=1, seq_len=4096, activation_checkpointing=True,
                 mixed_precision_policy=mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16), foreach=False)
    phases = {p.name: p.components for p in e.phases}
    step = max(phases["optimizer step: first units"]["optimizer step"], phases["optimizer step: the rest"]["optimizer step"])
    embedding = 128256 * 4096 * 4  # the largest group: the embedding (or the untied head), fp32
    assert step == embedding, step / 2**30
    assert e.peak_bytes < 110 * 2**30, e.peak_bytes / 2**30


def test_step_batches_share_a_call_within_the_largest_groups_bytes():
    """``step_batches``: consecutive groups share an optimizer call while their transient bytes fit
    the largest group's or ``STEP_CALL_BYTES``, and ``step_transient_bytes`` is the largest call's;
    all in one call where no group has a transient (fused AdamW on main-dtype gradients)."""
    from mfsdp.optimizer import step_batches, step_transient_bytes

    mib = 1 << 20
    assert step_batches([0, 0, 0]) == [[0, 1, 2]]
    assert step_batches([m * 100 * mib for m in (4, 1, 1, 1, 1, 2)]) == [[0], [1, 2, 3, 4], [5]]
    assert step_batches([m * 100 * mib for m in (1, 2, 1, 1)]) == [[0], [1], [2, 3]]
    assert step_batches([]) == []
    # Groups far below STEP_CALL_BYTES share a call up to it: 16 MiB each, four to a call.
    assert step_batches([16 * mib] * 9) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    sizes = [m * 100 * mib for m in (3, 5, 1, 1, 2, 2, 1)]
    peak = step_transient_bytes([(n, False) for n in sizes], foreach_temporary=True)
    assert peak == max(sizes) and all(sum(sizes[i] for i in batch) <= peak for batch in step_batches(sizes))
    assert step_transient_bytes([(16 * mib, True)] * 9, foreach_temporary=False) == 64 * mib


def test_the_flat_step_has_no_transient_and_the_planner_says_so():
    """The flat AdamW step (``mfsdp.flat_adamw``) reads bf16 gradients in place: the rule gives it no
    transient, and the planner, told so, predicts its step phase that much lower than the fused one."""
    from mfsdp import memory

    assert step_transient_bytes([(8 << 20, True), (4 << 20, True)], foreach_temporary=False, flat=True) == 0
    kw = dict(world_size=1, placements="zero3", local_batch=1, seq_len=64, foreach=False,
              mixed_precision_policy=mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                               main_grads_dtype=torch.bfloat16), device="cpu")
    fused, flat = memory.estimate("tiny", **kw), memory.estimate("tiny", flat_adamw=True, **kw)
    assert flat.component_max("optimizer step") == 0 < fused.component_max("optimizer step")
