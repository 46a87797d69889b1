"""``estimate``: one rank's memory over the phases of a training step, and its peak.

The step is replayed in the runtime's host order (allocations happen when the host issues them, so
``torch.cuda.max_memory_allocated`` follows it): the forward walk gathers each unit and prefetches
``prefetch_depth`` more (the root stays gathered into backward); the backward walk enters units in
the schedule's order (root, then children last to first), prefetching as it enters, and at each
unit's exit reshards it, releases pending reductions by the rule of ``in_flight`` (at most two
pending), packs the gradients in the reduction dtype and reduces them into the main gradient (or
HFSDP's accumulator); the optimizer step runs group by group, so its transient (gradients kept in
another dtype upcast, AdamW's foreach temporary) is the largest group's (``step_transient_bytes``).
Model state comes from ``model_state`` (the runtime's layout), activations from ``activations``
(measured on fake tensors).

FP8 all-gather: a step that gathers a unit with an encoded group records a phase of its own just
before the compute phase it is issued in ("..., gather (FP8 encode)"): the encode's transient
staging (``GroupBytes.encode_staging``, the largest of the groups gathered then: each group's is freed
before the next group encodes) on top of that phase's state less what its compute adds (the
activation transient, in backward the unit's own weight gradients), which comes only after the
gathers are issued (host order). The compute phase itself has no staging.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mfsdp.memory.activations import ActivationProfile
from mfsdp.memory.model_state import UnitBytes, optimizer_state_bytes
from mfsdp.optimizer import step_transient_bytes
from mfsdp.runtime.gather_slots import slotted
from mfsdp.runtime.in_flight import keeps_pending
from mfsdp.runtime.schedule import Schedule, StepKind

COMPONENTS = (
    "main weights", "optimizer states", "model weights", "gather slots", "unsharded (kept)", "main grads", "accumulator",
    "unsharded (forward)", "unsharded (backward)", "FP8 encode staging", "module grads", "reduction staging",
    "activations (saved)", "activations (transient)", "logits and loss", "optimizer step", "workspace",
)
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Phase:
    """Allocated bytes at the highest point of one phase of the step, by component."""

    name: str
    """What runs: "forward: layers.3", "backward: reduce output", "optimizer step"..."""
    components: dict
    """Component name (one of ``COMPONENTS``) -> bytes."""

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step being predicted."""

    placements: str
    """Name of the placement combination (ZeRO-3, HSDP...)."""
    world_size: int
    """Ranks in the mesh."""
    local_batch: int
    """Sequences per rank per microbatch."""
    seq_len: int
    """Tokens per sequence."""
    microbatches: int
    """Microbatches per optimizer step."""
    activation_checkpointing: bool
    """Whether blocks recompute their activations in backward."""
    optimizer: str
    """"adamw" or "sgd"."""
    foreach: bool = True
    """Whether the optimizer runs foreach kernels (AdamW then keeps one shard-sized temporary)."""
    flat_adamw: bool = False
    """Whether AdamW steps each group flat (``mfsdp.flat_adamw``: no upcast, no temporary)."""
    prefetch_depth: int = 1
    """Units gathered ahead (0 where ``overlap`` is off)."""
    prefetch_across_step: bool = True
    """Whether the optimizer step gathers the next forward's first units while it updates the rest
    (``CommunicationPolicy.prefetch_across_step``; torch's elementwise optimizers)."""
    double_buffer: bool = False
    """Whether repeated units gather into persistent slots."""
    kept_gathered: tuple = ()
    """Names of the units that keep their gathered weights through the step
    (``CommunicationPolicy.keep_gathered``): resident in every phase, and never in a slot."""
    cuda: bool = True
    """Count the CUDA workspaces (cuBLAS, two handles) that the caching allocator holds."""
    tp: int = 1
    """Tensor-parallel ranks (``world_size`` counts them: data-parallel ranks x tp)."""
    transforms: tuple = ()
    """The model transforms planned, each as ``str(transform)`` names it ("float8 tensorwise")."""
    head_loss: str = "plain"
    """The bundled Llama's head loss ("plain" or "fused", ``Llama.set_head_loss``)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The prediction for one rank (rank 0, which holds the largest uneven shards)."""

    settings: StepSettings
    """What was predicted."""
    phases: tuple
    """Every phase of the step, in order (``Phase``)."""
    peak_bytes: int
    """Predicted peak of allocated memory (``torch.cuda.max_memory_allocated``)."""
    peak_phase: str
    """The phase where the peak occurs."""
    breakdown: dict
    """Component -> bytes at the peak."""
    allocator_reserve: int
    """A margin for what the caching allocator holds beyond allocated bytes (``RESERVE_FRACTION``);
    a prediction inside it warns, it does not refuse."""
    outside_allocator: int
    """Device memory no tensor accounts for: the CUDA context, NCCL's buffers."""
    notes: tuple = ()
    """Assumptions behind the numbers (tensor parallel, MoE routing), one line each."""

    @property
    def device_bytes(self) -> int:
        """Device memory for the step with room to spare: the peak plus the reserve and the context."""
        return self.peak_bytes + self.allocator_reserve + self.outside_allocator

    @property
    def least_device_bytes(self) -> int:
        """The smallest device that might still hold the step: the peak less the planner's largest
        measured over-prediction (``PLANNER_OVERSHOOT``), plus the context."""
        return int(self.peak_bytes * (1 - PLANNER_OVERSHOOT)) + self.outside_allocator

    def fit(self, gpu_bytes: int) -> str:
        """"fits" (with the reserve), "tight" (within the reserve of the limit: it should train, the
        allocator may run short) or "no" (even ``least_device_bytes`` exceeds ``gpu_bytes``)."""
        if self.device_bytes <= gpu_bytes:
            return "fits"
        return "tight" if self.least_device_bytes <= gpu_bytes else "no"

    def component_max(self, name: str) -> int:
        return max(p.components.get(name, 0) for p in self.phases)


