"""Tensor-parallel plans for Hugging Face decoder models, applied with ``torch.distributed.tensor.parallel``.

The built-in plan is the Megatron layout: q/k/v and gate/up split by output features (colwise), o
and down split by input features (rowwise), a vocab-parallel embedding (rowwise over the
vocabulary) and a colwise output head. Two options change where activations live:

* ``sequence_parallel``: the activations between the sub-layers (the residual stream, the norms)
  are sharded on the sequence dim, ``Shard(1)``. The embedding reduce-scatters its output, the
  norms run on their sequence shard (torch's ``SequenceParallel``), attention and the MLP gather
  the normed input once (``PrepareModuleInput``: one all-gather, whose backward is one
  reduce-scatter), and o/down reduce-scatter instead of all-reduce. Same bytes as plain TP, and
  norms, residual adds and their saved activations cost 1/tp. The residual stream is a ``Shard(1)``
  DTensor, so its global shape is the full sequence: Hugging Face models derive ``position_ids``,
  rotary tables and the causal mask from it and get the full sequence, which is what attention
  sees after the gather. The norm weights are replicated DTensors whose gradients come out
  ``Partial`` over tp (each rank saw other tokens); mfsdp all-reduces them over tp before its
  data-parallel reduction.
* ``loss_parallel``: the head's logits stay sharded over the vocabulary (a ``Shard(-1)`` DTensor)
  and the cross-entropy runs inside torch's ``loss_parallel()`` context (the manager's
  ``loss_context()``), so the full logits never exist on one rank: three small all-reduces per
  loss instead of an all-gather of batch x seq x vocab.

Every plan feeds q/k/v (and gate/up) from one DTensor made once per sub-layer by a
``PrepareModuleInput`` on the attention and MLP modules. Without it each projection wraps the
same local input itself, and autograd all-reduces each projection's input gradient separately
(three all-reduces for attention, two for the MLP, per backward); with it the partial gradients
add up as one DTensor and are reduced once. With sequence parallel the same single wrapping
turns three all-gathers into one.

These plans are the ``"dtensor"`` activation path. The manager's default, ``"local"``
(:func:`apply_tensor_parallel`, :mod:`mfsdp.manager.tp_local`), gives the parameters the same
placements but runs the activations inside each block as local tensors with explicit collectives
(the same ones, counted in the tests), so no op pays DTensor dispatch on the host.

Hugging Face attention in transformers >= 5 reshapes with ``-1`` heads, so the local head count
follows the sharded projections and no per-module head attribute needs rewriting; the head counts
only have to divide by tp, which :func:`validate_tp` checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

LLAMA_STYLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values the built-in plan covers."""

HEAD_NORM_FAMILIES = ("qwen3",)
"""Families whose attention normalises each head (``q_norm`` / ``k_norm`` over the head dim)."""


def llama_style_plan(*, sequence_parallel: bool = False, loss_parallel: bool = False,
                     head_norms: bool = False) -> dict[str, ParallelStyle]:
    """The built-in plan for Llama, Mistral and Qwen2/3 causal LMs (module names of transformers 5).

    ``head_norms``: the attention has ``q_norm`` / ``k_norm`` over the head dim (Qwen3). Each tp
    rank normalises its own heads with the shared weight, so that weight becomes a replicated
    DTensor whose gradient is summed over tp (``SequenceParallel`` over the heads dim, local in
    and out).
    """
    seq = Shard(1)
    between = seq if sequence_parallel else Replicate()  # layout of the activations between sub-layers
    plan: dict[str, ParallelStyle] = {
        # use_local_output=False with sequence parallel: a Shard(1) DTensor reports the full sequence
        # length, from which HF models build position ids, rotary tables and the causal mask.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                              use_local_output=not sequence_parallel),
        "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **{f"model.layers.*.self_attn.{x}_proj": ColwiseParallel() for x in "qkv"},
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=between,
                                                           use_local_output=not sequence_parallel),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        **{f"model.layers.*.mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")},
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=between,
                                                        use_local_output=not sequence_parallel),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    norms = ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm")
    for norm in norms if sequence_parallel else ():
        plan[norm] = SequenceParallel()
    for x in "qk" if head_norms else ():  # (batch, seq, local heads, head_dim): the heads dim is sharded over tp
        plan[f"model.layers.*.self_attn.{x}_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def model_type(model: nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def select_tp_plan(model: nn.Module, user_plan: Optional[Mapping[str, Any]] = None, *,
                   sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The user's plan if given (used as is: it must implement the two options itself), else the
    built-in plan for the model's family, else an error."""
    if user_plan is not None:
        bad = {k: v for k, v in user_plan.items() if not isinstance(k, str) or not isinstance(v, ParallelStyle)}
        if bad:
            raise TypeError(f"tp_plan entries must map module-name patterns to torch ParallelStyle objects; "
                            f"bad entries: {bad}")
        return dict(user_plan)
    family = model_type(model)
    if family in LLAMA_STYLE_FAMILIES:
        return llama_style_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                head_norms=family in HEAD_NORM_FAMILIES)
    raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__} (config.model_type={family!r}); "
                     f"built-in plans cover {LLAMA_STYLE_FAMILIES}. Pass "
                     "MegatronFSDPConfig(tp_plan={pattern: ParallelStyle}).")


def apply_tensor_parallel(model: nn.Module, tp_mesh, *, user_plan: Optional[Mapping[str, Any]] = None,
                          sequence_parallel: bool = False, loss_parallel: bool = False,
                          activation_path: str = "local") -> str:
    """Validate and shard ``model`` over ``tp_mesh``; returns the activation path taken.

    ``"local"`` (:mod:`mfsdp.manager.tp_local`: local tensors, explicit collectives) for the
    built-in plan's families; ``"dtensor"`` (this module's plan through ``parallelize_module``) when
    asked, for a user plan, or for another family (whose error names the missing plan).
    """
    validate_tp(model, tp_mesh.size())
    family = model_type(model)
    if activation_path == "local" and user_plan is None and family in LLAMA_STYLE_FAMILIES:
        from mfsdp.manager.tp_local import apply_local_tp

        apply_local_tp(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                       head_norms=family in HEAD_NORM_FAMILIES)
        return "local"
    apply_tp_plan(model, tp_mesh, select_tp_plan(model, user_plan, sequence_parallel=sequence_parallel,
                                                 loss_parallel=loss_parallel))
    return "dtensor"


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


def loss_context(enabled: bool):
    """A fresh context for one loss computation and its backward: torch's ``loss_parallel()`` when
    ``enabled`` (the logits are vocabulary-sharded DTensors), else a null context."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def sequence_length_check(tp_size: int):
    """A forward pre-hook (with kwargs) for the root: sequence parallel needs seq % tp == 0."""
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is not None and ids.ndim >= 2 and ids.shape[1] % tp_size:
            raise ValueError(f"sequence_parallel: the sequence length {ids.shape[1]} does not divide by the "
                             f"tensor-parallel size {tp_size}; pad the batch to a multiple of {tp_size}")
        return None

    return hook


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
