"""Where this rank sits in a (mesh, placements) pair: axis groups, shard indices, DTensor specs."""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp import _compat
from mfsdp.placement import Placements


class Levels:
    """The sharded axes of a placement combination as sizes, coarsest first: the level math alone,
    which the planner (``mfsdp.memory``) uses without a mesh and ``ShardGeometry`` extends with one.

    Level ``j`` means "split over the first ``j`` sharded axes": level 0 is whole, level
    ``num_levels`` is the optimizer shard.
    """

    def __init__(self, sizes: Sequence[int], param_level: int, grad_level: int) -> None:
        self.sizes = tuple(sizes)  # size of each sharded axis, in shard order
        self.param_level = param_level  # levels that shard the compute weights at rest (0: replicated)
        self.grad_level = grad_level  # levels reduce-scattered on every backward
        self.num_levels = len(self.sizes)
        self.num_shards = math.prod(self.sizes)

    @classmethod
    def of(cls, placements: Placements, mesh_shape: Mapping) -> "Levels":
        """The levels of ``placements`` over a mesh of ``mesh_shape`` (axis name -> size)."""
        missing = [a for a in placements.dp_axes if a not in mesh_shape]
        if missing:
            raise ValueError(f"mesh_shape {dict(mesh_shape)} has no size for the axes {missing} that "
                             f"{placements.name} names; give every axis of Placements.dp_axes a size")
        return cls([int(mesh_shape[placements.dp_axes[i]]) for i in placements.shard_order],
                   placements.num_param_sharded, placements.num_grad_sharded)

    def ways(self, level: int) -> int:
        return math.prod(self.sizes[:level])

    @property
    def into_accumulator(self) -> bool:
        """HFSDP: every backward reduces into an accumulator, the last one into the main gradient."""
        return 0 < self.grad_level < self.num_levels