# [Note: the memory check's margins] (tests/test_prelaunch_checks.py holds them to the committed
# GPU results). What torch.cuda.max_memory_reserved adds over max_memory_allocated is the caching
# allocator's cache, and it grows into whatever is free: 0.4-21 GiB (0.7-27 %) on the committed 1- and
# 2-GPU mfsdp runs of benchmarks/results. It is not needed memory: before it reports an OOM the
# allocator frees its cached blocks and retries, so the 8b run on one H200 trained at 123.64 GiB
# allocated with 138.36 GiB reserved of 139.80 (2026-11-29_h200x4_run6/w1). What can fail a run
# whose peak fits is the fragmentation left after that: 5.01 GiB (3.8 %) reserved but unallocated
# at the one committed OOM (2026-11-29_h200x1). So the check refuses only a peak that exceeds the
# device even allowing for the planner's error, and warns within RESERVE_FRACTION of the limit.
RESERVE_FRACTION = 0.05
"""Margin on top of the allocated peak for the allocator's fragmentation, above the 3.8 % of the
committed OOM; a prediction inside it warns instead of refusing."""
PLANNER_OVERSHOOT = 0.02
"""The planner's largest over-prediction of a measured peak across the committed GPU grid (+1.7 %:
8b on 4 H200s without checkpointing): a peak refused is one above the device even by this much less."""
OUTSIDE_ALLOCATOR = int(1.5 * GIB)
"""CUDA context and NCCL buffers, outside the caching allocator (about 0.5 + 1 GiB on H200; 1.28 GiB
of non-PyTorch memory in the committed 1-GPU OOM message)."""
CUBLAS_WORKSPACES = 2 * 32 * (1 << 20)
"""cuBLAS workspaces from the caching allocator: one per handle (forward thread, autograd thread)."""


