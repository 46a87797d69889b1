"""How each data-parallel mesh axis treats parameters, gradients and optimizer state.

A :class:`Placements` value names, per data-parallel axis, one torch placement for each of three
lifetimes of a parameter:

* ``parameter``: the compute weights at rest. ``Shard(0)`` means they are gathered just in time
  (ZeRO-3); ``Replicate()`` means every rank keeps them whole.
* ``gradient``: when the axis is reduced. ``Shard(0)``/``Replicate()`` reduce on every backward
  (reduce-scatter / all-reduce); ``Partial()`` defers the reduction to the last microbatch.
* ``optimizer``: the main weights, their gradients and the optimizer states.

Layout rule shared by every combination. The axes a combination shards are ordered coarse to fine:
first those that shard the parameter, then those that shard the gradient, then those that shard
only the optimizer state. A parameter of ``n`` rows is padded to ``c * K`` rows, where ``K`` is
the product of the sharded axes' sizes and ``c = ceil(n / K)``. Each level of sharding is then a
contiguous block of rows nested in the level above, so every transition is one collective per axis
and the optimizer shard is exactly ``torch.chunk`` of the parameter over the flattened axes: a
well-formed DTensor with no uneven-shard pre-processing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Union

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

MeshAxis = Union[str, int]

# Per-axis behaviour as (parameter, gradient, optimizer) letters: S = Shard(0), R = Replicate,
# P = Partial. The table lists every supported combination, outermost axis first.
_NAMED_COMBINATIONS: dict[tuple[str, ...], str] = {
    ("SSS",): "ZeRO-3",
    ("RSS",): "ZeRO-2",
    ("RPS",): "ZeRO-1",
    ("RPR",): "DDP",
    ("RRR", "SSS"): "HSDP",
    ("RPR", "SSS"): "HSDP with the replicate reduction deferred",
    ("RPS", "SSS"): "HFSDP",
}


def _letter(placement: Placement, field: str) -> str:
    if isinstance(placement, Shard):
        if placement.dim != 0:
            raise NotImplementedError(f"Placements.{field}: Shard({placement.dim}) is not supported; mfsdp shards "
                                      "dim 0 only. Use Shard(0).")
        return "S"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        if field != "gradient":
            raise NotImplementedError(f"Placements.{field}: Partial() only makes sense for gradients (it defers their "
                                      "reduction); use Shard(0) or Replicate().")
        return "P"
    raise NotImplementedError(f"Placements.{field}: {placement!r} is not supported; use Shard(0), Replicate() "
                              "or Partial().")


@dataclasses.dataclass(frozen=True)
class Placements:
    """Per-axis placements of parameters, gradients and optimizer state over data-parallel axes."""

    dp_axes: Sequence[MeshAxis]
    """Mesh dims (names or indices), outermost first, over which parameters are data-parallel."""
    parameter: Sequence[Placement]
    """Placement of the compute weights at rest, one per axis."""
    gradient: Sequence[Placement]
    """When each axis's gradient reduction happens: every backward, or deferred (``Partial``)."""
    optimizer: Sequence[Placement]
    """Placement of the main weights, exposed gradients and optimizer states, one per axis."""

    def __post_init__(self) -> None:
        if isinstance(self.dp_axes, (str, int)):
            raise ValueError(f"Placements.dp_axes must be a sequence of axes, got {self.dp_axes!r}")
        for name in ("dp_axes", "parameter", "gradient", "optimizer"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.dp_axes:
            raise ValueError("Placements.dp_axes is empty; name at least one data-parallel mesh axis")
        if len(set(self.dp_axes)) != len(self.dp_axes):
            raise ValueError(f"Placements.dp_axes has a repeated axis: {self.dp_axes}")
        for field in ("parameter", "gradient", "optimizer"):
            if len(getattr(self, field)) != len(self.dp_axes):
                raise ValueError(f"Placements.{field} has {len(getattr(self, field))} entries but dp_axes has "
                                 f"{len(self.dp_axes)}; give exactly one placement per data-parallel axis")
        key = self.combination
        if key not in _NAMED_COMBINATIONS and set(key) != {"SSS"}:
            raise NotImplementedError(f"unsupported placement combination (parameter/gradient/optimizer per axis, "
                                      f"S=Shard(0) R=Replicate P=Partial): {'/'.join(key)}. Supported: "
                                      + ", ".join(f"{v} {'/'.join(k)}" for k, v in _NAMED_COMBINATIONS.items())
                                      + ", and SSS on every axis (ZeRO-3 over several axes).")

    # ----------------------------------------------------------------------- named constructors
    @classmethod
    def zero3(cls, axis: MeshAxis = "dp") -> "Placements":
        """Parameters, gradients and optimizer state all sharded: the least memory."""
        return cls((axis,), [Shard(0)], [Shard(0)], [Shard(0)])

    @classmethod
    def zero2(cls, axis: MeshAxis = "dp") -> "Placements":
        """Replicated compute weights (one all-gather per step), sharded gradients and states."""
        return cls((axis,), [Replicate()], [Shard(0)], [Shard(0)])

    @classmethod
    def zero1(cls, axis: MeshAxis = "dp") -> "Placements":
        """Replicated weights and local gradient accumulation; one reduce-scatter per step."""
        return cls((axis,), [Replicate()], [Partial()], [Shard(0)])

    @classmethod
    def ddp(cls, axis: MeshAxis = "dp") -> "Placements":
        """Everything replicated; one all-reduce per step, on the last microbatch."""
        return cls((axis,), [Replicate()], [Partial()], [Replicate()])

    @classmethod
    def hsdp(cls, replicate: MeshAxis, shard: MeshAxis, defer_replicate_reduction: bool = False) -> "Placements":
        """Shard within ``shard``, replicate across ``replicate`` (2-D).

        With ``defer_replicate_reduction`` the all-reduce across replicas waits for the last
        microbatch: less traffic on the slow axis, at the price of no overlap for it.
        """
        outer = Partial() if defer_replicate_reduction else Replicate()
        return cls((replicate, shard), [Replicate(), Shard(0)], [outer, Shard(0)], [Replicate(), Shard(0)])

    @classmethod
    def hfsdp(cls, replicate: MeshAxis, shard: MeshAxis) -> "Placements":
        """HSDP whose optimizer state is also sharded across ``replicate``.

        Gradients are reduce-scattered within ``shard`` every backward and across ``replicate`` on
        the last microbatch; after the step one all-gather across ``replicate`` rebuilds the
        weights' ``shard``-level copy.
        """
        return cls((replicate, shard), [Replicate(), Shard(0)], [Partial(), Shard(0)], [Shard(0), Shard(0)])

    @classmethod
    def fully_sharded(cls, *axes: MeshAxis) -> "Placements":
        """ZeRO-3 over every given axis (the flattened axes act as one)."""
        n = len(axes)
        return cls(tuple(axes), [Shard(0)] * n, [Shard(0)] * n, [Shard(0)] * n)

    # ----------------------------------------------------------------------------- derived facts
    @property
    def combination(self) -> tuple[str, ...]:
        return tuple(_letter(p, "parameter") + _letter(g, "gradient") + _letter(o, "optimizer")
                     for p, g, o in zip(self.parameter, self.gradient, self.optimizer))

    @property
    def name(self) -> str:
        key = self.combination
        return _NAMED_COMBINATIONS.get(key, f"ZeRO-3 over {len(key)} axes")

    @property
    def shard_order(self) -> tuple[int, ...]:
        """Positions (into ``dp_axes``) of the sharded axes, coarsest level first."""
        key = self.combination
        param = [i for i, c in enumerate(key) if c[0] == "S"]
        grad = [i for i, c in enumerate(key) if c[1] == "S" and i not in param]
        optim = [i for i, c in enumerate(key) if c[2] == "S" and c[1] != "S"]
        return tuple(param + grad + optim)

    @property
    def num_param_sharded(self) -> int:
        """How many leading axes of ``shard_order`` shard the compute weights."""
        return sum(c[0] == "S" for c in self.combination)

    @property
    def num_grad_sharded(self) -> int:
        """How many leading axes of ``shard_order`` are reduce-scattered on every backward."""
        return sum(c[1] == "S" for c in self.combination)

    @property
    def grad_all_reduced(self) -> tuple[int, ...]:
        """Axes all-reduced on every backward (HSDP's replicate axis)."""
        return tuple(i for i, c in enumerate(self.combination) if c[1] == "R")

    @property
    def deferred_all_reduce(self) -> tuple[int, ...]:
        """Axes all-reduced on the last microbatch only."""
        return tuple(i for i, c in enumerate(self.combination) if c[1] == "P" and c[2] == "R")

    def resolve_axes(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """Mesh dim indices of ``dp_axes``, with a clear error for an unknown axis."""
        return tuple(mesh_axis_index(mesh, axis) for axis in self.dp_axes)


def mesh_axis_index(mesh: DeviceMesh, axis: MeshAxis) -> int:
    """Index of ``axis`` (a mesh-dim name or index) in ``mesh``."""
    names = tuple(mesh.mesh_dim_names or ())
    if isinstance(axis, bool) or not isinstance(axis, (str, int)):
        raise ValueError(f"mesh axis must be a dim name or index, got {axis!r}")
    if isinstance(axis, int):
        if not 0 <= axis < mesh.ndim:
            raise ValueError(f"mesh axis {axis} is out of range for a {mesh.ndim}-D mesh {names or ''}")
        return axis
    if axis not in names:
        raise ValueError(f"unknown mesh axis {axis!r}; this mesh has dims {names or '(unnamed)'}. Name one of "
                         "them in Placements.dp_axes, or build the mesh with mesh_dim_names.")
    return names.index(axis)


def default_placements(mesh: DeviceMesh) -> Placements:
    """``Shard(0)`` on every axis of ``mesh``: fully sharded over all of it."""
    axes = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else tuple(range(mesh.ndim))
    return Placements.fully_sharded(*axes)
