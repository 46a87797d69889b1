"""Tensor-parallel plans for Hugging Face decoder models, applied with ``torch.distributed.tensor.parallel``.

The built-in plan is the Megatron layout: q/k/v and gate/up split by output features (colwise), o
and down split by input features (rowwise) so each block needs one all-reduce per sub-layer, a
vocab-parallel embedding (rowwise over the vocabulary) and a colwise lm_head whose logits are
gathered (the loss then needs no DTensor awareness; the alternative, vocab-sharded logits with a
parallel cross-entropy, saves the gather but changes the loss code, so it is left to user plans).

Hugging Face attention in transformers >= 5 reshapes with ``-1`` heads, so the local head count
follows the sharded projections and no per-module head attribute needs rewriting; the head counts
only have to divide by tp, which :func:`validate_tp` checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

LLAMA_STYLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values the built-in plan covers."""


def llama_style_plan() -> dict[str, ParallelStyle]:
    """The built-in plan for Llama, Mistral and Qwen2/3 causal LMs (module names of transformers 5).

    No sequence-parallel variant: Hugging Face models derive position ids from the length of the
    embedding output, which sequence parallelism would make the local shard's length.
    """
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    }


def model_type(model: nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def select_tp_plan(model: nn.Module, user_plan: Optional[Mapping[str, Any]] = None) -> dict[str, ParallelStyle]:
    """The user's plan if given, else the built-in plan for the model's family, else an error."""
    if user_plan is not None:
        bad = {k: v for k, v in user_plan.items() if not isinstance(k, str) or not isinstance(v, ParallelStyle)}
        if bad:
            raise TypeError(f"tp_plan entries must map module-name patterns to torch ParallelStyle objects; "
                            f"bad entries: {bad}")
        return dict(user_plan)
    family = model_type(model)
    if family in LLAMA_STYLE_FAMILIES:
        return llama_style_plan()
    raise ValueError(
        f"no built-in tensor-parallel plan for {type(model).__name__} (config.model_type={family!r}); built-in "
        f"plans cover {LLAMA_STYLE_FAMILIES}. Pass MegatronFSDPConfig(tp_plan={{pattern: ParallelStyle}})."
    )


def validate_tp(model: nn.Module, tp_size: int) -> None:
    """Head counts (and the MLP width) must divide by ``tp_size``."""
    if tp_size == 1:
        return
    config = getattr(model, "config", None)
    problems = []
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp_size:
            problems.append(f"{field}={value}")
    if problems:
        raise ValueError(f"tensor parallel size {tp_size} must divide {', '.join(problems)} of "
                         f"{type(model).__name__}; choose a tp_size that divides them")


def apply_tp_plan(model: nn.Module, tp_mesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Apply ``plan`` over ``tp_mesh``, keeping tied parameters tied.

    ``parallelize_module`` builds a new Parameter per module, which would silently untie an
    embedding and an output head that share one weight. They are re-tied when both sides got the
    same placements (vocab-parallel embedding and colwise head do); otherwise that plan cannot keep
    the tie and we say so.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    ties = _tied_names(model)
    parallelize_module(model, tp_mesh, dict(plan))
    for names in ties:
        params = [model.get_parameter(n) for n in names]
        first = params[0]
        for name, param in zip(names[1:], params[1:]):
            if param is first:
                continue
            if getattr(param, "placements", None) != getattr(first, "placements", None):
                raise NotImplementedError(
                    f"tied parameters {names} got different tensor-parallel placements from this plan; "
                    "shard them alike (e.g. vocab-parallel embedding with a colwise head) or untie them")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)
    return model


def _tied_names(model: nn.Module) -> list[list[str]]:
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return [names for names in by_param.values() if len(names) > 1]
