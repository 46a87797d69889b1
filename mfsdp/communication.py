"""Communication policy: how aggressively a module's collectives are scheduled and packed."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CommunicationPolicy:
    """Scheduling and packing of one ``fully_shard`` call's collectives.

    The stream and buffer options (``prefetch_depth``, ``overlap``, ``unify_streams``,
    ``double_buffer``) are read from the root module, since one context schedules the whole tree;
    the others apply per module.
    """

    prefetch_depth: int = 1
    """How many modules ahead (in forward, and in backward order) are gathered while one computes.
    1 overlaps each gather with the previous module's compute at the cost of one extra unsharded
    module in memory; 2 hides longer gathers behind short modules at the cost of a second; 0 gathers
    just in time."""
    overlap: bool = True
    """False runs every collective on the compute stream with no prefetch: slower, but any
    ordering bug becomes deterministic, which is what you want while debugging."""
    unify_streams: bool = False
    """One side stream for gathers and reductions. The allocator can then reuse blocks between
    them (lower peak memory), but a reduction can no longer run during the next gather."""
    double_buffer: bool = False
    """Repeated same-size modules (transformer blocks) gather into ``prefetch_depth + 1``
    persistent buffers, module ``k`` always into slot ``k % (prefetch_depth + 1)``, instead of
    allocating and freeing a buffer per unshard: no allocation on the hot path and a fixed memory
    layout, at the cost of keeping those buffers at rest. Needed by ``use_symm_mem``. A schedule
    that would overwrite a slot still in use raises. Read from the root."""
    prefetch_across_step: bool = True
    """A bound optimizer (``fully_shard_optimizer``) first updates the modules the next forward
    gathers first (the root and ``prefetch_depth`` more), starts their gathers, and updates the rest
    while those run, instead of leaving them exposed at the start of the next forward. Needs an
    optimizer whose update of a parameter reads only that parameter's gradient and state (torch's
    SGD, Adam, AdamW and kin); others, a closure, or a step pre hook registered after binding step
    in one call. Read from the root; off with ``overlap=False``."""
    high_priority_streams: bool = False
    """Create the gather and reduction streams at CUDA's high priority (as FSDP2 does), so that their
    kernels (on one GPU: the casts into the gather buffers, the gradient adds) take SMs as soon as the
    running compute kernels let go of some, instead of only when the compute stream stops to wait for
    them: GEMMs hold every SM, and at equal priority a side-stream kernel is starved until its consumer
    blocks (``benchmarks/results/2026-12-03_h200x1_session9``). Off by default until a GPU measures
    its gain. Read from the root."""
    keep_gathered: bool = False
    """This module's gathered weights stay in memory from its first gather until the main weights
    change (an optimizer step, a load, ``refresh_model_weights``), instead of being freed after every
    forward and backward. With M microbatches per step that is one gather per step instead of 2M:
    on one GPU one cast (or FP8 encode) instead of 2M, on several one all-gather. The price is the
    module's whole gathered weights resident through the step (``mfsdp.memory`` counts them), and
    a module that keeps its gather never shares a ``double_buffer`` slot. An in-place edit of the
    main weights outside the optimizer is reported with ``refresh_model_weights``, as for the compute
    copies that ZeRO-1/2 and HFSDP keep. Applies per module."""
    coalesce: bool = True
    """False issues one collective launch per parameter instead of one coalesced launch per group:
    only for debugging or backends without coalescing."""
    gradient_divide_factor: float = 1.0
    """Extra division of gradients after the data-parallel average: e.g. the expert-parallel
    size for experts, or to turn averaged gradients into sums (pass 1 / world size)."""
    check_collectives: bool = False
    """Debug mode: before every collective, the ranks of its group exchange a small fingerprint
    (kind, module, sizes, dtype) and compare them, so ranks about to issue different collectives
    (which would hang, or mix two modules' data) fail at once with every rank's module and call
    path. Costs one extra tiny collective and a host sync per collective. The environment variable
    ``MFSDP_CHECK_COLLECTIVES=1`` turns it on for every module without a code change."""
    check_finite_gradients: bool = False
    """After the last microbatch's backward, one fused check per group; a NaN or Inf raises
    FloatingPointError on every rank, naming the backward count, the modules and the parameters.
    Costs one tiny all-reduce and a host sync per step."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch_depth, int) or isinstance(self.prefetch_depth, bool) or self.prefetch_depth < 0:
            raise ValueError(f"CommunicationPolicy.prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        if not self.gradient_divide_factor > 0:
            raise ValueError(
                f"CommunicationPolicy.gradient_divide_factor must be > 0, got {self.gradient_divide_factor!r}")