class ShardGeometry(Levels):
    """The sharded axes of a placement combination, coarsest first, seen from this rank.

    Moving from level ``j`` to ``j + 1`` is one reduce-scatter over ``groups[j]``; the way back is
    one all-gather.
    """

    def __init__(self, mesh: DeviceMesh, placements: Placements) -> None:
        self.mesh = mesh
        self.placements = placements
        self.dims = placements.resolve_axes(mesh)
        order = placements.shard_order
        super().__init__([mesh.size(self.dims[i]) for i in order], placements.num_param_sharded,
                         placements.num_grad_sharded)
        self.groups = [mesh.get_group(self.dims[i]) for i in order]
        self.coords = [mesh.get_local_rank(self.dims[i]) for i in order]
        self.grad_all_reduce_groups = [mesh.get_group(self.dims[i]) for i in placements.grad_all_reduced]
        self.deferred_all_reduce_groups = [mesh.get_group(self.dims[i]) for i in placements.deferred_all_reduce]
        self.shard_index = self.index(self.num_levels)

    @property
    def device(self) -> torch.device:
        """This rank's device on the mesh's device type (where meta parameters get their shards)."""
        return mesh_device(self.mesh)

    def index(self, level: int) -> int:
        """This rank's block at ``level`` (mixed radix over the first ``level`` sharded axes)."""
        idx = 0
        for size, coord in zip(self.sizes[:level], self.coords[:level]):
            idx = idx * size + coord
        return idx

    # --------------------------------------------------------------------- DTensor exposure
    def dtensor_spec(self) -> tuple[DeviceMesh, list]:
        """Mesh and placements of the exposed (optimizer-placement) DTensors.

        One sharded axis: the user's mesh with the optimizer placements as given. Several: the
        optimizer shard is ``torch.chunk`` over the sharded axes flattened in ``shard_order``, which
        is ``Shard(0)`` on a 1-D mesh enumerating the ranks in that order (nested ``Shard(0)`` or
        ``_StridedShard`` would chunk uneven tensors differently). In mesh order with nothing else
        on the mesh (2-D ZeRO-3) that is torch's flattened mesh; otherwise (HFSDP, or other axes
        such as tensor parallel beside them) a mesh of its own, see ``shard_order_mesh``.
        """
        mesh, placements, _ = self._exposed
        return mesh, list(placements)

    @functools.cached_property
    def _exposed(self) -> tuple[DeviceMesh, list, dict]:
        """(mesh, placements, {user mesh dim: exposed mesh dim} for the dims mfsdp does not shard),
        built on first use (``shard_order_mesh`` may create process groups)."""
        others = [d for d in range(self.mesh.ndim) if d not in self.dims]
        placements = [Replicate()] * self.mesh.ndim
        for pos, dim in enumerate(self.dims):
            placements[dim] = self.placements.optimizer[pos]
        if self.num_levels <= 1:
            return self.mesh, placements, {d: d for d in others}
        order_dims = [self.dims[i] for i in self.placements.shard_order]
        if order_dims == sorted(order_dims) and not others:
            return _compat.flatten_mesh(self.mesh), [Shard(0)], {}
        if _compat.supports_ordered_groups():
            mesh = shard_order_mesh(self.mesh, order_dims)
            return mesh, [Shard(0)] + [Replicate()] * len(others), {d: 1 + i for i, d in enumerate(others)}
        # Older torch cannot order a process group's ranks: fall back to _StridedShard on the user's
        # mesh, which matches the flat buffer for evenly divisible rows only (``check_exposed`` says so).
        if len(order_dims) != 2:
            raise NotImplementedError(
                f"{self.placements.name} over these axes needs torch.distributed.new_group(sort_ranks=False), "
                f"which torch {torch.__version__} lacks; upgrade torch or shard over one axis")
        coarse, fine = order_dims
        placements[coarse] = Shard(0)
        placements[fine] = (Shard(0) if coarse < fine
                            else _compat.strided_shard(0, split_factor=self.mesh.size(coarse)))
        return self.mesh, placements, {d: d for d in others}

    def parameter_spec(self, param: torch.Tensor) -> tuple[DeviceMesh, list, bool]:
        """Exposed mesh and placements for ``param``, and whether tensor parallelism split its dim 0.

        A parameter that is already a DTensor (tensor parallel) keeps its placements on its own
        axes; mfsdp shards its *local* tensor over the data-parallel axes. When tensor parallelism
        already split dim 0, the data-parallel split of dim 0 comes second, which DTensor spells
        ``_StridedShard`` on the data-parallel axis: right-to-left nested ``torch.chunk``, which is
        what the flat buffer holds (a ``torch.chunk`` block of the local shard), uneven rows included.
        """
        mesh, placements = self.dtensor_spec()
        if not isinstance(param, DTensor):
            return mesh, placements, False
        _, _, exposed_dim = self._exposed
        names = list(self.mesh.mesh_dim_names or ())
        dp_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Shard) or _compat.is_strided_shard(pl)]
        tp_dim0 = []
        for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
            dim = exposed_dim.get(names.index(name)) if name in names else None
            if dim is None:
                raise NotImplementedError(
                    f"a tensor-parallel parameter's mesh axis {name!r} must be an axis of the mesh given to "
                    f"fully_shard {tuple(names)} other than the data-parallel axes {self.placements.dp_axes}")
            placements[dim] = placement
            if isinstance(placement, Shard) and placement.dim == 0:
                tp_dim0.append(dim)
        if tp_dim0:
            split = math.prod(mesh.size(d) for d in tp_dim0)
            for dp_dim in dp_dims:
                if any(dp_dim > dim for dim in tp_dim0):
                    raise NotImplementedError(
                        "tensor-parallel axes must come after the data-parallel axes in the mesh")
                placements[dp_dim] = _compat.strided_shard(0, split_factor=split)
        return mesh, placements, bool(tp_dim0)

    def check_exposed(self, params, members, specs, label: str) -> None:
        """Raise unless torch reads each parameter's exposed spec as exactly the shard the flat
        buffer holds (``specs`` from ``parameter_spec``, ``members`` from the group's layout).

        A DTensor whose spec disagrees with its local tensor gives wrong ``full_tensor()`` values,
        clipping norms and checkpoints without any error, so this is checked once, up front, with
        torch's own shape/offset rule. Nested or strided shards with uneven rows are where torch
        versions differ, and there only some ranks may see the mismatch: all ranks of the mesh then
        agree on the first bad parameter (one small all-reduce per mesh dim), so they all raise
        together instead of some of them waiting in the next collective.
        """
        found = [self._misdescribed(p, m, s) for p, m, s in zip(params, members, specs)]
        bad = next((i for i, why in enumerate(found) if why), len(params))
        nested = self.num_levels > 1 and self._exposed[0] is self.mesh  # the older-torch fallback
        if nested or any(_compat.is_strided_shard(pl) for _, placements, _ in specs for pl in placements):
            flag = torch.tensor([bad], dtype=torch.int64, device=self.device)
            for d in range(self.mesh.ndim):
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.mesh.get_group(d))
            bad = int(flag.item())
        if bad == len(params):
            return
        mesh, placements, tp_dim0 = specs[bad]
        if tp_dim0:
            fix = (f"this torch ({torch.__version__}) does not describe a tensor-parallel shard split again by "
                   f"data parallelism with uneven rows; pad dim 0 of the parameter so that its tensor-parallel "
                   f"shard divides by the {self.num_shards} data-parallel shards, or upgrade torch")
        else:
            fix = (f"{self.placements.name} with rows that do not divide by the {self.num_shards} shards needs "
                   f"torch.distributed.new_group(sort_ranks=False), which torch {torch.__version__} lacks; "
                   f"upgrade torch or pad dim 0 to a multiple of {self.num_shards}")
        raise NotImplementedError(
            f"a parameter of shape {tuple(params[bad].shape)} in {label}: its exposed DTensor "
            f"({[str(p) for p in placements]} on mesh {mesh.mesh_dim_names}) does not describe the shard the "
            f"flat buffer holds ({found[bad] or 'on another rank'}). {fix}.")

    def _misdescribed(self, param: torch.Tensor, member, spec) -> str:
        """Empty when torch's reading of ``spec`` on this rank is this rank's shard, else how not."""
        mesh, placements, _ = spec
        rows = member.rows_of_shard(self.shard_index)
        want_shape = (rows,) + tuple(member.shape[1:])
        want_offset = (list(_compat.local_shape_and_offset(param.shape, param.device_mesh, param.placements)[1])
                       if isinstance(param, DTensor) else [0] * len(param.shape))
        want_offset[0] += min(member.rows, member.chunk_rows * self.shard_index)
        got_shape, got_offset = _compat.local_shape_and_offset(param.shape, mesh, placements)
        if got_shape == want_shape and (rows == 0 or list(got_offset) == want_offset):
            return ""
        return f"torch reads {got_shape} at {got_offset}, this rank holds {want_shape} at {tuple(want_offset)}"


