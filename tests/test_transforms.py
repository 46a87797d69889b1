"""Model transforms as a list (``mfsdp.transforms``): the order rules, the optional hooks, and float8 as
the first transform (``Float8Transform``) through the list, replayed by the planner; a LoRA-like
transform that follows float8 and freezes weights shows what the planner sees through the replay.
CPU only, no process group."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch import nn

from mfsdp import transforms as mt
from mfsdp.models.parallelize import ParallelizeConfig


@dataclasses.dataclass(frozen=True)
class Record:
    """Appends its name to the model's ``applied`` list; ``follows`` as given."""

    name: ClassVar[str] = "record"
    follows: ClassVar[tuple] = ()

    def apply(self, model):
        model.applied = [*getattr(model, "applied", []), self.name]

    def describe(self, model):
        return f"{self.name} applied"


@dataclasses.dataclass(frozen=True)
class First(Record):
    name: ClassVar[str] = "first"


@dataclasses.dataclass(frozen=True)
class Second(Record):
    """Must come after ``first``, and has the optional optimizer hook."""

    name: ClassVar[str] = "second"
    follows: ClassVar[tuple] = ("first", "absent")

    def after_optimizer_step(self, optimizer, model):
        model.hooked = optimizer


def test_order_names_and_types_are_checked():
    mt.validate_order([First(), Second()])
    mt.validate_order([Second()])  # a transform it follows that is not listed is no constraint
    with pytest.raises(ValueError, match=r"transform 'second' must come after first; list first first "
                                         r"\(the order given: second, first\)"):
        mt.validate_order([Second(), First()])
    with pytest.raises(ValueError, match="transform 'first' is listed twice; list each transform once"):
        mt.validate_order([First(), First(), Second()])
    with pytest.raises(TypeError, match="is not a model transform"):
        mt.validate_order([First(), "float8"])
    with pytest.raises(ValueError, match="must come after first"):
        ParallelizeConfig(transforms=(Second(), First()))
    with pytest.raises(ValueError, match="transforms must be a tuple of model transforms"):
        ParallelizeConfig(transforms=[First()])


def test_the_list_applies_in_order_and_runs_the_hooks_it_has():
    model = nn.Linear(2, 2)
    assert mt.apply_transforms(model, (First(), Second())) is model and model.applied == ["first", "second"]
    with pytest.raises(ValueError, match="must come after first"):
        mt.apply_transforms(nn.Linear(2, 2), (Second(), First()))
    marker = object()
    mt.hook_results((First(), Second()), "after_optimizer_step", marker, model)
    assert model.hooked is marker
    assert mt.hook_results((First(), Second()), "describe", model) == ["first applied", "second applied"]


@dataclasses.dataclass(frozen=True)
class Measured(Record):
    """A transform the planner knows only by its hooks: compiled blocks save ``share`` of the eager ones."""

    name: ClassVar[str] = "lora"  # a feature's name: the planner must not read it
    bundled_only: ClassVar[bool] = True
    share: float = 0.5

    def compiled_block_saved(self, plain):
        return self.share

    def compiled_note(self):
        return f"measured at {self.share}"


