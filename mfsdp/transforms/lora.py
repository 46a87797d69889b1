"""LoRA adapters as a model transform, with PEFT's names and meanings (r, alpha, dropout,
target_modules, use_rslora).

``LoraTransform.apply`` freezes every parameter of the model and turns each target linear into a
LoRA linear. The module object stays; its class becomes a subclass of its own class that mixes
in the adapter (``nn.Linear`` becomes ``LoraLinear``, torchao's ``Float8Linear`` a
``LoraFloat8Linear``). So the base weight keeps its name (checkpoints and Hugging Face loaders
see the names they know), its dtype and any gather tag float8 gave it, and the base forward runs
as it did, float8 GEMMs included. The adapter adds ``(dropout(x) @ A.T @ B.T) * scale``: A
(r x in) is Kaiming-uniform with a = sqrt(5), as PEFT draws it, and B (out x r) is zeros, so step 0
is the base model. Plain tensor ops, so a compiled block has no graph break.

The adapters are made in the base weight's dtype and are the model's only trainable parameters.
``fully_shard`` groups a block's parameters by (dtype, requires_grad): the frozen base is gathered
and never reduced, and the adapters get the mixed-precision policy's fp32 main weights, gradients
and optimizer state like any trainable parameter.

Names: a target pattern is matched (``fnmatch``) against every dotted suffix of a linear's name and
of its alias in the other naming (the bundled Llama's ``layers.0.attention.wq`` is Hugging Face's
``model.layers.0.self_attn.q_proj``; ``mfsdp.hf.names.LINEARS``). So ``q_proj``, ``wq``, ``*_proj``,
``self_attn.*`` and ``layers.0.*`` work on either model. ``mfsdp.transforms.lora_export`` names the adapters
as PEFT does, writes PEFT adapter directories and merges the adapters into the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import math
import re
from collections import Counter
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp.hf.names import bundled_module_name, hf_module_name
from mfsdp.models.llama import init_chunk_seed, local_block
from mfsdp.transforms.adapter_names import ADAPTERS, is_adapter

__all__ = ["LoraTransform", "LoraLinear", "ALL_LINEAR", "ADAPTERS", "lora_linears", "candidate_linears",
           "init_adapters", "is_adapter", "adapters_off"]

ALL_LINEAR = "all-linear"
"""The ``target_modules`` entry that selects every linear of the blocks (PEFT's shorthand)."""

COMPILED_BLOCK_SAVED = 0.73
"""What a compiled LoRA block of the bundled dense Llama (bf16 base frozen, adapters on all its
linears, no dropout), without checkpointing, saves as a share of the eager block's: just above the
shares measured block by block on one H200 (8B at r 16 and r 64, 1b at r 16;
``benchmarks/results/2026-12-04_compiled_lora_block_saved.md``). It is higher than a full
fine-tune's: the eager LoRA block already saves nothing for the frozen norms' weights, results the
compiled full fine-tune recomputes; compiled, both save the same, plus the adapters' r-wide inputs."""
COMPILED_NOTE = (f"compiled blocks (--parallel.compile auto/true): a bundled dense Llama's LoRA blocks (bf16 "
                 f"base, all-linear, no dropout) without checkpointing are predicted to save "
                 f"{COMPILED_BLOCK_SAVED:.2f}x the eager activations (measured on one H200); other LoRA "
                 "recipes (a float8 base, some targets, dropout) as eager ones, an upper bound")

_BLOCK_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HEADS = ("output", "lm_head")  # the output projection: never adapted
_ROUTERS = ("router",)  # the bundled mixture of experts' router: never adapted


def _matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` matches a dotted suffix of ``name`` or of its other-naming alias."""
    aliases = (alias.split(".") for alias in {name, hf_module_name(name), bundled_module_name(name)})
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for parts in aliases for i in range(len(parts)))


def candidate_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every linear LoRA may adapt: each ``nn.Linear`` (float8's and LoRA's
    included) but the output head and the bundled experts' routers."""
    heads = set()
    get_output = getattr(model, "get_output_embeddings", None)  # a Hugging Face model's head
    if callable(get_output):
        heads.add(id(get_output()))
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m) not in heads and name not in _HEADS
            and name.rpartition(".")[2] not in _ROUTERS]


class _LoraForward:
    """Mixed in before a linear's own class: its forward plus the low-rank adapter."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return super().forward(x) + adapter * self.lora_scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_r={self.lora_A.shape[0]}, lora_scale={self.lora_scale:g}"


class LoraLinear(_LoraForward, nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter (``LoraTransform.apply`` makes it)."""


@functools.lru_cache(maxsize=None)
def lora_class(base: type) -> type:
    """The LoRA class of a linear class: ``LoraLinear`` for ``nn.Linear``, else one made once per
    class (``LoraFloat8Linear`` for torchao's float8 linear)."""
    if base is nn.Linear:
        return LoraLinear
    return type(f"Lora{base.__name__}", (_LoraForward, base),
                {"__module__": __name__, "__doc__": f"A {base.__name__} with a LoRA adapter."})


def lora_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every LoRA linear of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _LoraForward)]


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Within it, ``model`` is its base: every LoRA linear's scale is 0, so the adapter adds exactly
    zero (PEFT's ``disable_adapter``; a preference run's reference). The adapters still run, so a
    sharded model gathers and computes as always; a compiled block recompiles once for the scale."""
    linears = [m for _, m in lora_linears(model)]
    scales = [m.lora_scale for m in linears]
    for m in linears:
        m.lora_scale = 0.0
    try:
        yield model
    finally:
        for m, scale in zip(linears, scales):
            m.lora_scale = scale


@dataclasses.dataclass(frozen=True)
class LoraTransform:
    """LoRA on the linears of the blocks: frozen base, trainable low-rank adapters (PEFT's LoRA)."""

    name: ClassVar[str] = "lora"
    follows: ClassVar[tuple[str, ...]] = ("float8",)  # LoRA wraps the float8 linear, never the reverse

    r: int = 16
    """Rank of each adapter (PEFT's ``r``): A is r x in, B out x r. 16 is the common 8B choice."""
    alpha: float = 32.0
    """PEFT's ``lora_alpha``: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with
    ``use_rslora``), so changing r does not change the learning rate that works."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: dropout on the adapter's input only (the base path sees x as is)."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """"all-linear" (every linear of the blocks, never the head), or fnmatch patterns over linear
    names, in the bundled or the Hugging Face naming (``q_proj``, ``wq``, ``layers.0.*``). A string
    is read as comma-separated patterns."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (PEFT's ``use_rslora``): scale by alpha / sqrt(r) instead of alpha / r."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(p.strip() for p in self.target_modules.split(",")))
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoRA rank r={self.r!r} must be an integer >= 1; set --peft.lora_r to a "
                             "positive rank such as 16")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be positive; set --peft.lora_alpha (PEFT's "
                             "lora_alpha, e.g. 2 * r)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout={self.dropout!r} must lie in [0, 1); set --peft.lora_dropout "
                             "(0 turns it off)")
        patterns = self.target_modules
        if not isinstance(patterns, tuple) or not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"LoRA target_modules={patterns!r} must be 'all-linear' or name patterns "
                             "such as q_proj,v_proj; set --peft.target_modules")
        if ALL_LINEAR in patterns and len(patterns) > 1:
            raise ValueError(f"LoRA target_modules={','.join(patterns)} mixes 'all-linear' with patterns; "
                             "give 'all-linear' alone or only patterns")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"LoRA use_rslora={self.use_rslora!r} must be a bool")

    @property
    def scale(self) -> float:
        """The adapter's output scale: alpha / r, or alpha / sqrt(r) with ``use_rslora``."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, model: nn.Module) -> list[tuple[str, nn.Linear]]:
        """(name, module) of the linears of ``model`` this transform adapts; ValueError for a
        pattern that matches none of them."""
        candidates = candidate_linears(model)
        if not candidates:
            raise ValueError(f"{type(model).__name__} has no linear layer LoRA could adapt (the head is "
                             "never adapted); LoRA needs a model whose blocks use nn.Linear")
        if self.target_modules == (ALL_LINEAR,):
            return candidates
        for pattern in self.target_modules:
            if not any(_matches(pattern, name) for name, _ in candidates):
                _refuse_grouped_experts(model, pattern)
                known = sorted({n.rpartition(".")[2] for n, _ in candidates}
                               | {hf_module_name(n).rpartition(".")[2] for n, _ in candidates})
                raise ValueError(f"LoRA target_modules pattern {pattern!r} matches no linear of the blocks; "
                                 f"use 'all-linear' or patterns over the names {', '.join(known)}")
        return [(name, m) for name, m in candidates if any(_matches(p, name) for p in self.target_modules)]

    def __str__(self) -> str:
        return f"LoRA r {self.r}"

    def apply(self, model: nn.Module) -> None:
        """Freeze every parameter of ``model`` and give each target linear an adapter, initialised
        as PEFT does (left alone on the meta device: ``init_adapters`` after materialising)."""
        if lora_linears(model):
            raise ValueError(f"{type(model).__name__} already has LoRA adapters; apply LoRA once")
        targets = self.targets(model)
        model.requires_grad_(False)
        for _, linear in targets:
            weight = linear.weight
            linear.__class__ = lora_class(type(linear))
            like = dict(dtype=weight.dtype, device=weight.device)
            linear.lora_A = nn.Parameter(torch.empty(self.r, linear.in_features, **like))
            linear.lora_B = nn.Parameter(torch.zeros(linear.out_features, self.r, **like))
            linear.lora_scale = self.scale
            linear.lora_dropout = nn.Dropout(self.dropout) if self.dropout else nn.Identity()
        init_adapters(model)

    def describe(self, model: nn.Module) -> str:
        """``LoRA r 16, alpha 32, 7 linears × 32 blocks, 41.9M trainable of 8,072.2M``."""
        linears = lora_linears(model)
        trainable = sum(m.lora_A.numel() + m.lora_B.numel() for _, m in linears)
        total = sum(p.numel() for p in model.parameters())
        per_block = Counter(m.group(1) for name, _ in linears if (m := _BLOCK_INDEX.search(name)))
        if per_block and sum(per_block.values()) == len(linears) and len(set(per_block.values())) == 1:
            where = f"{next(iter(per_block.values()))} linears × {len(per_block)} blocks"
        else:
            where = f"{len(linears)} linears" + (f" in {len(per_block)} blocks" if per_block else "")
        rs = ", rsLoRA" if self.use_rslora else ""
        return (f"LoRA r {self.r}, alpha {self.alpha:g}{rs}, {where}, {trainable / 1e6:,.1f}M trainable of "
                f"{total / 1e6:,.1f}M")

    def plan_note(self, model: nn.Module) -> str:
        """The memory plan's note on what a LoRA block saves (the planner measures the transformed blocks)."""
        return ("LoRA: activations measured on the transformed blocks (the base frozen, the adapters present): a "
                "frozen linear saves its input only because its adapter's A needs it (the same tensor a trained "
                "linear saves for its weight gradient), plus the r-wide x @ A.T for B's gradient; the frozen norms "
                "save nothing for their weights")

    def compiled_block_saved(self, plain: float) -> float | None:
        """``COMPILED_BLOCK_SAVED`` for the recipe it was measured with (all-linear, no dropout), else None."""
        return COMPILED_BLOCK_SAVED if self.target_modules == (ALL_LINEAR,) and not self.dropout else None

    def compiled_note(self) -> str:
        return COMPILED_NOTE


def _refuse_grouped_experts(model: nn.Module, pattern: str) -> None:
    """ValueError where ``pattern`` names a mixture of experts' grouped weights (one 3-D parameter
    for all experts, not a linear): LoRA on them is out of scope."""
    grouped = [name for name, p in model.named_parameters() if p.ndim >= 3 and
               (_matches(pattern, name) or _matches(pattern, name.rpartition(".")[0]))]
    if grouped:
        raise ValueError(f"LoRA target_modules pattern {pattern!r} names the experts' grouped weights "
                         f"({grouped[0]}, one {model.get_parameter(grouped[0]).ndim}-D parameter for every "
                         "expert, not a linear): LoRA on them is out of scope; target the attention and other "
                         "linears (q_proj,k_proj,v_proj,o_proj) or all-linear, which leaves the experts frozen")


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int | None = None) -> None:
    """Initialise every adapter of ``model`` as PEFT does: A Kaiming-uniform (a = sqrt(5)), B zeros.

    Each A is drawn whole on the CPU from a generator keyed by ``seed`` and its name (r x in is
    small), and each rank keeps its own block of it, so sharded adapters (DTensors, after
    ``to_empty``) hold the values of unsharded ones at any world size. Meta tensors are left alone.
    ``seed`` None draws one from torch's global generator (``torch.manual_seed`` makes it repeat).
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())  # under a meta device context too
    for name, linear in lora_linears(model):
        a_local, offset, shape = local_block(linear.lora_A)
        if not a_local.is_meta and a_local.numel():
            whole = torch.empty(tuple(linear.lora_A.shape), dtype=torch.float32)
            generator = torch.Generator().manual_seed(init_chunk_seed(seed, f"{name}.lora_A", 0))
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            a_local.view(shape).copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        b_local = local_block(linear.lora_B)[0]
        if not b_local.is_meta:
            b_local.zero_()

