"""The one place that touches private or version-dependent torch APIs.

mfsdp supports torch 2.11 (the H200 machines) and 2.13 (CI). Everything that differs between them,
or that torch keeps private, is named here once so the rest of the package imports only public
torch.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

# Per-tensor collectives issued inside this context run as one coalesced launch (one NCCL group on
# GPU, one batch on gloo). torch exposes it only under a private name.
coalescing_manager = _c10d._coalescing_manager

# Fused multi-tensor kernels: one launch for a whole list of tensors.
foreach_copy_ = torch._foreach_copy_
foreach_add_ = torch._foreach_add_
foreach_div_ = torch._foreach_div_
foreach_zero_ = torch._foreach_zero_


COMPILER_MODULE = "torch._dynamo"
"""The module torch.compile (and DTensor's dispatch) imports on first use, about 0.8 s of CPU: named
here for a process pool that imports modules by name in advance (the test worlds' forkserver)."""


def queue_autograd_callback(callback) -> None:
    """Run ``callback`` once the current backward pass has finished."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_is_running() -> bool:
    """True inside an autograd backward pass (for example a reentrant checkpoint recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def supports_grad_dtype() -> bool:
    """Whether a parameter may hold a ``.grad`` of another dtype (``Tensor.grad_dtype``)."""
    return hasattr(torch.Tensor, "grad_dtype")


def set_grad_dtype(param: torch.Tensor, dtype) -> None:
    """Let ``param`` hold a ``.grad`` of ``dtype`` (None: any dtype). No grad may be attached."""
    param.grad_dtype = None if dtype is None or dtype == param.dtype else dtype


def set_dtensor_local(param: torch.Tensor, local: torch.Tensor) -> None:
    """Re-point a DTensor parameter's local tensor at ``local`` (same shape and dtype), keeping the
    Parameter object, its hooks and its spec. ``.data =`` on a DTensor does not reach the local
    tensor, so this sets the local tensor's data directly."""
    param._local_tensor.data = local


def nccl_mem_allocator(backend):
    """``(allocator, None)`` of a ProcessGroupNCCL backend, or ``(None, why)`` where its NCCL has none:
    a build without ncclMemAlloc raises RuntimeError from the ``mem_allocator`` property itself
    ("NCCL mem allocator is not supported in this NCCL version"), so ``hasattr`` cannot ask."""
    try:
        return backend.mem_allocator, None
    except RuntimeError as err:
        return None, str(err).splitlines()[0]
    except AttributeError:
        return None, f"this torch's ProcessGroupNCCL has no mem_allocator (torch {torch.__version__})"


def nccl_registered_buffers(specs, process_groups, register_with):
    """1-D tensors ``[(numel, dtype, device), ...]`` from NCCL's allocator, registered with every
    group in ``process_groups`` (NCCL user buffers; symmetric windows where this torch offers them).

    ``register_with(group_sizes, allocator_problem)`` decides (``gather_slots.registration``): it
    returns False for plain persistent tensors instead. Returns (tensors, pool); keep the pool alive
    as long as the tensors. Raises a clear error where the device, backend or torch build lacks
    what this needs.
    """
    devices = {device for _, _, device in specs}
    if any(d.type != "cuda" for d in devices):
        raise RuntimeError(f"use_symm_mem / nccl_ub needs CUDA devices, got {sorted(map(str, devices))}")
    missing = [name for name in ("MemPool", "use_mem_pool") if not hasattr(torch.cuda, name)]
    if missing:
        raise RuntimeError(f"use_symm_mem / nccl_ub needs torch.cuda.{missing[0]} (torch >= 2.8); this torch "
                           f"is {torch.__version__}. Use use_symm_mem=False")
    device = next(iter(devices))
    backends = []
    for pg in process_groups:
        if dist.get_backend(pg) != "nccl":
            raise RuntimeError(f"use_symm_mem / nccl_ub needs NCCL process groups, got {dist.get_backend(pg)!r}")
        backend = pg._get_backend(device)
        if not hasattr(backend, "register_mem_pool"):  # (mem_allocator: see nccl_mem_allocator)
            raise RuntimeError(f"use_symm_mem / nccl_ub: this torch's ProcessGroupNCCL lacks register_mem_pool "
                               f"(torch {torch.__version__}); use use_symm_mem=False")
        backends.append(backend)
    allocator, problem = nccl_mem_allocator(backends[0]) if backends else (None, None)
    if not register_with([pg.size() for pg in process_groups], problem):
        return [torch.empty(n, dtype=dt, device=d) for n, dt, d in specs], None
    pool = torch.cuda.MemPool(allocator)
    with torch.cuda.use_mem_pool(pool):
        tensors = [torch.empty(n, dtype=dt, device=d) for n, dt, d in specs]
    for backend in backends:
        try:
            backend.register_mem_pool(pool, symm=True)  # NCCL symmetric windows (torch >= 2.9)
        except (TypeError, RuntimeError):  # no symm argument, or no window support in this NCCL
            backend.register_mem_pool(pool)
    return tensors, pool


def strided_shard(dim: int, split_factor: int):
    """A placement sharding ``dim`` on this axis *after* another axis sharded it."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is torch's ``_StridedShard`` (not a ``Shard`` subclass in every version)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def supports_ordered_groups() -> bool:
    """Whether ``new_group`` can keep a caller-given rank order (``sort_ranks=False``; newer torch)."""
    import inspect

    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def new_ordered_group(ranks):
    """A process group whose group rank ``i`` is global rank ``ranks[i]``. Like ``new_group``, every
    rank of the world calls it, with the same list, in the same order."""
    return dist.new_group(ranks=list(ranks), sort_ranks=False)


def local_shape_and_offset(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset of a DTensor of ``shape``, as torch reads the spec."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(int(x) for x in local), tuple(int(x) for x in offset)


def flatten_mesh(mesh, name=None):
    """``mesh`` viewed as 1-D, ranks in row-major order (cached by torch; ``name`` names the dim,
    which then can be sliced from the root mesh, e.g. ``root["dp_shard_cp", "tp"]``)."""
    return mesh._flatten(name) if name else mesh._flatten()


# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group) -> None:
    _all_gather(output, input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op, group) -> None:
    _reduce_scatter(output, input, op=op, group=group)


def _grouped_mm_function():
    # Public as torch.nn.functional.grouped_mm in 2.13; torch._grouped_mm in 2.9 to 2.12.
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def has_grouped_mm() -> bool:
    """Whether this torch has the grouped GEMM (``grouped_mm``; a CPU kernel from torch 2.9)."""
    return _grouped_mm_function() is not None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` [N, K] by ``b`` [G, K, M] -> [N, M]: rows ``offs[g-1]:offs[g]`` of ``a`` (int32 end
    offsets) times ``b[g]``, with autograd. Only where ``has_grouped_mm()``."""
    return _grouped_mm_function()(a, b, offs=offs)


def tree_flatten(tree):
    """Flatten nested containers of tensors (tuples, lists, dicts, registered outputs)."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves, spec):
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def gpu_spin(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` clock cycles (tests delay a stream with
    it, so that a missing wait shows up as wrong numbers)."""
    torch.cuda._sleep(cycles)


def fake_tensor_mode():
    """A ``FakeTensorMode``: tensors carry shape, dtype and device but no data (``mfsdp.memory``
    runs a block's forward and backward under it to measure activations). Private in torch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base of a mode that sees every op's outputs (private in torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def launch_config(config_cls, **kwargs):
    """torch's elastic ``LaunchConfig(**kwargs)``, leaving out the fields this torch lacks: 2.11 has
    no ``shutdown_timeout`` (the agent's own default then applies to a SIGTERM'd run)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(config_cls)}
    return config_cls(**{k: v for k, v in kwargs.items() if k in known})


def optimizer_step_body(optimizer):
    """The function ``type(optimizer).step`` runs between its hooks (called as ``body(optimizer,
    ...)``), or None where it cannot be found.

    torch wraps each Optimizer subclass's ``step`` once (``profile_hook_step``, marked ``hooked``,
    through ``functools.wraps``) in a function that runs the pre hooks, the body, the post hooks."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None


def is_last_step_pre_hook(optimizer, handle) -> bool:
    """Whether ``handle``'s step pre hook runs last (torch keeps an instance's hooks in insertion
    order, after the global ones)."""
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    return hooks is not None and next(reversed(hooks), None) == handle.id


def foreach_amax(tensors):
    """max(|t|) of every (non-empty) tensor in one fused launch, as 0-d tensors (private in torch)."""
    import math

    return torch._foreach_norm(list(tensors), ord=math.inf)


def dtensor_with_local(dtensor, local: torch.Tensor):
    """A DTensor of ``dtensor``'s global shape, mesh and placements whose shard on this rank is
    ``local`` as it is, wherever it lives: a copy in host memory, for DCP to write, stays there
    (``DTensor.from_local`` would move it back to the mesh's device). Private constructor."""
    return type(dtensor)(local, dtensor._spec, requires_grad=False)


def already_staged_stager():
    """An ``AsyncStager`` for ``dcp.async_save(..., async_stager=...)`` that hands the state dict on
    as it is: the caller staged it already (and checked, with the other ranks, that staging worked)."""
    import inspect

    from torch.distributed.checkpoint import async_save, staging

    if "async_stager" not in inspect.signature(async_save).parameters:
        raise RuntimeError(f"asynchronous checkpoints need dcp.async_save(async_stager=...) "
                           f"(torch >= 2.7), this torch is {torch.__version__}; use "
                           "--train.async_checkpoint false")

    class AlreadyStaged(staging.AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return AlreadyStaged()


def pin_host_memory(tensor: torch.Tensor) -> None:
    """Page-lock a CPU tensor's memory where it is (``cudaHostRegister``): exactly its bytes,
    where torch's pinned allocator (``pin_memory=True``) may round a request up to a power of two."""
    nbytes = tensor.numel() * tensor.element_size()
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 1))  # portable
    if error:
        raise RuntimeError(f"pinning {nbytes / 2**30:.1f} GiB of host memory failed (cudaError "
                           f"{error}); free host memory, or use --train.async_checkpoint false")


def unpin_host_memory(tensor: torch.Tensor) -> None:
    """Undo ``pin_host_memory``."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