class _Walk:
    """Mutable state of the replay; ``snap`` records a phase."""

    def __init__(self, units: list[UnitBytes], s: StepSettings, blocks: list[str]) -> None:
        self.units = units
        self.by_name = {u.name: u for u in units}
        # The runtime's own schedule over the units: its walk and ancestors, not a copy of them.
        self.schedule = Schedule(units, {id(u): self.by_name[u.parent or ""] for u in units[1:]})
        self.root = units[0]
        self.blocks = blocks
        first = min((i for i, u in enumerate(units) if u.name in blocks), default=len(units))
        self.kind = {u.name: "root" if u is self.root else "block" if self._block_of(u) is not None
                     else "pre" if i < first else "post" for i, u in enumerate(units)}
        slot_bytes, self.in_flight = _gather_slots(units, s)
        # A kept gather is resident from the first step on; its later gathers replace it in place.
        kept = sum(self.in_flight[name] for name in s.kept_gathered)
        self.in_flight.update(dict.fromkeys(s.kept_gathered, 0))
        self.gathered: dict[str, int] = {}
        self.main_grads = self.raw_grads = 0  # held through the phases: main gradients, raw ones in .grad
        self.staging_due = 0  # FP8 encode staging of the gathers issued since the last phase
        self.phases: list[Phase] = []
        # What every phase holds throughout: model state and the cuBLAS workspaces.
        total = lambda field: sum(u.total(field) for u in units)  # noqa: E731
        self.fixed = {"main weights": total("main"), "optimizer states": optimizer_state_bytes(units, s.optimizer),
                      "model weights": total("model"), "gather slots": slot_bytes, "unsharded (kept)": kept,
                      "accumulator": total("accumulator"),  # allocated on the first backward, never released
                      "workspace": CUBLAS_WORKSPACES if s.cuda else 0}

    def _block_of(self, u: UnitBytes) -> Optional[str]:
        name = u.name
        while name is not None:
            if name in self.blocks:
                return name
            name = self.by_name[name].parent if name in self.by_name else None
        return None

    def gather(self, u: UnitBytes) -> None:
        if u.name not in self.gathered:
            self.gathered[u.name] = self.in_flight[u.name]
            self.staging_due = max([self.staging_due, *(g.encode_staging for g in u.groups)])

    def snap(self, name: str, at_gather: Optional[dict] = None, **parts) -> None:
        """Record a phase: the fixed components, the gradients held (``main_grads``, ``raw_grads``) and
        ``parts``; where the gathers issued for it encoded, first their own phase: ``parts`` without
        the activation transient (``at_gather`` overrides more), plus the staging."""
        if self.staging_due:
            staging, self.staging_due = self.staging_due, 0
            self.snap(f"{name}, gather (FP8 encode)", **{**parts, "act_transient": 0, **(at_gather or {})},
                      FP8_encode_staging=staging)
        c = {**dict.fromkeys(COMPONENTS, 0), **self.fixed,
             "main grads": self.main_grads, "module grads": self.raw_grads}
        for k, v in parts.items():
            c[k.replace("_", " ").replace("unsharded fwd", "unsharded (forward)")
              .replace("unsharded bwd", "unsharded (backward)").replace("act saved", "activations (saved)")
              .replace("act transient", "activations (transient)")] += v
        self.phases.append(Phase(name, c))


def _gather_slots(units: list[UnitBytes], s: StepSettings) -> tuple[int, dict]:
    """Persistent slot bytes, and each unit's bytes gathered through the allocator (``GatherSlots``)."""
    gathered = [g for u in units[1:] if u.name not in s.kept_gathered
                for g in u.groups if g.gather_key is not None] if s.double_buffer else []
    slots = slotted(gathered, lambda g: g.gather_key, s.prefetch_depth)
    bound = {id(g) for v in slots.values() for g in v}
    slot_bytes = sum(per_group[0].unsharded for per_group in slots.values()) * (s.prefetch_depth + 1)
    return slot_bytes, {u.name: sum(g.unsharded for g in u.groups if id(g) not in bound) for u in units}


def simulate(units: list[UnitBytes], acts: ActivationProfile, s: StepSettings,
             blocks: list[str]) -> MemoryEstimate:
    """Replay one step (its first and, with several, its last microbatch) and find the peak."""
    w = _Walk(units, s, blocks)
    grads_every_backward = any(g.every_backward for u in units for g in u.groups if g.requires_grad)
    for which in (["first", "last"] if s.microbatches > 1 else ["only"]):
        _microbatch(w, acts, s, which, grads_every_backward)
    _optimizer(w, units, s)
    peak = max(w.phases, key=lambda p: p.total)
    return MemoryEstimate(s, tuple(w.phases), peak.total, peak.name, dict(peak.components),
                          int(RESERVE_FRACTION * peak.total) if s.cuda else 0, OUTSIDE_ALLOCATOR if s.cuda else 0)


