"""A group whose compute weights are split one way at rest (one GPU, or HSDP with a shard axis of
size 1) computes on its resting buffer: no gather, no second copy, no free (``unsharded_aliases_model``).
CPU, gloo: LoRA on the bundled tiny Llama against the same run with the alias switched off."""

from __future__ import annotations

import pytest
import torch

from mfsdp.runtime import parameter_group

LAYERS = 2


def _run(rank, ws, kind, dtype, keep, alias):
    """Two AdamW steps of a LoRA tiny Llama under ``kind``; the alias forced off unless ``alias``.
    Returns (losses, adapter gradients, final weights, frozen groups' data_ptr checks, all-gathers
    the frozen groups issued)."""
    import torch.nn.functional as F

    from mfsdp.transforms.lora import LoraTransform
    from mfsdp.mesh import build_mesh
    from mfsdp.mixed_precision import MixedPrecisionPolicy
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize
    from test_lora import randomize_b, tiny

    model = tiny(seed=4).to(dtype)
    LoraTransform(r=4, alpha=8).apply(model)
    randomize_b(model)
    mesh = build_mesh("cpu", ws, replicate=2 if kind == "hsdp" else None)
    rule = parameter_group.unsharded_aliases_model
    parameter_group.unsharded_aliases_model = rule if alias else (lambda *args: False)
    try:
        parallelize(model, mesh, ParallelizeConfig(placements=kind, keep_gathered_blocks=LAYERS if keep else 0,
                                                   mixed_precision=MixedPrecisionPolicy(main_grads_dtype=torch.float32)))
    finally:
        parameter_group.unsharded_aliases_model = rule
    frozen = [g for b in model.layers for g in b.parameter_groups if not g.requires_grad]
    gathers = [0]
    for group in frozen:
        group.issue = _counting(group.issue, gathers)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(2):
        tokens = torch.randint(0, 64, (2 * ws, 10), generator=torch.Generator().manual_seed(10 + step)).chunk(ws)[rank]
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.detach().full_tensor() for n, p in model.named_parameters() if p.requires_grad})
        optim.step()
        optim.zero_grad()
    same_storage = [g.unsharded.tensor.data_ptr() == g.main.tensor.data_ptr()
                    and g.params[0].untyped_storage().data_ptr() == g.main.tensor.untyped_storage().data_ptr()
                    for g in frozen]
    return losses, grads, {n: p.detach().full_tensor() for n, p in model.named_parameters()}, same_storage, gathers[0]


def _counting(issue, count):
    def counted(kind, *args, **kwargs):
        count[0] += kind == "all_gather"
        return issue(kind, *args, **kwargs)
    return counted


@pytest.mark.parametrize("ws,kind,dtype", [(1, "zero3", torch.float32), (1, "zero3", torch.bfloat16),
                                           (2, "hsdp", torch.bfloat16)])
@pytest.mark.parametrize("keep", [False, True])
def test_a_one_way_frozen_group_computes_on_its_resting_buffer(world, ws, kind, dtype, keep):
    """Losses, gradients and weights bit for bit those of the gathered path; the frozen groups'
    compute parameters live in their main buffer and issue no all-gather (the unaliased path does)."""
    runs = {alias: world(ws).run(_run, kind=kind, dtype=dtype, keep=keep, alias=alias)[0] for alias in (True, False)}
    (losses, grads, weights, same, gathers), (ref_losses, ref_grads, ref_weights, ref_same, ref_gathers) = (
        runs[True], runs[False])
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for got, want in zip(grads, ref_grads):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(weights[n], w) for n, w in ref_weights.items())
    assert same and all(same) and not any(ref_same)
    assert gathers == 0 and ref_gathers > 0, (gathers, ref_gathers)


def test_the_planner_counts_no_gather_for_a_one_way_frozen_group():
    """8B LoRA on one GPU with every block kept: the frozen base has no unsharded bytes (it was a
    second 13 GiB copy), while the adapters' bf16 gathers still count; on 8 GPUs the base gathers."""
    from mfsdp.transforms.lora import LoraTransform
    from mfsdp.memory.model_state import describe_units
    from mfsdp.runtime.geometry import Levels
    from mfsdp.mixed_precision import MixedPrecisionPolicy
    from mfsdp.models import Llama, get_config
    from mfsdp.models.parallelize import sharding_units
    from mfsdp.placement import Placements

    with torch.device("meta"):
        model = Llama(get_config("8b")).to(torch.bfloat16)
    LoraTransform().apply(model)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32)
    units = list(sharding_units(model))
    for ws, frozen_gathers in ((1, False), (8, True)):
        levels = Levels.of(Placements.zero3("dp"), {"dp": ws})
        blocks = [u for u in describe_units(model, units, policy, levels) if u.name.startswith("layers.")]
        assert len(blocks) == 32
        frozen = [g for u in blocks for g in u.groups if not g.requires_grad]
        adapters = [g for u in blocks for g in u.groups if g.requires_grad]
        assert len(frozen) == len(adapters) == 32
        assert all((g.unsharded > 0) == frozen_gathers and (g.gather_key is None) != frozen_gathers for g in frozen)
        assert all(g.unsharded > 0 and g.gather_key is not None for g in adapters)
        if ws == 1:
            assert sum(g.main for g in frozen) > 12 * 2**30  # the base: main weights only, in bf16
