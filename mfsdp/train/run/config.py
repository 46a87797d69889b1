"""Configuration of ``mfsdp train``: frozen sections of plain values, each validated on its own.

The defaults below train the tiny model on the standard-library corpus. ``mfsdp.train.command.args`` reads
YAML and flags into these sections; ``mfsdp.train.run.resolve`` then reads what the values name (a
--model.hf directory's config.json), fills in what they leave open (the route, the recipe) and
derives the model's shape and counts once (``ResolvedModel``), so that these objects only hold
values: they read no file and print nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mfsdp.experts.parallel import describe_split
from mfsdp.mesh import PLACEMENT_NAMES as PLACEMENTS, TWO_AXIS
from mfsdp.hf.config import supports_bundled
from mfsdp.models.llama import HEAD_LOSSES, LlamaConfig, get_config
from mfsdp.models.preference_loss import PreferenceLoss
from mfsdp.transforms.float8 import FLOAT8_CHOICES, float8_placement_problem
from mfsdp.train.command.errors import ConfigError, require
from mfsdp.train.run.recipes import SCHEDULES, Recipe, recipe_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtype flags' values ("auto" is each flag's own default, resolved by ``RunConfig``)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype flags' name of ``dtype``: "fp32" or "bf16"."""
    return next(name for name, value in DTYPES.items() if value == dtype)
COMPILE_CHOICES = ("auto", "true", "false")
PEFT_METHODS = ("none", "lora")
OFFLOAD_CHOICES = ("none", "optimizer", "auto")
HF_IMPLS = ("auto", "bundled", "manager")
_NOT_SHAPE = ("preset", "hf", "float8", "float8_skip", "hf_impl", "random_init", "head_loss")
"""The ModelSection fields that are not overrides of the preset's shape."""


