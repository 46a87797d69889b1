"""``MegatronFSDPConfig``: every knob of the manager, validated when the config is built.

The field names follow the Megatron-FSDP manager this package replaces, so an existing YAML or
keyword set keeps working. Two defaults differ on purpose, because they favour correctness over
memory: ``preserve_fp32_weights`` and ``grad_reduce_in_fp32`` are True (fp32 main weights and
fp32 gradient reduction).

The config is a pure value: it checks types, ranges and combinations that can never work. Whether
a feature is available on a given mesh and device is checked by the manager, which raises
``NotImplementedError`` naming the reason for anything mfsdp cannot do yet; no field is ever
silently ignored.

What the data-parallel dims shard is mfsdp's own ``Placements`` (``placements``); Megatron's
integer options (``zero_dp_strategy``, ``outer_dp_sharding_strategy``) are the drop-in front,
which the manager translates into a ``Placements`` in one place (``core_options.dp_placements``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from mfsdp.mesh import DP_REPLICATE, DP_SHARD
from mfsdp.placement import Placements

ZERO_DP_STRATEGY_NAMES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""Megatron-FSDP's names for ``zero_dp_strategy`` levels."""

OUTER_DP_SHARDING_NAMES = {"no_shard": 0, "optim": 1}
"""Names for ``outer_dp_sharding_strategy`` (what the dp_replicate axis shards)."""

