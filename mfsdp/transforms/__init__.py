"""Model transforms: the ordered list of in-place rewrites a model goes through before sharding.

A transform (float8 training, LoRA adapters, ...) is a frozen config with a ``name`` and an
``apply(model)`` that rewrites the unsharded model in place: it swaps modules, adds parameters,
changes their dtypes or freezes them. ``parallelize`` applies the list to the real model and the
memory planner applies the *same* list to a meta model, so what the planner counts (parameter
numels, dtypes, ``requires_grad``, gather-codec tags) is what the runtime groups and allocates:
there is no second description of a transform's effect to drift from the first.

Order matters (LoRA wraps whatever linear float8 left behind), so each transform names the
transforms it must follow (``follows``) and ``validate_order`` refuses a list that breaks that,
as torchtitan's model converters do. Hooks that live past ``apply`` (after the optimizer step,
around checkpoints and exports) are optional methods; a transform without one is skipped. So are
the planner's, which asks hooks and never names: ``placement_problem(placements)`` (why a placement
name cannot run it, or None: the search skips such settings), ``plan_note(model)`` (how the plan
models it, on the transformed meta model), ``compiled_block_saved(plain)`` (the share of its eager
activations a compiled block saves under this transform alone, given ``plain``, the share without
transforms; None: not measured, planned eager), ``compiled_note()`` (the plan's note on compiled
blocks in its place) and a ``bundled_only`` class attribute (True: planned on the bundled Llama
only). ``str(transform)`` names it with its settings in a few words ("float8 tensorwise"), for the
plan's header.

The features live beside the contract: ``float8`` (``float8_linear``: torchao's float8 linears and
FP8 all-gather) and ``lora`` (``adapter_names``: the adapters' names, for the weight loaders).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, Sequence, runtime_checkable

from torch import nn

__all__ = ["ModelTransform", "validate_order", "apply_transforms", "hook_results"]


@runtime_checkable
class ModelTransform(Protocol):
    """One in-place rewrite of an unsharded model, applied before ``fully_shard``."""

    name: ClassVar[str]
    """A short unique name ("float8", "lora"): the key of ``follows``."""
    follows: ClassVar[tuple[str, ...]]
    """Names of transforms that, when present in the list, must come before this one."""

    def apply(self, model: nn.Module) -> None:
        """Rewrite ``model`` in place (on the meta device too: the planner replays it there).
        Raise ValueError naming the problem and the fix for a setting that does not fit ``model``."""

    def describe(self, model: nn.Module) -> str:
        """One line for the run's log, on the transformed ``model``."""


def validate_order(transforms: Sequence[ModelTransform]) -> None:
    """ValueError unless names are unique and each transform comes after those it ``follows``."""
    for transform in transforms:
        if not isinstance(transform, ModelTransform):
            raise TypeError(f"{transform!r} is not a model transform (it needs name, follows, apply and describe)")
    names = [t.name for t in transforms]
    for i, transform in enumerate(transforms):
        if transform.name in names[:i]:
            raise ValueError(f"transform {transform.name!r} is listed twice; list each transform once")
        late = [n for n in transform.follows if n in names[i + 1:]]
        if late:
            raise ValueError(f"transform {transform.name!r} must come after {', '.join(late)}; "
                             f"list {', '.join(late)} first (the order given: {', '.join(names)})")


def apply_transforms(model: nn.Module, transforms: Sequence[ModelTransform]) -> nn.Module:
    """Apply ``transforms`` to ``model`` in list order, after checking the order; returns ``model``."""
    validate_order(transforms)
    for transform in transforms:
        transform.apply(model)
    return model


def hook_results(transforms: Sequence[ModelTransform], hook: str, *args) -> list:
    """What each transform's optional ``hook(*args)`` returns, for those that have it, in list order
    (``after_optimizer_step``: float8's scale precompute, registered on the optimizer)."""
    return [getattr(t, hook)(*args) for t in transforms if hasattr(t, hook)]
