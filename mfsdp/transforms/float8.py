"""``Float8Transform``: torchao float8 training of the linears as a model transform (``mfsdp.transforms``).

``parallelize`` applies it before sharding (``float8_linear.convert_to_float8``: tensorwise also tags
the weights for FP8 all-gather) and the memory planner replays it on its meta model, so the gathers'
bytes it plans come from the same tags. Its rules live here: which recipes exist, which placements
FP8 all-gather needs, what the run logs and what the plan notes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from torch import nn

from mfsdp.runtime.module import FsdpModule
from mfsdp.transforms.float8_linear import (RECIPES, check_recipe, convert_to_float8, float8_linears,
                                           precompute_fp8_scales_after)

__all__ = ["Float8Transform", "FLOAT8_CHOICES", "float8_placement_problem"]

FLOAT8_CHOICES = ("none", *RECIPES)
"""What ``--model.float8`` takes: "none" (no transform), or one of torchao's recipes."""


@dataclasses.dataclass(frozen=True)
class Float8Transform:
    """Train the linears ``float8_linear.float8_filter`` takes (every block linear of the bundled Llama)
    in float8 with torchao, but for those the ``skip`` patterns name."""

    name: ClassVar[str] = "float8"
    follows: ClassVar[tuple[str, ...]] = ()
    bundled_only: ClassVar[bool] = True  # float8_filter picks the bundled Llama's block linears

    recipe: str = "tensorwise"
    """torchao's recipe (``float8_linear.RECIPES``): "tensorwise" or "rowwise"."""
    skip: tuple = ()
    """The linears kept in the compute dtype, as ``fnmatch`` patterns of their names (``layers.0.*``,
    ``*.feed_forward.w2``; ``float8_linear.float8_linears``). A pattern that names no float8 linear,
    or patterns that leave none, are an error at ``apply``: a typo would otherwise pass unseen."""
    all_gather: Optional[bool] = None
    """Gather the float8 weights as float8 bytes (``float8_linear.enable_fp8_all_gather``: half the
    bf16 bytes; tensorwise only). None: with tensorwise, as ``mfsdp train`` runs it."""

    def __post_init__(self) -> None:
        if self.all_gather is None:
            object.__setattr__(self, "all_gather", self.recipe == "tensorwise")
        check_recipe(self.recipe, self.all_gather)
        if not isinstance(self.skip, tuple) or not all(isinstance(p, str) and p for p in self.skip):
            raise ValueError(f"Float8Transform: skip must be a tuple of name patterns, got {self.skip!r}")

    def __str__(self) -> str:
        return f"float8 {self.recipe}" + ("" if self.all_gather or self.recipe != "tensorwise" else " (bf16 gathers)")

    def apply(self, model: nn.Module) -> None:
        convert_to_float8(model, self.recipe, fp8_all_gather=self.all_gather, skip=self.skip)

    def describe(self, model: nn.Module) -> str:
        """On the bundled Llama; its head's dtype is its unit's compute dtype once sharded (``mfsdp train``
        logs the line then), else its weight's."""
        others = f"--model.float8_skip {','.join(self.skip)} keeps the others" if self.skip else "all"
        unit = next((m for m in (model.output, model) if isinstance(m, FsdpModule)), None)
        dtype = unit.parameter_groups[0].dtypes.compute if unit is not None else model.output.weight.dtype
        return (f"float8 {self.recipe}: {len(float8_linears(model, self.skip))} of the {len(float8_linears(model))} "
                f"block linears train in float8 ({others}; the head in {str(dtype).removeprefix('torch.')})")

    def after_optimizer_step(self, optimizer, model: nn.Module) -> None:
        precompute_fp8_scales_after(optimizer, model)  # FP8 all-gather's scales, if any

    def placement_problem(self, placements: str) -> Optional[str]:
        return float8_placement_problem(self.recipe, placements) if self.all_gather else None

    def compiled_block_saved(self, plain: float) -> Optional[float]:
        """Compiled blocks in FP8 tensorwise with FP8 gathers were measured to save the share bf16 ones
        do (``plain``); other settings were not measured (None)."""
        return plain if self.recipe == "tensorwise" and self.all_gather else None

    def plan_note(self, model: nn.Module) -> str:
        count = len(float8_linears(model, self.skip))
        gathers = ("their weights gathered as float8 bytes beside the norms (the runtime's ByteLayout), and "
                   "each gather's encode stages up to 2^25 elements at 8 bytes (the 'FP8 encode staging' line, "
                   "in the phases that issue gathers)" if self.all_gather else
                   "their weights gathered in the compute dtype (torchao casts them in each GEMM)")
        return (f"{self}: {count} torchao Float8Linear layers, {gathers}; activations measured with "
                "torchao's Float8Linear on fake tensors" + (", weights pre-cast as the FP8 gather hands them"
                                                             if self.all_gather else ""))


def float8_placement_problem(float8: str, placements: str) -> Optional[str]:
    """Why ``float8`` ("none" or a recipe) cannot run with ``placements`` (a name), or None: tensorwise
    gathers the weights in FP8, which needs them sharded at rest."""
    from mfsdp.mesh import resolve_placements

    if float8 != "tensorwise" or resolve_placements(placements).num_param_sharded:
        return None
    return (f"--model.float8 tensorwise all-gathers the weights in FP8, which needs placements that shard "
            f"them at rest (zero3, hsdp, hfsdp); --parallel.placements {placements} keeps them whole. Use "
            "--model.float8 rowwise (float8 compute, bf16 gathers) or --parallel.placements zero3")

