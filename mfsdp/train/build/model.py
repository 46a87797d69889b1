"""What ``mfsdp train`` trains: the model (the bundled Llama, built on the meta device and initialised
shard by shard, then loaded from a Hugging Face directory's weights on the bundled route; or a
Hugging Face model through the manager), sharded, and its optimizer."""

from __future__ import annotations

import copy
from typing import Callable

import torch

import mfsdp
from mfsdp import transforms
from mfsdp.transforms.float8 import Float8Transform
from mfsdp.hf.files import HFWeightsError
from mfsdp.hf.names import load_hf_weights
from mfsdp.transforms.lora import init_adapters
from mfsdp.mesh import DP_SHARD, TWO_AXIS, build_mesh, resolve_placements
from mfsdp.models.llama import Llama
from mfsdp.models.moe import build_model
from mfsdp.models.parallelize import ParallelizeConfig, compile_modules, parallelize
from mfsdp.offload import OffloadPolicy
from mfsdp.train.build.adapters import lora_transform
from mfsdp.train.run.config import RunConfig
from mfsdp.train.command.errors import ConfigError
from mfsdp.train.report.metrics import peak_memory_gib


def build(cfg: RunConfig, device: torch.device, world: int, log: Callable[[str], None], resuming: bool = False):
    """The sharded model and its sharded optimizer (offloaded in part where the config asks);
    ``resuming``: a checkpoint's weights replace the initial ones, so pretrained ones are not read
    (but for LoRA, whose checkpoints hold only the adapters: the frozen base is read again)."""
    compute = cfg.compute_dtype(device.type)
    pretrained = cfg.loads_weights() and (not resuming or cfg.peft.lora)
    model_transforms = transforms_for(cfg)
    try:  # alike on every rank: each checks every tensor
        model = build_hf(cfg, device, compute, world, log, pretrained, model_transforms) if cfg.model.uses_manager \
            else build_bundled(cfg, device, compute, world, log, pretrained, model_transforms)
    except HFWeightsError as err:
        raise ConfigError(f"--model.hf {cfg.model.hf}: {err}") from None
    optimizer = mfsdp.fully_shard_optimizer(model, adamw(model, cfg.train), offload=offload_policy(cfg.parallel),
                                            flat_adamw=cfg.train.flat_adamw(device.type))
    describe_offload(optimizer, cfg, log)
    transforms.hook_results(model_transforms, "after_optimizer_step", optimizer, model)
    return model, optimizer


def transforms_for(cfg: RunConfig) -> tuple:
    """The model transforms the config asks for, in the order they apply (float8 first: LoRA wraps
    the float8 linears, so the frozen base computes in float8): the one list that ``parallelize`` and
    the manager route apply, the memory planner replays and ``resolve`` checks on the meta model."""
    m, peft = cfg.model, cfg.peft
    out = (Float8Transform(m.float8, m.float8_skip_patterns()),) if m.float8 != "none" else ()
    if peft.lora:
        out += (lora_transform(peft),)
    return out


def build_bundled(cfg: RunConfig, device: torch.device, compute: torch.dtype, world: int, log,
                  pretrained: bool = False, model_transforms: tuple = ()) -> Llama:
    """The bundled Llama (or MoELlama), built on the meta device and sharded there: each rank
    allocates only its shards, and the whole model never exists on any rank. A --model.hf model on
    the bundled route is the Llama of its config, built alike, then loaded from the directory's
    weights (each rank reads only its slices) when ``pretrained``. Its head computes the loss of
    ``--model.head_loss``; ``model_transforms`` (``transforms_for``) rewrite it before sharding."""
    p = cfg.parallel
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=cfg.main_grads_dtype(),
                                        grad_comm_dtype=cfg.grad_comm_dtype())
    with torch.device("meta"):
        model = build_model(cfg.resolved.shape, dtype=compute)
    model.set_head_loss(cfg.model.head_loss, compiled=cfg.compiles(device.type))
    mesh = build_mesh(device.type, world, replicate=p.replicate if p.placements in TWO_AXIS else None)
    parallelize(model, mesh, ParallelizeConfig(
        placements=p.placements, mixed_precision=policy, transforms=model_transforms,
        compile=cfg.compiles(device.type), communication=communication_policy(p),
        activation_checkpointing=p.activation_checkpointing, expert_units=p.expert_units,
        keep_gathered_blocks=p.kept_blocks(), **expert_parallel(p, "ep")))
    # The buffers (rotary tables) materialised, the shards fully_shard allocated kept; init_weights then
    # writes through each rank's DTensor shards, drawing only the rows it holds (normal_by_rows_), so every
    # world size and placement gives the weights of an unsharded init_weights(seed=seed).
    torch.manual_seed(cfg.train.seed)  # anything else that draws from the global generator
    model.to_empty(device=device)
    model.init_weights(buffer_device=device, seed=cfg.train.seed)
    for transform in model_transforms:  # a DTensor's numel is the whole parameter's: whole-model numbers
        log(transform.describe(model))
    numel = sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel() for q in model.parameters())
    log(f"model built and initialised shard by shard: {numel / 1e6:,.1f}M parameters on this "
        f"rank, peak memory {peak_memory_gib(device):.2f} GiB")
    if pretrained:
        load_hf_weights(model, cfg.model.hf)
        log(f"loaded the weights of {cfg.model.hf} into the bundled Llama, each rank its own slices")
    init_adapters(model, cfg.train.seed)  # neither init_weights nor the loader touches them
    return model


