"""torch.compile of the blocks under fully_shard: hooks stay outside the graphs, numbers stay exact."""

from __future__ import annotations

import pytest
import torch

from models import Net, full_params, global_batch, loss_fn, make_mesh, make_placements, max_rel_error, reference_copy, shard_net


def compiled_parity(rank, ws, kind):
    torch.manual_seed(0)
    torch.compiler.reset()
    model = Net()
    ref = reference_copy(model)
    shard_net(model, make_mesh(kind, ws), make_placements(kind))
    for block in model.blocks:
        block.compile(backend="aot_eager")  # inductor on GPU; aot_eager keeps CI fast
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    errors = []
    for step in range(3):
        x, y = global_batch(step, 8, 5, 13)
        loss_fn(ref(x), y).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
        optim.step()
        optim.zero_grad()
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    return errors


@pytest.mark.parametrize("kind", ["zero3", "zero2"])
def test_compiled_blocks_parity(world, kind):
    errors = world(2).run(compiled_parity, kind=kind)[0]
    assert max(errors) < 1e-5, errors
