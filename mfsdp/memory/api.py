"""``estimate(model_or_config, ...)``: the public entry of the memory planner."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
from typing import Optional, Union

import torch
from torch import nn

from mfsdp.communication import CommunicationPolicy
from mfsdp.experts.parallel import shared_expert_name
from mfsdp.memory.activations import ActivationProfile, StepRun, block_kind, measure_hf, measure_llama
from mfsdp.memory.estimate import MemoryEstimate, StepSettings, simulate
from mfsdp.memory.experts import expert_levels, experts_notes, split_experts_for_plan
from mfsdp.memory.model_state import Levels, describe_units, optimizer_state_bytes
from mfsdp.memory.tensor_parallel import TensorParallel, apply_tp, default_group_exists, fake_tp_mesh, in_child
from mfsdp.mesh import DP, DP_REPLICATE, DP_SHARD, PLACEMENT_NAMES, TWO_AXIS, resolve_placements
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.offload.policy import host_bytes, units_to_offload
from mfsdp.placement import Placements
from mfsdp.transforms import apply_transforms, hook_results

def mesh_for(placements: str, world_size: int, replicate: int = 1) -> tuple[Placements, dict]:
    """The placements a name stands for and the mesh shape ``parallelize`` / the manager build."""
    if placements not in PLACEMENT_NAMES:
        raise ValueError(f"unknown placements {placements!r}; use one of {', '.join(PLACEMENT_NAMES)}")
    if placements not in TWO_AXIS:
        return resolve_placements(placements), {DP: world_size}
    if world_size % replicate:
        raise ValueError(f"replicate={replicate} must divide the world size {world_size}")
    return resolve_placements(placements), {DP_REPLICATE: replicate, DP_SHARD: world_size // replicate}


def estimate(model_or_config, *, world_size: Optional[int] = None, mesh_shape: Optional[dict] = None,
             placements: Union[str, Placements] = "zero3", replicate: int = 1,
             mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
             communication_policy: Optional[CommunicationPolicy] = None,
             local_batch: int = 1, seq_len: int = 4096, microbatches: int = 1,
             activation_checkpointing: bool = False, optimizer: str = "adamw", foreach: bool = True,
             flat_adamw: bool = False,
             compute_dtype: torch.dtype = torch.bfloat16, expert_units: bool = False,
             tensor_parallel: Union[int, TensorParallel] = 1, tp_in_process: bool = False,
             transforms: tuple = (), device: str = "cuda", offload_fraction: float = 0.0,
             offload_overlap: str = "step", compiled: bool = False, head_loss: str = "plain",
             compiled_head: bool = False, keep_gathered_blocks: int = 0,
             step_run: Optional[StepRun] = None, expert_parallel: int = 1) -> MemoryEstimate:
    """Predict one rank's memory over a training step and its peak.

    ``model_or_config``: a bundled preset name ("8b", "moe-1b"), a ``LlamaConfig``, a model built on
    the meta device (the bundled Llama, or a Hugging Face causal LM), a Hugging Face config, or a
    local Hugging Face directory (its config.json). ``placements``: a name with ``world_size`` (and
    ``replicate`` for hsdp/hfsdp), or a ``Placements`` with ``mesh_shape`` ({axis: size}, the
    data-parallel axes only). ``tensor_parallel``: the manager's tp size (an int: with sequence
    parallel and the parallel loss) or a ``TensorParallel``; Hugging Face models only.
    ``world_size`` counts every rank (data-parallel ranks x tp). A tensor-parallel estimate runs in a
    spawned child process (a few seconds) unless ``tp_in_process``: then over a fake process group in
    this process, which must have none and must not create a real one later (``mfsdp plan``), see
    ``tensor_parallel``. ``expert_units``: each block's experts
    module of a bundled MoE is its own unit (``ParallelizeConfig.expert_units``). ``transforms``: the model
    transforms ``parallelize`` applies (``ParallelizeConfig.transforms``; on a Hugging Face model, those
    the manager route applies: model state only, activations measured without them), replayed
    on a copy of the meta model: model state is sized from what they leave (``Float8Transform``'s
    tags gather float8 bytes, plus the encode's staging while a gather is issued), and the
    activations are measured on fake copies of its blocks. A given model is sized as it is, its
    blocks included. Where the transforms make blocks differ (``Float8Transform.skip``), each block
    is planned with the largest activations of the kinds of block there are (an upper bound).
    ``device``: "cuda" counts the cuBLAS workspaces, the allocator reserve and the CUDA context.
    ``offload_fraction`` > 0: the optimizer states of that share of the units live on the host (``mfsdp.OffloadPolicy``, with
    ``offload_overlap`` its ``overlap``); the result is then an ``OffloadedEstimate``, with the
    host bytes. ``compiled``: the blocks run through torch.compile (``COMPILED_BLOCK_SAVED``);
    ``compiled_head``: the bundled Llama's head loss does too (``measure_llama``), as in ``mfsdp train``.
    ``head_loss``: the bundled Llama's loss, "plain" or "fused" (``Llama.set_head_loss``), measured
    as that model computes it, in its head's forward; a Hugging Face model returns logits (plain).
    ``keep_gathered_blocks``: that many of the last blocks keep their gathered weights through the step
    (``ParallelizeConfig.keep_gathered_blocks``, by its rule ``kept_blocks``), resident in every phase.
    ``foreach`` / ``flat_adamw``: AdamW's kernels (``fully_shard_optimizer(flat_adamw=)``), which
    decide the step's transient (``mfsdp.optimizer.step_transient_bytes``). ``step_run``: what a step
    of another objective than the causal LM's runs on a microbatch (``StepRun``), measured in its place.
    ``expert_parallel``: the experts split over that many ranks (``ParallelizeConfig.ep``; see
    ``mfsdp.memory.experts`` for their model state, their dispatch buffers and the routing assumed).
    """
    tp = TensorParallel.of(tensor_parallel)
    if tp.enabled and (default_group_exists() or not tp_in_process):
        args = {name: value for name, value in locals().items() if name != "tp"}
        return in_child(estimate, {**args, "tp_in_process": True})
    if isinstance(placements, str):
        if world_size is None:
            raise ValueError("estimate: give world_size with a placement name (or a Placements and mesh_shape)")
        if world_size % tp.size:
            raise ValueError(f"estimate: world_size {world_size} does not divide by the tensor-parallel size {tp.size}")
        placements, mesh_shape = mesh_for(placements, world_size // tp.size, replicate)
    elif mesh_shape is None:
        raise ValueError("estimate: a Placements object needs mesh_shape={axis: size}")
    comm = communication_policy or CommunicationPolicy()
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer {optimizer!r} is not modelled; use 'adamw' or 'sgd'")
    if tp.enabled and tp.sequence_parallel and seq_len % tp.size:
        raise ValueError(f"sequence parallel: seq_len {seq_len} does not divide by the tensor-parallel size {tp.size}")
    levels = Levels.of(placements, mesh_shape)
    with fake_tp_mesh(tp.size) if tp.enabled else contextlib.nullcontext() as tp_mesh:
        # Split experts are units of their own whatever expert_units says (as ``parallelize`` shards them).
        model, units, blocks, measure, notes = _resolve(model_or_config, compute_dtype, seq_len,
                                                        expert_units or expert_parallel > 1,
                                                        tp, tp_mesh, tuple(transforms), head_loss, compiled_head,
                                                        step_run)
        policy = mixed_precision_policy or MixedPrecisionPolicy()
        if expert_parallel > 1:
            if tp.enabled:
                raise ValueError("estimate: expert parallelism with tensor parallelism is not supported; give "
                                 "tensor_parallel=1 or expert_parallel=1")
            unit_bytes, acts = _expert_parallel(model, units, blocks, measure, policy, levels, placements, mesh_shape,
                                                expert_parallel, local_batch, seq_len, activation_checkpointing,
                                                compute_dtype, optimizer, notes)
        else:
            unit_bytes = describe_units(model, units, policy, levels)
            acts = measure(local_batch, seq_len, activation_checkpointing)
    if compiled:
        acts = _compiled(acts, model, activation_checkpointing, transforms, notes)
    from mfsdp.models.parallelize import kept_blocks

    settings = StepSettings(placements.name, tp.size * math.prod(mesh_shape.values()), local_batch, seq_len,
                            microbatches, activation_checkpointing, optimizer, foreach,
                            prefetch_depth=comm.prefetch_depth if comm.overlap else 0,
                            prefetch_across_step=comm.prefetch_across_step and comm.overlap,
                            double_buffer=comm.double_buffer, cuda=device == "cuda", tp=tp.size,
                            transforms=tuple(map(str, transforms)), head_loss=head_loss, flat_adamw=flat_adamw,
                            kept_gathered=tuple(kept_blocks(blocks, keep_gathered_blocks)))
    e = dataclasses.replace(simulate(unit_bytes, acts, settings, blocks), notes=tuple(notes))
    return offloaded(e, unit_bytes, offload_fraction, offload_overlap) if offload_fraction > 0 else e


def _expert_parallel(model, units, blocks, measure, policy, levels, placements, mesh_shape, ep, local_batch, seq_len,
                     checkpointing, compute_dtype, optimizer, notes):
    """The model state and activations of a run with its experts split over ``ep`` ranks
    (``mfsdp.memory.experts``), its lines added to ``notes``."""
    dp_shard = next(size for axis, size in mesh_shape.items() if axis != DP_REPLICATE)
    model, units, expert_ids, split = split_experts_for_plan(model, units, ep, dp_shard, len(blocks))
    experts_levels = expert_levels(placements, mesh_shape, ep)
    unit_bytes = describe_units(model, units, policy, levels, unit_levels=dict.fromkeys(expert_ids, experts_levels))
    names = {id(m): n for n, m in model.named_modules()}
    expert_names = {names[i] for i in expert_ids if i in names}
    state = lambda us: sum(g.main + g.main_grad for u in us for g in u.groups) + optimizer_state_bytes(us, optimizer)  # noqa: E731
    ours = [u for u in unit_bytes if u.name in expert_names]
    notes += experts_notes(split, dp_shard, state(ours), state([u for u in unit_bytes if u.name not in expert_names]),
                           shared_expert_name(model))
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    acts = split.profile(measure(local_batch, seq_len, checkpointing), local_batch * seq_len, itemsize, checkpointing)
    return unit_bytes, acts


@dataclasses.dataclass(frozen=True)
class OffloadedEstimate(MemoryEstimate):
    """A ``MemoryEstimate`` with the optimizer of some units offloaded (``mfsdp.offload``)."""

    offloaded_units: tuple = ()
    """The offloaded units' names, in the order ``OffloadPolicy.fraction`` picks them."""
    host_bytes: dict = dataclasses.field(default_factory=dict)
    """This rank's host bytes: "master" (fp32 weights), "states", "backup" (``overlap="step"``'s
    copy of both), "staging" (the pinned ring: two of the largest offloaded group)."""
    offloaded_share: float = 0.0
    """The offloaded units' share of this rank's optimizer parameters (what the host steps; the head
    and the embedding weigh more than a block)."""


def offloaded(e: MemoryEstimate, units: list, fraction: float, overlap: str = "step") -> OffloadedEstimate:
    """``e`` with the optimizer states of ``fraction`` of ``units`` (``describe_units``' order:
    registration order, the root first) on the host, chosen by the runtime's rule
    (``mfsdp.offload.policy.units_to_offload``). The device keeps their fp32 main weights (the runtime
    gathers from them), so only the states leave every phase."""
    trainable = [u for u in units if any(g.requires_grad for g in u.groups)]
    chosen = units_to_offload(trainable, fraction)
    states = optimizer_state_bytes(chosen, e.settings.optimizer)
    shards = [g.optimizer_numel * g.main_itemsize for u in chosen for g in u.groups if g.requires_grad]
    master = sum(shards)
    phases = tuple(dataclasses.replace(p, components={**p.components, "optimizer states":
                                                      p.components.get("optimizer states", 0) - states})
                   for p in e.phases)
    peak = max(phases, key=lambda p: p.total)
    reserve = int(e.allocator_reserve * peak.total / e.peak_bytes) if e.peak_bytes else e.allocator_reserve
    host = host_bytes(shards, states, overlap)
    base = dataclasses.replace(e, phases=phases, peak_bytes=peak.total, peak_phase=peak.name,
                               breakdown=dict(peak.components), allocator_reserve=reserve)
    everything = sum(g.optimizer_numel * g.main_itemsize for u in trainable for g in u.groups if g.requires_grad)
    return OffloadedEstimate(**vars(base), offloaded_units=tuple(u.name for u in chosen), host_bytes=host,
                             offloaded_share=master / everything if everything else 0.0)


def checkpoint_bytes(model_or_config, *, optimizer: str = "adamw", main_params_dtype: torch.dtype = torch.float32,
                     compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one whole training checkpoint, as ``mfsdp train`` writes it with
    torch.distributed.checkpoint: the main weights and the optimizer's states, each element once
    (DCP writes a replicated tensor once), whatever the placements. ``model_or_config`` as for
    ``estimate``; model state is sized by the same layout code, on a single shard."""
    model, units, *_ = _resolve(model_or_config, compute_dtype, 1, False, TensorParallel(), None)
    unit_bytes = describe_units(model, units, MixedPrecisionPolicy(main_params_dtype=main_params_dtype),
                                Levels.of(Placements.zero3("dp"), {"dp": 1}))
    return sum(g.main for u in unit_bytes for g in u.groups) + optimizer_state_bytes(unit_bytes, optimizer)


COMPILED_BLOCK_SAVED = 0.70
"""What a compiled block of the bundled dense Llama saves for backward, without checkpointing, as a
share of the eager block's (measured on fake tensors): Inductor's partitioner recomputes cheap
pointwise results in backward instead of saving them. Set just above the shares measured on one H200
at 1b and 8B in bf16 and at 8B in FP8 tensorwise (``benchmarks/results/2026-12-01_compiled_block_saved.md``)."""
COMPILED_NOTE = (f"compiled blocks (--parallel.compile auto/true): a bundled dense Llama's blocks without "
                 f"checkpointing, in bf16 or FP8 tensorwise, are predicted to save {COMPILED_BLOCK_SAVED:.2f}x "
                 "the eager activations (measured on one H200); other models and recipes as eager ones, an "
                 "upper bound")


def _compiled(acts: ActivationProfile, model: nn.Module, ac: bool, transforms: tuple, notes: list) -> ActivationProfile:
    """``acts`` of compiled blocks, with the first transform's ``compiled_note`` (else ``COMPILED_NOTE``)
    in ``notes``; scaled only where measured: the bundled dense Llama, no checkpointing (which saves the
    block inputs either way), and no transform (``COMPILED_BLOCK_SAVED``) or one alone whose
    ``compiled_block_saved`` gives a share (shares were measured one transform at a time)."""
    notes.append((hook_results(transforms, "compiled_note") or [COMPILED_NOTE])[0])
    share = None if transforms else COMPILED_BLOCK_SAVED
    if len(transforms) == 1 and hasattr(transforms[0], "compiled_block_saved"):
        share = transforms[0].compiled_block_saved(COMPILED_BLOCK_SAVED)
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "layers") or cfg.num_experts or ac or share is None:
        return acts
    return dataclasses.replace(acts, block_bytes=int(acts.block_bytes * share))


def _resolve(obj, dtype, seq_len, expert_units, tp: TensorParallel, tp_mesh, transforms: tuple = (),
             head_loss: str = "plain", compiled_head: bool = False, step_run: Optional[StepRun] = None):
    """(meta model, non-root units bottom-up, block names, activation measurement, notes)."""
    from mfsdp.models import LlamaConfig, get_config
    from mfsdp.models.llama import HEAD_LOSSES

    if isinstance(obj, str) and not os.path.isdir(obj):
        obj = get_config(obj)
    llama = isinstance(obj, LlamaConfig) or (isinstance(obj, nn.Module) and hasattr(obj, "cfg")
                                             and hasattr(obj, "layers"))
    bundled_only = [str(t) for t in transforms if getattr(t, "bundled_only", False)]
    if bundled_only and not llama:
        raise ValueError(f"estimate: the model transforms ({', '.join(bundled_only)}) are planned on the "
                         "bundled Llama (as --model.float8 applies to it), not on a Hugging Face model")
    if head_loss not in HEAD_LOSSES:
        raise ValueError(f"estimate: unknown head_loss {head_loss!r}; use {', '.join(HEAD_LOSSES)}")
    if head_loss != "plain" and not llama:
        raise ValueError(f"estimate: head_loss {head_loss!r} applies to the bundled Llama (as --model.head_loss "
                         "does); a Hugging Face model returns logits")
    if llama and tp.enabled:
        raise ValueError("tensor parallel is the manager's (mfsdp.manager, Hugging Face models); the bundled "
                         "Llama has no tensor-parallel plan: estimate it with tensor_parallel=1")
    if llama:
        cfg, model = (obj, None) if isinstance(obj, LlamaConfig) else (obj.cfg, obj)
        parts = _llama(cfg, dtype, seq_len, expert_units, model, transforms, head_loss, compiled_head, step_run)
    elif isinstance(obj, (str, os.PathLike)) or hasattr(obj, "to_json_string") or isinstance(obj, nn.Module):
        parts = _hf(obj, dtype, tp, tp_mesh, transforms, step_run)
    else:
        raise TypeError(f"estimate: cannot size a {type(obj).__name__}; pass a preset name, a LlamaConfig, a "
                        "meta-device model, a Hugging Face config or a local Hugging Face directory")
    if step_run is not None and step_run.note:
        parts[-1].append(step_run.note)
    return parts


def _llama(cfg, dtype, seq_len, expert_units, model=None, transforms=(), head_loss="plain", compiled_head=False,
           step_run=None):
    from mfsdp.models.parallelize import sharding_units

    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))
    model, kinds = _meta_llama(cfg, dtype, transforms, model)
    dtype = next(model.parameters()).dtype
    notes = hook_results(transforms, "plan_note", model)
    if len(kinds) > 1:
        notes.append(f"{', '.join(map(str, transforms))}: blocks of {len(kinds)} kinds (the transforms treat them "
                     "differently); every block is planned with the largest activations of those kinds")
    units = sharding_units(model, expert_units=expert_units)
    blocks = [f"layers.{i}" for i in range(len(model.layers))]
    if cfg.num_experts:
        notes.append(
            f"MoE: activations measured with uniform routing, each of the {cfg.num_experts} experts of a block "
            f"gets tokens x top_k / num_experts = tokens x {cfg.top_k}/{cfg.num_experts} of a microbatch "
            "(saved bytes depend only on that total; the peak inside an expert on its share); "
            + ("each block's experts module is a unit of its own, gathered on its own inside its block"
               if expert_units else "each block gathers all its experts with it"))

    def acts(batch, seq, ac):
        return _largest([_cached_acts(("llama", cfg, dtype, batch, seq, ac, head_loss, compiled_head, kind, step_run),
                                      functools.partial(measure_llama, cfg, dtype, batch, seq, ac, head_loss,
                                                        compiled_head, block, step_run))
                         for kind, block in kinds.items()])
    return model, units, blocks, acts, notes


def _largest(profiles: list) -> ActivationProfile:
    """One profile whose every byte count is the largest of ``profiles``' (the first's grad windows):
    an upper bound for a model whose blocks are of those kinds."""
    fields = {f.name: max(getattr(p, f.name) for p in profiles)
              for f in dataclasses.fields(profiles[0]) if f.name != "grad_window"}
    return dataclasses.replace(profiles[0], **fields)


@functools.lru_cache(maxsize=16)
def _meta_llama(cfg, dtype: torch.dtype, transforms: tuple = (), given: Optional[nn.Module] = None):
    """The bundled Llama of ``cfg`` on the meta device (or a copy of the ``given`` one, itself where no
    transform changes it) with ``transforms`` applied as ``parallelize`` applies them, and one block of
    each kind (``block_kind`` -> its first block): what model state is sized from and activations are
    measured on. Built once per (shape, transforms): a search (``mfsdp plan``, ``--parallel.offload
    auto``, ``--parallel.keep_gathered_blocks auto``) estimates dozens of settings of one model, and
    building the 8B one costs more than the rest of an estimate. Read only."""
    from mfsdp.models import build_model

    if given is None:
        with torch.device("meta"):
            given = build_model(cfg, dtype=dtype)
    elif transforms:
        given = copy.deepcopy(given)
    model, kinds = apply_transforms(given, transforms), {}
    for block in model.layers:
        kinds.setdefault(block_kind(block), block)
    return model, kinds


_ACTS: dict = {}


def _cached_acts(key, measure) -> ActivationProfile:
    """``measure()``, once per ``key`` (None: not cached): a profile depends only on the shape it
    is measured at (fake tensors, no data), and a search (``mfsdp plan``, the memory check's nearest
    setting) estimates dozens of settings that differ only in placements, gradient dtype or offload,
    so it would measure the same few (batch, checkpointing) pairs again and again. The oldest of 64
    entries makes room for a new one."""
    if key is None:
        return measure()
    if key not in _ACTS:
        if len(_ACTS) >= 64:
            _ACTS.pop(next(iter(_ACTS)))
        _ACTS[key] = measure()
    acts = _ACTS[key]
    return dataclasses.replace(acts, grad_window=dict(acts.grad_window))  # the caller's own dict


def _hf(obj, dtype, tp: TensorParallel, tp_mesh, transforms: tuple = (), step_run=None):
    """A Hugging Face model's parts, its model state from the meta model with ``transforms`` applied (as
    the manager route applies them) and its activations measured without them."""
    import transformers

    from mfsdp.manager.core_options import resolve_unit_modules
    from mfsdp.hf.sharded import meta_model_from_config

    given = isinstance(obj, nn.Module)
    model = obj if given else meta_model_from_config(obj, dtype=dtype)
    notes = []
    if transforms:
        model = apply_transforms(copy.deepcopy(model) if given else model, transforms)
        notes.append(f"{', '.join(map(str, transforms))}: model state of the transformed model; activations "
                     "measured on the Hugging Face model without the transforms")
    if tp.enabled:  # the manager's first step, on a copy: parameters become TP DTensors
        model = apply_tp(copy.deepcopy(model) if given else model, tp, tp_mesh)
        notes.append(f"{tp.describe()}: model state from the TP-local shards of the manager's plan (tp rank 0), "
                     "activations measured on a two-layer copy with the plan applied over a fake process group")
    units = [m for _, m in resolve_unit_modules(model)]
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(m)] for m in units[::-1]]
    config_json = model.config.to_json_string()
    config = transformers.AutoConfig.for_model(**json.loads(config_json))
    dtype = next(model.parameters()).dtype

    def acts(batch, seq, ac):  # a custom plan (module patterns -> styles) is not a cache key
        key = None if tp.plan is not None else ("hf", config_json, dtype, batch, seq, ac, tp, step_run)
        return _cached_acts(key, functools.partial(measure_hf, config, dtype, batch, seq, ac, tp=tp, tp_mesh=tp_mesh,
                                                   step_run=step_run))
    return model, units, blocks, acts, notes
