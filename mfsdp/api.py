"""``fully_shard``: attach FSDP to a module in place."""

from __future__ import annotations

from typing import Optional, TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mfsdp.communication import CommunicationPolicy
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.placement import Placements, default_placements
from mfsdp.runtime.module import FsdpModule
from mfsdp.runtime.registry import OWNER_OF_PARAMETER

M = TypeVar("M", bound=nn.Module)
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(
    module: M,
    mesh: DeviceMesh,
    placements: Optional[Placements] = None,
    mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
    use_symm_mem: bool = False,
    *,
    communication_policy: Optional[CommunicationPolicy] = None,
) -> M:
    """Shard ``module``'s parameters over ``mesh`` in place and return the same object.

    The instance's class becomes a subclass mixing :class:`FsdpModule` into the original class, so
    parents keep their references and ``isinstance`` checks still hold. The module takes ownership
    of every parameter beneath it that no FSDP descendant already owns; apply it bottom-up (blocks
    first, the root last). Afterwards ``named_parameters()`` yields the same names, each the main
    weights as a DTensor with the optimizer placements.

    Args:
        module: the module to shard; its parameters are on the mesh's device type, or on the meta
            device: then each rank allocates only its shards (zeros), to be filled in place by the
            model's own init (``model.to_empty(device=...)`` keeps the shards and materialises
            the buffers, then ``init_weights()`` writes through the DTensor parameters) or by
            ``set_model_state_dict``.
        mesh: device mesh whose data-parallel axes ``placements.dp_axes`` name.
        placements: per-axis placements; None shards fully (``Shard(0)``) over every mesh axis.
        mixed_precision_policy: dtypes of main weights, gradients and reductions; None is the
            default policy (fp32 main weights, gradients in the compute dtype).
        use_symm_mem: allocate the persistent gather buffers (``double_buffer``) from NCCL's
            allocator and register them with the gather process groups (symmetric windows where
            torch and NCCL offer them), so NCCL reads and writes them in place. CUDA only; the
            root's setting applies to the tree.
        communication_policy: prefetch depth, overlap, stream sharing, coalescing, gradient
            divide factor and the NaN check; None is the default policy.
    """
    _check_arguments(module, mesh, use_symm_mem, communication_policy)
    placements = placements if placements is not None else default_placements(mesh)
    _check_placements(module, mesh, placements)
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision_policy must be an mfsdp.MixedPrecisionPolicy, got {type(policy).__name__}")
    built_on_meta = _check_devices(module, mesh)
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FsdpModule, cls), {"__module__": cls.__module__})
    module.__class__ = _FSDP_CLASSES[cls]
    try:
        FsdpModule.__init__(module, mesh, placements, policy, use_symm_mem, communication_policy)
    except BaseException:
        module.__class__ = cls
        raise
    if built_on_meta:
        # The shards start as zeros and are filled in place next (an init_weights writing through
        # the DTensors, or a state-dict load): derive the compute weights from them at the first
        # unshard, not from the zeros they hold now.
        for group in module.parameter_groups:
            group.weights_written()
    return module


def _check_arguments(module, mesh, use_symm_mem: bool, communication_policy) -> None:
    """The types, a second ``fully_shard`` of one module, and what ``use_symm_mem`` needs."""
    if isinstance(module, FsdpModule):
        raise ValueError(
            f"fully_shard was already applied to this "
            f"{next(c for c in type(module).__mro__ if not issubclass(c, FsdpModule)).__name__}; apply it once "
            "per module")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects a DeviceMesh, got {type(mesh).__name__}")
    if use_symm_mem:
        if mesh.device_type != "cuda":
            raise ValueError(f"use_symm_mem=True registers gather buffers with NCCL, which needs a CUDA mesh; "
                             f"this mesh is on {mesh.device_type!r}. Use use_symm_mem=False")
        if communication_policy is None or not communication_policy.double_buffer:
            raise ValueError("use_symm_mem=True registers the persistent gather buffers with NCCL; pass "
                             "communication_policy=CommunicationPolicy(double_buffer=True) as well")


def _check_placements(module: nn.Module, mesh: DeviceMesh, placements) -> None:
    """Mesh axes outside the data-parallel ones are allowed where the parameters are already
    DTensors over them (tensor parallelism), or where FSDP descendants sharded such parameters on
    this same mesh."""
    if not isinstance(placements, Placements):
        raise TypeError(f"placements must be an mfsdp.Placements, got {type(placements).__name__}")
    dp_dims = placements.resolve_axes(mesh)
    names = mesh.mesh_dim_names or [str(d) for d in range(mesh.ndim)]
    extra = [names[d] for d in range(mesh.ndim) if d not in dp_dims]
    dtensor_axes = {tuple(p.device_mesh.mesh_dim_names or ()) for p in module.parameters() if isinstance(p, DTensor)}
    owned_axes = {tuple(p.device_mesh.mesh_dim_names or ()) for p in module.parameters()
                  if isinstance(p, DTensor) and not OWNER_OF_PARAMETER.get(p)}
    if extra and any(axes != tuple(extra) for axes in owned_axes):
        raise ValueError(
            f"the parameters are DTensors over mesh axes {sorted(owned_axes)} but the mesh's axes outside "
            f"the data-parallel ones are {extra}; they must be the same")
    if extra and not any(set(extra) <= set(axes) for axes in dtensor_axes):
        raise ValueError(
            f"mesh axes {extra} are not data-parallel axes of these placements; pass the data-parallel "
            f"sub-mesh (e.g. mesh[{tuple(placements.dp_axes)!r}]) or add the axes to Placements.dp_axes")


def _check_devices(module: nn.Module, mesh: DeviceMesh) -> bool:
    """Refuse a parameter off the mesh's device type; whether any is on the meta device."""
    built_on_meta = False
    for name, param in module.named_parameters():
        built_on_meta = built_on_meta or param.is_meta
        if param.device.type not in (mesh.device_type, "meta"):
            raise ValueError(
                f"parameter {name!r} is on {param.device} but the mesh is on {mesh.device_type}; move "
                "the module to the mesh's device first")
    return built_on_meta