def expert_parallel(p, name: str) -> dict:
    """``--parallel.ep`` as the keyword ``name`` of the route's config (``ParallelizeConfig.ep``,
    ``MegatronFSDPConfig.ep_size``): none at 1, so that a config without expert parallelism is
    built exactly as without the flag."""
    return {name: p.ep} if p.ep > 1 else {}


def describe_offload(optimizer, cfg: RunConfig, log) -> None:
    """One line on what the optimizer steps on the host, if anything."""
    engine = mfsdp.offload.offload_of(optimizer)
    if engine is None:
        return
    numel, clip = sum(g.main.tensor.numel() for g in engine.groups), cfg.train.grad_clip
    log(f"optimizer offload: {len(engine.groups)} parameter groups stepped on the host "
        f"({numel / 1e6:,.1f}M parameters on this rank, about {sum(engine.planned_host_bytes().values()) / 2**30:.1f} "
        "GiB of host memory with their backup and staging), speculatively during backward"
        + (f"; a step whose gradient norm exceeds --train.grad_clip {clip:g} runs them after "
           "backward instead, and the next one too until a step is not clipped" if clip > 0 else ""))


def adamw(model, t) -> torch.optim.AdamW:
    """AdamW on the sharded parameters; 1-D ones (norm scales, biases) are not decayed: shrinking
    them towards zero only hurts. ``--train.adamw_kernel`` picks torch's kernels for the groups the
    flat step (``fully_shard_optimizer(flat_adamw=)``) does not take (``fused_adamw``: fused on CUDA,
    one kernel per dtype and no shard-sized temporary, often the step's memory peak with foreach;
    foreach on CPU, where the fused kernel is slower). Frozen parameters (LoRA's base) are left out."""
    trainable = [q for q in model.parameters() if q.requires_grad]  # LoRA: the adapters only
    decay = [q for q in trainable if q.ndim >= 2]
    no_decay = [q for q in trainable if q.ndim < 2]
    device = (decay + no_decay)[0].device.type
    kernel = {"fused": True} if t.fused_adamw(device) else {"foreach": True}
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), **kernel)


def communication_policy(p) -> mfsdp.CommunicationPolicy:
    """The core's ``CommunicationPolicy`` for the --parallel section (its stream priority)."""
    return mfsdp.CommunicationPolicy(high_priority_streams=p.high_priority_streams)


def offload_policy(p):
    """The core's ``OffloadPolicy`` for ``--parallel.offload`` (None: every unit steps on the GPU);
    "auto" is resolved to one of the others before (``preflight.resolve_offload``)."""
    if p.offload == "auto":
        raise ValueError("--parallel.offload auto: resolve it with the planner first (preflight.resolve_offload)")
    return None if p.offload == "none" else OffloadPolicy(fraction=p.offload_fraction)


def build_hf(cfg, device: torch.device, compute_dtype: torch.dtype, world: int, log=print, pretrained: bool = False,
             model_transforms: tuple = ()):
    """``--model.hf DIR``: the Hugging Face model sharded by the manager.

    Built on the meta device from ``DIR/config.json`` (as resolved) in the compute dtype, parallelized by the
    manager (``--parallel.placements`` as a ``Placements`` over the manager's dp_shard, hsdp/hfsdp
    over (dp_replicate, dp_shard) with ``--parallel.replicate`` replicas), then loaded slice by
    slice from ``DIR``'s safetensors when ``pretrained``, else initialised shard-locally with
    ``--train.seed``. ``model_transforms`` (LoRA) rewrite the meta model first, and are described
    there (whole-model numbers); the adapters are initialised after the load.
    """
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
    from mfsdp.manager.core_options import resolve_unit_modules
    from mfsdp.hf.sharded import meta_model_from_config, refresh_compute_weights

    p, path = cfg.parallel, cfg.model.hf
    config = MegatronFSDPConfig(
        placements=resolve_placements(p.placements, shard_axis=DP_SHARD),
        grad_reduce_in_fp32=cfg.main_grads_dtype() == torch.float32,
        activation_checkpointing=p.activation_checkpointing,
        init_fsdp_with_meta_device=True, **expert_parallel(p, "ep_size"))
    mesh = build_device_mesh(device.type, dp_replicate_size=p.replicate, world_size=world)
    # A copy of the resolved config: the model shares its config, which is changed here.
    model = meta_model_from_config(copy.deepcopy(cfg.resolved.transformers_config), dtype=compute_dtype)
    model.config.use_cache = False
    transforms.apply_transforms(model, model_transforms)
    for transform in model_transforms:
        log(transform.describe(model))
    # The units, named before sharding renames their classes; compiled after it, as the blocks are.
    units = [module for _, module in resolve_unit_modules(model, config.megatron_fsdp_unit_modules)]
    model, _ = MegatronFSDPManager(config, mesh).parallelize(
        model, hf_path=path if pretrained else None, init_seed=cfg.train.seed)
    if model_transforms:
        init_adapters(model, cfg.train.seed)
        refresh_compute_weights(model)  # the adapters' compute copies, from the main weights just written
    if cfg.compiles(device.type):
        compile_modules(units)
    return model
