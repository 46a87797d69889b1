"""What ``mfsdp train`` builds before it trains: the checks a user can fail, the model (bundled on
the meta device and initialised shard by shard, or a Hugging Face one through the manager) and its
optimizer."""

from __future__ import annotations

from pathlib import Path

import torch

from mfsdp.data import DataError, TokenFile
from mfsdp.models.llama import Llama, LlamaConfig
from mfsdp.models.parallelize import compile_modules, mesh_shape_error, resolve_placements
from mfsdp.offload import OffloadPolicy
from mfsdp.train.checkpoint import check_compatible, find_resumable
from mfsdp.train.config import ConfigError, RunConfig


def model_fingerprint(model_cfg: LlamaConfig) -> dict:
    """What a checkpoint must match to be loadable into a model of shape ``model_cfg``."""
    fingerprint = {k: getattr(model_cfg, k) for k in (
        "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")}
    if model_cfg.num_experts:  # only then: dense checkpoints written before MoE lack the key
        fingerprint["num_experts"] = model_cfg.num_experts
    return fingerprint


def float8_compile_problem(cfg: RunConfig, device_type: str) -> str | None:
    """Why the float8 setting cannot run as configured on ``device_type``, or None. Eager float8 on
    CUDA runs torchao's casts kernel by kernel, slower than bf16; CPU keeps it allowed (tests)."""
    if cfg.model.float8 == "none" or device_type != "cuda" or cfg.compiles(device_type):
        return None
    return (f"--model.float8 {cfg.model.float8} with --parallel.compile false runs torchao's float8 casts "
            "eagerly, slower than bf16 on CUDA; use --parallel.compile auto (or true), or --model.float8 none")


def validate_run(cfg: RunConfig, world: int, open_data=None, device_type: str = "cpu"):
    """Check what a user can get wrong before any model is built; raises a USER_ERRORS type.

    ``open_data`` opens the token file (None skips the data checks: the launcher does so
    for the "stdlib" corpus, which the workers build); ``device_type`` is where it will train.
    Returns the token file (or None), the checkpoint to resume from (or None) and notes on damaged
    checkpoints skipped.
    """
    p = cfg.parallel
    mesh_problem = mesh_shape_error(world, p.placements, p.replicate) or float8_compile_problem(cfg, device_type)
    if mesh_problem:
        raise ConfigError(mesh_problem)
    if cfg.model.float8 == "tensorwise" and resolve_placements(p.placements).num_param_sharded == 0:
        raise ConfigError(
            f"--model.float8 tensorwise all-gathers the weights in FP8, which needs placements that shard "
            f"them at rest (zero3, hsdp, hfsdp); --parallel.placements {p.placements} keeps them whole. Use "
            "--model.float8 rowwise (float8 compute, bf16 gathers) or --parallel.placements zero3")
    model_cfg = cfg.llama_config()
    data = open_data() if open_data is not None else None
    if data is not None and data.vocab_size > model_cfg.vocab_size:
        raise DataError(
            f"{data.path} was tokenized with a vocabulary of {data.vocab_size} but the "
            f"model has {model_cfg.vocab_size} embeddings; set --model.vocab_size "
            f"{data.vocab_size} or more")
    if cfg.data.val_path is not None:
        _check_val_file(cfg.data.val_path, data, model_cfg)
    resume_from, notes = None, []
    if cfg.resume:
        resume_from, notes = find_resumable(Path(cfg.train.out_dir) / "checkpoints")
        if resume_from is not None:
            check_compatible(resume_from, model_fingerprint(model_cfg))
    return data, resume_from, notes


def _check_val_file(path: str, data, model_cfg: LlamaConfig) -> None:
    """The --data.val_path token file: readable, in the model's vocabulary, same tokenizer."""
    val = TokenFile(path)  # DataError naming the fix when missing or corrupt
    if val.vocab_size > model_cfg.vocab_size:
        raise DataError(f"--data.val_path {path} was tokenized with a vocabulary of {val.vocab_size} "
                        f"but the model has {model_cfg.vocab_size} embeddings; tokenize it as the "
                        "training file")
    if data is not None and val.tokenizer != data.tokenizer:
        raise DataError(f"--data.val_path {path} was tokenized by {val.tokenizer!r}, the training file "
                        f"{data.path} by {data.tokenizer!r}; tokenize both with the same --tokenizer")


