"""Expert parallelism applied to a model: the experts split over ``ep`` ranks, each expert's weights
FSDP-sharded over the data-parallel ranks that remain, tokens sent to their experts by all-to-all.

Meshes. The dense parameters keep the data-parallel mesh (``dp``, or ``(dp_replicate, dp_shard)``).
The experts use a second mesh over the same ranks, ``([dp_replicate,] ep_shard, ep)``, with ``ep``
innermost (neighbouring ranks, the fastest links, exchange tokens) and ``ep_shard = dp_shard / ep``.

Parameters. Each experts module's ``gate_up_proj`` and ``down_proj`` become DTensors split on dim 0
over ``ep`` (``Shard(0)``): rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``. ``fully_shard`` then
shards those local experts over ``ep_shard`` as it shards a tensor-parallel parameter's local tensor,
so the exposed DTensors describe the global ``[E, ...]`` tensors and DCP reshards them across ``ep``.

Gradients. A local expert's gradient already sums the contributions of every token of the ``ep``
group (the all-to-all's backward brings them home); the reduce-scatter over ``ep_shard`` averages
over ``dp_shard / ep`` ranks, so the experts' units divide by ``ep`` once more
(``CommunicationPolicy.gradient_divide_factor``): the average over every data-parallel rank, as the
dense parameters get. The dense path is untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mfsdp.api import fully_shard
from mfsdp.communication import CommunicationPolicy
from mfsdp.experts.dispatch import combine, dispatch
from mfsdp.experts.grouped import expert_swiglu
from mfsdp.mesh import DP_REPLICATE, EP, EP_SHARD
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.placement import Placements

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` has the stacked experts' interface (``mfsdp.experts``)."""
    return (all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3
                for n in EXPERT_WEIGHTS) and isinstance(getattr(module, "num_experts", None), int))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every stacked experts module of ``model``, in module order (one per MoE layer)."""
    return [m for m in model.modules() if is_experts_module(m)]


def ep_problem(ep: int, dp_shard: int, num_experts: int) -> Optional[str]:
    """Why ``ep`` cannot split ``num_experts`` experts over a data-parallel shard of ``dp_shard``
    ranks (the fix included), or None when it can."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return f"--parallel.ep must be a positive integer, got {ep!r}"
    if ep == 1:
        return None
    if num_experts < 1:
        return f"--parallel.ep {ep} splits experts, but this model has none; leave --parallel.ep at 1"
    if dp_shard % ep:
        return (f"--parallel.ep {ep} must divide the {dp_shard} data-parallel shard ranks; launch a multiple of "
                f"{ep} ranks per replica or choose an ep that divides {dp_shard}")
    if num_experts % ep:
        return (f"--parallel.ep {ep} must divide the model's {num_experts} experts per layer; choose an ep that "
                f"divides {num_experts}")
    return None


def describe_split(num_experts: int, ep: int, ep_shard: int, shared: Optional[str] = None) -> str:
    """The first line of a run with experts: how they are split and sharded."""
    line = (f"experts: {num_experts} per layer, {num_experts // ep} on each of {ep} ep ranks, "
            f"each sharded {ep_shard} ways")
    return line + (f"; the shared expert ({shared}) is sharded like the dense layers" if shared else "")


def shared_expert_name(model: nn.Module) -> Optional[str]:
    """The name a model gives its shared expert (Qwen2-MoE's ``shared_expert``), if it has one
    (``describe_split``'s ``shared``)."""
    return next((name.rpartition(".")[2] for name, _ in model.named_modules() if name.endswith("shared_expert")),
                None)


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The experts' mesh over the ranks of the data-parallel ``mesh`` (1-D, or ``(dp_replicate,
    shard)``): ``([dp_replicate,] ep_shard, ep)``, ``ep`` innermost. Collective: every rank calls it."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim not in (1, 2) or (mesh.ndim == 2 and names[0] != DP_REPLICATE):
        raise ValueError(f"expert parallelism needs a data-parallel mesh of one dim or (dp_replicate, shard); got "
                         f"dims {names} of shape {tuple(mesh.shape)} (tensor and context parallelism with "
                         "--parallel.ep are not supported: set --parallel.tp 1 and --parallel.cp 1)")
    shard = mesh.size(mesh.ndim - 1)
    if shard % ep:
        raise ValueError(f"ep={ep} must divide the data-parallel shard size {shard}")
    ranks = mesh.mesh.reshape(*mesh.mesh.shape[:-1], shard // ep, ep)
    dims = ((DP_REPLICATE,) if mesh.ndim == 2 else ()) + (EP_SHARD, EP)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=dims)


def expert_placements(placements: Placements) -> Placements:
    """``placements`` over the experts' mesh: the replicate axis kept, the shard axis ``ep_shard``."""
    return dataclasses.replace(placements, dp_axes=tuple(a if a == DP_REPLICATE else EP_SHARD
                                                         for a in placements.dp_axes))


def split_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Make ``experts``' stacked weights DTensors split on dim 0 over the 1-D ``ep_mesh`` (each rank keeps
    its own experts' rows; a meta module stays meta) and route its forward through the all-to-all."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_WEIGHTS:
        full = getattr(experts, name)
        rows = full.shape[0] // ep
        local = full.detach()[rank * rows:(rank + 1) * rows]
        local = local if local.is_meta else local.clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                stride=full.stride())
        setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
    experts.forward = functools.partial(ep_forward, experts, ep_mesh.get_group())


def ep_forward(experts: nn.Module, group: dist.ProcessGroup, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism: this rank's tokens to the ranks holding
    their experts, this rank's experts over what it received, the results back and mixed."""
    rows, counts, state = dispatch(hidden, top_k_index, experts.num_experts, group)
    gate_up, down = (getattr(experts, n) for n in EXPERT_WEIGHTS)
    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (gate_up, down))
    return combine(expert_swiglu(rows, counts, gate_up, down, experts.act_fn), top_k_weights, state)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, placements: Placements, ep: int, *,
                          mixed_precision: Optional[MixedPrecisionPolicy] = None,
                          communication: Optional[CommunicationPolicy] = None) -> list[nn.Module]:
    """Split every experts module of ``model`` over ``ep`` ranks of the data-parallel ``mesh`` and shard each
    as its own FSDP unit over the ranks that remain; returns those modules. Call it before the units
    around them are sharded (bottom-up), with the placements and policies the dense units get.
    ``mesh`` may also be the experts' mesh itself (``expert_mesh``'s, with an ``ep`` dim), built once."""
    emesh = mesh if EP in (mesh.mesh_dim_names or ()) else expert_mesh(mesh, ep)
    policy = communication or CommunicationPolicy()
    policy = dataclasses.replace(policy, gradient_divide_factor=policy.gradient_divide_factor * ep)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"ep={ep} splits stacked experts (modules with 3-D gate_up_proj and down_proj, see "
                         f"mfsdp.experts), but {type(model).__name__} has none (transformers 5 or later stores Qwen3-MoE, "
                         f"Qwen2-MoE and Mixtral experts stacked; older versions one module per expert); "
                         f"upgrade transformers or leave ep at 1")
    for experts in modules:
        split_experts(experts, emesh[EP])
        fully_shard(experts, emesh, expert_placements(placements), mixed_precision, communication_policy=policy)
    return modules
