"""A bare embedding unit is not gathered in backward (its backward never reads the table): parity
with an unsharded reference, one all-gather fewer per backward, no unsharded table while the blocks
run backward, and an on-demand gather where a checkpoint recomputes it. CPU, gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mfsdp
from models import (Net, full_params, global_batch, loss_fn, make_mesh, make_placements, max_rel_error,
                    reference_copy)
from mfsdp.runtime import collectives

FP32_TOL = 1e-5


class ScaledEmbedding(nn.Embedding):
    """Its own forward: mfsdp cannot know what it reads in backward, so it gathers as usual."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


class CheckpointedEmbedNet(Net):
    """The root recomputes the embedding in backward (a checkpoint around it)."""

    def forward(self, tokens):
        h = checkpoint(self.embed, tokens, use_reentrant=False)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def embedding_unit(rank, ws, kind="zero3", variant="bare", ckpt=None, steps=3):
    """The embedding, each block and the root as units; three steps against the reference. Returns
    (worst relative error, all-gathers issued during each backward, whether the table was gathered
    while a block ran backward)."""
    torch.manual_seed(0)
    model = (CheckpointedEmbedNet if variant == "recompute" else Net)(checkpointing=ckpt)
    if variant == "scaled":
        scaled = ScaledEmbedding(13, 6)
        scaled.load_state_dict(model.embed.state_dict())
        model.embed = scaled
    ref = reference_copy(model)
    mesh, placements = make_mesh(kind, ws), make_placements(kind)
    for unit in [model.embed, *model.blocks, model]:
        mfsdp.fully_shard(unit, mesh, placements)
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    table = model.embed.parameter_groups[0]
    seen_gathered: list[bool] = []
    for block in model.blocks:  # when each block's weight gradients arrive (the walk has entered it)
        for p in block.parameter_groups[0].params:
            p.register_post_accumulate_grad_hook(lambda p: seen_gathered.append(table.unsharded.is_allocated))
    gathers, errors = [], []
    original = collectives.all_gather
    for step in range(steps):
        x, y = global_batch(step, 4 * ws, 5, 13)
        loss_fn(ref(x), y).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank])
        count = [0]

        def counting(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)

        collectives.all_gather = counting
        try:
            loss.backward()
        finally:
            collectives.all_gather = original
        gathers.append(count[0])
        optim.step()
        optim.zero_grad()
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    return max(errors), gathers, any(seen_gathered)


@pytest.mark.parametrize("kind,ws", [("zero3", 2), ("hsdp", 4)])
def test_bare_embedding_is_not_gathered_in_backward(world, kind, ws):
    # Backward gathers the three blocks (the root kept its weights from forward), not the table. HSDP
    # on four ranks (2 x 2): on two it shards one way, and an fp32 group then computes on its resting
    # buffer (unsharded_aliases_model), gathering nothing at all.
    err, gathers, table_gathered = world(ws).run(embedding_unit, kind=kind)[0]
    assert err < FP32_TOL, err
    assert gathers == [3] * 3, gathers
    assert not table_gathered


def test_checkpointed_blocks_and_a_recomputed_embedding(world):
    """Checkpointed blocks recompute with their own gathers; an embedding recomputed in backward
    gathers on demand, and both train as the reference does."""
    err, gathers, _ = world(2).run(embedding_unit, ckpt="non-reentrant")[0]
    assert err < FP32_TOL and gathers == [3] * 3, (err, gathers)
    err, gathers, _ = world(2).run(embedding_unit, variant="recompute")[0]  # after the blocks' backward
    assert err < FP32_TOL and gathers == [4] * 3, (err, gathers)


def test_an_embedding_with_its_own_forward_is_gathered(world):
    err, gathers, table_gathered = world(2).run(embedding_unit, variant="scaled")[0]
    assert err < FP32_TOL and gathers == [4] * 3 and table_gathered, (err, gathers, table_gathered)


def test_planner_skips_the_table_in_backward():
    from mfsdp.memory.model_state import Levels, describe_units

    model = Net()
    levels = Levels.of(mfsdp.Placements.zero3("dp"), {"dp": 2})
    units = describe_units(model, [model.embed, *model.blocks], mfsdp.MixedPrecisionPolicy(), levels)
    flags = {u.name: u.gathers_in_backward for u in units}
    assert flags == {"": True, "embed": False, "blocks.0": True, "blocks.1": True, "blocks.2": True}, flags
    # A forward replaced on the instance (as the manager's local TP path does) may read anything.
    model.embed.forward = lambda ids: nn.functional.embedding(ids, model.embed.weight)
    units = describe_units(model, [model.embed, *model.blocks], mfsdp.MixedPrecisionPolicy(), levels)
    assert all(u.gathers_in_backward for u in units)