def materialize_and_init(model: Llama, device: torch.device, seed: int) -> Llama:
    """Give a meta-built, sharded model its buffers on ``device`` and initialise its shards.

    ``to_empty`` materialises the buffers (the rotary tables) and keeps the shards that
    ``fully_shard`` allocated; ``init_weights`` then writes through each rank's DTensor shards,
    drawing only the rows this rank holds (``normal_by_rows_``), so every world size and
    placement gives the weights of an unsharded ``init_weights(seed=seed)``. The compute
    weights are derived from the initialised shards at the first forward.
    """
    torch.manual_seed(seed)  # anything else that draws from the global generator
    model.to_empty(device=device)
    model.init_weights(buffer_device=device, seed=seed)
    return model


def shard_numel(model) -> int:
    return sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel()
               for q in model.parameters())


def adamw(model, t) -> torch.optim.AdamW:
    """AdamW on the sharded parameters; 1-D ones (norm scales, biases) are not decayed: shrinking
    them towards zero only hurts. ``--train.adamw_kernel`` picks torch's kernels (``fused_adamw``:
    fused on CUDA by default, one kernel per dtype and no shard-sized temporary, often the step's
    memory peak with foreach; foreach on CPU, where the fused kernel is slower)."""
    decay = [q for q in model.parameters() if q.ndim >= 2]
    no_decay = [q for q in model.parameters() if q.ndim < 2]
    device = (decay + no_decay)[0].device.type
    kernel = {"fused": True} if t.fused_adamw(device) else {"foreach": True}
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), **kernel)


def offload_policy(p):
    """The core's ``OffloadPolicy`` for ``--parallel.offload`` (None: every unit steps on the GPU);
    "auto" is resolved to one of the others before (``Trainer.resolve_offload``)."""
    if p.offload == "auto":
        raise ValueError("--parallel.offload auto: resolve it with the planner first (Trainer.resolve_offload)")
    return None if p.offload == "none" else OffloadPolicy(fraction=p.offload_fraction)


HF_STRATEGIES = {"zero3": 3, "zero2": 2, "zero1": 1, "ddp": 0, "hsdp": 3, "hfsdp": 3}


def build_hf(cfg, device: torch.device, compute_dtype: torch.dtype, world: int):
    """``--model.hf DIR``: the Hugging Face model sharded by the manager.

    Built on the meta device from ``DIR/config.json`` in the compute dtype, parallelized by the
    manager (``--parallel.placements`` mapped to ``zero_dp_strategy``, hsdp/hfsdp to
    ``dp_replicate_size``), then loaded slice by slice from ``DIR``'s safetensors if it has any,
    else initialised shard-locally with ``--train.seed``.
    """
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
    from mfsdp.manager.core_options import resolve_unit_modules
    from mfsdp.manager.hf_checkpoint import has_weights, meta_model_from_config

    p, path = cfg.parallel, cfg.model.hf
    config = MegatronFSDPConfig(
        zero_dp_strategy=HF_STRATEGIES[p.placements],
        outer_dp_sharding_strategy=1 if p.placements == "hfsdp" else 0,
        grad_reduce_in_fp32=p.main_grads_dtype != "bf16",
        activation_checkpointing=p.activation_checkpointing,
        init_fsdp_with_meta_device=True)
    mesh = build_device_mesh(device.type, dp_replicate_size=p.replicate, world_size=world)
    model = meta_model_from_config(path, dtype=compute_dtype)
    model.config.use_cache = False
    # The units, named before sharding renames their classes; compiled after it, as the blocks are.
    units = [module for _, module in resolve_unit_modules(model, config.megatron_fsdp_unit_modules)]
    model, _ = MegatronFSDPManager(config, mesh).parallelize(
        model, hf_path=path if has_weights(path) else None, init_seed=cfg.train.seed)
    if cfg.compiles(device.type):
        compile_modules(units)
    return model
