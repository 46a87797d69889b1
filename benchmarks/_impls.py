"""How each implementation compared by ``throughput.py`` turns the Llama model into a trainable one.

Every builder takes the same ``Ctx`` and returns a ``Built``: a model whose ``forward(tokens)`` gives
logits, an optimizer whose ``step()``/``zero_grad()`` complete one update, and the dtype the
gradients travel in. The training loop itself lives in ``throughput.py`` and is identical for all.

The settings copy the peer anchor runs (``/work/shared/anchors``), because a comparison only means
something when the model code, data, optimizer and precision are the same for everyone:

- optimizer: AdamW(lr 1e-4, betas 0.9/0.95, weight decay 0.1), fused on CUDA, foreach on CPU;
- ``none``: the unsharded model in the compute dtype (pure bf16: bf16 weights, grads and AdamW
  states), no communication. An upper bound for this model code, not a like-for-like peer.
- ``fsdp2``: torch's ``fully_shard`` per block then the root, on an fp32 model built on the meta
  device, bf16 compute (``param_dtype``), reduce-scatter in ``--grad-reduce-dtype``.
- ``mfsdp``: a compute-dtype model built on the device, ``mfsdp.fully_shard`` on the embedding,
  each block and the head, then the root, with ZeRO-3 placements, fp32 main weights, main grads in ``--grad-reduce-dtype``.
  ``mfsdp-db`` adds persistent gather buffers (``double_buffer``); ``mfsdp-ub`` also registers
  them with NCCL (``use_symm_mem``); ``mfsdp-step1`` steps the optimizer in one call, without the
  next forward's first gathers during the step (``prefetch_across_step=False``: that lever alone).
  ``mfsdp-offload`` steps the optimizer of ``--offload``'s share of the units on the host
  (``mfsdp.OffloadPolicy(fraction=...)``: fp32 masters and AdamW states in pinned host memory,
  torch's fused CPU AdamW, overlapped with backward and validated at the step).
- ``fsdp2-offload``: ``fsdp2`` with ``CPUOffloadPolicy()`` on every ``fully_shard`` (parameters,
  gradients and optimizer states on the host, all of them; fused CPU AdamW after backward).
- ``megatron-fsdp``: ``megatron_fsdp.fully_shard`` (v1) with ``fsdp_unit_modules=[Block]``, ZeRO-3,
  package defaults otherwise; its reduce-scatter runs in the main-grad dtype.
- ``megatron-fsdp-exp``: ``megatron_fsdp.experimental.fully_shard`` bottom-up with all-Flat
  placements. Version 0.6.1 packs the bf16 parameter grads into a bf16 buffer, so it always
  reduces in bf16, whatever the main-grad dtype.

With ``replicate > 1`` (``--replicate R``) the FSDP implementations run HSDP on an
``(R, world / R)`` mesh named ``("dp_replicate", "dp_shard")``: sharded within a group of
``world / R`` ranks, replicated across the ``R`` groups, gradients averaged over all. FSDP2 does this
from the 2-D mesh, mfsdp from ``Placements.hsdp``, megatron-fsdp experimental from
``[Replicate, Flat]`` parameter placements. megatron-fsdp v1 needs Megatron-Core's process groups
for it and is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from mfsdp.models.llama import Block, Llama, LlamaConfig
from mfsdp.models.moe import build_model

# Every implementation draws the same initial weights (init_weights keys its draws by this seed and
# the parameter names, whether the model was built on the device or on meta and sharded first).
INIT_SEED = 1234

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Skip(Exception):
    """Raised by a builder that cannot run here; reported as ``status: skipped: <message>``."""


@dataclasses.dataclass
class Ctx:
    cfg: LlamaConfig
    device: torch.device
    world_size: int
    compute_dtype: torch.dtype      # bf16 normally; fp32 for the CPU smoke run
    grad_reduce_dtype: torch.dtype  # what the FSDP implementations reduce gradients in
    ac: bool
    compile: bool
    lr: float = 1e-4
    replicate: int = 1              # HSDP replica groups (a divisor of world_size; 1 = plain ZeRO-3)
    convert: Optional[Callable[[nn.Module], None]] = None  # applied to each fresh model first (float8)
    offload_fraction: float = 1.0   # mfsdp-offload's share of units stepped on the host (0: none)
    offload_threads: Optional[int] = None  # its host step's CPU threads (None: torch's)

    @property
    def hsdp(self) -> bool:
        return self.replicate > 1

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        if self.hsdp:
            return init_device_mesh(self.device.type, (self.replicate, self.world_size // self.replicate),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))

    def layout(self) -> str:
        """How the ranks are laid out, for the one-line setup description."""
        return f"HSDP {self.replicate} x {self.world_size // self.replicate}" if self.hsdp else "ZeRO-3"


@dataclasses.dataclass
class Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_reduce_dtype: str  # "fp32", "bf16", or "none" (no gradient communication)
    setup: str              # one line: how the implementation was applied
    extra: dict = dataclasses.field(default_factory=dict)
    microbatch: Callable = lambda is_last: contextlib.nullcontext()  # around each microbatch
    offload: Optional[str] = None  # what is offloaded, for the JSON line (None: nothing)
    offload_counts: Optional[Callable[[], dict]] = None  # mfsdp: its speculated steps kept/redone
    offload_host_nbytes: Optional[Callable[[], dict]] = None  # mfsdp: host bytes by kind (master, states, ...)
    step_call_s: list = dataclasses.field(default_factory=list)  # host time in optimizer.step()


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def make_adamw(params, ctx: Ctx) -> torch.optim.Optimizer:
    # Fused AdamW is the fastest CUDA kernel and what the anchors used; CPU has only foreach.
    kind = {"fused": True} if ctx.device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(list(params), lr=ctx.lr, betas=(0.9, 0.95), weight_decay=0.1, **kind)


def _prepare(model: Llama, ctx: Ctx) -> None:
    """``ctx.convert``, then AC and compile per block, before any wrapping, identically for every impl."""
    if ctx.convert is not None:
        ctx.convert(model)
    model.set_activation_checkpointing(ctx.ac)
    if ctx.compile:
        for block in model.layers:
            block.compile()
    model.train()


def _model_on_device(ctx: Ctx, dtype: torch.dtype) -> Llama:
    model = build_model(ctx.cfg, dtype=dtype, device=ctx.device)
    model.init_weights(buffer_device=ctx.device, seed=INIT_SEED)
    _prepare(model, ctx)
    return model


def build_none(ctx: Ctx) -> Built:
    model = _model_on_device(ctx, ctx.compute_dtype)
    return Built(model, make_adamw(model.parameters(), ctx), "none",
                 f"unsharded {dtype_name(ctx.compute_dtype)} model, {dtype_name(ctx.compute_dtype)} "
                 "AdamW states, no communication (each rank independent)")


def build_fsdp2(ctx: Ctx, cpu_offload: bool = False) -> Built:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=ctx.compute_dtype, reduce_dtype=ctx.grad_reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cpu_offload else OffloadPolicy()
    mesh = ctx.mesh()
    # Meta init, then shard, then materialise only the local shards: the fp32 full model is
    # never allocated, as in the anchor run.
    with torch.device("meta"):
        model = build_model(ctx.cfg, dtype=torch.float32)
    _prepare(model, ctx)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    if ctx.cfg.num_experts and hasattr(model, "set_reduce_scatter_unused_params"):
        # Ranks route tokens to different experts: zeros for the unused expert weights keep FSDP2's
        # reduce-scatters the same size on every rank (torch 2.11 has no such switch).
        model.set_reduce_scatter_unused_params(True)
    # With CPU offload the sharded parameters live on the host (the rotary tables stay on the GPU).
    model.to_empty(device="cpu" if cpu_offload else ctx.device)
    model.init_weights(buffer_device=ctx.device, seed=INIT_SEED)
    return Built(model, make_adamw(model.parameters(), ctx), dtype_name(ctx.grad_reduce_dtype),
                 f"torch fully_shard(block) x n_layers + root, {ctx.layout()}; fp32 sharded params, "
                 f"param_dtype={dtype_name(ctx.compute_dtype)}, "
                 f"reduce_dtype={dtype_name(ctx.grad_reduce_dtype)}"
                 + (f"; CPUOffloadPolicy(pin_memory={offload.pin_memory}), fused CPU AdamW" if cpu_offload else ""),
                 offload="all (CPUOffloadPolicy)" if cpu_offload else None)  # reduces every microbatch


def build_mfsdp(ctx: Ctx, double_buffer: bool = False, use_symm_mem: bool = False,
                prefetch_across_step: bool = True, offload: bool = False) -> Built:
    import mfsdp

    placements = (mfsdp.Placements.hsdp("dp_replicate", "dp_shard") if ctx.hsdp
                  else mfsdp.Placements.zero3("dp"))
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                        main_grads_dtype=ctx.grad_reduce_dtype)
    mesh = ctx.mesh()
    from mfsdp.models.parallelize import sharding_units

    model = _model_on_device(ctx, ctx.compute_dtype)
    comm = mfsdp.CommunicationPolicy(double_buffer=double_buffer, prefetch_across_step=prefetch_across_step)
    options = dict(placements=placements, mixed_precision_policy=policy, use_symm_mem=use_symm_mem,
                   communication_policy=comm)
    for unit in sharding_units(model):  # embedding, blocks, head: mfsdp's recommended wrapping
        mfsdp.fully_shard(unit, mesh, **options)
    mfsdp.fully_shard(model, mesh, **options)
    fraction = ctx.offload_fraction if offload else 0.0
    on_host = mfsdp.OffloadPolicy(fraction=fraction, threads=ctx.offload_threads) if fraction else None
    optimizer = mfsdp.fully_shard_optimizer(model, make_adamw(model.parameters(), ctx), offload=on_host)
    engine = mfsdp.offload.offload_of(optimizer) if on_host else None
    return Built(model, optimizer, dtype_name(ctx.grad_reduce_dtype),
                 "mfsdp.fully_shard(embedding, each block, head) + root, "
                 f"{'Placements.hsdp' if ctx.hsdp else 'Placements.zero3'}; "
                 f"{dtype_name(ctx.compute_dtype)} model, fp32 main params, "
                 f"main grads {dtype_name(ctx.grad_reduce_dtype)}; fully_shard_optimizer"
                 + ("; double_buffer" if double_buffer else "") + ("; use_symm_mem" if use_symm_mem else "")
                 + ("" if prefetch_across_step else "; prefetch_across_step=False")
                 + (f"; OffloadPolicy(fraction={fraction:g}, threads={ctx.offload_threads}): "
                    f"{len(engine.groups)} groups' AdamW on the host"
                    if engine else ""),
                 {"mfsdp_version": getattr(mfsdp, "__version__", None)},
                 microbatch=lambda is_last: mfsdp.microbatch(model, is_last=is_last),
                 offload=f"fraction {fraction:g}" if engine else None,
                 offload_counts=(lambda: engine.counts) if engine else None,
                 offload_host_nbytes=engine.host_nbytes if engine else None)


def _import_megatron(ctx=None):
    if ctx is not None and ctx.cfg.num_experts:
        raise Skip("MoE presets are not wired to megatron-fsdp here")
    try:
        import megatron_fsdp
    except ImportError as exc:
        raise Skip(f"megatron-fsdp not installed ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip("megatron-fsdp needs CUDA")
    return megatron_fsdp


def build_megatron_fsdp(ctx: Ctx) -> Built:
    megatron_fsdp = _import_megatron(ctx)
    if ctx.hsdp:
        raise Skip("HSDP with megatron-fsdp v1 needs Megatron-Core process groups; use megatron-fsdp-exp")
    model = _model_on_device(ctx, ctx.compute_dtype)
    optimizer = make_adamw(model.parameters(), ctx)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                main_grads_dtype=ctx.grad_reduce_dtype,
                                                grad_comm_dtype=None)
    # Everything else at the package defaults, as in the anchor (overlap on, no nccl_ub).
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                                 zero_dp_strategy=3, mixed_precision_policy=policy)
    return Built(model, optimizer, dtype_name(ctx.grad_reduce_dtype),
                 "megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block], "
                 f"zero_dp_strategy=3), main params fp32, main grads {dtype_name(ctx.grad_reduce_dtype)}",
                 {"megatron_fsdp_version": megatron_fsdp.__version__})


def build_megatron_fsdp_exp(ctx: Ctx) -> Built:
    megatron_fsdp = _import_megatron(ctx)
    from megatron_fsdp import experimental as mx

    if ctx.hsdp:  # replicated across groups; gradients averaged over the replicas as well
        avg = mx.Partial(torch.distributed.ReduceOp.AVG)
        placements = mx.Placements(dp_axes=["dp_replicate", "dp_shard"],
                                   parameter=[mx.Replicate(), mx.Flat()], gradient=[avg, mx.Flat()],
                                   optimizer=[mx.Replicate(), mx.Flat()])
    else:
        placements = mx.Placements(dp_axes=["dp"], parameter=[mx.Flat()], gradient=[mx.Flat()],
                                   optimizer=[mx.Flat()])
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                main_grads_dtype=ctx.grad_reduce_dtype)
    mesh = ctx.mesh()
    model = _model_on_device(ctx, ctx.compute_dtype)
    for block in model.layers:
        mx.fully_shard(block, mesh, placements, mixed_precision_policy=policy)
    mx.fully_shard(model, mesh, placements, mixed_precision_policy=policy)
    torch.cuda.empty_cache()  # the full bf16 copies are gone now; return them to the driver
    optimizer = make_adamw(model.parameters(), ctx)
    mx.fully_shard_optimizer(optimizer)
    return Built(model, optimizer, "bf16",
                 "megatron_fsdp.experimental.fully_shard(block) x n_layers + root, "
                 f"{'[Replicate, Flat] (HSDP)' if ctx.hsdp else 'all-Flat'} placements, main params fp32, "
                 f"main grads {dtype_name(ctx.grad_reduce_dtype)}, "
                 "reduce-scatter bf16; experimental.fully_shard_optimizer",
                 {"megatron_fsdp_version": megatron_fsdp.__version__})


BUILDERS: dict[str, Callable[[Ctx], Built]] = {
    "mfsdp": build_mfsdp,
    "mfsdp-db": lambda ctx: build_mfsdp(ctx, double_buffer=True),  # persistent gather buffers
    "mfsdp-ub": lambda ctx: build_mfsdp(ctx, double_buffer=True, use_symm_mem=True),  # NCCL-registered
    "mfsdp-step1": lambda ctx: build_mfsdp(ctx, prefetch_across_step=False),  # one-call step, no early gathers
    "mfsdp-offload": lambda ctx: build_mfsdp(ctx, offload=True),  # --offload's share on the host
    "fsdp2": build_fsdp2,
    "fsdp2-offload": lambda ctx: build_fsdp2(ctx, cpu_offload=True),  # CPUOffloadPolicy
    "megatron-fsdp": build_megatron_fsdp,
    "megatron-fsdp-exp": build_megatron_fsdp_exp,
    "none": build_none,
}