_SHARD_ORDER_MESHES: dict = {}


def shard_order_mesh(mesh: DeviceMesh, order_dims: Sequence[int]) -> DeviceMesh:
    """``mesh`` with ``order_dims`` flattened into its first dim, ranks enumerated in that order
    (the first of ``order_dims`` the slowest), and its other dims after it, unchanged.

    The flattened dim needs a process group whose group ranks follow that order, which no mesh
    of torch's provides when it is not mesh order (HFSDP: shard axis, then replicate axis), so
    this creates one per slice of the world. Collective: every rank calls it in the same order
    (``fully_shard`` does); cached per (mesh, order), so each process group is created once.
    """
    key = (mesh, tuple(order_dims))
    world, exposed = _SHARD_ORDER_MESHES.get(key, (None, None))
    if world is dist.group.WORLD:  # not a cached mesh whose groups died with an earlier world
        return exposed
    others = [d for d in range(mesh.ndim) if d not in order_dims]
    sizes = [mesh.size(d) for d in others]
    ranks = mesh.mesh.permute(*order_dims, *others).reshape(-1, *sizes)
    mine = [tuple(col) for col in ranks.reshape(ranks.shape[0], -1).t().tolist()]
    # Another slice of a bigger world (say one pipeline stage) is not in ``mesh``: gather every
    # rank's slices so that all ranks create the same groups in the same order.
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    group, my_slice = None, None
    for slice_ranks in sorted({s for slices in everyone for s in slices}):
        created = _compat.new_ordered_group(slice_ranks)
        if dist.get_rank() in slice_ranks:
            group, my_slice = created, slice_ranks
    # A backend that quietly sorted the ranks would make every exposed DTensor wrong without an
    # error; one tiny all-gather, once per mesh, proves the order.
    device = mesh_device(mesh)
    seen = torch.empty(len(my_slice), dtype=torch.int64, device=device)
    _compat.all_gather_into_tensor(seen, torch.tensor([dist.get_rank()], dtype=torch.int64, device=device), group)
    if seen.tolist() != list(my_slice):
        raise RuntimeError(f"a process group created for ranks {list(my_slice)} in that order gathers them as "
                           f"{seen.tolist()} (torch {torch.__version__}); this torch cannot expose "
                           f"{tuple(mesh.mesh_dim_names or ())} sharded in shard order {tuple(order_dims)}; use "
                           "HSDP, or ZeRO over one data-parallel axis")
    names = list(mesh.mesh_dim_names or (f"dim{d}" for d in range(mesh.ndim)))
    flat_name = "_".join(names[d] for d in order_dims) + "_in_shard_order"
    groups = [group] + [mesh.get_group(d) for d in others]  # with no other dims: ``group`` alone, 1-D
    exposed = DeviceMesh.from_group(groups if others else group, mesh.device_type, mesh=ranks,
                                    mesh_dim_names=(flat_name, *(names[d] for d in others)))
    _SHARD_ORDER_MESHES[key] = (dist.group.WORLD, exposed)
    return exposed


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on ``mesh``'s device type."""
    cuda = mesh.device_type == "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)


def exposed_dtensors(params, shards, specs) -> list[DTensor]:
    """DTensors over ``shards`` (this rank's, from the flat buffers) with each parameter's global
    shape and its exposed (mesh, placements) of ``specs``: the sharded parameters and their ``.grad``."""
    return [DTensor.from_local(t, mesh, placements, run_check=False, shape=p.shape, stride=contiguous_stride(p.shape))
            for p, t, (mesh, placements) in zip(params, shards, specs)]


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
