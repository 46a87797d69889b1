"""Where this rank sits in a (mesh, placements) pair: axis groups, shard indices, DTensor specs."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp import _compat
from mfsdp.placement import Placements


class ShardGeometry:
    """The sharded axes of a placement combination, coarsest first, seen from this rank.

    Level ``j`` means "split over the first ``j`` sharded axes": level 0 is whole, level
    ``num_levels`` is the optimizer shard. Moving from level ``j`` to ``j + 1`` is one
    reduce-scatter over ``groups[j]``; the way back is one all-gather.
    """

    def __init__(self, mesh: DeviceMesh, placements: Placements) -> None:
        self.mesh = mesh
        self.placements = placements
        self.dims = placements.resolve_axes(mesh)
        order = placements.shard_order
        self.sizes = [mesh.size(self.dims[i]) for i in order]
        self.groups = [mesh.get_group(self.dims[i]) for i in order]
        self.coords = [mesh.get_local_rank(self.dims[i]) for i in order]
        self.num_levels = len(order)
        self.param_level = placements.num_param_sharded
        self.grad_level = placements.num_grad_sharded
        self.grad_all_reduce_groups = [mesh.get_group(self.dims[i]) for i in placements.grad_all_reduced]
        self.deferred_all_reduce_groups = [mesh.get_group(self.dims[i]) for i in placements.deferred_all_reduce]
        self.num_shards = math.prod(self.sizes)
        self.shard_index = self.index(self.num_levels)
        self._order = order

    @property
    def device(self) -> torch.device:
        """This rank's device on the mesh's device type (where meta parameters get their shards)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def has_deferred(self) -> bool:
        return self.grad_level < self.num_levels or bool(self.deferred_all_reduce_groups)

    def ways(self, level: int) -> int:
        return math.prod(self.sizes[:level])

    def index(self, level: int) -> int:
        """This rank's block at ``level`` (mixed radix over the first ``level`` sharded axes)."""
        idx = 0
        for size, coord in zip(self.sizes[:level], self.coords[:level]):
            idx = idx * size + coord
        return idx

    # --------------------------------------------------------------------- DTensor exposure
    def dtensor_spec(self) -> tuple[DeviceMesh, list]:
        """Mesh and placements of the exposed (optimizer-placement) DTensors.

        One sharded axis: the user's mesh with the optimizer placements as given. Several, in mesh
        order (ZeRO-3 over 2-D): the shard is ``torch.chunk`` over the flattened axes, which is
        ``Shard(0)`` on the flattened 1-D mesh (nested ``Shard(0)`` would chunk uneven tensors
        differently). Several, finer axis first in the mesh (HFSDP): ``_StridedShard`` on the finer
        axis, which torch defines only for evenly divisible rows (checked by ``require_even``).
        """
        placements = [Replicate()] * self.mesh.ndim
        for pos, dim in enumerate(self.dims):
            placements[dim] = self.placements.optimizer[pos]
        if self.num_levels <= 1:
            return self.mesh, placements
        order_dims = [self.dims[i] for i in self._order]
        if order_dims == sorted(order_dims) and len(order_dims) == self.mesh.ndim:
            return _compat.flatten_mesh(self.mesh), [Shard(0)]
        if len(order_dims) != 2:
            raise NotImplementedError(f"{self.placements.name}: optimizer sharding over these axes is not supported")
        coarse, fine = order_dims
        placements[fine] = _compat.strided_shard(0, split_factor=self.mesh.size(coarse))
        placements[coarse] = Shard(0)
        return self.mesh, placements

    def parameter_spec(self, param: torch.Tensor) -> tuple[DeviceMesh, list, bool]:
        """Exposed mesh and placements for ``param``, and whether its dim 0 must divide evenly.

        A parameter that is already a DTensor (tensor parallel) keeps its placements on its own
        axes; mfsdp shards its *local* tensor over the data-parallel axes. When tensor parallelism
        already split dim 0, the data-parallel split of dim 0 comes second, which DTensor spells
        ``_StridedShard`` on the data-parallel axis (defined for even splits only).
        """
        mesh, placements = self.dtensor_spec()
        if not isinstance(param, DTensor):
            return mesh, placements, False
        if mesh is not self.mesh:
            raise NotImplementedError(
                f"{self.placements.name} with tensor-parallel parameters is not supported; use ZeRO-1/2/3, "
                "DDP or HSDP over the data-parallel axes"
            )
        names = list(self.mesh.mesh_dim_names or ())
        even = False
        for own_dim, placement in enumerate(param.placements):
            dim = names.index(param.device_mesh.mesh_dim_names[own_dim])
            placements[dim] = placement
            if isinstance(placement, Shard) and placement.dim == 0:
                for dp_dim in self.dims:
                    if isinstance(placements[dp_dim], Shard):
                        if dp_dim > dim:
                            raise NotImplementedError(
                                "tensor-parallel axes must come after the data-parallel axes in the mesh")
                        placements[dp_dim] = _compat.strided_shard(0, split_factor=self.mesh.size(dim))
                        even = True
        return mesh, placements, even

    @property
    def requires_even_rows(self) -> bool:
        order_dims = [self.dims[i] for i in self._order]
        return self.num_levels > 1 and order_dims != sorted(order_dims)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def fill_region(region: torch.Tensor, full: torch.Tensor, member, ways: int, index: int) -> None:
    """Copy the real rows of block ``index`` (of ``ways``) of ``full`` into ``region``."""
    rows_per_block = member.padded_rows // ways
    start = index * rows_per_block
    stop = min(member.rows, start + rows_per_block)
    region.zero_()
    if stop > start:
        n = (stop - start) * member.row_numel
        region[:n].copy_(full.reshape(member.rows, member.row_numel)[start:stop].reshape(-1))
