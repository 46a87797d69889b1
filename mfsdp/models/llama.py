"""A Llama-3-style decoder in plain PyTorch, free of any parallelism.

The pieces are the usual ones: pre-norm RMSNorm, rotary position embeddings
(rotate-half form), grouped-query causal attention through
``F.scaled_dot_product_attention``, and a SwiGLU feed-forward layer.

Two choices exist for the sake of sharding wrappers such as ``mfsdp.fully_shard``:

* ``Llama.layers`` holds one ``Block`` per layer, the natural unit to shard.
* A block's feed-forward layer comes from ``Llama.make_feed_forward``, so a subclass can
  swap in another one (``mfsdp.models.moe.MoELlama`` puts a mixture of experts there)
  and reuse everything else.
* Activation checkpointing happens *inside* ``Block.forward``. A wrapper that
  hooks the block therefore sees exactly one forward call per step, and the
  recomputation in backward reuses the parameters the wrapper has already
  gathered for the block's backward.
* Packed fine-tuning samples: ``Llama.forward`` takes ``positions`` (the rotary tables are
  indexed by them) and ``document_ids`` (attention is causal within each document; the mask is
  built once per forward at the root, ``mfsdp.models.document_mask``, and handed to every
  block), and with ``labels`` returns the summed cross entropy and the token count, computed in
  the output head's forward (``Head``) so that a sharding wrapper has its weight gathered there.

The rotary tables are non-persistent buffers, so they are not in the state dict
and ``init_weights`` rebuilds them; that is what makes meta-device construction
followed by ``to_empty`` + ``init_weights`` work. ``init_weights`` draws each weight from
a generator keyed by the parameter's name (``normal_by_rows_``), so it gives the same
values on sharded DTensor parameters as on the whole model, and never needs a whole
matrix on one process.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.utils.checkpoint import checkpoint

from mfsdp import _compat
from mfsdp.models.document_mask import DocumentMask, document_mask, masked_attention
from mfsdp.models.loss import linear_cross_entropy

IGNORE_INDEX = -100
"""The label of a token that the loss does not count (torch's and Hugging Face's convention)."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary frequency rescaling (Hugging Face ``rope_type: llama3``).

    Frequencies whose wavelength is longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``; those shorter than ``original_max_position_embeddings
    / high_freq_factor`` are kept; those in between are interpolated smoothly. A pretrained model
    needs exactly the tables it was trained with, so this must match its config.
    """

    factor: float
    """How much the long wavelengths are stretched (8 for Llama 3.1)."""
    low_freq_factor: float
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are fully scaled (1)."""
    high_freq_factor: float
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept (4)."""
    original_max_position_embeddings: int
    """The context length the model was pretrained at (8192 for Llama 3.1)."""

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"Llama3RopeScaling.factor must be positive, got {self.factor!r}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"Llama3RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor!r} and {self.high_freq_factor!r}")
        n = self.original_max_position_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError("Llama3RopeScaling.original_max_position_embeddings must be a positive "
                             f"integer, got {n!r}")

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The rescaled inverse frequencies (fp32 in, fp32 out)."""
        context = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq
        long = wavelength > context / self.low_freq_factor  # fully scaled
        short = wavelength < context / self.high_freq_factor  # kept as they are
        smooth = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(long, inv_freq / self.factor, torch.where(short, inv_freq, between))


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and initialisation of a Llama-style decoder."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per attention layer; must divide ``dim``."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward layer."""
    vocab_size: int
    """Rows of the embedding table and columns of the output head."""
    max_seq_len: int = 4096
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 500000.0
    """Base of the rotary frequencies (Llama 3 uses 500000)."""
    norm_eps: float = 1e-5
    """Added to the mean square in RMSNorm, for stability."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    tie_embeddings: bool = False
    """Share one matrix between the input embedding and the output head."""
    num_experts: int = 0
    """Experts per feed-forward layer (``mfsdp.models.moe``); 0 is the dense SwiGLU layer. Each
    expert is a SwiGLU layer of hidden width ``ffn_dim``."""
    top_k: int = 2
    """Experts each token is routed to; ignored when ``num_experts`` is 0."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (``MoELlama.aux_loss``) that ``mfsdp train`` adds to the
    cross entropy; 0 turns it off. 0.01 is the Switch Transformer's value."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 has them; the output projection
    never does). They start at zero."""
    rope_scaling: "Llama3RopeScaling | None" = None
    """Llama 3.1's rescaling of the rotary frequencies for long contexts; None keeps the plain
    ``rope_theta`` frequencies."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide dim ({self.dim})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (dim / n_heads = {self.head_dim}) must be even for "
                             "rotary embeddings")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("rope_theta, norm_eps and init_std must be positive")
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be a non-negative integer, got {value!r}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must lie in [1, num_experts={self.num_experts}]; "
                             "set top_k to at most the number of experts")
        if not self.moe_aux_loss_coef >= 0:
            raise ValueError(f"moe_aux_loss_coef must not be negative, got {self.moe_aux_loss_coef!r}")
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"LlamaConfig.qkv_bias must be a bool, got {self.qkv_bias!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"LlamaConfig.rope_scaling must be a Llama3RopeScaling or None, got "
                             f"{self.rope_scaling!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, c: dict, max_seq_len: int) -> "LlamaConfig":
        """The shape of a Hugging Face decoder ``config.json`` (for FLOP counts and shape checks).

        Lenient on purpose: it reads the shape of any Llama-like decoder (Mixtral's experts too),
        including ones the bundled model cannot run, because the manager trains those. The config
        of a bundled model built from Hugging Face weights comes from
        ``mfsdp.hf.config.bundled_config_from_hf``, which honours or refuses every key that
        changes the forward. Raises KeyError or ValueError when the dict is not a Llama-like
        decoder config.
        """
        # Mixtral-style experts (num_local_experts of width intermediate_size); other MoE layouts
        # (shared experts, a separate moe_intermediate_size) are counted as their dense shape.
        experts = c.get("num_local_experts") or 0
        return cls(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                   n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                   ffn_dim=c["intermediate_size"], vocab_size=c["vocab_size"], max_seq_len=max_seq_len,
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)), num_experts=experts,
                   top_k=c.get("num_experts_per_tok") or 2)


PRESETS: dict[str, LlamaConfig] = {
    # About 3.4M parameters: trains on two CPU processes in minutes. The vocabulary holds
    # the 256 byte values plus room for special tokens.
    "tiny": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                        vocab_size=512, max_seq_len=256),
    # The Llama-3.2-1B shape with an untied head: about 1.50B parameters.
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      vocab_size=128256),
    # The Llama-3-8B shape: about 8.03B parameters.
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      vocab_size=128256),
    # The Llama-3-70B shape: about 70.55B parameters (140 GB in bf16, so it is only ever built
    # on the meta device and materialised shard by shard; see Llama.init_weights).
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       vocab_size=128256, rope_theta=500000.0),
    # Mixtures of experts (mfsdp.models.moe.MoELlama; build_model picks it from num_experts).
    # About 1.9M parameters, 1.1M of them used per token: trains on two CPU processes in a minute.
    "moe-tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256,
                            vocab_size=512, max_seq_len=256, num_experts=4, top_k=2),
    # 8 experts, top 2, the Llama-3 vocabulary: about 1.02B parameters, 0.49B used per token.
    "moe-1b": LlamaConfig(dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=1792,
                          vocab_size=128256, num_experts=8, top_k=2),
}


def get_config(preset: str, **overrides) -> LlamaConfig:
    """The named preset, with any field replaced by ``overrides``."""
    if preset not in PRESETS:
        dense = [k for k, v in PRESETS.items() if not v.num_experts]  # smallest first
        moe = sorted(k for k, v in PRESETS.items() if v.num_experts)
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(dense)}; "
                         f"mixtures of experts: {', '.join(moe)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; known: {sorted(fields)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


INIT_CHUNK_NUMEL = 1 << 22
"""Elements per chunk of the shard-invariant initialisation (``normal_by_rows_``): 16 MiB in fp32.
Part of the init's definition (the chunk is the unit of the random stream), so changing it changes
the initial weights; it bounds the transient memory of initialising any parameter, however large."""


def init_chunk_seed(seed: int, key: str, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of the tensor named ``key``: a stable hash, the same
    in every process (Python's ``hash`` of a string is not)."""
    digest = hashlib.blake2b(f"{seed}:{key}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def normal_by_rows_(tensor: torch.Tensor, std: float, *, seed: int, key: str,
                    chunk_numel: int | None = None) -> torch.Tensor:
    """Fill ``tensor`` with N(0, std) values that depend only on ``(seed, key)`` and position.

    The rows (dim 0) of the whole tensor are cut into chunks of ``chunk_numel // row_numel`` rows
    (at least one); chunk ``c`` is drawn in fp32 from a generator on the tensor's device seeded by
    ``init_chunk_seed(seed, key, c)``, then cast into the tensor. A DTensor (sharded by mfsdp,
    FSDP2 or tensor parallelism) fills only its local block: each rank draws just the chunks its
    block's rows fall in and keeps its part. So a sharded tensor holds exactly the values of the
    unsharded one, at every world size and placement, and no rank ever holds the whole tensor:
    the transient memory is one chunk (``INIT_CHUNK_NUMEL`` elements by default). The values
    depend on the device type's generator (CPU and CUDA draw different numbers), as any torch
    initialisation does. A meta tensor is left alone.
    """
    chunk_numel = INIT_CHUNK_NUMEL if chunk_numel is None else chunk_numel
    local, offset, local_shape = local_block(tensor)
    if local.is_meta or local.numel() == 0:
        return tensor
    shape = tuple(tensor.shape) or (1,)
    local = local.view(local_shape)
    row_numel = math.prod(shape[1:])
    rows_per_chunk = max(1, chunk_numel // max(1, row_numel))
    lo, hi = offset[0], offset[0] + local_shape[0]
    for chunk in range(lo // rows_per_chunk, (hi - 1) // rows_per_chunk + 1):
        first, last = chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, shape[0])
        generator = torch.Generator(device=local.device)
        generator.manual_seed(init_chunk_seed(seed, key, chunk))
        values = torch.empty((last - first, *shape[1:]), dtype=torch.float32, device=local.device)
        values.normal_(0.0, std, generator=generator)
        a, b = max(lo, first), min(hi, last)
        src = values[a - first:b - first]
        for dim in range(1, len(shape)):
            src = src.narrow(dim, offset[dim], local_shape[dim])
        local[a - lo:b - lo].copy_(src)
        del values, src  # one chunk alive at a time
    return tensor


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this process's tensor, its global offset, its shape), 0-dim tensors read as shape (1,)."""
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape) or (1,)
        return tensor, (0,) * len(shape), shape
    if any(isinstance(p, Partial) for p in tensor.placements):
        raise ValueError(f"cannot initialise a DTensor with placements {tensor.placements} in place: a "
                         "Partial placement holds summands, not values; redistribute it to Shard or "
                         "Replicate first")
    local = tensor.to_local()  # under no_grad: the DTensor's own local tensor, written in place
    shape, offset = _compat.local_shape_and_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(local.shape) != shape:
        raise NotImplementedError(
            f"a DTensor of shape {tuple(tensor.shape)} with placements {tensor.placements} holds a local "
            f"tensor of shape {tuple(local.shape)} but torch describes its block as {shape}; it cannot be "
            "initialised shard by shard (initialise it before sharding, or load its values)")
    return local, (tuple(offset) or (0,)), (tuple(shape) or (1,))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean square of bf16 activations loses too much precision, so normalise in fp32
        # and only then return to the activation dtype for the scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None,
                  scaling: Llama3RopeScaling | None = None):
    """fp32 cosine and sine tables, each of shape ``(seq_len, head_dim // 2)``; ``scaling``
    rescales the frequencies as Llama 3.1 does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = theta ** -exponents
    if scaling is not None:
        inv_freq = scaling.rescale(inv_freq)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, seq, heads, head_dim) by position.

    Rotate-half form: element i of the first half pairs with element i of the second.
    The tables are (seq, head_dim // 2), shared by the batch, or (batch, seq, head_dim // 2)
    when each sequence has its own positions (packed samples restart at 0).
    ``Llama.forward`` passes tables already in the activation dtype, so the casts below
    are no-ops there; they keep direct callers with the fp32 tables working.
    """
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    if cos.ndim == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype=None, device=None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        qkv = dict(bias=cfg.qkv_bias, dtype=dtype, device=device)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, **qkv)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, **qkv)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, **qkv)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        """Causal self-attention; with ``mask`` (``document_mask``) also within each document."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # (batch, heads, seq, head_dim), the layout SDPA expects.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:  # SDPA's kernels read the shared key/value heads in place (cuDNN, flash)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            out = masked_attention(q, k, v, mask, expand_kv=self._expand_kv)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat each key/value head for the query heads that share it: for SDPA with a boolean
        mask (``masked_attention``), whose kernels take no grouped heads with one."""
        repeats = self.n_heads // self.n_kv_heads
        if repeats == 1:
            return t
        batch, kv_heads, seq, head_dim = t.shape
        t = t[:, :, None].expand(batch, kv_heads, repeats, seq, head_dim)
        return t.reshape(batch, kv_heads * repeats, seq, head_dim)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, cfg: LlamaConfig, dtype=None, device=None):
        super().__init__()
        linear = dict(bias=False, dtype=dtype, device=device)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, **linear)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, **linear)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_matrices(self) -> tuple[list[nn.Linear], list[nn.Linear]]:
        """The linears ``Llama.init_weights`` draws: those read from the residual stream (init_std),
        then those writing into it (the scaled std), each list in draw order."""
        return [self.w1, self.w3], [self.w2]


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype=None, device=None,
                 feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, device=device)
        self.attention = Attention(cfg, dtype=dtype, device=device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, device=device)
        # Any module mapping (..., dim) to (..., dim) with an ``init_matrices`` method.
        self.feed_forward = (feed_forward if feed_forward is not None
                             else FeedForward(cfg, dtype=dtype, device=device))
        # Set through Llama.set_activation_checkpointing: recompute this block's activations
        # in backward instead of storing them, optionally with the reentrant implementation.
        self.checkpointing = False
        self.checkpoint_reentrant = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, mask, use_reentrant=self.checkpoint_reentrant)
        return self._body(x, cos, sin, mask)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def plain_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of the token cross entropies, int64 count) over the tokens whose label is not -100.

    The plain form of ``linear_cross_entropy(hidden, weight, labels)``: the whole (batch, seq,
    vocab) logits exist at once. ``Llama.loss_fn`` may be swapped for a fused chunked one of the
    same signature that never holds them.
    """
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


HEAD_LOSSES = {"plain": plain_linear_cross_entropy, "fused": linear_cross_entropy}
"""The losses of ``Llama.set_head_loss``, by name. "plain" makes the whole (batch, seq, vocab) logits
and holds their fp32 log-probabilities from the forward to the backward. "fused"
(``mfsdp.models.loss.linear_cross_entropy``) goes over the tokens in chunks, holds one chunk's logits
at a time and, from the forward to the backward, the head's weight and hidden gradients instead
(vocab x dim plus tokens x dim in the compute dtype; see that module's design note)."""


@functools.lru_cache(maxsize=None)
def compiled_head_loss(name: str):
    """``HEAD_LOSSES[name]`` through torch.compile, made once per process. Inductor fuses the plain
    loss's upcast, log-softmax and their gradient, so neither the fp32 logits nor their fp32
    log-probabilities exist: the forward keeps the compute-dtype logits, the backward makes their
    gradient in the compute dtype (``mfsdp.memory.activations.CompiledPlainLoss`` plans that)."""
    return torch.compile(HEAD_LOSSES[name])


class Head(nn.Linear):
    """The output projection; with labels it returns the loss instead of the logits.

    The loss is computed here, in the head's own forward, because a sharding wrapper that makes
    the head a unit of its own (``mfsdp.models.parallelize``) gathers its weight only around this
    forward; a loss that read ``weight`` from elsewhere would see a shard.
    """

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                loss_fn=plain_linear_cross_entropy):
        if labels is None:
            with torch.profiler.record_function("mfsdp.model.head"):
                return super().forward(hidden)
        with torch.profiler.record_function("mfsdp.model.head_and_loss"):
            return loss_fn(hidden, self.weight, labels)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Block(cfg, dtype=dtype, device=device,
                  feed_forward=self.make_feed_forward(cfg, dtype=dtype, device=device))
            for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype, device=device)
        self.output = Head(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device,
                                 scaling=cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The loss of ``forward(..., labels=...)``: any function (hidden, head weight, labels) ->
        # (fp32 sum, int64 count); ``set_head_loss("fused")`` swaps in the chunked one that never
        # holds the whole logits.
        self.loss_fn = plain_linear_cross_entropy
        # Where document-masked attention runs ("auto": flex_attention on CUDA, SDPA with a
        # boolean mask elsewhere; see mfsdp.models.document_mask).
        self.document_mask_backend = "auto"

    def make_feed_forward(self, cfg: LlamaConfig, dtype=None, device=None) -> nn.Module:
        """The feed-forward layer of one block: SwiGLU here; subclasses may return another."""
        if cfg.num_experts:
            raise ValueError(f"num_experts={cfg.num_experts} needs the mixture-of-experts model: "
                             "build it with mfsdp.models.build_model(cfg) or "
                             "mfsdp.models.moe.MoELlama(cfg), or set num_experts=0")
        return FeedForward(cfg, dtype=dtype, device=device)

    def set_head_loss(self, name: str, compiled: bool = False) -> None:
        """Compute the loss of ``forward(..., labels=...)`` with ``HEAD_LOSSES[name]``, "plain" or
        "fused", through torch.compile when ``compiled`` (``compiled_head_loss``); ``mfsdp train
        --model.head_loss`` (compiled with the blocks) and the memory planner both set it here."""
        if name not in HEAD_LOSSES:
            raise ValueError(f"unknown head loss {name!r}; use one of {', '.join(HEAD_LOSSES)}")
        self.loss_fn = compiled_head_loss(name) if compiled else HEAD_LOSSES[name]

    def set_activation_checkpointing(self, enabled: bool, reentrant: bool = False) -> None:
        """Make every block recompute its activations in backward (or stop doing so)."""
        for block in self.layers:
            block.checkpointing = enabled
            block.checkpoint_reentrant = reentrant

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None,
                     seed: int | None = None) -> None:
        """Initialise every parameter in place and rebuild the rotary tables.

        Matrices are drawn from N(0, init_std); the two projections that write into the
        residual stream (``wo`` and ``w2``) use init_std / sqrt(2 * n_layers) so the
        stream's variance does not grow with depth (a feed-forward layer names its own two
        sets, linears or parameters, through ``init_matrices``). Norm scales start at one.

        Each matrix's values are a function of ``seed``, its parameter name and the position
        only (``normal_by_rows_``), so the result is the same whether the parameters are plain
        tensors or DTensor shards (built on the meta device and sharded first, as ``mfsdp
        train`` does), at any world size and placement, and no rank draws or holds more than
        its own shard plus one chunk. ``seed`` None draws one from torch's global (CPU)
        generator, so ``torch.manual_seed(s)`` then ``init_weights()`` is deterministic; seed
        every rank alike. Matrices are drawn in fp32 and cast, so a bf16 model holds the bf16
        rounding of an fp32 one's values.
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        names = {id(p): name for name, p in self.named_parameters()}

        def normal(matrix: nn.Module | torch.Tensor, std: float) -> None:  # a linear, or a parameter itself
            weight = matrix if isinstance(matrix, torch.Tensor) else matrix.weight
            normal_by_rows_(weight, std, seed=seed, key=names[id(weight)])

        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        normal(self.tok_embeddings, std)
        for block in self.layers:
            ffn_in, ffn_out = block.feed_forward.init_matrices()
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, *ffn_in):
                normal(linear, std)
            for linear in (block.attention.wo, *ffn_out):
                normal(linear, residual_std)
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
                if linear.bias is not None:
                    local_block(linear.bias)[0].zero_()
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            normal(self.output, std)
        self.reset_rotary_tables(buffer_device)

    def reset_rotary_tables(self, device: torch.device | str | None = None) -> None:
        """Rebuild the rotary tables (non-persistent buffers) on ``device`` (default: where they
        are), as after ``to_empty``, which leaves them uninitialised."""
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rotary_tables(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device,
            scaling=self.cfg.rope_scaling)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                branch_ids: torch.Tensor | None = None):
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq).

        ``positions`` (batch, seq) int64 index the rotary tables (default 0, 1, ...; packed
        samples restart at 0, and each must stay below ``max_seq_len``, which is not checked on
        the device). ``document_ids`` (batch, seq) ints restrict attention to earlier tokens of
        the same id; the mask is built here once for all blocks (``branch_ids``, (batch, seq),
        add a packed preference pair's branches: ``document_mask``). With ``labels`` (batch, seq)
        int64, -100 where a token is not counted, the result is ``self.loss_fn``'s
        ``(fp32 loss sum, int64 count)`` instead of the logits.
        """
        batch, seq = tokens.shape
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.cfg.max_seq_len}")
        for name, extra in (("positions", positions), ("document_ids", document_ids), ("labels", labels),
                            ("branch_ids", branch_ids)):
            if extra is not None and tuple(extra.shape) != (batch, seq):
                raise ValueError(f"{name} must have the tokens' shape {(batch, seq)}, got "
                                 f"{tuple(extra.shape)}")
        h = self.tok_embeddings(tokens)
        # Cast once here rather than for q and k in every layer.
        if positions is None:
            cos, sin = self.rope_cos[:seq].to(h.dtype), self.rope_sin[:seq].to(h.dtype)
        else:
            cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        mask = None if document_ids is None else document_mask(document_ids, self.document_mask_backend, branch_ids)
        for block in self.layers:
            h = block(h, cos, sin) if mask is None else block(h, cos, sin, mask)
        if labels is None:
            return self.output(self.norm(h))
        return self.output(self.norm(h), labels, self.loss_fn)
