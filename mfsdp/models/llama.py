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

The rotary tables are non-persistent buffers, so they are not in the state dict
and ``init_weights`` rebuilds them; that is what makes meta-device construction
followed by ``to_empty`` + ``init_weights`` work. ``init_weights`` draws each weight from
a generator keyed by the parameter's name (``normal_by_rows_``), so it gives the same
values on sharded DTensor parameters as on the whole model, and never needs a whole
matrix on one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.utils.checkpoint import checkpoint

from mfsdp import _compat


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

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, c: dict, max_seq_len: int) -> "LlamaConfig":
        """The shape of a Hugging Face decoder ``config.json`` (for FLOP counts and shape checks).

        Raises KeyError or ValueError when the dict is not a Llama-like decoder config.
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
    local, offset, local_shape = _local_block(tensor)
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


def _local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
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


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None):
    """fp32 cosine and sine tables, each of shape ``(seq_len, head_dim // 2)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = theta ** -exponents
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, seq, heads, head_dim) by position.

    Rotate-half form: element i of the first half pairs with element i of the second.
    ``Llama.forward`` passes tables already in the activation dtype, so the casts below
    are no-ops there; they keep direct callers with the fp32 tables working.
    """
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype=None, device=None):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        linear = dict(bias=False, dtype=dtype, device=device)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, **linear)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, **linear)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, **linear)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, **linear)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # (batch, heads, seq, head_dim), the layout SDPA expects.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = self._expand_kv(k), self._expand_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat each key/value head for the query heads that share it.

        Done by hand rather than with SDPA's ``enable_gqa`` so every torch version and
        attention backend takes the same path.
        """
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, use_reentrant=self.checkpoint_reentrant)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


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
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_feed_forward(self, cfg: LlamaConfig, dtype=None, device=None) -> nn.Module:
        """The feed-forward layer of one block: SwiGLU here; subclasses may return another."""
        if cfg.num_experts:
            raise ValueError(f"num_experts={cfg.num_experts} needs the mixture-of-experts model: "
                             "build it with mfsdp.models.build_model(cfg) or "
                             "mfsdp.models.moe.MoELlama(cfg), or set num_experts=0")
        return FeedForward(cfg, dtype=dtype, device=device)

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
        sets through ``init_matrices``). Norm scales start at one.

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

        def normal(linear: nn.Module, std: float) -> None:
            normal_by_rows_(linear.weight, std, seed=seed, key=names[id(linear.weight)])

        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        normal(self.tok_embeddings, std)
        for block in self.layers:
            ffn_in, ffn_out = block.feed_forward.init_matrices()
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, *ffn_in):
                normal(linear, std)
            for linear in (block.attention.wo, *ffn_out):
                normal(linear, residual_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            normal(self.output, std)
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rotary_tables(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for token ids of shape (batch, seq)."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        # Cast once here rather than for q and k in every layer.
        cos, sin = self.rope_cos[:seq].to(h.dtype), self.rope_sin[:seq].to(h.dtype)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h))
