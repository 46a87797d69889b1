"""Model state per rank, from the layout code the runtime allocates with.

Every byte of model state is one of a parameter group's flat buffers (see
``runtime/parameter_group``). Here each group's buffers are sized by the runtime's own
``FlatLayout`` and its own choice of compute-weight buffer (``choose_model_buffer``), with the
levels of sharding the runtime's own ``geometry.Levels`` (what ``ShardGeometry`` extends with a
mesh), built from a mesh *shape* instead of a live mesh. Units (the modules ``fully_shard`` is applied to) own their
parameters and group them by the runtime's own rule (``ownership.unit_groups``). The gradient
buffers mirror ``GradientReducer`` (main gradient at the optimizer level in the gradient dtype,
HFSDP's accumulator at the gradient level); the CPU test holds the whole of it to the byte against
live buffers. Tensor-parallel parameters (DTensors from
the manager's plan, see ``tensor_parallel``) are sized by their local shard, the tensor the runtime
flattens (``local_tensor``).

FP8 all-gather (``mfsdp.float8``): a group whose parameters carry a gather-codec tag gets the
runtime's own ``gather_codec.encoded_gather``, and its unsharded buffer is sized by that object's
``ByteLayout`` (float8 members 1 byte per element, the others the compute dtype, each at a 16-byte
aligned offset) in uint8, as ``FsdpParameterGroup`` allocates it. The encode's transient staging
(``Float8GatherCodec._cast_staged``: the rows staged in the compute dtype, their scales and the
float8 rows of its largest pass) is the codec's own ``staging_nbytes``, ``GroupBytes.encode_staging``.
On CUDA the fused encode (``mfsdp.kernels``) stages nothing, so there this figure is an upper bound
by one pass (at most 192 MiB).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from mfsdp.mixed_precision import MixedPrecisionPolicy, ResolvedDtypes
from mfsdp.runtime import gather_codec
from mfsdp.runtime.flat_buffer import FlatLayout
from mfsdp.runtime.geometry import Levels
from mfsdp.runtime.ownership import gathers_in_backward, unit_groups
from mfsdp.runtime.parameter_group import choose_model_buffer, local_tensor, unsharded_aliases_model
from mfsdp.runtime.reducer import reduction_nbytes, usage_layout


@dataclasses.dataclass(frozen=True)
class GroupBytes:
    """One parameter group's bytes on one rank."""

    label: str
    """Owning unit and dtype."""
    main: int
    """Main weights (optimizer shard, main dtype)."""
    model: int
    """Compute weights at rest, 0 where they alias the main weights or are cast on the fly."""
    unsharded: int
    """The gathered compute weights while the module runs; 0 where they are the model buffer itself
    (``unsharded_aliases_model``: replicated, or split one way at rest, as a frozen group on one GPU)."""
    main_grad: int
    """Reduced gradients (optimizer shard, gradient dtype) plus the int64 usage row."""
    accumulator: int
    """HFSDP's gradient accumulator (gradient level) plus its usage row; 0 otherwise."""
    module_grads: int
    """Autograd's gradients of the unsharded parameters (compute dtype, unpadded)."""
    staging: int
    """``pack_gradients``' copy in the reduction dtype (padded members, or a dtype change) plus the
    usage input."""
    scatter_out: int
    """A reduce-scatter output buffer, where it cannot write straight into the main gradient."""
    reduction_nbytes: int
    """What the runtime's pending-reduction rule counts for this group (``reduction_nbytes``)."""
    optimizer_numel: int
    """Elements of this rank's real (unpadded) optimizer shards."""
    main_itemsize: int
    """Bytes per element of the main weights (and optimizer states)."""
    gather_key: Optional[tuple]
    """(numel, dtype) of the gathered buffer, or None: which groups may share a gather slot."""
    requires_grad: bool
    """Whether the group has gradients at all."""
    every_backward: bool
    """Reduced on every backward (False: ZeRO-1 and DDP accumulate raw gradients until the last)."""
    direct: bool
    """The first reduction may write straight into the main gradient (gradient dtype = reduction
    dtype), with no scatter output buffer."""
    grads_differ: bool
    """Gradients kept in another dtype than the main weights: the optimizer step upcasts them, one
    group at a time (``mfsdp.optimizer.step_transient_bytes``)."""
    encode_staging: int = 0
    """Transient bytes of an encoded gather's encode (FP8 all-gather's staging), held while the
    group's gather is issued; 0 for a plain gather."""


@dataclasses.dataclass(frozen=True)
class UnitBytes:
    """One ``fully_shard`` unit: its groups, and where it sits in the tree."""

    name: str
    """The module's name under the root ("" for the root)."""
    groups: tuple[GroupBytes, ...]
    """Its parameter groups."""
    parent: Optional[str]
    """The nearest unit above it (None for the root)."""
    param_names: tuple[str, ...]
    """Names of the parameters it owns (for matching measured gradient arrival)."""
    param_grad_bytes: tuple[int, ...]
    """Autograd gradient bytes of each of those parameters (0 where frozen)."""
    gathers_in_backward: bool = True
    """Whether its backward gathers its weights (not a bare embedding: ``ownership``)."""

    def total(self, field: str) -> int:
        return sum(getattr(g, field) for g in self.groups)