def _level(value: Any, names: Mapping[str, int], field: str, top: int) -> int:
    if isinstance(value, str):
        key = value.strip().lower()
        if key in names:
            return names[key]
        if not key.isdigit():
            raise ValueError(f"MegatronFSDPConfig.{field}={value!r} is not a known name; use one of "
                             f"{sorted(names, key=names.get)} or an integer 0..{top}")
        value = int(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"MegatronFSDPConfig.{field} must be an integer 0..{top} or a name, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class MegatronFSDPConfig:
    """How :class:`~mfsdp.manager.MegatronFSDPManager` parallelizes a model.

    ``keep_fp8_transpose_cache`` is *not available*: True raises ``NotImplementedError`` from the
    manager; the field exists so configs written for Megatron-FSDP load (see the field for why).
    """

    megatron_fsdp_unit_modules: Optional[Sequence[Union[str, type]]] = None
    """Default None. Classes whose instances become shard units (gathered and released as one):
    class names (``"LlamaDecoderLayer"``), import paths (``"transformers.models.llama.modeling_llama.
    LlamaDecoderLayer"``) or classes. None: the model's ``_no_split_modules``. Nothing matching is an
    error. The root always becomes a unit too and owns every parameter no unit owns."""

    placements: Optional[Placements] = None
    """Default None (from ``zero_dp_strategy``). mfsdp's own placements over ``("dp_shard",)`` or ``("dp_replicate",
    "dp_shard")`` (``Placements.zero1("dp_shard")``); the integers below then keep their defaults."""

    zero_dp_strategy: Union[int, str] = 3
    """Default 3. Megatron's front for ``placements``: what dp_shard shards, 0 ``no_shard`` (DDP), 1
    ``optim`` (ZeRO-1: optimizer state), 2 ``optim_grads`` (ZeRO-2: + gradients), 3 ``optim_grads_params``
    (ZeRO-3: + parameters; HSDP with dp_replicate > 1). Stored as the integer."""

    outer_dp_sharding_strategy: Union[int, str] = 0
    """Default 0. With ``dp_replicate > 1`` and ``zero_dp_strategy=3``: 0 ``no_shard`` replicates
    everything across dp_replicate (HSDP); 1 ``optim`` also shards the optimizer state and main
    weights across it (HFSDP; needs dim 0 of every parameter divisible by the dp size)."""

    init_fsdp_with_meta_device: bool = False
    """Default False. True: ``parallelize`` accepts a model built on the meta device (e.g.
    :func:`~mfsdp.hf.sharded.meta_model_from_config`); ``fully_shard`` allocates only this
    rank's shards, meta buffers (RoPE ``inv_freq``) are recomputed, and the shards are either loaded
    from ``parallelize(..., hf_path=DIR)`` (each rank reads only its slices of the safetensors) or
    initialised shard-locally (:func:`~mfsdp.hf.sharded.init_weights_shard_local`). The
    full model never exists on one rank. False: a meta-device model is an error."""

    grad_reduce_in_fp32: bool = True
    """Default True. Gradients are reduced and accumulated in fp32 (``MixedPrecisionPolicy.
    main_grads_dtype=float32``). False: in the compute dtype (half the traffic for bf16 models)."""

    preserve_fp32_weights: bool = True
    """Default True. The optimizer updates fp32 main weights and the bf16 compute weights are derived
    from them after each step. False: the compute weights are the main weights (a bf16 model then
    takes bf16 optimizer steps)."""

    overlap_grad_reduce: bool = True
    """Default True. Reduce gradients on a side stream while backward continues. False:
    ``CommunicationPolicy(overlap=False)``, every collective on the compute stream with no prefetch
    (synchronous, deterministic ordering, for debugging). The core has a single overlap switch, so
    False here also makes the all-gathers synchronous (logged when only one flag is False)."""

    overlap_param_gather: bool = True
    """Default True. Prefetch the next unit's all-gather during compute. False: synchronous and
    non-prefetched communication, exactly as ``overlap_grad_reduce=False`` (one core switch)."""

    check_for_nan_in_grad: bool = True
    """Default True. The core's NaN/Inf check (``CommunicationPolicy(check_finite_gradients=True)``):
    once the gradients of a backward are reduced, if any holds NaN or Inf, ``loss.backward()`` raises
    :data:`~mfsdp.manager.NonFiniteGradientError` (``FloatingPointError``) on every rank, naming the
    backward and the parameter group(s), before any optimizer can step on it. It runs in every loop,
    whichever way the optimizer was built (or none). Cost: one fused check per parameter group, one
    small all-reduce and one host sync per backward."""

    report_nan_in_param_grad: bool = False
    """Default False. Turns the same check on even when ``check_for_nan_in_grad`` is off (kept for
    Megatron-FSDP configs). The error names the parameter groups (module and dtype) that hold the
    NaN or Inf."""

    average_in_collective: bool = False
    """Default False. Gradients are the mean over the data-parallel ranks either way. True asks for
    the division to happen inside the collective (``ReduceOp.AVG``), which the core does on NCCL;
    gloo has no AVG, so there the core sums and divides once. False (Megatron: pre-scale, then sum)
    has the same scale; the core does not pre-scale, so only the rounding point differs. Cannot be
    combined with ``calculate_per_token_loss``."""

    disable_bucketing: bool = False
    """Default False. True: one collective per parameter instead of one coalesced launch per unit
    (``CommunicationPolicy(coalesce=False)``); slower, for debugging or backends without
    coalescing."""

    calculate_per_token_loss: bool = False
    """Default False. True: gradients are *summed* over the data-parallel ranks (dp_replicate x
    dp_shard x cp) instead of averaged, because the loss is already normalised by the global token
    count. Done inside the reduction, with ``CommunicationPolicy(gradient_divide_factor=1/dp)``."""

    keep_fp8_transpose_cache: bool = False
    """Default False. Megatron-FSDP: keep Transformer Engine's column-wise (transposed) FP8 copy of
    each weight from forward to backward, +1 byte per parameter, instead of re-deriving it. True:
    *not available*. mfsdp's FP8 path is torchao's float8 linears (``mfsdp.float8``), not Transformer
    Engine: there is no transpose cache to keep. The weights of a unit are re-gathered for backward
    (in FP8 with ``mfsdp.float8.enable_fp8_all_gather``: half the bf16 bytes) and torchao lays out
    the transposed operand inside the grad-input GEMM; keeping the gathered FP8 weights from forward
    to backward would need a reshard-after-forward switch, which the core does not have."""

    nccl_ub: bool = False
    """Default False. Allocate the persistent gather buffers from NCCL's allocator and register them
    with the data-parallel communicators (NCCL user buffers; symmetric windows where torch and NCCL
    offer them), i.e. the core's ``fully_shard(use_symm_mem=True)``. Needs CUDA and
    ``fsdp_double_buffer=True`` (registration needs buffers that never move); otherwise a
    ValueError. Where this torch lacks NCCL memory pools, the first forward raises."""

    fsdp_double_buffer: bool = False
    """Default False. Unit modules of the same size (the decoder layers) gather into persistent
    buffers used in alternation (two with the default prefetch), each unit always into the same
    one, instead of allocating and freeing a buffer per gather: the core's
    ``CommunicationPolicy(double_buffer=True)``. Costs those buffers at rest; a schedule that would
    overwrite a buffer still in use raises."""

    activation_checkpointing: bool = False
    """Default False. Recompute each unit module's activations in backward (torch's non-reentrant
    checkpoint around the unit's forward), at any world size. Sets ``model.config.use_cache=False``
    on Hugging Face models, since a KV cache would be written twice."""

    tp_size: Optional[int] = None
    """Default None (take it from the mesh). Tensor-parallel degree; must match ``mesh["tp"]``."""

    cp_size: Optional[int] = None
    """Default None (take it from the mesh). Context-parallel degree; must match ``mesh["cp"]``.
    With cp > 1 parameters shard over the flattened ``dp_shard_cp`` dim (every ZeRO level, and
    HSDP), so gradients are reduced over dp x cp; the loop feeds each cp rank its part of the
    sequence (:mod:`mfsdp.manager.context_parallel`)."""

    ep_size: int = 1
    """Default 1 (no expert parallelism). Expert-parallel degree for mixtures of experts (transformers 5's
    stacked ``*Experts``: Qwen3-MoE, Qwen2-MoE, Mixtral): each layer's experts are split over ``ep``
    ranks of dp_shard, tokens reach them by all-to-all, and each expert is FSDP-sharded over the
    dp_shard / ep ranks that remain (the experts' mesh, ``MegatronFSDPManager.expert_mesh``:
    ``([dp_replicate,] ep_shard, ep)`` over the dense mesh's ranks; :mod:`mfsdp.experts.parallel`).
    Must divide dp_shard and the experts per layer; needs tp = cp = 1. Every other parameter,
    shared experts included, is sharded as without it."""

    dp_replicate_size: Optional[int] = None
    """Default None (take it from the mesh). Replicas of the sharded model (HSDP); must match
    ``mesh["dp_replicate"]``. dp_shard is derived: world / (dp_replicate * cp * tp)."""

    sequence_parallel: bool = False
    """Default False. Sequence parallel (needs tp > 1, and the sequence length divisible by tp): the
    activations between sub-layers (residual stream, norms) are sharded on the sequence dim over tp,
    as ``Shard(1)`` DTensors; the norms run on their shard (torch's ``SequenceParallel``), attention
    and the MLP all-gather their input once and their output projections reduce-scatter. Same
    communication volume as plain TP, 1/tp of the norm and residual memory. The built-in plans
    implement it; a user ``tp_plan`` is used as given."""

    loss_parallel: bool = False
    """Default False. Vocabulary-parallel loss (needs tp > 1): the output head's logits stay sharded
    over the vocabulary (``model(...).logits`` is a ``Shard(-1)`` DTensor) and the cross-entropy,
    forward *and* backward, must run inside ``model.loss_context()`` (torch's ``loss_parallel()``),
    so the full logits never exist on one rank. The loss is then a replicated DTensor
    (``float(loss)`` or ``loss.full_tensor()`` read it). False: the logits are all-gathered into a
    plain tensor. The built-in plans implement it; a user ``tp_plan`` is used as given."""

    tp_activation_path: str = "local"
    """Default ``"local"``. How the built-in tensor-parallel plans run the activations. ``"local"``
    (Megatron's way, :mod:`mfsdp.manager.tp_local`): inside each block the activations are plain
    local tensors and the sequence all-gathers / reduce-scatters are explicit autograd Functions,
    so no op pays DTensor dispatch; the parameters are the same DTensors (same placements, same
    gradients) either way. ``"dtensor"``: torch's ``ParallelStyle`` hooks, every activation a
    DTensor. A user ``tp_plan``, or cp > 1, always runs the ``"dtensor"`` way."""

    tp_plan: Optional[Mapping[str, Any]] = None
    """Default None (built-in plan for Llama, Qwen2/3 and Mistral, else the model's ``_tp_plan``). A
    dict of module-name patterns to ``torch.distributed.tensor.parallel`` styles."""

    def __post_init__(self) -> None:
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):  # types are strings here
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"MegatronFSDPConfig.{name} must be a bool, got {value!r}")
        object.__setattr__(self, "zero_dp_strategy",
                           _level(self.zero_dp_strategy, ZERO_DP_STRATEGY_NAMES, "zero_dp_strategy", 3))
        object.__setattr__(self, "outer_dp_sharding_strategy",
                           _level(self.outer_dp_sharding_strategy, OUTER_DP_SHARDING_NAMES,
                                  "outer_dp_sharding_strategy", 1))
        p = self.placements
        if p is not None and not (isinstance(p, Placements) and p.dp_axes in ((DP_SHARD,), (DP_REPLICATE, DP_SHARD))):
            raise ValueError("MegatronFSDPConfig.placements must be a mfsdp.Placements over the manager mesh's dims, "
                             "('dp_shard',) or ('dp_replicate', 'dp_shard'), e.g. Placements.zero3('dp_shard') or "
                             f"Placements.hsdp('dp_replicate', 'dp_shard'); got {p!r}")
        if p is not None and (self.zero_dp_strategy, self.outer_dp_sharding_strategy) != (3, 0):
            raise ValueError(f"MegatronFSDPConfig: placements={p.name} and the Megatron integers (zero_dp_strategy, "
                             "outer_dp_sharding_strategy) both say what dp shards; set one, the integers left 3 and 0")
        for name in ("tp_size", "cp_size", "dp_replicate_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"MegatronFSDPConfig.{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"MegatronFSDPConfig.ep_size must be a positive integer, got {self.ep_size!r}")
        units = self.megatron_fsdp_unit_modules
        if units is not None:
            units = (units,) if isinstance(units, (str, type)) else tuple(units)
            if not units or not all(isinstance(u, (str, type)) and u for u in units):
                raise ValueError("MegatronFSDPConfig.megatron_fsdp_unit_modules must be a non-empty list of class "
                                 f"names, import paths or classes, got {self.megatron_fsdp_unit_modules!r}")
            object.__setattr__(self, "megatron_fsdp_unit_modules", units)
        if self.average_in_collective and self.calculate_per_token_loss:
            raise ValueError("MegatronFSDPConfig: average_in_collective=True averages gradients but "
                             "calculate_per_token_loss=True sums them; choose one")
        for name in ("sequence_parallel", "loss_parallel"):
            if getattr(self, name) and self.tp_size is not None and self.tp_size == 1:
                raise ValueError(f"MegatronFSDPConfig.{name}=True needs tp_size > 1 (it shards over tp)")
        if self.tp_activation_path not in ("local", "dtensor"):
            raise ValueError(f"MegatronFSDPConfig.tp_activation_path must be 'local' or 'dtensor', "
                             f"got {self.tp_activation_path!r}")
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise TypeError(f"MegatronFSDPConfig.tp_plan must be a dict of module patterns to styles, "
                            f"got {type(self.tp_plan).__name__}")
        if self.outer_dp_sharding_strategy and self.zero_dp_strategy != 3:
            raise ValueError("MegatronFSDPConfig.outer_dp_sharding_strategy=1 (HFSDP) needs zero_dp_strategy=3")


def field_names() -> tuple[str, ...]:
    """Every field of :class:`MegatronFSDPConfig`, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(MegatronFSDPConfig))