def _microbatch(w: _Walk, acts: ActivationProfile, s: StepSettings, which: str, every: bool) -> None:
    """One microbatch ("first", "last" or "only"): its forward, then its backward."""
    tag = "" if which == "only" else f" [{which} microbatch]"
    first = which in ("first", "only")
    # Main gradients: freed by zero_grad before the step; with several microbatches the later ones
    # start with every group's (ZeRO-1/DDP: with every raw gradient in .grad instead).
    w.main_grads = 0 if first else (sum(u.total("main_grad") for u in w.units) if every else 0)
    w.raw_grads = 0 if (first or every) else sum(u.total("module_grads") for u in w.units)
    w.gathered = {}
    _forward(w, acts, s.prefetch_depth, tag)
    _backward(w, acts, s.prefetch_depth, tag, first, every, reduces_now=every or which in ("last", "only"))


def _forward(w: _Walk, acts: ActivationProfile, depth: int, tag: str) -> None:
    """The forward walk: each unit gathered with ``depth`` more ahead, released after its forward
    unless it is an ancestor of the next one (the root stays into backward); then the loss."""
    units, root, block, head = w.units, w.root, acts.block_bytes, acts.head_forward_bytes
    computed: list[UnitBytes] = []
    for pos, u in enumerate(units):
        for q in range(pos, w.schedule.issued_by(pos, depth)):  # the earlier ones are gathered already
            w.gather(units[q])
        for done in list(computed):  # post_forward of units that are not ancestors of u
            if done is not root and not w.schedule.is_ancestor_or_self(done, u):
                w.gathered.pop(done.name, None)
                computed.remove(done)
        kind = w.kind[u.name]
        w.snap(f"forward: {u.name or 'root'}{tag}", unsharded_fwd=sum(w.gathered.values()),
               act_saved=_saved_before(w, u, acts),
               act_transient=acts.block_forward_transient + block if kind == "block" else 0,
               logits_and_loss=head if kind == "post" else 0)
        computed.append(u)
    for done in computed:
        if done is not root:
            w.gathered.pop(done.name, None)
    saved_all = acts.embed_bytes + len(w.blocks) * block
    w.snap(f"forward: loss{tag}", unsharded_fwd=sum(w.gathered.values()), act_saved=saved_all,
           logits_and_loss=head + acts.head_forward_transient)
    w.snap(f"backward: loss{tag}", unsharded_bwd=sum(w.gathered.values()), act_saved=saved_all,
           logits_and_loss=head + acts.loss_backward_peak)


def _backward(w: _Walk, acts: ActivationProfile, depth: int, tag: str, first: bool, every: bool,
              reduces_now: bool) -> None:
    """The backward walk: ENTER gathers and prefetches and records the backward of a block, the
    embedding or the head; EXIT reshards, releases pending reductions by the runtime's rule, packs
    and reduces."""
    units, root, block, head = w.units, w.root, acts.block_bytes, acts.head_forward_bytes
    saved_all = acts.embed_bytes + len(w.blocks) * block
    pending: list[tuple[int, int]] = []  # (bytes held, bytes the release rule counts)
    root_grads = _root_grads(root, acts)
    arrived = {"head": root_grads["head"], "blocks": 0, "embed": 0}
    head_done = False
    for position, step in enumerate(w.schedule.backward):
        u = step.module
        if step.kind is StepKind.ENTER:
            if u.gathers_in_backward:
                w.gather(u)
            for following in w.schedule.walk.prefetched_at(position, depth):
                w.gather(following)
            kind = w.kind[u.name]
            own = sum(u.param_grad_bytes) if u is not root else 0  # the weight gradients its backward adds
            if kind == "block":
                arrived["blocks"] = root_grads["blocks"]
                own = acts.block_weight_grad_bytes if u.name in w.blocks else own
                parts = dict(act_saved=_saved_before(w, u, acts) + block,
                             act_transient=acts.block_backward_peak - acts.block_weight_grad_bytes)
            elif kind == "pre":
                arrived["embed"] = root_grads["embed"]
                parts = dict(act_saved=acts.embed_bytes, act_transient=acts.embed_backward_peak)
            elif (kind == "post" or (kind == "root" and not any(w.kind[x.name] == "post" for x in units))) \
                    and not head_done:
                head_done = True
                own = acts.head_weight_grad_bytes if kind == "post" else own  # its own, measured at its peak
                parts = dict(act_saved=saved_all, logits_and_loss=head + acts.head_backward_peak)
            else:
                continue
            w.snap(f"backward: {u.name or 'root'}{tag}", dict(module_grads=sum(arrived.values())),
                   unsharded_bwd=sum(w.gathered.values()), module_grads=own + sum(arrived.values()),
                   reduction_staging=sum(b for b, _ in pending), **parts)
            continue
        if u is not root:
            w.gathered.pop(u.name, None)
        if not any(g.requires_grad for g in u.groups):
            continue
        own = sum(arrived.values()) if u is root else sum(u.param_grad_bytes)
        if not reduces_now:  # ZeRO-1/DDP before the last microbatch: raw gradients stay in .grad
            w.raw_grads += own
            continue
        if u is root:
            arrived = {"head": 0, "blocks": 0, "embed": 0}
        _reduce(w, u, acts, tag, first, every, own, sum(arrived.values()), pending)
    w.snap(f"backward: end{tag}")


