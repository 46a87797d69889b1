"""One parameter group: the parameters of one module sharing (dtype, requires_grad).

A group keeps up to five flat buffers (see ``flat_buffer`` for their layout):

=================  =================  ===========================================================
buffer             level              role
=================  =================  ===========================================================
``main``           optimizer shard    main weights in ``main`` dtype; the exposed DTensors
``model``          parameter shard    compute weights at rest; aliases ``main`` when equal
``unsharded``      whole              gathered for compute; released at rest; aliases ``model`` when whole
``accum``          gradient shard     HFSDP only: per-microbatch reductions until the last one
``main_grad``      optimizer shard    reduced gradients in ``grads`` dtype; the exposed ``.grad``
=================  =================  ===========================================================

A group some of whose parameters were tagged with a gather codec (``gather_codec``; FP8 weights
in ``mfsdp.float8``) keeps ``unsharded`` as bytes: tagged members in the codec's wire dtype, the
others (norms) in the compute dtype. The first gather encodes the shard into its block of the
output, every member travels in the one coalesced all-gather, and the tagged compute parameters
are the codec's wrappers over the gathered views.

The group only moves bytes; *when* it does so (streams, events, prefetch) is the module's and the
context's business, so every method takes the stream it runs on.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from mfsdp import _compat
from mfsdp.communication import CommunicationPolicy
from mfsdp.mixed_precision import ResolvedDtypes
from mfsdp.runtime import gather_codec
from mfsdp.runtime.collectives import CollectiveIssuer, stream_context, sum_in_place
from mfsdp.runtime.flat_buffer import FlatBuffer, FlatLayout
from mfsdp.runtime.geometry import ShardGeometry, exposed_dtensors, fill_region
from mfsdp.runtime.reducer import GradientReducer


class FsdpParameterGroup:
    """Parameters of one FsdpModule with one (dtype, requires_grad), sharded as one unit."""

    def __init__(self, params: list[nn.Parameter], aliases: list[list[tuple[dict, str]]], geometry: ShardGeometry,
                 dtypes: ResolvedDtypes, label: str, policy: CommunicationPolicy = CommunicationPolicy()) -> None:
        self.params = params  # the Parameters used for compute, views of the unsharded buffer
        self.aliases = aliases  # every (module._parameters, attribute) that holds each parameter
        self.geometry = geometry
        self.dtypes = dtypes
        self.label = label
        self.policy = policy
        self.requires_grad = params[0].requires_grad
        # Weight staleness, written only by ``weights_written`` and ``refresh_if_stale``.
        self._stale = False  # main weights written since the compute weights were derived
        # Bumped whenever the main weights are (about to be) written: a step, a load, an init, an
        # edit the user reports. Tensor version counters cannot say it: a fused optimizer step
        # bumps none, and in-place ops that DTensor runs on its local shard bump neither tensor's.
        self._weights_epoch = 0
        # Seams for optimizer offload (mfsdp/offload/): ``gradient_final_hooks`` are called as
        # hook(group, stream) once the last microbatch's reduction is issued on ``stream``;
        # ``weights_ready`` is an event that the next refresh or gather waits for on its stream.
        self.gradient_final_hooks: list[Callable] = []
        self.weights_ready: Optional[torch.Event] = None
        self.issue = CollectiveIssuer(label, policy.coalesce, policy.check_collectives
                                      or os.environ.get("MFSDP_CHECK_COLLECTIVES", "0") not in ("", "0"))
        # Built without storage (meta): the shards are allocated on the mesh's device, then initialised.
        device = geometry.device if params[0].device.type == "meta" else params[0].device
        # Tensor-parallel parameters: FSDP works on their local shards, the DTensor keeps its axes.
        locals_ = [local_tensor(p) for p in params]
        specs = [geometry.parameter_spec(p) for p in params]
        self.layout = FlatLayout([t.shape for t in locals_], geometry.num_shards)
        geometry.check_exposed(params, self.layout.members, specs, label)  # the DTensors describe these shards
        # Tagged parameters (gather_codec): None, and the untouched path below, when none is.
        self.encoded = gather_codec.encoded_gather(params, dtypes, self.layout, label, geometry.param_level)
        self._allocate_buffers(device)
        self._fill_shards(locals_)
        self._point_params_at_unsharded()
        self._slot = None  # a persistent gather slot (double buffering), bound by the context
        if self.unsharded is not self.model:
            self.unsharded.release()  # views stay valid: the storage object is kept
        self._expose_shards([(mesh, placements) for mesh, placements, _ in specs], device)
        self.use_sharded_params()

    def _allocate_buffers(self, device: torch.device) -> None:
        """The main, compute and unsharded buffers and their per-member regions.

        Compute weights at rest. Three cases, cheapest memory first:
        * main dtype == compute dtype at the same level: the main weights *are* the compute weights;
        * sharded like the main weights but in another dtype (ZeRO-3 / HSDP with fp32 masters): no
          persistent copy; each unshard casts the main shard into its block of the gather output
          (one kernel of 1/N of the bytes), which saves 2 bytes per parameter per rank at rest;
        * replicated (ZeRO-1/2, DDP) or sharded over fewer axes (HFSDP): a persistent copy, refreshed
          once per optimizer step, so the per-step gathers stay off the slow axes.
        """
        g, dtypes = self.geometry, self.dtypes
        level_ways = g.ways(g.param_level)
        self.main_aliases_model, self.model_on_the_fly = choose_model_buffer(dtypes, g.num_levels, g.param_level)
        self.main = FlatBuffer(self.layout.numel(g.num_shards), dtypes.main, device)
        self.model: Optional[FlatBuffer] = (self.main if self.main_aliases_model else None if self.model_on_the_fly
                                            else FlatBuffer(self.layout.numel(level_ways), dtypes.compute, device))
        # The unsharded buffer's layout: bytes with a view per member's dtype when encoded.
        self._gather_layout = self.layout if self.encoded is None else self.encoded.layout
        self.unsharded = self.model if unsharded_aliases_model(dtypes, g, self.encoded) else FlatBuffer(
            self._gather_layout.numel(1), dtypes.compute if self.encoded is None else self._gather_layout.dtype, device)
        self._unsharded_regions = self._gather_layout.regions(self.unsharded.tensor, 1)
        self._main_regions = self.layout.regions(self.main.tensor, g.num_shards)
        # What unshard gathers from: the compute weights at rest, or the main weights cast on the fly.
        self._model_regions = (self._main_regions if self.model is None
                               else self.layout.regions(self.model.tensor, level_ways))

    def _fill_shards(self, locals_: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each parameter into the main (and a separate compute) buffer."""
        g = self.geometry
        with torch.no_grad():
            for i, (t, m) in enumerate(zip(locals_, self.layout.members)):
                if t.is_meta:
                    continue  # zeros until the caller initialises or loads the shards
                fill_region(self._main_regions[i], t.detach(), m, g.num_shards, g.shard_index)
                if self.model is not None and self.model is not self.main:
                    fill_region(self._model_regions[i], t.detach(), m, g.ways(g.param_level), g.index(g.param_level))

    def _point_params_at_unsharded(self) -> None:
        """Make each compute parameter a view of its region of the unsharded buffer."""
        for i, (p, view) in enumerate(zip(self.params, self.layout.unpadded(self._unsharded_regions))):
            if self.encoded is not None and self.encoded.wraps(i):  # a new Parameter: the codec's
                self.params[i] = self.encoded.wrap(i, p, view)  # wrapper over the gathered bytes
            elif isinstance(p, DTensor):  # a new Parameter: a DTensor over the unsharded view
                self.params[i] = nn.Parameter(
                    DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()),
                    requires_grad=p.requires_grad)
            else:  # the original Parameter now lives in the unsharded buffer
                if p.is_meta:  # no storage to re-point: a new Parameter, then re-pointed like the rest
                    # (assigning .data keeps the Parameter's own version counter, so gathers into the
                    # buffer do not look like in-place edits of tensors autograd saved)
                    p = self.params[i] = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                                      requires_grad=p.requires_grad)
                p.data = view

    def _expose_shards(self, specs: list[tuple], device: torch.device) -> None:
        """The sharded parameters (DTensors over the main buffer's shards, with ``specs``' mesh and
        placements) and, for a trainable group, its gradient half ``self.reducer``."""
        g, dtypes, params = self.geometry, self.dtypes, self.params
        self._specs = specs
        self.sharded_params = [nn.Parameter(t, requires_grad=p.requires_grad) for p, t in zip(
            params, exposed_dtensors(params, self.layout.shards(self._main_regions, g.shard_index), specs))]
        if self.requires_grad:
            self.reducer = GradientReducer(params, self.sharded_params, specs, self.layout, g, dtypes,
                                           self.policy.gradient_divide_factor, self.issue, device)
        if self.requires_grad and dtypes.grads != dtypes.main:
            if not _compat.supports_grad_dtype():
                raise NotImplementedError(
                    f"main_grads_dtype={dtypes.grads} differs from main_params_dtype={dtypes.main}, which "
                    "needs Tensor.grad_dtype (torch >= 2.10); set them equal")
            # Autograd never produces a gradient for a sharded parameter, so grad_dtype only checks
            # assignments: None accepts our main gradient and the main-dtype zeros that torch's
            # get/set_optimizer_state_dict attach to a fresh optimizer.
            for p in self.sharded_params:
                _compat.set_grad_dtype(p, None)

    # ------------------------------------------------------------------------------ weights
    @property
    def codec(self) -> Optional[gather_codec.GatherCodec]:
        """The codec of the encoded gather, None for a group that gathers as is."""
        return self.encoded.codec if self.encoded is not None else None

    def use_sharded_params(self) -> None:
        for sharded, aliases in zip(self.sharded_params, self.aliases):
            for parameters, name in aliases:
                parameters[name] = sharded

    def use_unsharded_params(self) -> None:
        for param, aliases in zip(self.params, self.aliases):
            for parameters, name in aliases:
                parameters[name] = param

    def gather_key(self) -> Optional[tuple]:
        """(numel, dtype, device) of the unsharded buffer, or None where nothing is gathered."""
        return None if self.unsharded is self.model else _tensor_key(self.unsharded.tensor)

    def bind_gather_slot(self, slot) -> None:
        """Gather into ``slot`` (see ``gather_slots``) from now on: re-point the parameters once."""
        assert self.gather_key() == _tensor_key(slot.tensor), (self.label, slot.label)
        self.unsharded.release()
        self.unsharded = FlatBuffer.over(slot.tensor)
        self._unsharded_regions = self._gather_layout.regions(slot.tensor, 1)
        for i, (p, view) in enumerate(zip(self.params, self.layout.unpadded(self._unsharded_regions))):
            if self.encoded is not None and self.encoded.wraps(i):
                self.encoded.codec.repoint(p, view)
            elif isinstance(p, DTensor):
                _compat.set_dtensor_local(p, view)
            else:
                p.data = view
        self._slot = slot

    def can_unshard(self) -> bool:
        """False while this group's gather slot is held by another group (prefetch must wait)."""
        return self._slot is None or self._slot.is_free_for(self)

    def unshard(self, stream: Optional[torch.Stream]) -> None:
        """Gather the compute weights into the unsharded buffer, on ``stream``. Whether the group is
        unsharded is its module's to know (``FsdpModule.is_unsharded``), which calls this once."""
        g = self.geometry
        if self._slot is not None:
            self._slot.acquire(self)
        if self.unsharded is not self.model:
            with torch.no_grad(), stream_context(stream):
                self.unsharded.allocate()  # allocated on the all-gather stream, freed there too
                if self.model_on_the_fly and g.num_shards == 1 and self.encoded is None:
                    self.unsharded.tensor.copy_(self.main.tensor)  # one rank: cast straight into place
                else:  # on the fly, the first gather casts the main shard into its own block of the output
                    self._gather(self._model_regions, g.param_level, self._unsharded_regions, stream)
                if self.encoded is not None:
                    self.encoded.decode(self.params)

    def reshard(self, stream: Optional[torch.Stream]) -> None:
        """Release the unsharded buffer; the caller has made ``stream`` wait for compute."""
        if self.unsharded is not self.model:
            with stream_context(stream):
                self.unsharded.release()
        if self._slot is not None:
            self._slot.release(self)  # the next holder gathers on ``stream``, after this compute

    @property
    def weights_epoch(self) -> int:
        """Bumped by every ``weights_written``: what was derived from the main weights (precomputed
        FP8 scales, a gather made during the step) holds only for the epoch it was made in."""
        return self._weights_epoch

    def weights_written(self) -> None:
        """The main weights are being (or were) written: an optimizer step, a state-dict load, an
        init, an edit the user reports. The new epoch retires what was derived from the old weights,
        and the next ``refresh_if_stale`` derives the compute weights afresh."""
        self._stale = True
        self._weights_epoch += 1

    def weights_token(self) -> tuple[int, ...]:
        """Changes whenever what ``unshard`` gathers from may have been written: ``weights_epoch``
        (steps, loads, reported edits), and the version counters an unreported in-place edit bumps
        (of an exposed parameter, of its local shard, of the compute copy)."""
        model = self.model.tensor._version if self.model is not None and self.model is not self.main else 0
        return (self.weights_epoch, model, sum(p._version for p in self.sharded_params),
                sum(local_tensor(p)._version for p in self.sharded_params))

    def wait_for_weights(self, stream: Optional[torch.Stream] = None, keep: bool = False) -> None:
        """Make ``stream`` (the current one by default) wait until the main weights are written: a
        no-op unless the offload's copy up is in flight (``weights_ready``, a CUDA event). ``keep``:
        another reader on another stream will wait for the same event (the refresh)."""
        if self.weights_ready is not None:
            (stream or torch.cuda.current_stream(self.main.tensor.device)).wait_event(self.weights_ready)
            if not keep:
                self.weights_ready = None

    def refresh_if_stale(self, stream: Optional[torch.Stream] = None) -> None:
        """Where the main weights were written since, cast them into the compute weights on
        ``stream`` (one kernel), re-gathering if needed."""
        self.wait_for_weights(stream)
        stale, self._stale = self._stale, False
        if not stale or self.main_aliases_model or self.model_on_the_fly:
            return
        g = self.geometry
        with torch.no_grad(), stream_context(stream):
            if g.num_levels == g.param_level:
                self.model.tensor.copy_(self.main.tensor)
            else:
                self._gather(self._main_regions, g.num_levels, self._model_regions, stream, stop=g.param_level)

    def _gather(self, regions, level, out_regions, stream, stop: int = 0) -> None:
        """All-gather ``regions`` (at ``level``) up to level ``stop``, ending in ``out_regions``
        (cast to their dtype by the first gather, or encoded: only into the unsharded buffer, whose
        members are in their wire dtypes and gathered as bytes)."""
        g = self.geometry
        encoded = self.encoded if self.encoded is not None and out_regions is self._unsharded_regions else None
        layout = self.layout if encoded is None else encoded.layout
        dtype = out_regions[0].dtype if encoded is None else layout.dtype  # of the intermediate levels
        for j in range(level - 1, stop - 1, -1):
            outs = out_regions if j == stop else layout.regions(
                torch.empty(layout.numel(g.ways(j)), dtype=dtype, device=regions[0].device), g.ways(j))
            if encoded is None:
                outs_and_ins = (outs, regions)
            elif j == level - 1:  # this rank's shard, encoded in place: gathered as bytes
                outs_and_ins = encoded.encode(regions, outs, g.groups[j], g.groups[:level], self._weights_epoch,
                                              j == stop)
            else:
                outs_and_ins = (gather_codec.as_bytes(outs), gather_codec.as_bytes(regions))
            self.issue("all_gather", *outs_and_ins, g.groups[j], stream)
            regions = outs

    # -------------------------------------------------------------------------- gradients
    def reduce_gradients(self, is_last: bool, stream: Optional[torch.Stream],
                         record_tag: Callable[[torch.Tensor, torch.Tensor], None]) -> list[torch.Tensor]:
        """Reduce this backward's gradients on ``stream`` (see ``reducer``); on the last microbatch,
        finish the deferred axes.

        Everything runs on ``stream``, the copy-in too (the bf16 -> fp32 cast of an fp32
        reduction, and padded members): that copy reads and writes 6 bytes per parameter, and on
        the compute stream it would delay the next module's backward by as much. The price is
        that the autograd gradients live until the reduction is done instead of until the copy
        is queued. ``record_tag`` receives each finished reduction's tag columns and the expected
        values. Returns the tensors that must stay alive until ``stream`` has finished.
        """
        if self.reducer.plan.every_backward is None and not is_last:
            return []  # ZeRO-1 / DDP: autograd keeps accumulating full gradients in .grad
        grads = _local_grads(self.params)  # a TP Partial -> Replicate runs on compute
        for p in self.params:
            p.grad = None
        if stream is not None:
            stream.wait_stream(torch.accelerator.current_stream(stream.device))  # grads are ready
        with torch.no_grad(), stream_context(stream):
            keep = self.reducer.reduce(grads, is_last, record_tag)
        for hook in self.gradient_final_hooks if is_last else ():
            hook(self, stream)
        return keep


