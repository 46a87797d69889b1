"""The memory of a training run per GPU, and the settings that fit: what ``mfsdp plan`` prints and
``mfsdp train``'s memory check and ``--parallel.offload auto`` ask. A run is described by a
``PlannedRun`` (``mfsdp.train.command.plan`` builds one from a ``mfsdp train`` config); a ``Setting`` is one
combination of the knobs the search varies."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

import torch

from mfsdp.memory.activations import StepRun
from mfsdp.memory.api import estimate
from mfsdp.memory.estimate import COMPONENTS, GIB, PLANNER_OVERSHOOT, RESERVE_FRACTION, MemoryEstimate
from mfsdp.memory.tensor_parallel import TensorParallel
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.transforms import hook_results

PLACEMENT_SPEED = ("zero1", "zero2", "zero3")
"""Faster first: ZeRO-1 and ZeRO-2 gather weights once per step, ZeRO-3 in every pass."""
DEFAULT_GPU = 141 * GIB


@dataclasses.dataclass(frozen=True)
class Setting:
    """One candidate: what ``mfsdp train`` flags would change."""

    placements: str
    """zero1, zero2, zero3 (or the config's hsdp / hfsdp)."""
    activation_checkpointing: bool
    """Recompute blocks in backward."""
    local_batch: int
    """Sequences per microbatch; microbatches keep the tokens per step."""
    microbatches: int
    """Microbatches per step."""
    main_grads_dtype: str = "auto"
    """fp32, bf16 or "auto" (``--parallel.main_grads_dtype``). bf16 halves the gradient buffers; the
    optimizer step upcasts them to fp32 one group at a time (the largest group's bytes at most)."""
    offload: float = 0.0
    """Share of the units whose optimizer steps on the host (``--parallel.offload optimizer
    --parallel.offload_fraction``); 0: none."""
    tokens: int = 0
    """Tokens per optimizer step on one GPU (what decides whether offload can hide its CPU step)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload <= 1.0:
            raise ValueError(f"Setting.offload must be in [0, 1], got {self.offload}")

    def flags(self) -> str:
        off = (f" --parallel.offload optimizer --parallel.offload_fraction {self.offload:g}" if self.offload else "")
        return (f"--parallel.placements {self.placements} --parallel.activation_checkpointing "
                f"{str(self.activation_checkpointing).lower()} --data.local_batch {self.local_batch} "
                f"--data.microbatches {self.microbatches} --parallel.main_grads_dtype {self.main_grads_dtype}{off}")

    def knobs(self) -> tuple:
        """What a user changes to go from one setting to another (the microbatches follow the batch)."""
        return (self.placements, self.activation_checkpointing, self.local_batch, self.main_grads_dtype, self.offload)

    def step_cost(self, share: Optional[float] = None) -> float:
        """The step's predicted time, relative to the same tokens with neither checkpointing nor
        offload: ``AC_COST`` more with checkpointing, plus what the host step of ``share`` of the
        parameters leaves exposed (``exposed_share``; ``share`` defaults to the unit fraction)."""
        exposed = exposed_share(self, self.offload if share is None else share) if self.offload else 0.0
        return 1.0 + AC_COST * self.activation_checkpointing + exposed

    def speed_key(self, share: Optional[float] = None) -> tuple:
        rank = PLACEMENT_SPEED.index(self.placements) if self.placements in PLACEMENT_SPEED else len(PLACEMENT_SPEED)
        return (round(self.step_cost(share), 3), self.offload, -self.local_batch, rank)


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """What the planner needs to know of a training run besides the ``Setting`` it searches over."""

    model: object
    """The bundled model's ``LlamaConfig``, or a Hugging Face model (the manager's): its transformers
    config or its directory."""
    setting: Setting
    """The setting the run is configured with."""
    seq_len: int
    """Tokens per sequence."""
    grads_dtypes: dict
    """What each ``main_grads_dtype`` name ("auto", "fp32", "bf16") means for this model, as the core's
    ``main_grads_dtype`` (None: its default)."""
    auto_grads: str
    """What "auto" resolves to, "fp32" or "bf16" (the search tries the other one second)."""
    replicate: int = 1
    """Replicas of hsdp / hfsdp."""
    compute_dtype: torch.dtype = torch.bfloat16
    """Dtype of forward and backward."""
    grad_comm_dtype: Optional[torch.dtype] = None
    """Dtype of the gradient reduction (None: the core's default)."""
    expert_units: bool = False
    """Each expert of a mixture of experts sharded as its own unit."""
    transforms: tuple = ()
    """The model transforms ``parallelize`` applies (``ParallelizeConfig.transforms``), replayed on the
    planner's meta model."""
    foreach: bool = False
    """AdamW's foreach kernels (a shard-sized temporary at the step), else the fused one."""
    compiled: bool = True
    """Blocks compiled with torch.compile."""
    async_checkpoint: bool = True
    """Checkpoints staged in pinned host memory (counted in the host RAM line)."""
    head_loss: str = "plain"
    """The bundled Llama's head loss, "plain" or "fused" (``Llama.set_head_loss``)."""
    compiled_head: Optional[bool] = None
    """The bundled Llama's head loss compiled too; None: as the blocks (``mfsdp train`` compiles both;
    a benchmark loop that computes the loss eagerly sets False)."""
    flat_adamw: bool = False
    """AdamW steps each group flat (``mfsdp.flat_adamw``), with no transient at the step."""
    keep_gathered_blocks: int = 0
    """The last blocks that keep their gathered weights through the step (``kept_blocks``)."""
    step_run: Optional[StepRun] = None
    """What a step of another objective than the causal LM's runs (``estimate``'s ``step_run``)."""
    ep: int = 1
    """The experts split over that many ranks (``--parallel.ep``; ``estimate``'s ``expert_parallel``)."""

    @property
    def hf(self) -> bool:
        return isinstance(self.model, (str, Path)) or hasattr(self.model, "to_json_string")


OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""The offload fractions the search tries, after none."""
AC_COST = 0.17
"""What activation checkpointing adds to a step, as a share of it (measured at 8B compiled;
benchmarks/results/2026-12-01_planner_step_costs.md)."""
HOST_STEP_S_PER_PARAM = 0.375e-9
"""Host seconds per offloaded parameter of one optimizer step, copies included (fused CPU AdamW on
an H200 host's cores; the same results file)."""
HOST_TOKENS = 31_250
"""Tokens per GPU and optimizer step at which the host step of every parameter lasts as long as the
step's compute: ``HOST_STEP_S_PER_PARAM`` times the GPU's model FLOP/s over 6 FLOPs per parameter and
token. Both scale with the parameters, so the ratio holds for any model size on that hardware."""


def exposed_share(setting: "Setting", share: float) -> float:
    """The host step that offload leaves exposed, as a share of the step's compute. The ranks of a
    node share its cores, so a node steps ``share`` of the parameters whatever its ranks (one node
    assumed); the step hides only behind the last microbatch's backward (2/3 of its compute), from
    the first offloaded unit's gradient on (checked against the measured offload rows in
    benchmarks/results/2026-12-01_planner_step_costs.md)."""
    return max(0.0, HOST_TOKENS * share / setting.tokens - 2 / (3 * setting.microbatches))


def parse_bytes(text: str) -> int:
    """"141GiB", "80GB", "75.5 GiB", or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 141GiB or 80GB")
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def estimate_run(run: PlannedRun, world: int, setting: Optional[Setting] = None,
                 tp: TensorParallel = TensorParallel(), tp_in_process: bool = False) -> MemoryEstimate:
    """The estimate of ``run`` on ``world`` GPUs, optionally with another ``setting``; ``tp``: the
    manager's tensor parallel (a Hugging Face model only), ``world`` counting tp ranks too;
    ``tp_in_process``: see ``estimate`` (``mfsdp plan``'s process never holds a real group)."""
    s = setting or run.setting
    if run.hf and s.placements not in ("zero3", "zero2", "zero1", "ddp") and run.replicate == 1:
        raise ValueError("--model.hf: hsdp/hfsdp need --parallel.replicate > 1")
    if tp.enabled and not run.hf:
        raise ValueError("--tp: tensor parallel is the manager's; plan a Hugging Face model (--model.hf DIR)")
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=run.grads_dtypes[s.main_grads_dtype],
                                  grad_comm_dtype=run.grad_comm_dtype)
    return estimate(run.model, world_size=world, placements=s.placements, replicate=run.replicate,
                    offload_fraction=s.offload, mixed_precision_policy=policy, local_batch=s.local_batch,
                    seq_len=run.seq_len, microbatches=s.microbatches, activation_checkpointing=s.activation_checkpointing,
                    compute_dtype=run.compute_dtype, expert_units=run.expert_units, tensor_parallel=tp,
                    tp_in_process=tp_in_process, transforms=run.transforms, foreach=run.foreach, compiled=run.compiled,
                    compiled_head=run.compiled if run.compiled_head is None else run.compiled_head,
                    head_loss=run.head_loss, flat_adamw=run.flat_adamw,
                    keep_gathered_blocks=run.keep_gathered_blocks, step_run=run.step_run, expert_parallel=run.ep)


def candidates(run: PlannedRun) -> list[Setting]:
    """Settings to try, fastest first; the tokens per step stay those of the run, and each setting
    comes with the run's gradient dtype before the other one."""
    c = run.setting
    tokens = c.local_batch * c.microbatches
    batches = [b for b in range(tokens, 0, -1) if tokens % b == 0 and (b & (b - 1) == 0 or b == c.local_batch)]
    placements = [c.placements] if c.placements in ("hsdp", "hfsdp") else list(PLACEMENT_SPEED)
    placements = [pl for pl in placements if not any(hook_results(run.transforms, "placement_problem", pl))]
    grads = [c.main_grads_dtype, *(g for g in ("fp32", "bf16") if g != (
        run.auto_grads if c.main_grads_dtype == "auto" else c.main_grads_dtype))]
    out = [Setting(pl, ac, b, tokens // b, g, off, tokens * run.seq_len) for pl in placements for ac in (False, True)
           for b in batches for off in (0.0, *OFFLOAD_FRACTIONS) for g in grads]
    return sorted(out, key=Setting.speed_key)


def fitting(run: PlannedRun, world: int, gpu_bytes: int, tp: TensorParallel = TensorParallel(),
            tight: bool = False) -> list[tuple[Setting, MemoryEstimate]]:
    """Every candidate that fits with the allocator's margin (``tight``: or within it), fastest first;
    the other gradient dtype only where the config's does not fit, offload only where neither
    does, and then its smallest fraction that fits."""
    out, seen, hopeless, estimates = [], set(), set(), {}
    fits = lambda e: e.fit(gpu_bytes) == "fits" or (tight and e.fit(gpu_bytes) == "tight")  # noqa: E731

    def estimate(setting: Setting) -> MemoryEstimate:
        if setting not in estimates:
            estimates[setting] = estimate_run(run, world, setting, tp, tp_in_process=True)
        return estimates[setting]

    for s in candidates(run):
        layout = dataclasses.replace(s, main_grads_dtype=None, offload=0.0)
        if layout in seen or (layout, s.main_grads_dtype) in hopeless:
            continue
        if s.offload and s.offload != OFFLOAD_FRACTIONS[-1]:
            # Offloading more never needs more GPU memory: where the whole offload does not fit,
            # no smaller fraction does, and the search skips them (one estimate, not four).
            whole = dataclasses.replace(s, offload=OFFLOAD_FRACTIONS[-1])
            if not fits(estimate(whole)):
                hopeless.add((layout, s.main_grads_dtype))
                continue
        e = estimate(s)
        if fits(e):
            out.append((s, e))
            seen.add(layout)
    # Fastest first, with the share of the parameters each estimate offloads (not the unit fraction).
    return sorted(out, key=lambda pair: pair[0].speed_key(getattr(pair[1], "offloaded_share", None)))


def nearest(run: PlannedRun, world: int, gpu_bytes: int, tight: bool = False) -> Optional[tuple[Setting, MemoryEstimate]]:
    """The fitting setting (``tight``: or one within the margin) that changes the fewest of the
    run's knobs, then the fastest."""
    now = run.setting.knobs()
    fits = fitting(run, world, gpu_bytes, tight=tight)
    changes = lambda s: sum(a != b for a, b in zip(s.knobs(), now))  # noqa: E731
    return min(fits, key=lambda pair: changes(pair[0]), default=None)  # the first of the fewest: fastest


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def breakdown_table(e: MemoryEstimate) -> str:
    rows = [f"{'component':<26} {'at peak GiB':>11} {'max GiB':>9}"]
    for name in COMPONENTS:
        at, top = e.breakdown.get(name, 0), e.component_max(name)
        if at or top:
            rows.append(f"{name:<26} {gib(at):>11} {gib(top):>9}")
    rows.append(f"{'peak allocated':<26} {gib(e.peak_bytes):>11}   ({e.peak_phase})")
    rows.append(f"{'+ allocator reserve':<26} {gib(e.allocator_reserve):>11}")
    rows.append(f"{'+ CUDA context, NCCL':<26} {gib(e.outside_allocator):>11}")
    rows.append(f"{'= device memory needed':<26} {gib(e.device_bytes):>11}")
    rows.extend(f"note: {note}" for note in e.notes)
    return "\n".join(rows)


def plot_phases(e: MemoryEstimate, path: Path) -> Path:
    """One PNG: allocated memory over the phases of a step, stacked by component."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in COMPONENTS if any(p.components.get(c) for p in e.phases)]
    xs = range(len(e.phases))
    fig, ax = plt.subplots(figsize=(max(8, len(e.phases) * 0.12), 5))
    ax.stackplot(xs, [[p.components.get(c, 0) / GIB for p in e.phases] for c in names], labels=names, step="mid")
    ticks = [i for i, p in enumerate(e.phases) if i == 0 or p.name.split(":")[0] != e.phases[i - 1].name.split(":")[0]
             or "loss" in p.name or p.name == e.peak_phase]
    ax.set_xticks(ticks, [e.phases[i].name for i in ticks], rotation=30, ha="right", fontsize=7)
    ax.axhline(e.peak_bytes / GIB, color="k", lw=0.8, ls="--")
    ax.set_ylabel("allocated GiB per GPU")
    s = e.settings
    ax.set_title(f"{s.placements}, {s.world_size} GPUs, batch {s.local_batch}x{s.seq_len}, "
                 f"{'AC' if s.activation_checkpointing else 'no AC'}: peak {gib(e.peak_bytes)} GiB at {e.peak_phase}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(run: PlannedRun, e: MemoryEstimate, model: str, world: int, tp: TensorParallel, gpu: int, source: str,
           ranks_per_node: int, staging: int = 0) -> str:
    """What ``mfsdp plan`` prints of ``run``'s estimate ``e`` on ``gpu`` bytes per GPU (``source``:
    where that figure comes from): the breakdown, the verdict, the host RAM and the settings that
    fit, fastest first; ``staging``: an asynchronous checkpoint's pinned bytes per rank."""
    s = e.settings
    variant = "".join(f" ({label})" for label in s.transforms) + \
        (f" ({s.head_loss} head loss)" if s.head_loss != "plain" else "")
    parallel = f" x {tp.describe()}" if tp.enabled else ""
    verdict = {"fits": "fits", "no": "does NOT fit",
               "tight": f"is tight (within the {RESERVE_FRACTION:.0%} allocator margin: it should train, "
                        "but may run out of memory)"}[e.fit(gpu)]
    objective = f"{run.step_run.label}, " if run.step_run is not None else ""
    lines = [f"mfsdp plan: {model}{variant}, {objective}{s.placements}{parallel} on {world} GPU(s), local batch {s.local_batch} "
             f"x {s.seq_len} tokens, {s.microbatches} microbatch(es), activation checkpointing "
             f"{'on' if s.activation_checkpointing else 'off'}\n", breakdown_table(e),
             f"\nthis setting {verdict} in {gib(gpu)} GiB per GPU ({source})",
             host_ram_line(e, ranks_per_node, staging) + "\n"]
    fits = fitting(run, world, gpu, tp) or fitting(run, world, gpu, tp, tight=True)
    if not fits:
        return "\n".join(lines + [f"no setting of {SEARCHED} fits; use more GPUs"])
    lines.append(f"settings that fit{' within the margin' if fits[0][1].fit(gpu) == 'tight' else ''}, fastest "
                 f"first (tokens per step kept):\n{'':2}{'peak GiB':>8} {'needs GiB':>9}  flags")
    lines += [f"  {gib(est.peak_bytes):>8} {gib(est.device_bytes):>9}  {setting.flags()}{offload_note(setting, est)}"
              for setting, est in fits[:12]]
    return "\n".join(lines)


def host_ram_line(e: MemoryEstimate, ranks_per_node: int, staging: int = 0) -> str:
    """Host RAM per node: the offloaded optimizer's (``OffloadedEstimate.host_bytes``) and
    ``staging``, an asynchronous checkpoint's pinned staging per rank."""
    parts = {**getattr(e, "host_bytes", {}), **({"checkpoint staging": staging} if staging else {})}
    total = sum(parts.values())
    detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v) or "nothing counted"
    return f"host RAM: {gib(total * ranks_per_node)} GiB per node ({ranks_per_node} rank(s) x {gib(total)} GiB: {detail})"


def offload_note(setting: Setting, e: MemoryEstimate) -> str:
    if not setting.offload:
        return ""
    share = e.offloaded_share
    host_step = HOST_STEP_S_PER_PARAM * (e.host_bytes["master"] // 4) * e.settings.world_size  # one node
    host_share = HOST_TOKENS * share / setting.tokens  # the host step, as a share of the step's compute
    exposed = host_step * exposed_share(setting, share) / host_share  # the part of it left exposed
    slower = (" (slower than checkpointing without offload)"
              if not setting.activation_checkpointing and setting.step_cost(share) > 1 + AC_COST else "")
    return f"   [host {gib(sum(e.host_bytes.values()))} GiB per rank, ~{exposed:.2f} s CPU exposed per step{slower}]"


def kept_blocks_that_fit(run: PlannedRun, world: int, gpu_bytes: int, blocks: int) -> int:
    """``mfsdp train --parallel.keep_gathered_blocks auto``: the most of the ``blocks`` blocks that may
    keep their gathers with the run still fitting ``gpu_bytes`` with the allocator's margin (0 if none
    does). Kept blocks only add memory, so the count that fits is found by bisection."""
    def fits(n: int) -> bool:
        return estimate_run(dataclasses.replace(run, keep_gathered_blocks=n), world).fit(gpu_bytes) == "fits"

    low, high = 0, blocks  # fits(low) is assumed (checked by the memory check), high is the upper end
    if fits(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def offload_fraction_that_fits(run: PlannedRun, world: int, gpu_bytes: int) -> Optional[float]:
    """``mfsdp train --parallel.offload auto``: the smallest offload fraction (0: none) with which
    the run's own setting fits, or None if none does."""
    return next((fraction for fraction in (0.0, *OFFLOAD_FRACTIONS) if estimate_run(
        run, world, dataclasses.replace(run.setting, offload=fraction)).fit(gpu_bytes) == "fits"), None)


SEARCHED = "placements, checkpointing, local batch, gradient dtype and optimizer offload"
"""The knobs ``candidates`` varies (``Setting``), as the messages name them."""


def memory_check(run: PlannedRun, world: int, gpu_bytes: int) -> Optional[tuple[str, str]]:
    """None when the run's predicted memory fits ``gpu_bytes`` per GPU with the allocator's margin;
    ("warn", line) when it is within the margin; ("refuse", line) when even the least it could need
    does not fit (see [Note: the memory check's margins] in ``estimate``)."""
    e = estimate_run(run, world)
    verdict = e.fit(gpu_bytes)
    if verdict == "fits":
        return None
    roomy = nearest(run, world, gpu_bytes)
    head = f"predicted peak memory {gib(e.peak_bytes)} GiB per GPU (at {e.peak_phase})"
    if verdict == "tight":
        fix = f"; with room to spare ({gib(roomy[1].device_bytes)} GiB): {roomy[0].flags()}" if roomy else ""
        return "warn", (f"{head} is within the {RESERVE_FRACTION:.0%} allocator margin of this GPU's "
                        f"{gib(gpu_bytes)} GiB ({gib(e.device_bytes)} GiB with it and the CUDA context): it "
                        f"should train, but may run out of memory if the allocator fragments{fix}")
    near = nearest(run, world, gpu_bytes, tight=True) if roomy is None else None
    fix = (f"nearest setting that fits ({gib(roomy[1].device_bytes)} GiB): {roomy[0].flags()}" if roomy
           else f"nearest setting that may fit, within the margin ({gib(near[1].least_device_bytes)} GiB at "
                f"least): {near[0].flags()}" if near else f"no setting of {SEARCHED} fits: use more GPUs")
    return "refuse", (f"{head} does not fit this GPU's {gib(gpu_bytes)} GiB: it needs at least "
                      f"{gib(e.least_device_bytes)} GiB (the peak less the planner's {PLANNER_OVERSHOOT:.0%} "
                      f"tolerance, plus the CUDA context); {fix}; or override with --train.skip_memory_check true")
