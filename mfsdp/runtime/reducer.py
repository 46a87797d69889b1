"""The gradient half of a parameter group: a reduction plan compiled once, and the buffers it fills.

[Note: reduction plans]
Every placement is a sequence of levels (see ``geometry``). Its gradients travel one of three ways:

====================  ===========================================  ===========================
placement             every backward                               last microbatch only
====================  ===========================================  ===========================
ZeRO-3, ZeRO-2, HSDP  scatter to the optimizer shard (+ all-reduce  --
                      over HSDP's replicas) into the main gradient
HSDP, deferred        scatter into the main gradient               all-reduce it in place
HFSDP                 scatter within the node into an accumulator  scatter across nodes into
                                                                   the main gradient
ZeRO-1, DDP           nothing: autograd accumulates ``.grad``      scatter (ZeRO-1) or all-reduce
                                                                   (DDP) the raw gradients
====================  ===========================================  ===========================

``ReductionPlan.compile`` turns the geometry into those paths once; ``GradientReducer`` only runs
them. Each path knows how many ranks it averages over (its ``scale``), which the exact usage counts
and reduction tags need (see ``tag_check``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mfsdp import _compat
from mfsdp.mixed_precision import ResolvedDtypes
from mfsdp.runtime.flat_buffer import FlatBuffer, FlatLayout, pack_gradients
from mfsdp.runtime.geometry import ShardGeometry, exposed_dtensors

TAG_COLUMNS = 4  # the reduction tags a, a*a, b, b*b beside the usage counts (see ``tag_check``)


def usage_layout(num_params: int, num_shards: int) -> FlatLayout:
    """The int64 usage rows a group's reductions carry beside its gradients (see ``GradientReducer``)."""
    return FlatLayout([torch.Size((num_shards, num_params + TAG_COLUMNS))], num_shards)


def reduction_nbytes(layout: FlatLayout, comm_dtype: torch.dtype) -> int:
    """What one backward's reduction of a group holds, which the in-flight release rule counts
    (``in_flight``): the unsharded gradients in the reduction dtype and the usage rows."""
    return layout.numel(1) * comm_dtype.itemsize + usage_layout(len(layout.members), layout.num_shards).numel(1) * 8


class Source(enum.Enum):
    RAW = "raw"  # the autograd gradients of this backward (or of every microbatch, for ZeRO-1/DDP)
    ACCUMULATOR = "accumulator"  # HFSDP's per-microbatch reductions, within the node
    MAIN = "main"  # the main gradient itself, reduced in place


@dataclasses.dataclass(frozen=True)
class Stage:
    """One collective of a path: a reduce-scatter to a finer level, or an all-reduce in place."""

    kind: str  # "reduce_scatter" | "all_reduce"
    group: object  # the process group
    ways: int  # the level split after this stage (reduce-scatter), or unchanged (all-reduce)


@dataclasses.dataclass(frozen=True)
class ReductionPath:
    source: Source
    stages: tuple[Stage, ...]
    scale: int
    """How many ranks the path averages over."""
    divide: bool
    """Whether ``gradient_divide_factor`` applies (raw gradients not divided yet)."""

    @property
    def reduces_in_place(self) -> bool:
        """Whether the first collective overwrites the path's inputs (an all-reduce, as DDP's)."""
        return not self.stages or self.stages[0].kind == "all_reduce"


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
    every_backward: Optional[ReductionPath]
    """None where autograd accumulates the microbatches (ZeRO-1, DDP)."""
    into_accumulator: bool
    """Whether ``every_backward`` lands in the accumulator (HFSDP) rather than the main gradient."""
    last_microbatch: Optional[ReductionPath]

    @property
    def count_scale(self) -> int:
        """What each rank's usage count starts at: the product of every path's scale, so that the
        count stays an exact integer through *all* the averages it passes (a count of 1 averaged
        over 2 ranks, then over 2 more, would floor to 0 and drop a gradient one rank made)."""
        return math.prod(p.scale for p in (self.every_backward, self.last_microbatch) if p is not None)

    @classmethod
    def compile(cls, g: ShardGeometry) -> "ReductionPlan":
        def path(source, start, stop, all_reduce_groups, divide):
            # A reduce-scatter over one rank is the identity: its stage is left out, so the
            # gradients go straight into (or onto) their target, with no staging copy between.
            stages = [Stage("reduce_scatter", g.groups[j], g.ways(j + 1)) for j in range(start, stop)
                      if dist.get_world_size(g.groups[j]) > 1]
            stages += [Stage("all_reduce", pg, g.ways(stop)) for pg in all_reduce_groups]
            scale = math.prod(dist.get_world_size(s.group) for s in stages)
            return ReductionPath(source, tuple(stages), scale, divide)

        deferred = g.deferred_all_reduce_groups
        if g.grad_level == 0:  # ZeRO-1, DDP
            return cls(None, False, path(Source.RAW, 0, g.num_levels, deferred, True))
        every = path(Source.RAW, 0, g.grad_level, g.grad_all_reduce_groups, True)
        if g.into_accumulator:  # HFSDP
            return cls(every, True, path(Source.ACCUMULATOR, g.grad_level, g.num_levels, deferred, False))
        if deferred:  # HSDP with the replicate reduction deferred
            return cls(every, False, path(Source.MAIN, g.num_levels, g.num_levels, deferred, False))
        return cls(every, False, None)


