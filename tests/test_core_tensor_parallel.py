"""fully_shard over the data-parallel axes of a (dp, tp) mesh whose blocks are tensor parallel."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mfsdp
from models import (Net, full_params, make_placements, max_rel_error, reference_copy, round_to_bf16, shard_net,
                    step_both)


def tp_parity(rank, ws, kind="zero3", steps=3, bf16=False):
    torch.manual_seed(0)
    model = Net(vocab=16, dim=8, hidden=12)
    if bf16:
        round_to_bf16(model)
    ref = reference_copy(model)
    mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if bf16:
        model.to(torch.bfloat16)
    policy = mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32) if bf16 else None
    shard_net(model, mesh, make_placements(kind), policy)
    exposed = {n: (tuple(p.device_mesh.mesh_dim_names), [str(pl) for pl in p.placements])
               for n, p in model.named_parameters()}
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.5)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    errors = []
    for step in range(steps):
        # Clipping works across (dp, tp) DTensors.
        step_both(model, ref, optim, ref_optim, step, 8, dp_rank, dp_size,
                  after_backward=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        errors.append(max_rel_error(full_params(model), full_params(ref)))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return errors, exposed


@pytest.mark.parametrize("kind", ["zero3", "zero2", "zero1", "ddp"])
def test_tensor_parallel_parity(world, kind):
    errors, exposed = world(4).run(tp_parity, kind=kind)[0]
    assert max(errors) < 1e-5, errors
    assert exposed["blocks.0.w2.weight"][1][1] == "S(1)", exposed
    assert exposed["embed.weight"][0] == ("dp", "tp")


def test_tensor_parallel_bf16(world):
    errors, _ = world(4).run(tp_parity, kind="zero3", bf16=True)[0]
    assert max(errors) < 3e-2, errors