def group_bytes(label: str, shapes, dtypes: ResolvedDtypes, levels: Levels, requires_grad: bool,
                rank_shard: int = 0, params: Optional[list] = None) -> GroupBytes:
    """The bytes of one group, from the runtime's layout and buffer choice; ``params`` (the group's
    parameters) lets tagged ones (FP8 all-gather) size the gather as the runtime does."""
    layout = FlatLayout(shapes, levels.num_shards)
    k = levels.num_shards
    main_aliases_model, on_the_fly = choose_model_buffer(dtypes, levels.num_levels, levels.param_level)
    isz = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
    main = layout.numel(k) * isz(dtypes.main)
    model = 0 if (main_aliases_model or on_the_fly) else layout.numel(levels.ways(levels.param_level)) * isz(dtypes.compute)
    encoded = (None if params is None
               else gather_codec.encoded_gather(params, dtypes, layout, label, levels.param_level))
    gathered = not unsharded_aliases_model(dtypes, levels, encoded)
    gather_layout, gather_dtype = ((layout, dtypes.compute) if encoded is None
                                   else (encoded.layout, encoded.layout.dtype))  # the runtime's ByteLayout
    unsharded = gather_layout.numel(1) * isz(gather_dtype) if gathered else 0
    source_dtype = dtypes.main if on_the_fly else dtypes.compute  # what unshard gathers from
    encode_staging = _encode_staging(encoded, layout, levels, source_dtype) if encoded is not None else 0
    main_grad = accumulator = module_grads = staging = scatter_out = reduction = 0
    if requires_grad:
        usage = usage_layout(len(shapes), k)
        main_grad = layout.numel(k) * isz(dtypes.grads) + usage.numel(k) * 8
        if levels.into_accumulator:
            ways = levels.ways(levels.grad_level)
            accumulator = layout.numel(ways) * isz(dtypes.grads) + usage.numel(ways) * 8
        module_grads = sum(m.rows * m.row_numel for m in layout.members) * isz(dtypes.compute)
        staged = [m for m in layout.members if m.is_padded or dtypes.compute != dtypes.comm]
        staging = sum(m.padded_rows * m.row_numel for m in staged) * isz(dtypes.comm) + usage.numel(1) * 8
        out_level = levels.grad_level or levels.num_levels  # ZeRO-1 scatters on the last microbatch
        scatter_out = layout.numel(levels.ways(out_level)) * isz(dtypes.comm) if out_level else 0
        reduction = reduction_nbytes(layout, dtypes.comm)
    opt = sum(m.rows_of_shard(rank_shard) * m.row_numel for m in layout.members)
    key = (gather_layout.numel(1), gather_dtype) if gathered else None
    return GroupBytes(label, main, model, unsharded, main_grad, accumulator, module_grads, staging,
                      scatter_out, reduction, opt, isz(dtypes.main), key, requires_grad,
                      levels.grad_level > 0, dtypes.grads == dtypes.comm, dtypes.grads != dtypes.main,
                      encode_staging)


def _encode_staging(encoded, layout: FlatLayout, levels: Levels, source_dtype: torch.dtype) -> int:
    """Bytes of the largest encode pass of a group's gather: its tagged members' sources are this
    rank's regions at the level it gathers from (the runtime's ``FlatLayout.regions``, on meta),
    sized by the codec (``GatherCodec.staging_nbytes``)."""
    ways = levels.ways(levels.param_level)
    regions = layout.regions(torch.empty(layout.numel(ways), device="meta"), ways)
    return encoded.codec.staging_nbytes([regions[i].numel() for i in encoded.tagged], source_dtype)


class _UnitMarker(type):
    """``isinstance(m, marker)`` is True for the modules in ``marker.ids``: the runtime's ownership
    walk then stops at them as it stops at FSDP children."""

    def __instancecheck__(cls, obj) -> bool:
        return id(obj) in cls.ids


def describe_units(model: nn.Module, units: list, policy: MixedPrecisionPolicy, levels: Levels,
                   rank_shard: int = 0, unit_levels: Optional[dict] = None) -> list[UnitBytes]:
    """Units of ``model`` (``units``: the non-root modules ``fully_shard`` is applied to, bottom-up,
    as ``parallelize`` does), each with the bytes of its groups, in registration order (the root
    first); ``unit_levels``: the levels of the units sharded on another mesh (``id(unit)`` -> levels:
    the experts under expert parallelism, ``mfsdp.memory.experts``), ``levels`` for the others."""
    marker = _UnitMarker("Unit", (), {"ids": set()})
    names = {id(m): n for n, m in model.named_modules()}
    param_names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
    out, parent_of = {}, {}
    for unit in [*units, model]:
        owned, children, grouped = unit_groups(unit, marker, policy)
        marker.ids.add(id(unit))
        parent_of.update((id(child), names.get(id(unit))) for child in children)  # the runtime's FSDP parent rule
        groups = [group_bytes(f"{names.get(id(unit)) or 'root'}[{params[0].dtype}]",
                              [local_tensor(p).shape for p in params], dtypes,
                              (unit_levels or {}).get(id(unit), levels), params[0].requires_grad,
                              rank_shard, params=list(params)) for params, _, dtypes in grouped]
        out[id(unit)] = UnitBytes(names.get(id(unit), ""), tuple(groups), None,
                                  tuple(param_names.get(p, "?") for p in owned),
                                  tuple(local_tensor(p).numel() * p.element_size() if p.requires_grad else 0
                                        for p in owned), gathers_in_backward(unit, owned))
    # Forward order (registration pre-order, root first), each unit with its parent's name.
    return [dataclasses.replace(out[id(m)], parent=parent_of.get(id(m))) for m in model.modules() if id(m) in out]


def optimizer_state_bytes(units: list[UnitBytes], optimizer: str) -> int:
    """AdamW: two moments per element of the main shard; SGD (with momentum): one."""
    per = {"adamw": 2, "sgd": 1}
    if optimizer not in per:
        raise ValueError(f"optimizer {optimizer!r} is not modelled; use 'adamw' or 'sgd'")
    return per[optimizer] * sum(g.optimizer_numel * g.main_itemsize for u in units for g in u.groups
                                if g.requires_grad)
