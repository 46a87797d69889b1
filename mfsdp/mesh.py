"""Device meshes of named dims, one layout for every route, and the placement names that run on them.

Dims, outermost first: the data-parallel part, then ``cp``, then ``tp`` (the fastest link
innermost). The data-parallel part is one ``dp`` dim, or ``(dp_replicate, dp_shard)`` when
replicas are asked for: the two-axis placements (hsdp, hfsdp) of the bundled route, and the
manager, whose mesh always has all four dims (size 1 where unused). These names are what
placements, checkpoints and plans refer to.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mfsdp.placement import Placements

DP, DP_REPLICATE, DP_SHARD, CP, TP = "dp", "dp_replicate", "dp_shard", "cp", "tp"
EP, EP_SHARD = "ep", "ep_shard"
"""The experts' mesh dims (``mfsdp.experts.parallel``): experts split over ``ep``, each sharded over ``ep_shard``."""
TWO_AXIS = ("hsdp", "hfsdp")
PLACEMENT_NAMES = ("zero3", "zero2", "zero1", "ddp", *TWO_AXIS)
"""The names of ``--parallel.placements`` (``ParallelizeConfig.placements``): ``Placements``'s
constructors; the two-axis ones replicate over dp_replicate and shard over dp_shard."""


@dataclasses.dataclass(frozen=True)
class MeshSizes:
    """Sizes of the four dims (dp_replicate, dp_shard, cp, tp), 1 where a dim is unused."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @property
    def dp(self) -> int:
        """Ranks over which gradients are averaged (data parallel, context parallel included)."""
        return self.dp_replicate * self.dp_shard * self.cp


def resolve_sizes(world_size: int, *, tp_size: Optional[int] = 1, cp_size: Optional[int] = 1,
                  dp_replicate_size: Optional[int] = 1, dp_shard_size: Optional[int] = None) -> MeshSizes:
    """Sizes of the four dims; ``dp_shard`` is derived from the world size unless given."""
    tp, cp, rep = tp_size or 1, cp_size or 1, dp_replicate_size or 1
    for name, value in (("tp_size", tp), ("cp_size", cp), ("dp_replicate_size", rep), ("dp_shard_size", dp_shard_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    fixed = tp * cp * rep
    if dp_shard_size is None and world_size % fixed:
        raise ValueError(f"world size {world_size} is not divisible by tp_size*cp_size*dp_replicate_size = "
                         f"{tp}*{cp}*{rep} = {fixed}")
    shard = world_size // fixed if dp_shard_size is None else dp_shard_size
    if fixed * shard != world_size:
        raise ValueError(f"mesh sizes dp_replicate={rep} x dp_shard={shard} x cp={cp} x tp={tp} = {fixed * shard} "
                         f"do not match the world size {world_size}")
    return MeshSizes(rep, shard, cp, tp)


def build_mesh(device_type: str, world_size: Optional[int] = None, *, replicate: Optional[int] = None,
               shard: Optional[int] = None, cp: Optional[int] = None, tp: Optional[int] = None) -> DeviceMesh:
    """The (data parallel x cp x tp) mesh over ``world_size`` ranks (default: the process group's).

    Without ``replicate`` the data-parallel part is one ``dp`` dim; with it, ``(dp_replicate,
    dp_shard)``, dp_shard derived unless ``shard`` gives it. ``cp`` and ``tp`` are dims when given,
    size 1 included, so a caller can keep one layout at every size.
    """
    if world_size is None:  # torch says to call init_process_group when there is none
        world_size = dist.get_world_size()
    s = resolve_sizes(world_size, tp_size=tp, cp_size=cp, dp_replicate_size=replicate, dp_shard_size=shard)
    dims = {DP_REPLICATE: s.dp_replicate, DP_SHARD: s.dp_shard} if replicate is not None else {DP: s.dp_shard}
    dims.update({name: size for name, size, given in ((CP, s.cp, cp), (TP, s.tp, tp)) if given is not None})
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def resolve_placements(placements: "str | Placements", shard_axis: str = DP) -> Placements:
    """The Placements a name stands for: the one-axis names over ``shard_axis`` (``dp`` on a mesh
    without replicas, ``dp_shard`` on the manager's), hsdp and hfsdp over (dp_replicate, dp_shard).
    A Placements is returned as it is."""
    if not isinstance(placements, str):
        return placements
    return getattr(Placements, placements)(*((DP_REPLICATE, DP_SHARD) if placements in TWO_AXIS else (shard_axis,)))


def mesh_shape_error(world_size: int, placements: str, replicate: int) -> str | None:
    """Why ``world_size`` processes cannot form the mesh of a placement name, or None when they can."""
    if placements not in TWO_AXIS:
        return None if replicate == 1 else f"parallel.replicate={replicate} only applies to hsdp/hfsdp placements"
    if world_size % replicate:
        return (f"world size {world_size} does not fit a mesh of {replicate} replicas "
                f"(parallel.replicate must divide the number of processes); launch a "
                f"multiple of {replicate} processes or change --parallel.replicate")
    return None