def _reduce(w: _Walk, u: UnitBytes, acts: ActivationProfile, tag: str, first: bool, every: bool, own: int,
            arrived: int, pending: list) -> None:
    """``u``'s reduction of ``own`` gradient bytes: the pending ones the runtime's rule releases
    first, then the pack (staging, scatter output) and the main gradient; ``arrived``: the root's
    gradients still held."""
    incoming = u.total("reduction_nbytes")
    while pending and not keeps_pending([r for _, r in pending], incoming):
        pending.pop(0)
    scatter = 0 if (first and all(g.direct for g in u.groups)) else u.total("scatter_out")
    if first or not every:  # the main gradient is allocated by this unit's first reduction
        w.main_grads += u.total("main_grad")
    if w.raw_grads:
        w.raw_grads -= u.total("module_grads")  # now held by the reduction (below)
    w.snap(f"backward: reduce {u.name or 'root'}{tag}", unsharded_bwd=sum(w.gathered.values()),
           module_grads=arrived, act_saved=0 if w.kind[u.name] == "pre" else _saved_before(w, u, acts),
           reduction_staging=own + u.total("staging") + scatter + sum(b for b, _ in pending))
    pending.append((own + u.total("staging"), incoming))


def _saved_before(w: _Walk, u: UnitBytes, acts: ActivationProfile) -> int:
    """Activations saved when ``u``'s forward begins (a block's: those of the blocks before it)."""
    kind = w.kind[u.name]
    blocks = w.blocks.index(w._block_of(u)) if kind == "block" else len(w.blocks) if kind == "post" else 0
    return 0 if kind == "root" else acts.embed_bytes + blocks * acts.block_bytes


def _root_grads(root: UnitBytes, acts: ActivationProfile) -> dict:
    out = {"head": 0, "blocks": 0, "embed": 0}
    for name, nbytes in zip(root.param_names, root.param_grad_bytes):
        out[acts.grad_window.get(name, "head")] += nbytes
    return out


def _optimizer(w: _Walk, units: list[UnitBytes], s: StepSettings) -> None:
    """The bound step (``mfsdp.optimizer``): group by group, each group's upcast gradient (and
    foreach AdamW's temporary) freed before the next group steps, so its bytes are the largest
    group's, by the optimizer's own rule (``step_transient_bytes``)."""
    w.main_grads, w.raw_grads = sum(u.total("main_grad") for u in units), 0

    def step_bytes(units_stepped) -> int:
        return step_transient_bytes(((g.optimizer_numel * g.main_itemsize, g.grads_differ)
                                     for u in units_stepped for g in u.groups if g.requires_grad),
                                    foreach_temporary=s.optimizer == "adamw" and s.foreach,
                                    flat=s.optimizer == "adamw" and s.flat_adamw)

    if not s.prefetch_across_step:
        w.snap("optimizer step", optimizer_step=step_bytes(units))
        return
    # The first units update, then gather while the rest update.
    early = units[:w.schedule.issued_by(0, s.prefetch_depth)]
    w.snap("optimizer step: first units", optimizer_step=step_bytes(early))
    w.gathered = {}
    for u in early:
        w.gather(u)
    w.snap("optimizer step: the rest", unsharded_fwd=sum(w.gathered.values()),
           optimizer_step=step_bytes(units[len(early):]))