def test_the_planner_asks_hooks_never_names():
    """Compiled blocks are scaled by the one transform's ``compiled_block_saved`` with its
    ``compiled_note``; a transform without the hook is planned eager, and several at once too (their
    shares were measured one at a time); ``bundled_only`` keeps one off a Hugging Face model. No
    module of mfsdp/memory imports a feature module."""
    import ast
    from pathlib import Path

    from mfsdp.memory import estimate
    from mfsdp.memory.api import COMPILED_NOTE, _resolve
    from mfsdp.memory.tensor_parallel import TensorParallel

    def saved(transforms, compiled=True):
        e = estimate("tiny", world_size=1, seq_len=64, device="cpu", compiled=compiled, transforms=transforms)
        return e.component_max("activations (saved)"), e.notes[-1] if e.notes else None

    eager, _ = saved((First(),), compiled=False)
    assert saved((Measured(0.5),))[1] == "measured at 0.5"
    assert saved((Measured(0.5),))[0] < saved((Measured(0.9),))[0] < eager
    assert saved((First(),)) == (eager, COMPILED_NOTE)
    assert saved((Measured(0.5), Second())) == (eager, "measured at 0.5")
    with pytest.raises(ValueError, match=r"transforms \(Measured\(share=0.5\)\) are planned on the bundled Llama"):
        _resolve(nn.Linear(2, 2), torch.bfloat16, 64, False, TensorParallel(), None, (Measured(),))
    memory = Path(mt.__file__).parent.parent / "memory"
    imported = {a.name if isinstance(n, ast.Import) else f"{n.module}.{a.name}"
                for path in memory.glob("*.py") for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert {i for i in imported if i.startswith("mfsdp.transforms.")} <= {"mfsdp.transforms.apply_transforms",
                                                                            "mfsdp.transforms.hook_results"}


torchao = pytest.importorskip("torchao.float8")
from mfsdp.transforms.float8 import Float8Transform  # noqa: E402


@dataclasses.dataclass(frozen=True)
class FreezeEmbedding:
    """LoRA's shape of change in small: it follows float8 and freezes base weights (the embedding)."""

    name: ClassVar[str] = "freeze"
    follows: ClassVar[tuple] = ("float8",)

    def apply(self, model):
        model.tok_embeddings.weight.requires_grad_(False)

    def describe(self, model):
        return "embedding frozen"

    def __str__(self):
        return "freeze"


def tiny_meta(dtype=torch.bfloat16):
    from mfsdp.models import build_model, get_config

    with torch.device("meta"):
        return build_model(get_config("tiny"), dtype=dtype)


def test_float8_transform_fields_and_rules():
    assert Float8Transform().all_gather is True and Float8Transform("rowwise").all_gather is False
    assert Float8Transform("tensorwise", all_gather=None) == Float8Transform("tensorwise", (), True)
    assert str(Float8Transform()) == "float8 tensorwise" and str(Float8Transform("rowwise")) == "float8 rowwise"
    with pytest.raises(ValueError, match="unknown recipe 'none'; choose from tensorwise, rowwise"):
        Float8Transform("none")
    with pytest.raises(ValueError, match="FP8 all-gather needs the tensorwise recipe, not 'rowwise'"):
        Float8Transform("rowwise", all_gather=True)
    assert Float8Transform().placement_problem("zero3") is None
    assert "keeps them whole" in Float8Transform().placement_problem("zero2")
    assert Float8Transform("rowwise").placement_problem("zero2") is None
    assert Float8Transform(all_gather=False).placement_problem("ddp") is None
    with pytest.raises(ValueError, match="'freeze' must come after float8"):
        mt.validate_order([FreezeEmbedding(), Float8Transform()])


def test_float8_through_the_list_converts_tags_and_describes():
    from torchao.float8.float8_linear import Float8Linear

    from mfsdp.runtime import gather_codec

    model = mt.apply_transforms(tiny_meta(), (Float8Transform("tensorwise", ("layers.0.*",)), FreezeEmbedding()))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = {n for n, m in linears.items() if isinstance(m, Float8Linear)}
    assert converted == {n for n in linears if n.startswith("layers.") and not n.startswith("layers.0.")}
    assert all((gather_codec.spec_of(m.weight) is not None) == (n in converted) for n, m in linears.items())
    assert not model.tok_embeddings.weight.requires_grad
    assert Float8Transform("tensorwise", ("layers.0.*",)).describe(model) == (
        f"float8 tensorwise: {len(converted)} of the {len(linears) - 1} block linears train in float8 "
        "(--model.float8_skip layers.0.* keeps the others; the head in bfloat16)")
    rowwise = mt.apply_transforms(tiny_meta(), (Float8Transform("rowwise"),))
    assert not any(gather_codec.spec_of(p) for p in rowwise.parameters())  # rowwise gathers in bf16


def test_the_planner_replays_the_list():
    """The meta model the planner sizes is the list applied to a copy (the shared meta model stays as
    built): float8's tags halve the gathered linears, the frozen embedding has no optimizer states,
    and the header and notes name the transforms."""
    from torchao.float8.float8_linear import Float8Linear

    from mfsdp.memory import estimate
    from mfsdp.memory.api import _meta_llama
    from mfsdp.models import get_config

    args = dict(world_size=1, placements="zero3", seq_len=64, device="cpu")
    fp8 = (Float8Transform("tensorwise"),)
    plain, float8, frozen = (estimate("tiny", transforms=t, **args) for t in ((), fp8, (*fp8, FreezeEmbedding())))
    assert float8.settings.transforms == ("float8 tensorwise",) and float8.notes[0].startswith("float8 tensorwise: 28")
    assert frozen.settings.transforms == ("float8 tensorwise", "freeze")
    cfg = get_config("tiny")
    linear = 2 * cfg.dim * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    saved = plain.component_max("unsharded (forward)") - float8.component_max("unsharded (forward)")
    assert saved == 2 * linear  # two blocks gathered (one prefetched), a byte an element fewer each
    states = float8.breakdown["optimizer states"] - frozen.breakdown["optimizer states"]
    assert states == 2 * 4 * cfg.vocab_size * cfg.dim  # AdamW's two fp32 states of the embedding
    shared, _ = _meta_llama(dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, 64)), torch.bfloat16)
    assert not any(isinstance(m, Float8Linear) for m in shared.modules())  # each list has its own meta model
    with pytest.raises(ValueError, match="are planned on the bundled Llama"):
        from mfsdp.memory.api import _resolve
        from mfsdp.memory.tensor_parallel import TensorParallel

        _resolve(nn.Linear(2, 2), torch.bfloat16, 64, False, TensorParallel(), None, fp8)