def _one_of(section: object, name: str, choices) -> None:
    """ConfigError unless ``section.name`` is one of ``choices``, naming them."""
    value = getattr(section, name)
    require(value in choices, f"{type(section).__name__.removesuffix('Section').lower()}.{name} must be one of "
             f"{', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"
    """One of mfsdp.models.llama.PRESETS: tiny, 1b, 8b, 70b, or the mixtures of experts moe-tiny, moe-1b."""
    dim: int | None = None
    """Overrides the preset's width when set."""
    n_layers: int | None = None
    """Overrides the preset's number of blocks when set."""
    n_heads: int | None = None
    """Overrides the preset's query heads when set."""
    n_kv_heads: int | None = None
    """Overrides the preset's key/value heads when set."""
    ffn_dim: int | None = None
    """Overrides the preset's feed-forward width when set."""
    vocab_size: int | None = None
    """Overrides the preset's vocabulary size when set."""
    tie_embeddings: bool | None = None
    """Overrides whether the output head shares the embedding matrix."""
    num_experts: int | None = None
    """Overrides the preset's experts per block when set (0: the dense feed-forward layer)."""
    top_k: int | None = None
    """Overrides the preset's experts per token when set."""
    moe_aux_loss_coef: float | None = None
    """Overrides the weight of the load-balancing loss added to the cross entropy (the preset's is
    0.01); the loss is logged as aux_loss in metrics.jsonl, the loss column stays cross entropy."""
    hf: str | None = None
    """A local Hugging Face model directory (config.json, plus safetensors weights if present) to
    train instead of a preset; the shape fields above must then be unset. With weights (and not
    ``random_init``) the run fine-tunes them, with the fine-tuning recipe (mfsdp/train/run/recipes.py)."""
    float8: str = "none"
    """Train the blocks' linears in float8 (torchao, mfsdp.float8): none, tensorwise (weights
    also all-gathered in FP8) or rowwise; the bundled Llama only (presets, and --model.hf models
    on the bundled route)."""
    float8_skip: str = ""
    """With --model.float8: the linears that stay in the compute dtype, as comma-separated ``fnmatch``
    patterns of their names (the bundled Llama's are layers.N.attention.{wq,wk,wv,wo} and
    layers.N.feed_forward.{w1,w2,w3}): "layers.0.*,layers.31.*" keeps the first and last of 32
    blocks out of float8, "*.w2" every down projection. The default, empty, trains every block
    linear in float8; the output head is never float8 (torchtitan's choice: the logits are the
    most sensitive GEMM, and the head is not a block's). A pattern that names no linear is an error."""
    hf_impl: str = "auto"
    """How a --model.hf model is built: "bundled" runs it as the bundled Llama (compiled blocks, FP8,
    planned as the preset of its shape; the Llama, Qwen2 and Mistral configs that
    mfsdp.hf.config accepts), "manager" runs Hugging Face's own modeling code through
    mfsdp.manager (any causal LM, slower), "auto" the bundled route where the config allows it,
    else the manager's (the run says why). A run records the route it took, and resumes on it."""
    random_init: bool = False
    """With --model.hf: train the architecture from random weights (seeded by --train.seed) even if
    the directory holds weights, with the pretraining recipe of the preset nearest in size."""
    head_loss: str = "plain"
    """The output head's cross entropy (``Llama.set_head_loss``; the memory plan measures the one
    chosen): "plain" makes the whole logits and holds their fp32 log-probabilities from the forward
    to the backward (4 bytes x vocabulary per token: 2 GiB per 4,096 tokens at 128,256); "fused"
    (mfsdp/models/loss.py) goes over the tokens in chunks (at most 1 GiB of fp32 logits at a time) and
    holds the head's weight and hidden gradients instead (vocabulary x dim plus tokens x dim in the
    compute dtype: about 1 GiB at the 8B shape); three GEMMs either way, the same loss and gradients
    (one rounding more in bf16). It saves memory where a microbatch has more tokens than the model is
    wide (the logits then outweigh the head's gradients).
    The bundled Llama only: refused with --model.hf_impl manager; a --model.hf_impl auto model that
    goes through the manager trains with plain. Plain stays the default until a GPU measurement shows
    fused pays."""

    def __post_init__(self) -> None:
        _one_of(self, "float8", FLOAT8_CHOICES)
        _one_of(self, "hf_impl", HF_IMPLS)
        require(self.hf is None or not self.shape_overrides(), f"--model.hf takes the shape from {self.hf}/config.json;"
                f" unset {', '.join('--model.' + n for n in self.shape_overrides())}")
        require(self.hf is not None or (self.hf_impl == "auto" and not self.random_init),
                 "--model.hf_impl and --model.random_init apply to --model.hf DIR runs; unset them")
        require(self.float8 == "none" or self.hf_impl != "manager",
                 "--model.float8 needs the bundled Llama, and --model.hf_impl manager runs Hugging Face's "
                 "modeling code; use --model.hf_impl auto (or bundled), or --model.float8 none")
        require(not self.float8_skip or self.float8 != "none",
                f"--model.float8_skip {self.float8_skip!r} keeps linears out of float8, but --model.float8 is "
                "none; set --model.float8 tensorwise (or rowwise), or drop --model.float8_skip")
        require(all(self.float8_skip_patterns()), f"--model.float8_skip {self.float8_skip!r} has an empty "
                "pattern; give comma-separated name patterns such as layers.0.*,*.w2")
        _one_of(self, "head_loss", HEAD_LOSSES)
        require(self.head_loss == "plain" or self.hf_impl != "manager",
                f"--model.head_loss {self.head_loss} needs the bundled Llama, and --model.hf_impl manager runs "
                "Hugging Face's modeling code, which returns logits; use --model.hf_impl auto (or bundled), "
                "or --model.head_loss plain")

    def shape_overrides(self) -> dict:
        """The set fields that override the preset's shape."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _NOT_SHAPE and getattr(self, f.name) is not None}

    def default_out_dir(self) -> str:
        """--train.out_dir's default: runs/ and the --model.hf directory's name, else the preset's."""
        return f"runs/{(Path(self.hf).resolve().name or 'hf') if self.hf else self.preset}"

    def float8_skip_patterns(self) -> tuple[str, ...]:
        """--model.float8_skip as ``Float8Transform.skip`` takes it."""
        return tuple(p.strip() for p in self.float8_skip.split(",")) if self.float8_skip else ()

    @classmethod
    def recorded(cls, model: dict) -> "ModelSection":
        """The section a checkpoint's run config recorded, keys this mfsdp does not know dropped. A
        --model.hf run recorded before the bundled route existed reads hf_impl "auto", which
        ``uses_manager`` takes as the manager's, the route it was trained on; one recorded before
        --model.head_loss existed trained with the plain loss, whatever the default is now."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"head_loss": "plain", **{k: v for k, v in model.items() if k in known}})

    def on_manager(self) -> "ModelSection":
        """This section on the manager's route, whose Hugging Face model returns logits: the head loss
        is the plain one there (``mfsdp.train.run.resolve`` resolving "auto", ``mfsdp plan --tp``)."""
        return dataclasses.replace(self, hf_impl="manager", head_loss="plain")

    @property
    def uses_manager(self) -> bool:
        """Whether mfsdp.manager builds the model from Hugging Face's modeling code: a --model.hf one
        not on the bundled route (``mfsdp.train.run.resolve`` resolves "auto" to one of the two)."""
        return self.hf is not None and self.hf_impl != "bundled"

    def llama_config(self, max_seq_len: int) -> LlamaConfig:
        """A preset model's shape: the preset's with the overrides (a --model.hf model's is its
        config.json's, ``mfsdp.train.run.resolve``)."""
        try:
            return get_config(self.preset, max_seq_len=max_seq_len, **self.shape_overrides())
        except ValueError as err:
            raise ConfigError(f"{err}; set --model.preset or the --model.* fields") from None


@dataclass(frozen=True)
class DataSection:
    path: str = "stdlib"
    """A token file from `mfsdp prepare-data`, or "stdlib": build the demo corpus from
    this Python's standard library into OUT_DIR/data/ on first use."""
    seq_len: int = 128
    """Tokens per training sequence."""
    local_batch: int = 8
    """Sequences per rank per microbatch."""
    microbatches: int = 1
    """Microbatches accumulated into one optimizer step."""
    seed: int = 0
    """Seed of the window sampler; with the step number it fixes every batch."""
    val_path: str | None = None
    """A token file (`mfsdp prepare-data`, the training file's tokenizer) to compute the validation
    loss on; the training file is then sampled whole."""
    val_fraction: float = 0.005
    """Without val_path: the fraction of the training file, taken from its end (at least one window
    of seq_len + 1 tokens), held out for the validation loss and never sampled for training; 0 holds
    nothing out. A resumed run keeps the split its checkpoint recorded, so its windows do not change.
    A file of samples holds out its last samples instead (at least one)."""
    packing: bool = True
    """A file of samples (prompt/completion or chat rows): pack whole samples into each window,
    attending only within a sample (document-causal attention, positions restarting per sample);
    false puts one sample in each window, padded, for models without document attention."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "local_batch", "microbatches"):
            require(getattr(self, name) > 0, f"data.{name} must be positive")
        require(0 <= self.val_fraction < 1, "data.val_fraction must lie in [0, 1)")


@dataclass(frozen=True)
class TrainSection:
    steps: int = 300
    """Optimizer steps in the whole run (the learning-rate decay ends here); see also ``epochs``."""
    epochs: int | None = None
    """With a file of samples: passes over the training samples, each in its own order; the run
    then has epochs x (steps per epoch) steps, whatever ``steps`` says. None: ``steps`` decides."""
    lr: float | None = None
    """Peak learning rate of AdamW; None: the recipe's (mfsdp/train/run/recipes.py: 2e-5 for pretrained
    --model.hf weights; 3e-3 for tiny, 3e-4 for 1b and 8b, 1.5e-4 for 70b)."""
    warmup_steps: int | None = None
    """Steps of linear warm-up from zero to ``lr``; None: the recipe's (fine-tuning min(100, steps
    // 10); 2,000 for 1b to 70b and 20 for tiny, at most a fifth of ``steps``)."""
    lr_schedule: str | None = None
    """The decay after the warm-up: "cosine" (a half cosine) or "linear", both down to ``lr *
    min_lr_ratio`` at the last step, or "constant" (``lr`` to the end); None: the recipe's (cosine)."""
    min_lr_ratio: float | None = None
    """The decay ends at ``lr * min_lr_ratio``; None: the recipe's (0 fine-tuning, 0.1 pretraining)."""
    weight_decay: float | None = None
    """AdamW decoupled weight decay of the matrices (norm scales and biases are never decayed);
    None: the recipe's (0 fine-tuning, 0.1 pretraining)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float | None = None
    """AdamW second-moment decay; None: the recipe's (0.999 fine-tuning, 0.95 pretraining)."""
    adamw_kernel: str = "auto"
    """The AdamW kernels for the units stepped on the device: torch's "fused" (one kernel per dtype
    after an fp32 upcast of the gradients), "foreach" (a dozen passes and a shard-sized temporary:
    about 4 more bytes per parameter at the step), "flat" (``mfsdp.flat_adamw``: one pass per
    parameter group over its flat buffers, reading bf16 gradients as they are, compiled on CUDA; no
    step transient; groups it cannot take step with torch's fused kernel on CUDA, foreach on CPU) or
    "auto" (flat on CUDA, where it is the fastest and frees the fused kernel's fp32 copy of the
    gradients; foreach on CPU). All are exact AdamW; their roundings differ, so a run is reproducible
    bit for bit only on one."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    seed: int = 0
    """Seed of the weight initialisation."""
    out_dir: str | None = None
    """Where metrics.jsonl, checkpoints/ and loss.png go; None: runs/ and the preset's name or the
    --model.hf directory's, so that runs of different models never meet (mfsdp/train/run/run_dir.py)."""
    overwrite: bool = False
    """Start this run in an out_dir that holds another run's checkpoints or metrics (another model,
    config or data), or this run's checkpoints, deleting them; without it such a run is refused
    (--resume continues one)."""
    checkpoint_every: int = 100
    """Save every N steps (and always at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep; 0 keeps all. A save is pruned to these only once
    it is complete, so the default has up to 3 on disk at once (plus OUT_DIR/hf with --train.export_hf):
    the disk check before the first step counts them and says how many fit."""
    save_only_model: bool = False
    """Checkpoints hold only the model's weights (in --train.save_dtype), not the fp32 main weights
    and AdamW's moments: 2 bytes a parameter in bf16 instead of 12, for fine-tunes on a small disk.
    A resume from one loads the weights and starts the optimizer afresh; `mfsdp export` reads it."""
    save_dtype: str = "auto"
    """The weights' dtype in a --train.save_only_model checkpoint and in the --train.export_hf export:
    "auto" (the compute dtype, bf16 on CUDA), "bf16" or "fp32" (the fp32 main weights exactly)."""
    sample_tokens: int = 300
    """Length of the text sample printed after training; 0 skips it."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    device: str = "auto"
    """"auto" (CUDA when available), "cuda" or "cpu"."""
    skip_memory_check: bool = False
    """On CUDA the run first predicts its peak memory (``mfsdp plan``) and stops, before building
    anything, when it would not fit the GPU; true skips that check."""
    eval_every: int = 100
    """Compute the validation loss (cross entropy on the held-out tokens, see data.val_path and
    data.val_fraction) every N steps and after the last one; 0 turns evaluation off."""
    eval_batches: int = 8
    """Global batches (world size x local_batch x microbatches windows each) per evaluation; the
    same windows at every world size, so val_loss compares across runs of one global batch."""
    export_hf: bool = False
    """At the end of the run, also write the final weights as a Hugging Face model directory
    (OUT_DIR/hf: config.json and safetensors, as `mfsdp export` does) that transformers loads."""
    async_checkpoint: str | bool = "auto"
    """Write checkpoints in the background: "true", "false" or "auto" (on for CUDA runs, off on
    CPU). Training then waits only for the copy of this rank's shards into pinned host buffers
    (about as many bytes as its checkpoint, held for the whole run), not for the disk; the next
    save or the end of the run waits for the write. Off, every save stalls training until its
    files are written (tens of seconds for a model of a few billion parameters)."""

    def fused_adamw(self, device_type: str) -> bool:
        """Whether torch's AdamW runs its fused kernel (rather than foreach) on a ``device_type``
        ("cuda" or "cpu") run, for the groups it steps."""
        return self.adamw_kernel == "fused" or (self.adamw_kernel in ("auto", "flat") and device_type == "cuda")

    def flat_adamw(self, device_type: str) -> bool:
        """Whether the bound optimizer steps groups flat (``mfsdp.flat_adamw``) on a ``device_type`` run."""
        return self.adamw_kernel == "flat" or (self.adamw_kernel == "auto" and device_type == "cuda")

    def async_checkpoint_on(self, device_type: str) -> bool:
        """Whether saves are asynchronous on a ``device_type`` ("cuda" or "cpu") run."""
        return self.async_checkpoint == "true" or (self.async_checkpoint == "auto"
                                                    and device_type == "cuda")
    profile_step: int = 0
    """Profile this step (torch.profiler, CPU and CUDA): a chrome trace per rank in
    OUT_DIR/profile/ and, from rank 0, the step's time by mfsdp's profiler ranges (data, forward
    and backward, head and loss, optimizer step); 0 profiles nothing. Its metrics record says
    "profiled": the profiler slows that step."""
    skip_disk_check: bool = False
    """Before the first step the run checks that its checkpoints fit the free space of ``out_dir``
    (mfsdp/train/run/disk.py) and stops when not even one does; true skips that check."""

    def __post_init__(self) -> None:
        # One spelling: YAML gives true/false as bools, a flag may say True.
        object.__setattr__(self, "async_checkpoint", str(self.async_checkpoint).lower())
        _one_of(self, "async_checkpoint", ("auto", "true", "false"))
        _one_of(self, "adamw_kernel", ("auto", "flat", "fused", "foreach"))
        require(self.steps > 0, "train.steps must be positive")
        require(self.epochs is None or self.epochs > 0, "train.epochs must be positive")
        require(self.lr is None or self.lr > 0, "train.lr must be positive")
        require(self.warmup_steps is None or 0 <= self.warmup_steps,
                 "train.warmup_steps must not be negative")
        require(self.min_lr_ratio is None or 0 <= self.min_lr_ratio <= 1,
                 "train.min_lr_ratio must lie in [0, 1]")
        if self.lr_schedule is not None:
            _one_of(self, "lr_schedule", SCHEDULES)
        require(self.weight_decay is None or self.weight_decay >= 0, "train.weight_decay must not be negative")
        for name in ("beta1", "beta2"):
            require(getattr(self, name) is None or 0 <= getattr(self, name) < 1, f"train.{name} must lie in [0, 1)")
        for name in ("grad_clip", "checkpoint_every", "keep_checkpoints"):
            require(getattr(self, name) >= 0, f"train.{name} must not be negative")
        _one_of(self, "save_dtype", ("auto", *DTYPES))
        require(self.save_dtype == "auto" or self.save_only_model or self.export_hf, "--train.save_dtype applies "
                "to --train.save_only_model true checkpoints (full ones keep the fp32 main weights) and to "
                "--train.export_hf true; set one of them")
        require(self.sample_tokens >= 0, "train.sample_tokens must not be negative")
        _one_of(self, "device", ("auto", "cuda", "cpu"))
        require(self.eval_every >= 0, "train.eval_every must not be negative (0 turns it off)")
        require(self.eval_batches > 0, "train.eval_batches must be positive")
        require(self.profile_step >= 0 and (self.epochs is not None or self.profile_step <= self.steps),
                f"train.profile_step must lie in [0, train.steps], got {self.profile_step} (0 profiles nothing)")


FROM_RECIPE = ("lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "weight_decay", "beta2")
"""The ``--train`` fields whose None is the recipe's value (``RunConfig.recipe_values``)."""


@dataclass(frozen=True)
class ParallelSection:
    placements: str = "zero3"
    """How state is sharded: zero3, zero2, zero1, ddp, or the two-axis hsdp and hfsdp."""
    replicate: int = 1
    """Replicas for hsdp/hfsdp: the mesh is (replicate, world / replicate)."""
    compute_dtype: str = "auto"
    """Dtype of forward and backward: bf16 on CUDA and fp32 on CPU when "auto"."""
    main_grads_dtype: str = "auto"
    """Dtype gradients accumulate and are reduced in; "auto" is the compute dtype (the core's default)
    for every model, Hugging Face ones included: bf16 gradients halve their buffers, and the step
    upcasts them to fp32 one group at a time. fp32 accumulates in fp32."""
    grad_comm_dtype: str = "auto"
    """Dtype of the gradient reduce-scatter; "auto" follows the core's default."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""
    expert_units: bool = False
    """Shard the experts module of each mixture-of-experts block (all its stacked experts) as its own
    unit inside the block's unit, not with the rest of the block (the bundled MoE presets). Once
    experts are split (--parallel.ep > 1) every layer's experts module is its own unit whatever this
    says: it holds that rank's experts, sharded over the data-parallel ranks left."""
    ep: int = 1
    """Expert parallelism: split each mixture-of-experts layer's experts over N ranks (rank r of a
    group holds experts [r E/N, (r+1) E/N)), each expert's weights then sharded over the world /
    --parallel.replicate / N data-parallel ranks left; tokens travel to their experts and back by
    all-to-all. N must divide the data-parallel shard ranks (world / --parallel.replicate) and the
    experts per layer; both routes (--model.preset moe-tiny/moe-1b or --model.num_experts, and
    --model.hf of a Qwen3-MoE, Qwen2-MoE or Mixtral). 1: every rank gathers every expert."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before the run stops with an error
    (torch's default is 10 minutes). Raise it when a step or a checkpoint save legitimately
    takes longer."""
    compile: str = "auto"
    """torch.compile each block (inductor), as the benchmarks run the library: "auto" compiles on
    CUDA and not on CPU, "true" or "false" force it. The first step then includes the compile (a
    minute or so for a large model, shown in the progress bar); float8 on CUDA needs it, since
    eager float8 runs torchao's casts kernel by kernel."""
    deterministic: bool = False
    """Bit-identical losses across reruns and resumes with the same seeds, world size and
    software: deterministic torch kernels (flash attention's deterministic backward, sort-based
    index ops, NaN-filled torch.empty), no cuDNN attention, CUBLAS_WORKSPACE_CONFIG=:4096:8 and
    NCCL_NVLS_ENABLE=0 (see mfsdp/train/run/determinism.py). Costs speed: slower attention backward
    and index ops, memory fills, and less all-reduce bandwidth on NVSwitch systems; a model op
    with no deterministic kernel stops the run with torch's error naming it."""
    keep_gathered_blocks: str = "auto"
    """How many of the last blocks keep their gathered weights through the step instead of gathering
    again for every forward and backward (``CommunicationPolicy.keep_gathered``): one gather per step
    instead of two per microbatch. Each costs one block's compute-dtype (FP8: float8) weights resident
    throughout; the memory check counts them. A number, or "auto": on one GPU, where a gather is a
    cast (or an FP8 encode) that runs serially with the compute, as many as the planner fits with
    the allocator's margin; elsewhere none (``mfsdp plan`` plans "auto" as none)."""
    high_priority_streams: bool = False
    """Run the gathers and gradient reductions on high-priority CUDA streams
    (``CommunicationPolicy.high_priority_streams``): their kernels get SMs between the compute
    kernels instead of only when compute waits for them. Off until a GPU measures its gain."""
    offload: str = "none"
    """Step part of the optimizer on the host: "none"; "optimizer": the fp32 master weights and
    AdamW states of the units chosen by --parallel.offload_fraction live in host memory (pinned
    on CUDA) and are stepped there by torch's fused CPU AdamW, speculatively during backward as
    each unit's gradient is final, validated at the step (exact with clipping and accumulation;
    mfsdp/offload/); "auto": the planner's smallest fraction that fits this GPU (none if the
    run fits without; CPU runs: none). Saves the states' 8 bytes per offloaded parameter on the
    GPU; costs host RAM (master, states and their backup: 24 bytes per offloaded parameter) and
    whatever CPU time backward does not hide (a clip that bites redoes the CPU steps after it)."""
    offload_fraction: float = 1.0
    """With --parallel.offload optimizer: the share of units offloaded, in (0, 1], counted from
    those whose gradients finish first in backward (the last blocks and the head)."""

    def kept_blocks(self) -> int:
        """``keep_gathered_blocks`` as a number ("auto" before preflight resolves it: none)."""
        return 0 if self.keep_gathered_blocks == "auto" else int(self.keep_gathered_blocks)

    def __post_init__(self) -> None:
        require(self.collective_timeout_s > 0, "parallel.collective_timeout_s must be positive")
        require(self.keep_gathered_blocks == "auto" or (self.keep_gathered_blocks.isdigit()),
                f"parallel.keep_gathered_blocks must be auto or a number >= 0, got {self.keep_gathered_blocks!r}")
        _one_of(self, "offload", OFFLOAD_CHOICES)
        require(0.0 < self.offload_fraction <= 1.0,
                 f"parallel.offload_fraction must be in (0, 1], got {self.offload_fraction}")
        require(self.offload_fraction == 1.0 or self.offload == "optimizer",
                 "--parallel.offload_fraction needs --parallel.offload optimizer")
        _one_of(self, "placements", PLACEMENTS)
        require(isinstance(self.ep, int) and not isinstance(self.ep, bool) and self.ep >= 1,
                f"--parallel.ep must be a positive integer, got {self.ep!r}")
        require(self.replicate > 0, "parallel.replicate must be positive")
        require(self.replicate == 1 or self.placements in TWO_AXIS,
                 f"parallel.replicate={self.replicate} needs --parallel.placements hsdp or "
                 "hfsdp")
        _one_of(self, "compile", COMPILE_CHOICES)
        for name in ("compute_dtype", "main_grads_dtype", "grad_comm_dtype"):
            _one_of(self, name, ("auto", *DTYPES))


@dataclass(frozen=True)
class MetricsSection:
    tensorboard: bool = False
    """Also write the scalars of metrics.jsonl as TensorBoard events to OUT_DIR/tensorboard
    (needs the tensorboard package: pip install tensorboard)."""
    log_every: int = 10
    """With --train.progress false (batch jobs, Slurm logs): print a line with step, loss, lr, tok/s
    and ETA every N steps (and at the first and last)."""
    wandb: bool = False
    """Also log the scalars of metrics.jsonl to Weights & Biases (pip install mfsdp[wandb]; offline
    with WANDB_MODE=offline); a resume continues the same W&B run."""
    wandb_project: str = "mfsdp"
    """The W&B project of --metrics.wandb."""
    wandb_run_name: str | None = None
    """The W&B run name of --metrics.wandb; None: the name of --train.out_dir."""

    def __post_init__(self) -> None:
        require(self.log_every > 0, "metrics.log_every must be positive")


@dataclass(frozen=True)
class PeftSection:
    """Parameter-efficient fine-tuning (``mfsdp.transforms.lora``), with PEFT's names and meanings."""

    method: str = "none"
    """"none" trains every weight; "lora" freezes the base (kept only in the compute dtype: no fp32
    copy, gradient or optimizer state) and trains low-rank adapters on the target linears. Room is
    left here for other methods (DoRA, ...), which are not built."""
    lora_r: int = 16
    """The adapters' rank r (PEFT's ``r``)."""
    lora_alpha: float = 32.0
    """The adapters' scale is lora_alpha / r (PEFT's ``lora_alpha``), or lora_alpha / sqrt(r) with use_rslora."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in training (PEFT's ``lora_dropout``)."""
    target_modules: str = "all-linear"
    """The linears that get adapters: "all-linear" (every linear of the blocks, never the head), or
    comma-separated fnmatch patterns over linear names, Hugging Face's (q_proj, down_proj, ...) or the
    bundled model's (wq, w2, ...) on either route."""
    use_rslora: bool = False
    """Scale by lora_alpha / sqrt(r) (rank-stabilised LoRA) instead of lora_alpha / r."""
    merge_on_export: bool = False
    """Exports (--train.export_hf, mfsdp export) write the merged full Hugging Face model, with the base
    directory's tokenizer and chat template, instead of a PEFT adapter directory."""

    def __post_init__(self) -> None:
        _one_of(self, "method", PEFT_METHODS)
        if self.method == "none":
            given = [f"--peft.{f.name}" for f in dataclasses.fields(self)
                     if f.name != "method" and getattr(self, f.name) != f.default]
            require(not given, f"{', '.join(given)} applies to --peft.method lora; set --peft.method lora or "
                    f"drop {'them' if len(given) > 1 else 'it'}")
        require(isinstance(self.lora_r, int) and self.lora_r >= 1, f"--peft.lora_r must be an integer >= 1, "
                f"got {self.lora_r!r}")
        require(self.lora_alpha > 0, f"--peft.lora_alpha must be positive, got {self.lora_alpha!r}")
        require(0 <= self.lora_dropout < 1, f"--peft.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        require(bool(self.target_modules.strip()), "--peft.target_modules is empty; give all-linear or patterns")

    @property
    def lora(self) -> bool:
        return self.method == "lora"


@dataclass(frozen=True)
class ResolvedModel:
    """What ``mfsdp.train.run.resolve`` found and derived about the model, once: nothing reads the
    --model.hf directory, builds a meta model or counts the parameters again."""

    shape: LlamaConfig
    """The model's shape: the bundled Llama's config; through the manager, the Hugging Face model's
    (for FLOP counts and checkpoint checks)."""
    params: int
    """Every parameter of the model."""
    adapter_params: int = 0
    """LoRA's adapters' parameters (counted on the transformed meta model): what a LoRA run trains and
    checkpoints; 0 without LoRA."""
    hf_config: dict | None = None
    """The --model.hf directory's config.json (checkpoints record it: `mfsdp export` needs no access to
    it); None: a preset."""
    hf_weights: bool = False
    """Whether that directory holds safetensors weights."""

    @property
    def num_experts(self) -> int:
        """Experts per mixture-of-experts layer (0: a dense model): the bundled shape's, or a --model.hf
        config's ``num_experts`` (Qwen3-MoE, Qwen2-MoE) or ``num_local_experts`` (Mixtral)."""
        if self.hf_config is None:
            return self.shape.num_experts
        return int(self.hf_config.get("num_experts") or self.hf_config.get("num_local_experts") or 0)

    @property
    def shared_expert(self) -> str | None:
        """The name of a layer's shared expert module, where the model has one (Qwen2-MoE's
        ``shared_expert``), else None."""
        return "shared_expert" if (self.hf_config or {}).get("shared_expert_intermediate_size") else None

    @functools.cached_property
    def transformers_config(self):
        """``hf_config`` as a transformers config, built from the parsed dict on first use, then shared by
        what the manager route builds from it (the planner's meta model, the trained model)."""
        import transformers

        return transformers.AutoConfig.for_model(**{"model_type": None, **self.hf_config})  # None: its error


@dataclass(frozen=True)
class DpoSection:
    """Preference tuning (DPO and its kin), with trl's names and defaults; it trains when --data.path
    holds preference pairs (``mfsdp prepare-data`` of prompt/chosen/rejected rows), and only then."""

    beta: float = 0.1
    """How far the policy may move from the reference (trl's ``beta``): the losses' temperature."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge, simpo (reference-free, length-normalised, as trl's CPO trainer with
    cpo_alpha 0) or sft (the NLL of the chosen answer); a comma list sums several (trl's list)."""
    loss_weights: str = ""
    """One weight per loss_type, comma-separated (empty: 1 each)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the share of pairs assumed mislabelled, in [0, 0.5) (sigmoid and simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target margin (trl's ``simpo_gamma``)."""

    def __post_init__(self) -> None:
        self.loss()  # its ValueError, in its own words, is the flag's ConfigError

    def loss(self) -> PreferenceLoss:
        """The preference loss of these settings."""
        weights = tuple(float(w) for w in self.loss_weights.split(",")) if self.loss_weights.strip() else None
        return PreferenceLoss(self.beta, tuple(n.strip() for n in self.loss_type.split(",")), weights,
                              self.label_smoothing, self.simpo_gamma)

    def describe(self, lora: bool) -> str:
        """The method and its reference in a few words, for the first line of a run."""
        loss = self.loss()
        reference = ("no reference" if not loss.needs_reference else "reference: the base with the adapters off"
                     if lora else "reference: the initial model's log-probs, computed first")
        return f"preference tuning ({self.loss_type}, beta {self.beta:g}; {reference})"


@dataclass(frozen=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    """The model to train: a preset with optional shape overrides, or a Hugging Face directory."""
    data: DataSection = field(default_factory=DataSection)
    """The token file and how batches are drawn from it."""
    train: TrainSection = field(default_factory=TrainSection)
    """Optimizer, schedule, checkpoints and output directory."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """Sharding, dtypes and the collective timeout."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Where per-step metrics go besides metrics.jsonl."""
    peft: PeftSection = field(default_factory=PeftSection)
    """Parameter-efficient fine-tuning (LoRA) instead of training every weight."""
    dpo: DpoSection = field(default_factory=DpoSection)
    """Preference tuning, when the data holds preference pairs."""
    resume: bool | str = False
    """Continue from the newest complete checkpoint in OUT_DIR/checkpoints (--resume: an error where
    there is none); "auto" (--resume auto, for job scripts that requeue) starts afresh where there is none."""
    resolved: ResolvedModel | None = None
    """What ``mfsdp.train.run.resolve`` found and derived about the model, once; None until resolved."""
    from_recipe: tuple[str, ...] = ()
    """The ``FROM_RECIPE`` fields of ``train`` that no flag set, filled in from the recipe."""
    dpo_given: tuple[str, ...] = ()
    """The ``--dpo`` flags (or YAML keys) given, at any value: refused unless the data holds pairs."""
    pairs: bool = False
    """Whether --data.path holds preference pairs (preflight opens it): the run tunes preferences."""

    def __post_init__(self) -> None:
        require(self.resume in (False, True, "auto"), f"--resume takes no value or auto, got {self.resume!r}")
        problem = float8_placement_problem(self.model.float8, self.parallel.placements)
        require(problem is None, problem)

    def loads_weights(self) -> bool:
        """Whether the run starts from pretrained weights: --model.hf DIR with safetensors there, and
        not --model.random_init true."""
        return self.model.hf is not None and not self.model.random_init and self.resolved.hf_weights

    def recipe(self) -> tuple[str, Recipe]:
        """The name and values of the run's recipe (``mfsdp.train.run.recipes``): fine-tuning (LoRA's with
        --peft.method lora) for pretrained weights, else the preset's or, for ``--model.hf``, that of the preset nearest in
        size."""
        return recipe_for(self.model.preset, self.resolved.shape, by_size=self.model.hf is not None,
                          pretrained=self.loads_weights(), lora=self.peft.lora, pairs=self.pairs)

    def recipe_values(self) -> dict:
        """The recipe's value of each ``FROM_RECIPE`` field of ``--train``, for this run's length."""
        _, r = self.recipe()
        return {"lr": r.lr, "warmup_steps": r.warmup_for(self.train.steps), "lr_schedule": r.schedule,
                "min_lr_ratio": r.min_lr_ratio, "weight_decay": r.weight_decay, "beta2": r.beta2}

    def schedule_line(self) -> str:
        """The learning rate and its schedule in a few words, for the first line of a run; names the
        recipe and the ``--train`` flags that changed its values."""
        t = self.train
        name, _ = self.recipe()
        given = [f"--train.{key}" for key, value in self.recipe_values().items() if getattr(t, key) != value]
        source = f"the {name} recipe" + (f", {' and '.join(given)} given" if given else "")
        decay = "then constant" if t.lr_schedule == "constant" else f"{t.lr_schedule} to {t.min_lr_ratio:g}x"
        return f"lr {t.lr:g} (warm-up {t.warmup_steps} steps, {decay}; {source})"

    def model_line(self) -> str:
        """The model in a few words, for the first line of a run: the preset, or the Hugging Face
        architecture and its directory."""
        if self.model.hf is None:
            return f"{self.model.preset} model"
        c = self.resolved.hf_config
        name = (c.get("architectures") or [c.get("model_type") or "Hugging Face model"])[0]
        return f"{name} from {self.model.hf}" + ("" if self.loads_weights() else " (random init)")

    def dp_shard(self, world: int) -> int:
        """The data-parallel shard ranks of a ``world``-rank run: the world over its replicas."""
        return world // self.parallel.replicate

    def experts_line(self, world: int) -> str | None:
        """How a mixture of experts' experts are split over ``world`` ranks, for the first lines of a
        run (``describe_split``); None for a dense model."""
        experts, ep = self.resolved.num_experts, self.parallel.ep
        if not experts:
            return None
        return describe_split(experts, ep, self.dp_shard(world) // ep, self.resolved.shared_expert)

    def method_line(self) -> str:
        """What trains, in a few words, for the first line of a run: every weight, or LoRA's adapters."""
        p = self.peft
        if not p.lora:
            return "every weight trains"
        scale = f"alpha {p.lora_alpha:g}" + (", rsLoRA" if p.use_rslora else "")
        return f"LoRA r {p.lora_r}, {scale} on {p.target_modules} (the base frozen)"

    def route_note(self) -> str | None:
        """Why a --model.hf model trains through the manager although the bundled Llama is faster, in
        one line; None where it is on the bundled route (or the manager was asked for a config
        the bundled Llama could run)."""
        m = self.model
        why = supports_bundled(self.resolved.hf_config, self.data.seq_len) if m.uses_manager else None
        return None if why is None else (f"--model.hf {m.hf}: trained through the manager (Hugging Face's "
                                         f"modeling code), not as the bundled Llama: {why}")

    def compute_dtype(self, device_type: str) -> torch.dtype:
        """``--parallel.compute_dtype``: "auto" is bf16 on CUDA and fp32 on CPU."""
        return DTYPES.get(self.parallel.compute_dtype) or (
            torch.bfloat16 if device_type == "cuda" else torch.float32)

    def weights_dtype(self, device_type: str) -> torch.dtype:
        """``--train.save_dtype`` as a dtype ("auto": the compute dtype): what model-only checkpoints
        and the end-of-run export write the weights in."""
        return DTYPES.get(self.train.save_dtype) or self.compute_dtype(device_type)

    def save_dtype(self, device_type: str) -> torch.dtype | None:
        """The weights' dtype of a ``--train.save_only_model`` checkpoint, or None when checkpoints
        hold the whole training state."""
        return self.weights_dtype(device_type) if self.train.save_only_model else None

    def main_grads_name(self, device_type: str = "cuda") -> str:
        """What ``--parallel.main_grads_dtype`` means, "fp32" or "bf16": "auto" is the compute dtype
        on ``device_type``, for every model."""
        chosen = self.parallel.main_grads_dtype
        if chosen != "auto":
            return chosen
        return "fp32" if self.compute_dtype(device_type) == torch.float32 else "bf16"

    def main_grads_dtype(self, name: str | None = None) -> torch.dtype | None:
        """The core's ``main_grads_dtype`` for ``--parallel.main_grads_dtype`` (or ``name``): None for
        "auto", the core's default, which is the compute dtype (``main_grads_name``); the manager
        route reduces in fp32 exactly when this is fp32."""
        return DTYPES.get(self.parallel.main_grads_dtype if name is None else name)

    def grad_comm_dtype(self) -> torch.dtype | None:
        """The core's ``grad_comm_dtype`` (None: its default); the manager picks its own."""
        return None if self.model.uses_manager else DTYPES.get(self.parallel.grad_comm_dtype)

    def compiles(self, device_type: str) -> bool:
        """Whether the blocks are compiled on ``device_type`` ("cuda" or "cpu")."""
        return self.parallel.compile == "true" or (self.parallel.compile == "auto" and device_type == "cuda")

    def to_dict(self) -> dict:
        """The sections and ``resume``, as checkpoints record them (not what resolve read or filled)."""
        return {k: v if k == "resume" else dataclasses.asdict(v) for k, v in vars(self).items()
                if k not in ("resolved", "from_recipe", "dpo_given", "pairs")}