class GradientReducer:
    """Reduces one parameter group's gradients and exposes them as DTensor ``.grad`` shards."""

    def __init__(self, params, sharded_params, specs, layout: FlatLayout, geometry: ShardGeometry,
                 dtypes: ResolvedDtypes, divide_factor: float, collective: Callable, device: torch.device) -> None:
        # ``collective``: the group's CollectiveIssuer (kind, outputs, inputs, process group).
        self.params, self.sharded_params, self._specs = params, sharded_params, specs
        self.layout, self.geometry, self.dtypes = layout, geometry, dtypes
        self._divide_factor, self._collective, self._device = divide_factor, collective, device
        self.plan = ReductionPlan.compile(geometry)
        # Beside the gradients, each reduction carries K rows of per-parameter usage counts and the
        # reduction tag, as int64 scaled so that every average stays an exact integer (see
        # ``tag_check``). Reduced with the gradients, the counts tell every rank whether *any* rank
        # produced a gradient, so a parameter unused everywhere keeps .grad None, as in plain PyTorch.
        self.usage_layout = usage_layout(len(params), geometry.num_shards)
        self.set_tags(1, 1)
        self.reduction_nbytes = reduction_nbytes(layout, dtypes.comm)
        self.main_grad: Optional[FlatBuffer] = None
        self._usage_main: Optional[torch.Tensor] = None
        self._accum: Optional[FlatBuffer] = None
        self._usage_accum: Optional[torch.Tensor] = None
        self._accum_empty = True
        self._missing_seen = False  # a parameter lacked a gradient since the last main-grad write
        self._grad_dtensors: list = []  # the exposed .grad DTensors, made with the main gradient
        self.needs_usage_check = False

    # ------------------------------------------------------------------------------ tags, usage
    def set_tags(self, position_tag: int, name_tag: int) -> None:
        """The tags this group's reductions carry: the owning module's place in the backward walk
        and a hash of its name, each in 1..61 (see ``tag_check``)."""
        self._tag_values = torch.tensor([position_tag, position_tag ** 2, name_tag, name_tag ** 2],
                                        dtype=torch.int64, device=self._device)
        self._usage_inputs: dict[int, torch.Tensor] = {}
        # What each path's reduced tag columns must read, made once, not per reduction.
        paths = [p for p in (self.plan.every_backward, self.plan.last_microbatch) if p is not None]
        self._expected_tags = {p.scale: self._tag_values * p.scale for p in paths}

    def _usage_input(self, scale: int, missing: list[int], in_place: bool) -> torch.Tensor:
        """Level-0 usage rows: the plan's count scale per parameter that has a gradient, then the
        tags scaled for the first path (``scale``; later paths get theirs set in between)."""
        cached = self._usage_inputs.get(scale) if not missing else None
        if cached is not None:  # a copy where the path reduces its inputs in place (DDP)
            return cached.clone() if in_place else cached
        n, rows = len(self.params), self.geometry.num_shards
        usage = torch.full((rows, n + TAG_COLUMNS), self.plan.count_scale, dtype=torch.int64)
        usage[:, missing] = 0
        usage[:, n:] = self._tag_values.cpu() * scale
        usage = usage.view(-1).to(self._device)
        if not missing:
            self._usage_inputs[scale] = usage.clone()
        return usage

    def _tag_columns(self, usage: torch.Tensor) -> torch.Tensor:
        return usage.view(-1, len(self.params) + TAG_COLUMNS)[:, len(self.params):]

    # ------------------------------------------------------------------------------ main gradient
    def release_unused_memory(self) -> None:
        """Free the main-gradient storage when every ``.grad`` was set to None (``zero_grad()``).

        Gradients are dead between the optimizer step and the next backward; FSDP2 frees them too.
        With ``zero_grad(set_to_none=False)`` the buffer stays, persistent and zeroed in place.
        """
        main_grad = self.main_grad
        if main_grad is not None and main_grad.is_allocated and all(p.grad is None for p in self.sharded_params):
            main_grad.release()

    def _main_grad_regions(self) -> list[torch.Tensor]:
        """The optimizer-level gradient regions, then the usage row."""
        g = self.geometry
        if self.main_grad is None:  # zeros, like the usage row
            self.main_grad = FlatBuffer(self.layout.numel(g.num_shards), self.dtypes.grads, self._device)
            self._usage_main = torch.zeros(self.usage_layout.numel(g.num_shards), dtype=torch.int64,
                                           device=self._device)
            regions = self.layout.regions(self.main_grad.tensor, g.num_shards)
            self._main_grad_views = regions + [self._usage_main]
            self._grad_dtensors = exposed_dtensors(self.params, self.layout.shards(regions, g.shard_index), self._specs)
        self.main_grad.allocate()  # after a release every .grad is None, so the next write overwrites it all
        return self._main_grad_views

    def _claim_main_grad(self) -> tuple[list[torch.Tensor], bool]:
        """Regions to reduce into, and whether they may be overwritten (no gradient to keep).

        A parameter whose exposed ``.grad`` is None starts from zero, as autograd would; one whose
        ``.grad`` is ours accumulates; one whose ``.grad`` the user replaced is copied back first.
        """
        regions = self._main_grad_regions()
        grads = [p.grad for p in self.sharded_params]
        if all(gr is None for gr in grads):
            return regions, True
        with torch.no_grad():
            for i, (gr, mine) in enumerate(zip(grads, self._grad_dtensors)):
                if gr is None:
                    regions[i].zero_()
                    regions[-1][i : i + 1].zero_()  # its usage count
                elif gr is not mine:
                    mine.to_local().copy_(gr.to_local() if isinstance(gr, DTensor) else gr)
        return regions, False

    def _accumulator_regions(self) -> tuple[list[torch.Tensor], bool]:
        ways = self.geometry.ways(self.geometry.grad_level)
        if self._accum is None:
            self._accum = FlatBuffer(self.layout.numel(ways), self.dtypes.grads, self._device)
            self._usage_accum = torch.zeros(self.usage_layout.numel(ways), dtype=torch.int64, device=self._device)
        overwrite, self._accum_empty = self._accum_empty, False
        return self._regions_at(ways, self._accum.tensor, self._usage_accum), overwrite

    def _regions_at(self, ways: int, grads: torch.Tensor, usage: torch.Tensor) -> list[torch.Tensor]:
        return self.layout.regions(grads, ways) + self.usage_layout.regions(usage, ways)

    # ---------------------------------------------------------------------------------- reduce
    def reduce(self, grads: list, is_last: bool, record_tag: Callable) -> list:
        """Run this backward's part of the plan on the current stream; returns the tensors that must
        stay alive until it has finished. ``grads``: the autograd gradients (None where missing)."""
        plan = self.plan
        first = plan.every_backward or plan.last_microbatch
        keep, inputs = pack_gradients(grads, self.layout.members, self.dtypes.comm, self._device)
        missing = [i for i, gr in enumerate(grads) if gr is None]
        self._missing_seen = self._missing_seen or bool(missing)  # rare: a parameter had no gradient
        inputs.append(self._usage_input(first.scale, missing, first.reduces_in_place))
        keep.append(inputs)
        target = self._accumulator_regions() if plan.into_accumulator else self._claim_main_grad()
        self._run(inputs, first, *target, record_tag)
        if not plan.into_accumulator:
            self._expose()
        if is_last and first is plan.every_backward and plan.last_microbatch is not None:
            self._finish_last_microbatch(plan.last_microbatch, record_tag)
        return keep

    def _finish_last_microbatch(self, path: ReductionPath, record_tag: Callable) -> None:
        g = self.geometry
        if path.source is Source.ACCUMULATOR:
            inputs = self._regions_at(g.ways(g.grad_level), self._in_comm_dtype(self._accum.tensor), self._usage_accum)
            self._accum_empty = True
            self._run(inputs, path, *self._claim_main_grad(), record_tag)
        else:  # Source.MAIN: all-reduce the main gradient in place (its own target: nothing to copy)
            self._main_grad_regions()
            flat = self._in_comm_dtype(self.main_grad.tensor)
            regions = self._regions_at(g.num_shards, flat, self._usage_main)
            self._run(regions, path, regions, True, record_tag)
            if flat is not self.main_grad.tensor:
                self.main_grad.tensor.copy_(flat)
        self._expose()

    def _run(self, inputs, path: ReductionPath, target: list, overwrite: bool, record_tag: Callable) -> None:
        """``target (+)= path(inputs)``. The last reduce-scatter writes straight into ``target`` when
        nothing there must be kept and the dtypes agree; where a later path reads ``target``, its tag
        columns are then set, not summed, to what that path must contribute."""
        direct = overwrite and target[0].dtype == self.dtypes.comm
        regions = inputs  # the last reduce-scatter may write straight into the target
        last_scatter = max((i for i, s in enumerate(path.stages) if s.kind == "reduce_scatter"), default=-1)
        for i, stage in enumerate(path.stages):
            if stage.kind == "all_reduce":
                self._collective("all_reduce", regions, None, stage.group)
                continue
            outs = target if i == last_scatter and direct else self._regions_at(
                stage.ways, torch.empty(self.layout.numel(stage.ways), dtype=regions[0].dtype, device=self._device),
                torch.empty(self.usage_layout.numel(stage.ways), dtype=torch.int64, device=self._device))
            self._collective("reduce_scatter", outs, regions, stage.group)
            regions = outs
        if path.divide and self._divide_factor != 1.0:
            _compat.foreach_div_(regions[:-1], self._divide_factor)  # not the usage counts
        record_tag(self._tag_columns(regions[-1]), self._expected_tags[path.scale])
        if regions is not target:
            (_compat.foreach_copy_ if overwrite else _compat.foreach_add_)(target, regions)
        following = self.plan.last_microbatch
        if path is self.plan.every_backward and following is not None:  # only a later path reads them
            self._tag_columns(target[-1]).copy_(self._expected_tags[following.scale])

    def _in_comm_dtype(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself, or one cast of it to the reduction dtype (one kernel, not one per member)."""
        return flat if flat.dtype == self.dtypes.comm else flat.to(self.dtypes.comm)

    # ---------------------------------------------------------------------------------- expose
    def _expose(self) -> None:
        """Point each sharded parameter's ``.grad`` at its main-gradient shard.

        Values land asynchronously on the reduce-scatter stream; the final backward callback makes
        the compute stream wait before anyone reads them.
        """
        for p, grad in zip(self.sharded_params, self._grad_dtensors):
            if p.grad is not grad:  # the setter validates; skip it once ours is in place
                p.grad = grad
        if self._missing_seen:
            self._missing_seen = False
            self.needs_usage_check = True

    def exposed_gradients(self) -> list:
        """The ``.grad`` DTensors this reducer exposes (views of the main gradient), in member order;
        empty before the first reduction."""
        return self._grad_dtensors

    def nonfinite_flag(self) -> Optional[torch.Tensor]:
        """A 0-d tensor, nonzero when the reduced gradients hold a NaN or Inf (one fused check)."""
        if self.main_grad is None or not self.main_grad.is_allocated:
            return None
        return ~torch.isfinite(self.main_grad.tensor).all()

    def finalize(self) -> None:
        """After the reductions have finished: unused-everywhere parameters keep ``.grad`` None."""
        if not self.needs_usage_check:
            return
        self.needs_usage_check = False
        used = self._usage_main[: len(self.params)].tolist()  # a host sync, on this rare path only
        for p, grad, count in zip(self.sharded_params, self._grad_dtensors, used):
            p.grad = grad if count > 0 else None
