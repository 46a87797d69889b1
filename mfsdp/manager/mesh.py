"""The manager's device mesh: four named dims, ``(dp_replicate, dp_shard, cp, tp)``, size 1 where unused.

One layout for every job, so the code that shards a model never branches on which axes exist:
world size 1 is a mesh of ones and takes the same path as a cluster. tp is innermost (the fastest
link), then cp, then dp_shard, and dp_replicate is outermost (the slowest link carries the least
traffic in HSDP).
"""

from __future__ import annotations

from typing import Optional

from torch.distributed.device_mesh import DeviceMesh

from mfsdp.mesh import CP, DP_REPLICATE, DP_SHARD, TP, MeshSizes, build_mesh

MESH_DIM_NAMES = (DP_REPLICATE, DP_SHARD, CP, TP)


def build_device_mesh(device_type: str = "cpu", *, tp_size: Optional[int] = 1, cp_size: Optional[int] = 1,
                      dp_replicate_size: Optional[int] = 1, dp_shard_size: Optional[int] = None,
                      world_size: Optional[int] = None) -> DeviceMesh:
    """A 4-D mesh named ``(dp_replicate, dp_shard, cp, tp)`` over the default process group
    (``mfsdp.mesh.build_mesh`` with every dim present)."""
    return build_mesh(device_type, world_size, replicate=dp_replicate_size or 1, shard=dp_shard_size,
                      cp=cp_size or 1, tp=tp_size or 1)


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
        raise ValueError(f"the manager needs a 4-D mesh with dims {MESH_DIM_NAMES} (size 1 where unused), got dims "
                         f"{names or '(unnamed)'} of shape {tuple(mesh.shape)}; build one with "
                         "mfsdp.manager.build_device_mesh")
    return MeshSizes(*(mesh.size(i) for i in range(4)))


def check_config_against_mesh(config, sizes: MeshSizes) -> None:
    """The mesh wins; sizes the config sets must agree with it."""
    for field, actual in (("tp_size", sizes.tp), ("cp_size", sizes.cp), ("dp_replicate_size", sizes.dp_replicate)):
        wanted = getattr(config, field)
        if wanted is not None and wanted != actual:
            raise ValueError(f"MegatronFSDPConfig.{field}={wanted} disagrees with the device mesh, whose "
                             f"{field[:-5]} dim has size {actual} (mesh shape {sizes}); leave it None or match "
                             "the mesh")
