"""torch.compile of the blocks under fully_shard: hooks stay outside the graphs, numbers stay exact."""

from __future__ import annotations

import pytest
import torch

from models import Net, full_params, make_mesh, make_placements, max_rel_error, reference_copy, shard_net, step_both


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
        step_both(model, ref, optim, ref_optim, step, 8, rank, ws)
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    return errors


@pytest.mark.parametrize("kind", ["zero3", "zero2"])
def test_compiled_blocks_parity(world, kind):
    errors = world(2).run(compiled_parity, kind=kind)[0]
    assert max(errors) < 1e-5, errors
