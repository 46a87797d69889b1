"""Tensor parallel for the planner: the manager's own plan, applied over a fake process group.

The manager (``mfsdp.manager``) applies its tensor-parallel plan (``select_tp_plan`` /
``apply_tp_plan``) over ``mesh["tp"]`` and then ``fully_shard`` flattens each parameter's *local*
shard (``runtime.parameter_group.local_tensor``) over the data-parallel axes. The planner does the
same, on a meta (model state) or fake-tensor (activations) model, over a mesh of ``size`` ranks of
torch's ``"fake"`` process-group backend: every collective is a no-op, this process plays tp rank
0 (the rank that holds the largest uneven ``torch.chunk`` shards), and the DTensors get exactly the
local shapes the runtime sees. No formula of local shapes is written here.

A fake process group is the process's default group, so it cannot be created where one already
exists, and it leaves state behind: a real group created later in the same process (torch 2.13,
gloo) then had a manager at dp=1 x tp=2 refuse its shards (``check_exposed``: the exposed DTensor
read another rank's block), presumably a DTensor cache keyed by a mesh that compares equal across
the two groups. So ``estimate`` runs a tensor-parallel estimate in a spawned child process
(``in_child``, a few seconds of imports) unless told the process will never hold a real group
(``tp_in_process``: ``mfsdp plan``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Optional

from torch import nn


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The manager's tensor-parallel settings (``MegatronFSDPConfig`` fields of the same names)."""

    size: int = 1
    """Ranks of the ``tp`` mesh dim (the manager's ``tp_size``); 1 is no tensor parallel."""
    sequence_parallel: bool = True
    """Activations between sub-layers are ``Shard(1)`` over tp (seq / tp tokens per rank)."""
    loss_parallel: bool = True
    """Logits stay vocabulary-sharded and the loss runs in ``loss_parallel()``."""
    plan: Optional[Mapping[str, Any]] = None
    """``MegatronFSDPConfig.tp_plan`` (module pattern -> ParallelStyle), None for the built-in plan."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be positive, got {self.size}")

    @classmethod
    def of(cls, value) -> "TensorParallel":
        """An int is a size with the defaults (sequence parallel and the parallel loss, as
        ``benchmarks/hf_manager.py`` runs the manager); a ``TensorParallel`` is kept."""
        if isinstance(value, TensorParallel):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"tensor_parallel must be an int or a TensorParallel, got {value!r}")
        return cls(value) if value > 1 else cls(1, False, False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        extras = [name for name, on in (("sequence parallel", self.sequence_parallel),
                                        ("parallel loss", self.loss_parallel)) if on]
        return f"tp={self.size}" + (f" ({', '.join(extras)})" if extras else "")


def default_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def fake_tp_mesh(size: int) -> Iterator:
    """A 1-D ``("tp",)`` mesh of ``size`` ranks on the fake backend, this process as rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if default_group_exists():
        raise RuntimeError("fake_tp_mesh needs a process without a default process group")
    dist.init_process_group("fake", rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def apply_tp(model: nn.Module, tp: TensorParallel, mesh) -> nn.Module:
    """What ``MegatronFSDPManager.parallelize`` does first: check the sizes, pick the plan, apply
    it over ``mesh`` (its own functions, in its order)."""
    from mfsdp.manager.tp_plans import apply_tp_plan, select_tp_plan, validate_tp

    validate_tp(model, tp.size)
    plan = select_tp_plan(model, tp.plan, sequence_parallel=tp.sequence_parallel, loss_parallel=tp.loss_parallel)
    return apply_tp_plan(model, mesh, plan)


def in_child(fn, kwargs: dict):
    """``fn(**kwargs)`` in a spawned process (for a process that already has a default group)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, (), kwargs)