def choose_model_buffer(dtypes: ResolvedDtypes, num_levels: int, param_level: int) -> tuple[bool, bool]:
    """(main aliases model, model derived on the fly): which compute-weight buffer a group keeps at
    rest (the three cases of ``FsdpParameterGroup._allocate_buffers``). Pure, so that
    ``mfsdp.memory`` predicts the buffers from the same choice the runtime makes."""
    main_aliases_model = dtypes.main == dtypes.compute and num_levels == param_level
    return main_aliases_model, not main_aliases_model and num_levels == param_level > 0


def unsharded_aliases_model(dtypes: ResolvedDtypes, levels, encoded) -> bool:
    """Whether a group's unsharded buffer *is* its compute buffer at rest, so that nothing is
    gathered, kept or freed: the compute weights are split one way at rest (replicated, or sharded
    over axes of size 1: a frozen group on one GPU), persistent (not cast from the main weights on
    the fly) and not encoded for the gather. ``levels``: the group's ``geometry.Levels``;
    ``encoded``: its ``gather_codec.encoded_gather``. The one rule ``mfsdp.memory`` plans with too."""
    _, on_the_fly = choose_model_buffer(dtypes, levels.num_levels, levels.param_level)
    return levels.ways(levels.param_level) == 1 and not on_the_fly and encoded is None


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.numel(), t.dtype, t.device)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP shards: the local shard of a tensor-parallel DTensor, else the tensor."""
    if isinstance(param, DTensor):
        with torch.no_grad():
            return param.to_local()
    return param


def _local_grads(params) -> list[Optional[torch.Tensor]]:
    """The local tensors of the parameters' gradients, in the parameters' own placements.

    Under sequence parallelism a norm's weight gradient is ``Partial`` (summed) over the TP axis
    while the weight is replicated there: those are summed in place, one coalesced all-reduce per
    (mesh, axes) for the whole group instead of one DTensor redistribution per parameter. Any
    other mismatch goes through ``redistribute``.
    """
    out: list[Optional[torch.Tensor]] = []
    partial_sums: dict[tuple, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if not isinstance(grad, DTensor):  # None included
            out.append(grad)
            continue
        differ = [d for d, (g, q) in enumerate(zip(grad.placements, param.placements)) if g != q]
        summed = all(isinstance(grad.placements[d], Partial) and grad.placements[d].reduce_op == "sum"
                     and isinstance(param.placements[d], Replicate) for d in differ)  # True where none differ
        local = grad.to_local() if summed else grad.redistribute(placements=param.placements).to_local()
        if differ and summed:  # summed in place below; the gradient DTensor is dropped next
            partial_sums.setdefault((grad.device_mesh, tuple(differ)), []).append(local)
        out.append(local)
    for (mesh, dims), tensors in partial_sums.items():
        for d in dims:
            sum_in_place(tensors, mesh.get_group(d))
    return out
