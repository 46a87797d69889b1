"""One parameter group: the parameters of one module sharing (dtype, requires_grad).

A group keeps up to five flat buffers (see ``flat_buffer`` for their layout):

=================  =================  ===========================================================
buffer             level              role
=================  =================  ===========================================================
``main``           optimizer shard    main weights in ``main`` dtype; the exposed DTensors
``model``          parameter shard    compute weights at rest; aliases ``main`` when equal
``unsharded``      whole              gathered for compute; released at rest (ZeRO-3, HSDP)
``accum``          gradient shard     HFSDP only: per-microbatch reductions until the last one
``main_grad``      optimizer shard    reduced gradients in ``grads`` dtype; the exposed ``.grad``
=================  =================  ===========================================================

The group only moves bytes; *when* it does so (streams, events, prefetch) is the module's and the
context's business, so every method takes the stream it runs on.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import _compat
from mfsdp.communication import CommunicationPolicy
from mfsdp.mixed_precision import ResolvedDtypes
from mfsdp.runtime import collectives
from mfsdp.runtime.collectives import stream_context
from mfsdp.runtime.flat_buffer import FlatBuffer, FlatLayout, pack_gradients
from mfsdp.runtime.geometry import ShardGeometry, contiguous_stride, fill_region


class GroupState(enum.Enum):
    SHARDED = "sharded"  # compute weights at rest (whole only where the placement replicates them)
    UNSHARDED = "unsharded"  # gathered; module attributes point at the unsharded parameters


class FsdpParameterGroup:
    """Parameters of one FsdpModule with one (dtype, requires_grad), sharded as one unit."""

    def __init__(
        self,
        params: list[nn.Parameter],
        aliases: list[list[tuple[nn.Module, str]]],
        geometry: ShardGeometry,
        dtypes: ResolvedDtypes,
        label: str,
        policy: CommunicationPolicy = CommunicationPolicy(),
    ) -> None:
        self.params = params  # the Parameters used for compute, views of the unsharded buffer
        self.aliases = aliases  # every (module, attribute) that holds each parameter
        self.geometry = geometry
        self.dtypes = dtypes
        self.label = label
        self.policy = policy
        self.requires_grad = params[0].requires_grad
        self.state = GroupState.SHARDED
        self.needs_refresh = False  # main weights changed since the compute weights were derived
        device = params[0].device
        if device.type == "meta":  # built without storage: shards are allocated here, then initialised
            device = geometry.device
        g = geometry
        # Tensor-parallel parameters: FSDP works on their local shards, the DTensor keeps its axes.
        locals_ = [local_tensor(p) for p in params]
        specs = [g.parameter_spec(p) for p in params]
        self.layout = FlatLayout([t.shape for t in locals_], g.num_shards)
        for p, m, (_, _, even) in zip(params, self.layout.members, specs):
            if g.requires_even_rows or even:
                if m.is_padded:
                    why = "tensor parallelism already splits its dim 0" if even else geometry.placements.name
                    raise NotImplementedError(
                        f"a parameter of shape {tuple(p.shape)} in {label}: {why}, so its local dim 0 "
                        f"({m.rows}) must divide by the {g.num_shards} data-parallel shards (torch's "
                        "strided shard is even-only). Pad that dimension, or use HSDP or 1-D ZeRO "
                        "without tensor parallelism on it."
                    )

        # Compute weights at rest. Three cases, cheapest memory first:
        # * main dtype == compute dtype at the same level: the main weights *are* the compute weights;
        # * sharded like the main weights but in another dtype (ZeRO-3 / HSDP with fp32 masters): no
        #   persistent copy; each unshard casts the main shard into its block of the gather output
        #   (one kernel of 1/N of the bytes), which saves 2 bytes per parameter per rank at rest;
        # * replicated (ZeRO-1/2, DDP) or sharded over fewer axes (HFSDP): a persistent copy, refreshed
        #   once per optimizer step, so the per-step gathers stay off the slow axes.
        level_ways = g.ways(g.param_level)
        self.main_aliases_model = dtypes.main == dtypes.compute and g.num_levels == g.param_level
        self.model_on_the_fly = not self.main_aliases_model and g.num_levels == g.param_level > 0
        self.main = FlatBuffer(self.layout.numel(g.num_shards), dtypes.main, device)
        self.model: Optional[FlatBuffer] = (
            self.main if self.main_aliases_model
            else None if self.model_on_the_fly
            else FlatBuffer(self.layout.numel(level_ways), dtypes.compute, device)
        )
        self.unsharded = (
            self.model if g.param_level == 0 else FlatBuffer(self.layout.numel(1), dtypes.compute, device)
        )
        self._model_regions = self.layout.regions(self.model.tensor, level_ways) if self.model else None
        self._unsharded_regions = self.layout.regions(self.unsharded.tensor, 1)
        self._main_regions = self.layout.regions(self.main.tensor, g.num_shards)
        with torch.no_grad():
            for i, (t, m) in enumerate(zip(locals_, self.layout.members)):
                if t.is_meta:
                    continue  # zeros until the caller initialises or loads the shards
                fill_region(self._main_regions[i], t.detach(), m, g.num_shards, g.shard_index)
                if self.model is not None and self.model is not self.main:
                    fill_region(self._model_regions[i], t.detach(), m, level_ways, g.index(g.param_level))
        for i, (p, view) in enumerate(zip(params, self.layout.unpadded(self._unsharded_regions))):
            if isinstance(p, DTensor):  # a new Parameter: a DTensor over the unsharded view
                self.params[i] = nn.Parameter(
                    DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()),
                    requires_grad=p.requires_grad)
            elif p.is_meta:  # no storage to re-point: a new Parameter, then re-pointed like the rest
                # (assigning .data keeps the Parameter's own version counter, so gathers into the
                # buffer do not look like in-place edits of tensors autograd saved)
                self.params[i] = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                              requires_grad=p.requires_grad)
                self.params[i].data = view
            else:
                p.data = view  # the original Parameter now lives in the unsharded buffer
        self._slot = None  # a persistent gather slot (double buffering), bound by the context
        if self.unsharded is not self.model:
            self.unsharded.release()  # views stay valid: the storage object is kept

        self._specs = [(mesh, placements) for mesh, placements, _ in specs]
        self.sharded_params = [
            nn.Parameter(
                DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                                   stride=contiguous_stride(p.shape)),
                requires_grad=p.requires_grad,
            )
            for p, local, (mesh, placements) in zip(
                params, self.layout.shards(self._main_regions, g.shard_index), self._specs)
        ]
        if self.requires_grad:
            self._init_gradient_state(device)
        self.use_sharded_params()

    # ------------------------------------------------------------------------------ weights
    def use_sharded_params(self) -> None:
        for sharded, aliases in zip(self.sharded_params, self.aliases):
            for module, name in aliases:
                module._parameters[name] = sharded

    def use_unsharded_params(self) -> None:
        for param, aliases in zip(self.params, self.aliases):
            for module, name in aliases:
                module._parameters[name] = param

    def gather_key(self) -> Optional[tuple]:
        """(numel, dtype, device) of the unsharded buffer, or None where nothing is gathered."""
        if self.unsharded is self.model:
            return None
        t = self.unsharded.tensor
        return (t.numel(), t.dtype, t.device)

    def bind_gather_slot(self, slot) -> None:
        """Gather into ``slot`` (see ``gather_slots``) from now on: re-point the parameters once."""
        assert self.state is GroupState.SHARDED and self.gather_key() == (
            slot.tensor.numel(), slot.tensor.dtype, slot.tensor.device), (self.label, slot.label)
        self.unsharded.release()
        self.unsharded = FlatBuffer.over(slot.tensor)
        self._unsharded_regions = self.layout.regions(slot.tensor, 1)
        for p, view in zip(self.params, self.layout.unpadded(self._unsharded_regions)):
            if isinstance(p, DTensor):
                _compat.set_dtensor_local(p, view)
            else:
                p.data = view
        self._slot = slot

    def can_unshard(self) -> bool:
        """False while this group's gather slot is held by another group (prefetch must wait)."""
        return self._slot is None or self.state is GroupState.UNSHARDED or self._slot.is_free_for(self)

    def unshard(self, stream: Optional[torch.Stream]) -> None:
        """Gather the compute weights into the unsharded buffer, on ``stream``."""
        if self.state is GroupState.UNSHARDED:
            return
        g = self.geometry
        if self._slot is not None:
            self._slot.acquire(self)
        if self.unsharded is not self.model:
            with torch.no_grad(), stream_context(stream):
                self.unsharded.allocate()  # allocated on the all-gather stream, freed there too
                if not self.model_on_the_fly:
                    self._gather(self._model_regions, g.param_level, self._unsharded_regions, stream)
                elif g.num_shards == 1:
                    self.unsharded.tensor.copy_(self.main.tensor)  # one rank: cast straight into place
                else:  # the first gather casts the main shard into its own block of the output
                    self._gather(self._main_regions, g.param_level, self._unsharded_regions, stream)
        self.state = GroupState.UNSHARDED

    def reshard(self, stream: Optional[torch.Stream]) -> None:
        """Release the unsharded buffer; the caller has made ``stream`` wait for compute."""
        if self.state is GroupState.SHARDED:
            return
        if self.unsharded is not self.model:
            with stream_context(stream):
                self.unsharded.release()
        if self._slot is not None:
            self._slot.release(self)  # the next holder gathers on ``stream``, after this compute
        self.state = GroupState.SHARDED

    def refresh_model_weights(self, stream: Optional[torch.Stream] = None) -> None:
        """Cast the main weights into the compute weights (one kernel), re-gathering if needed."""
        if self.main_aliases_model or self.model_on_the_fly:
            return
        g = self.geometry
        with torch.no_grad(), stream_context(stream):
            if g.num_levels == g.param_level:
                self.model.tensor.copy_(self.main.tensor)
            else:
                self._gather(self._main_regions, g.num_levels, self._model_regions, stream, stop=g.param_level)

    def _gather(self, regions, level, out_regions, stream, stop: int = 0) -> None:
        """All-gather ``regions`` (at ``level``) up to level ``stop``, ending in ``out_regions``
        (cast to their dtype by the first gather)."""
        g = self.geometry
        for j in range(level - 1, stop - 1, -1):
            if j == stop:
                outs = out_regions
            else:
                outs = self.layout.regions(torch.empty(self.layout.numel(g.ways(j)), dtype=out_regions[0].dtype,
                                                       device=regions[0].device), g.ways(j))
            collectives.all_gather(outs, regions, g.groups[j], stream, self.policy.coalesce)
            regions = outs

    # -------------------------------------------------------------------------- gradients
    def _init_gradient_state(self, device: torch.device) -> None:
        g, d = self.geometry, self.dtypes
        # Gradients carry one extra member: per-parameter usage counts (K rows of one entry per
        # parameter). Reduced like the gradients, they tell every rank whether *any* rank produced
        # a gradient, so a parameter unused everywhere keeps .grad None, as in plain PyTorch.
        shapes = [m.shape for m in self.layout.members] + [torch.Size((g.num_shards, len(self.params)))]
        self.grad_layout = FlatLayout(shapes, g.num_shards)
        self._all_used = torch.ones(g.num_shards * len(self.params), dtype=d.comm, device=device)
        # What one backward's reduction holds: the unsharded gradients in the reduction dtype.
        self.reduction_nbytes = self.grad_layout.numel(1) * self._all_used.element_size()
        self.main_grad: Optional[FlatBuffer] = None
        self._accum: Optional[FlatBuffer] = None
        self._accum_empty = True
        self._missing_seen = False  # a parameter lacked a gradient since the last main-grad write
        self.needs_usage_check = False
        if d.grads != d.main:
            if not _compat.supports_grad_dtype():
                raise NotImplementedError(
                    f"main_grads_dtype={d.grads} differs from main_params_dtype={d.main}, which "
                    "needs Tensor.grad_dtype (torch >= 2.10); set them equal"
                )
            for p in self.sharded_params:
                _compat.set_grad_dtype(p, d.grads)

    def release_unused_gradient_memory(self) -> None:
        """Free the main-gradient storage when every ``.grad`` was set to None (``zero_grad()``).

        Gradients are dead between the optimizer step and the next backward; FSDP2 frees them too.
        With ``zero_grad(set_to_none=False)`` the buffer stays, persistent and zeroed in place.
        """
        if self.main_grad is not None and self.main_grad.is_allocated:
            if all(p.grad is None for p in self.sharded_params):
                self.main_grad.release()

    def _main_grad_regions(self) -> list[torch.Tensor]:
        g = self.geometry
        if self.main_grad is not None and not self.main_grad.is_allocated:
            self.main_grad.allocate()  # every .grad is None, so the next write overwrites it all
        if self.main_grad is None:
            self.main_grad = FlatBuffer(self.grad_layout.numel(g.num_shards), self.dtypes.grads,
                                        self._all_used.device)
            self.main_grad.tensor.zero_()
            regions = self._main_grad_views = self.grad_layout.regions(self.main_grad.tensor, g.num_shards)
            self._grad_dtensors = [
                DTensor.from_local(local, mesh, placements, run_check=False,
                                   shape=p.shape, stride=contiguous_stride(p.shape))
                for p, local, (mesh, placements) in zip(
                    self.params, self.grad_layout.shards(regions, g.shard_index), self._specs)
            ]
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
        usage = regions[-1]
        with torch.no_grad():
            for i, (gr, mine) in enumerate(zip(grads, self._grad_dtensors)):
                if gr is None:
                    regions[i].zero_()
                    usage[i : i + 1].zero_()
                elif gr is not mine:
                    mine.to_local().copy_(gr.to_local() if isinstance(gr, DTensor) else gr)
        return regions, False

    def reduce_gradients(self, is_last: bool, stream: Optional[torch.Stream]) -> list[torch.Tensor]:
        """Reduce this backward's gradients; on the last microbatch, finish the deferred axes.

        Everything runs on ``stream``, the copy-in too (the bf16 -> fp32 cast of an fp32
        reduction, and padded members): that copy reads and writes 6 bytes per parameter, and on
        the compute stream it would delay the next module's backward by as much. The price is
        that the autograd gradients live until the reduction is done instead of until the copy
        is queued. Returns the tensors that must stay alive until ``stream`` has finished.
        """
        g = self.geometry
        if g.grad_level == 0 and not is_last:
            return []  # ZeRO-1 / DDP: autograd keeps accumulating full gradients in .grad
        grads = [_local_grad(p) for p in self.params]  # a TP Partial -> Shard runs on compute
        for p in self.params:
            p.grad = None
        if stream is not None:
            stream.wait_stream(torch.accelerator.current_stream(stream.device))  # grads are ready
        with torch.no_grad(), stream_context(stream):
            keep_alive = self._stage_inputs(grads)
            inputs = keep_alive[-1]
            if g.grad_level == 0:
                self._finish_deferred(inputs, stream)
            else:
                self._reduce_microbatch(inputs, stream)
                if is_last and g.has_deferred:
                    self._finish_deferred(None, stream)
        return keep_alive

    def _stage_inputs(self, grads: list) -> list:
        """Level-0 gradient regions in the reduction dtype, plus the usage counts; returns what
        must stay alive (every gradient, read on this stream), the input list last."""
        keep, inputs = pack_gradients(grads, self.grad_layout.members[:-1], self.dtypes.comm,
                                      self._all_used.device)
        present = [i for i, gr in enumerate(grads) if gr is not None]
        if len(present) == len(grads):
            inputs.append(self._all_used)
        else:  # rare: some parameter had no gradient on this rank
            usage = torch.zeros(self.geometry.num_shards, len(self.params), dtype=self.dtypes.comm)
            usage[:, present] = 1
            inputs.append(usage.to(self._all_used.device).view(-1))
            self._missing_seen = True
        keep.append(inputs)
        return keep

    def _scatter(self, regions, start: int, stop: int, final=None) -> list[torch.Tensor]:
        """Reduce-scatter ``regions`` from level ``start`` to ``stop``; the last lands in ``final``."""
        g = self.geometry
        for j in range(start, stop):
            if j == stop - 1 and final is not None:
                outs = final
            else:
                buf = torch.empty(self.grad_layout.numel(g.ways(j + 1)), dtype=regions[0].dtype,
                                  device=regions[0].device)
                outs = self.grad_layout.regions(buf, g.ways(j + 1))
            collectives.reduce_scatter(outs, regions, g.groups[j], coalesce=self.policy.coalesce)
            regions = outs
        return regions

    def _accumulate(self, target: list[torch.Tensor], overwrite: bool, compute) -> None:
        """``target (+)= compute(...)``, letting the last collective write straight into ``target``
        when nothing there must be kept and the dtypes agree."""
        direct = overwrite and target[0].dtype == self.dtypes.comm
        result = compute(target if direct else None)
        if result is not target:
            (_compat.foreach_copy_ if overwrite else _compat.foreach_add_)(target, result)

    def _reduce_microbatch(self, inputs, stream) -> None:
        g = self.geometry
        if g.has_deferred and g.grad_level < g.num_levels:
            if self._accum is None:
                self._accum = FlatBuffer(self.grad_layout.numel(g.ways(g.grad_level)), self.dtypes.grads,
                                         inputs[0].device)
            target = self.grad_layout.regions(self._accum.tensor, g.ways(g.grad_level))
            overwrite, self._accum_empty = self._accum_empty, False
        else:
            target, overwrite = self._claim_main_grad()

        def compute(final):
            out = self._scatter(inputs, 0, g.grad_level, final)
            for group in g.grad_all_reduce_groups:
                collectives.all_reduce(out, group, coalesce=self.policy.coalesce)
            self._divide(out)
            return out

        self._accumulate(target, overwrite, compute)
        if self._accum is None:  # accumulated straight into the main gradient
            self._expose_gradients()

    def _finish_deferred(self, inputs, stream) -> None:
        """Reduce the deferred axes (last microbatch) into the main gradient."""
        g = self.geometry
        start = g.grad_level
        if inputs is None:
            if self._accum is not None:  # HFSDP: from the accumulated gradient shard
                inputs = self.grad_layout.regions(self._in_comm_dtype(self._accum.tensor), g.ways(start))
                self._accum_empty = True
            else:  # the deferred axis is all-reduced in place on the main gradient
                self._main_grad_regions()
                flat = self._in_comm_dtype(self.main_grad.tensor)
                regions = self.grad_layout.regions(flat, g.num_shards)
                for group in g.deferred_all_reduce_groups:
                    collectives.all_reduce(regions, group, coalesce=self.policy.coalesce)
                if flat is not self.main_grad.tensor:
                    self.main_grad.tensor.copy_(flat)
                self._expose_gradients()
                return
        target, overwrite = self._claim_main_grad()

        divide = start == 0  # raw gradients: not divided by a per-microbatch reduction yet

        def compute(final):
            out = self._scatter(inputs, start, g.num_levels, final) if g.num_levels > start else inputs
            for group in g.deferred_all_reduce_groups:
                collectives.all_reduce(out, group, coalesce=self.policy.coalesce)
            if divide:
                self._divide(out)
            return out

        self._accumulate(target, overwrite, compute)
        self._expose_gradients()

    def _in_comm_dtype(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself, or one cast of it to the reduction dtype (one kernel, not one per member)."""
        return flat if flat.dtype == self.dtypes.comm else flat.to(self.dtypes.comm)

    def _divide(self, regions: list[torch.Tensor]) -> None:
        factor = self.policy.gradient_divide_factor
        if factor != 1.0:
            _compat.foreach_div_(regions[:-1], factor)  # not the usage counts

    def _expose_gradients(self) -> None:
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

    def nonfinite_flag(self) -> Optional[torch.Tensor]:
        """A 0-d tensor, nonzero when the reduced gradients hold a NaN or Inf (one fused check)."""
        if self.main_grad is None or not self.main_grad.is_allocated:
            return None
        return (~torch.isfinite(self.main_grad.tensor)).any()

    def finalize_gradients(self) -> None:
        """After the reductions have finished: unused-everywhere parameters keep ``.grad`` None."""
        if not self.needs_usage_check:
            return
        self.needs_usage_check = False
        counts = self._main_grad_views[-1]
        used = counts.float().tolist()  # a host sync, on this rare path only
        for p, grad, count in zip(self.sharded_params, self._grad_dtensors, used):
            p.grad = grad if count > 0 else None


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP shards: the local shard of a tensor-parallel DTensor, else the tensor."""
    if isinstance(param, DTensor):
        with torch.no_grad():
            return param.to_local()
    return param


def _local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = param.grad
    if grad is None or not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(param.placements):  # e.g. Partial over the TP axis
        grad = grad.redistribute(placements=param.placements)
    return grad.to_local()
