"""Expert parallelism on the manager route (``MegatronFSDPConfig.ep_size``): the checks against the
mesh and the model, the experts' mesh, and the split of transformers 5's stacked experts.

The manager's own mesh keeps its four dims (``MESH_DIM_NAMES``): the experts get a second mesh over
the same ranks, ``([dp_replicate,] ep_shard, ep)`` (:func:`mfsdp.experts.parallel.expert_mesh`),
which the manager exposes as ``expert_mesh``. Every other parameter, a shared expert included, is
sharded over the dense mesh as without expert parallelism.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp.experts.parallel import (apply_expert_parallel, describe_split, ep_problem, experts_modules,
                                    shared_expert_name)
from mfsdp.mesh import MeshSizes

logger = logging.getLogger("mfsdp.manager")


def check_ep_against_mesh(ep: int, sizes: MeshSizes) -> None:
    """Refuse, in one line naming the fix, an ``ep_size`` this mesh cannot run."""
    if ep == 1:
        return
    if sizes.tp > 1 or sizes.cp > 1:
        raise ValueError(f"MegatronFSDPConfig.ep_size={ep} with tp={sizes.tp} and cp={sizes.cp}: expert parallelism "
                         "with tensor or context parallelism is not supported; build the mesh with tp_size=1 and "
                         "cp_size=1, or set ep_size=1")
    if sizes.dp_shard % ep:
        raise ValueError(f"MegatronFSDPConfig.ep_size={ep} must divide the mesh's dp_shard size {sizes.dp_shard}; "
                         f"choose an ep_size that divides {sizes.dp_shard}")


def num_experts(model: nn.Module) -> int:
    """The experts per layer of ``model``'s stacked experts modules (0: none); one count for all."""
    counts = {m.num_experts for m in experts_modules(model)}
    if len(counts) > 1:
        raise ValueError(f"expert parallelism needs one expert count for every layer, got {sorted(counts)}")
    return counts.pop() if counts else 0


def split_experts_over_ep(model: nn.Module, emesh: DeviceMesh, dp_mesh: DeviceMesh, placements, ep: int, *,
                          mixed_precision, communication) -> list[nn.Module]:
    """Check the model against ``ep`` (it has stacked experts, ``ep`` divides their count), split them
    over ``emesh``'s ``ep`` dim and make each experts module its own FSDP unit; logs the split."""
    count, dp_shard = num_experts(model), dp_mesh.size(dp_mesh.ndim - 1)
    if count == 0:
        raise ValueError(f"MegatronFSDPConfig.ep_size={ep} splits experts, but {type(model).__name__} has no stacked "
                         "experts (gate_up_proj [E, 2F, D], down_proj [E, D, F]); set ep_size=1")
    problem = ep_problem(ep, dp_shard, count)
    if problem:
        raise ValueError(problem.replace("--parallel.ep", "MegatronFSDPConfig.ep_size"))
    modules = apply_expert_parallel(model, emesh, placements, ep, mixed_precision=mixed_precision,
                                    communication=communication)
    logger.info(describe_split(count, ep, dp_shard // ep, shared_expert_name(model)))
    return modules
