"""The manager's device mesh: four named dims, ``(dp_replicate, dp_shard, cp, tp)``, size 1 where unused.

One layout for every job, so the code that shards a model never branches on which axes exist:
world size 1 is a mesh of ones and takes the same path as a cluster. tp is innermost (the fastest
link), then cp, then dp_shard, and dp_replicate is outermost (the slowest link carries the least
traffic in HSDP).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class MeshSizes:
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
    sizes = {"tp_size": tp_size or 1, "cp_size": cp_size or 1, "dp_replicate_size": dp_replicate_size or 1}
    for name, value in list(sizes.items()) + [("dp_shard_size", dp_shard_size)]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    fixed = sizes["tp_size"] * sizes["cp_size"] * sizes["dp_replicate_size"]
    if dp_shard_size is None:
        if world_size % fixed:
            raise ValueError(
                f"world size {world_size} is not divisible by tp_size*cp_size*dp_replicate_size = "
                f"{sizes['tp_size']}*{sizes['cp_size']}*{sizes['dp_replicate_size']} = {fixed}"
            )
        dp_shard_size = world_size // fixed
    if fixed * dp_shard_size != world_size:
        raise ValueError(
            f"mesh sizes dp_replicate={sizes['dp_replicate_size']} x dp_shard={dp_shard_size} x "
            f"cp={sizes['cp_size']} x tp={sizes['tp_size']} = {fixed * dp_shard_size} do not match the "
            f"world size {world_size}"
        )
    return MeshSizes(sizes["dp_replicate_size"], dp_shard_size, sizes["cp_size"], sizes["tp_size"])


def build_device_mesh(device_type: str = "cpu", *, tp_size: Optional[int] = 1, cp_size: Optional[int] = 1,
                      dp_replicate_size: Optional[int] = 1, dp_shard_size: Optional[int] = None,
                      world_size: Optional[int] = None) -> DeviceMesh:
    """A 4-D mesh named ``(dp_replicate, dp_shard, cp, tp)`` over the default process group."""
    if world_size is None:
        if not dist.is_initialized():
            raise RuntimeError("build_device_mesh needs an initialised process group (torch.distributed."
                               "init_process_group) or an explicit world_size")
        world_size = dist.get_world_size()
    s = resolve_sizes(world_size, tp_size=tp_size, cp_size=cp_size, dp_replicate_size=dp_replicate_size,
                      dp_shard_size=dp_shard_size)
    return init_device_mesh(device_type, (s.dp_replicate, s.dp_shard, s.cp, s.tp), mesh_dim_names=MESH_DIM_NAMES)


def build_device_mesh_from_config(config, device_type: str = "cpu") -> DeviceMesh:
    """The mesh a :class:`MegatronFSDPConfig` describes (unset sizes count as 1)."""
    return build_device_mesh(device_type, tp_size=config.tp_size, cp_size=config.cp_size,
                             dp_replicate_size=config.dp_replicate_size)


def mesh_sizes(mesh: DeviceMesh) -> MeshSizes:
    """Sizes of a manager mesh, with a clear error for any other shape or naming."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_DIM_NAMES:
        raise ValueError(
            f"the manager needs a 4-D mesh with dims {MESH_DIM_NAMES} (size 1 where unused), got dims "
            f"{names or '(unnamed)'} of shape {tuple(mesh.shape)}; build one with "
            "mfsdp.manager.build_device_mesh"
        )
    return MeshSizes(*(mesh.size(i) for i in range(4)))


def check_config_against_mesh(config, sizes: MeshSizes) -> None:
    """The mesh wins; sizes the config sets must agree with it."""
    for field, actual in (("tp_size", sizes.tp), ("cp_size", sizes.cp), ("dp_replicate_size", sizes.dp_replicate)):
        wanted = getattr(config, field)
        if wanted is not None and wanted != actual:
            raise ValueError(
                f"MegatronFSDPConfig.{field}={wanted} disagrees with the device mesh, whose "
                f"{field[:-5]} dim has size {actual} (mesh shape {sizes}); leave it None or match the mesh"
            )
