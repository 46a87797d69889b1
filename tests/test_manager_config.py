"""MegatronFSDPConfig, placement mapping, unit resolution, TP plan selection: no process group needed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import mfsdp
from mfsdp.manager import (HAS_MEGATRON_FSDP, MegatronFSDPConfig, dp_placements, logger, maybe_shard_optimizer,
                           precision_policy, resolve_sizes, resolve_unit_modules, snapshot_distributed_param_attrs)
from mfsdp.manager.config import field_names
from mfsdp.manager.mesh import MeshSizes
from mfsdp.manager.tp_plans import select_tp_plan, validate_tp

pytest.importorskip("transformers")
from test_manager_models import make_hf  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "manager.md")


def test_module_surface():
    assert HAS_MEGATRON_FSDP is True and logger.name == "mfsdp.manager"
    c = MegatronFSDPConfig()
    assert (c.preserve_fp32_weights, c.grad_reduce_in_fp32, c.zero_dp_strategy) == (True, True, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.zero_dp_strategy = 1


@pytest.mark.parametrize("value,level", [(0, 0), (3, 3), ("no_shard", 0), ("optim", 1), ("optim_grads", 2),
                                         ("OPTIM_GRADS_PARAMS", 3), ("2", 2)])
def test_zero_dp_strategy_names(value, level):
    assert MegatronFSDPConfig(zero_dp_strategy=value).zero_dp_strategy == level


@pytest.mark.parametrize("kwargs,match", [
    ({"zero_dp_strategy": 4}, "integer 0..3"),
    ({"zero_dp_strategy": "zero9"}, "not a known name"),
    ({"zero_dp_strategy": True}, "integer 0..3"),
    ({"outer_dp_sharding_strategy": 2}, "integer 0..1"),
    ({"outer_dp_sharding_strategy": "optim", "zero_dp_strategy": 2}, "needs zero_dp_strategy=3"),
    ({"tp_size": 0}, "positive integer"),
    ({"cp_size": 1.5}, "positive integer"),
    ({"dp_replicate_size": -1}, "positive integer"),
    ({"megatron_fsdp_unit_modules": []}, "non-empty list"),
    ({"megatron_fsdp_unit_modules": [3]}, "non-empty list"),
    ({"average_in_collective": True, "calculate_per_token_loss": True}, "choose one"),
    ({"sequence_parallel": True, "tp_size": 1}, "needs tp_size > 1"),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronFSDPConfig(**kwargs)


@pytest.mark.parametrize("field", ["nccl_ub", "activation_checkpointing", "check_for_nan_in_grad"])
def test_bool_fields_are_checked(field):
    with pytest.raises(TypeError, match=field):
        MegatronFSDPConfig(**{field: "yes"})


def test_tp_plan_type_is_checked():
    with pytest.raises(TypeError, match="tp_plan"):
        MegatronFSDPConfig(tp_plan=["colwise"])


def test_every_field_documented():
    import inspect

    source = inspect.getsource(MegatronFSDPConfig)
    with open(DOCS) as f:
        docs = f.read()
    for name in field_names():
        body = source.split(f"    {name}:", 1)[1].split('"""', 2)[1]
        assert "Default" in body, name
        assert f"`{name}`" in docs, name


def test_unit_module_string_is_wrapped():
    assert MegatronFSDPConfig(megatron_fsdp_unit_modules="LlamaDecoderLayer").megatron_fsdp_unit_modules == (
        "LlamaDecoderLayer",)


def test_precision_policy():
    assert precision_policy(MegatronFSDPConfig()) == mfsdp.MixedPrecisionPolicy(torch.float32, torch.float32)
    assert precision_policy(MegatronFSDPConfig(preserve_fp32_weights=False, grad_reduce_in_fp32=False)) == \
        mfsdp.MixedPrecisionPolicy(None, None)


def test_placements_mapping():
    one = MeshSizes(1, 4, 1, 1)
    assert [dp_placements(s, one).name for s in range(4)] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    two = MeshSizes(2, 2, 1, 1)
    assert dp_placements(3, two).name == "HSDP" and dp_placements(3, two).dp_axes == ("dp_replicate", "dp_shard")
    assert dp_placements(3, two, outer_dp_sharding_strategy=1).name == "HFSDP"
    for s in range(3):
        with pytest.raises(NotImplementedError, match="dp_replicate_size=2"):
            dp_placements(s, two)
    cp = MeshSizes(1, 2, 2, 1)  # every ZeRO level over the flattened dp_shard x cp dim
    assert [dp_placements(s, cp).dp_axes for s in range(4)] == [("dp_shard_cp",)] * 4
    assert dp_placements(3, MeshSizes(2, 1, 2, 1)).name == "HSDP"


def test_placements_given_directly():
    """Placements in the config: the integer front's translation of each strategy, on every mesh shape."""
    from mfsdp.manager.core_options import mesh_placements
    from mfsdp.mesh import PLACEMENT_NAMES, TWO_AXIS, resolve_placements

    P = mfsdp.Placements
    pairs = [((0, 0), P.ddp("dp_shard")), ((1, 0), P.zero1("dp_shard")), ((2, 0), P.zero2("dp_shard")),
             ((3, 0), P.hsdp("dp_replicate", "dp_shard")), ((3, 1), P.hfsdp("dp_replicate", "dp_shard"))]
    for sizes in (MeshSizes(1, 4, 1, 1), MeshSizes(2, 2, 1, 1), MeshSizes(1, 2, 2, 1), MeshSizes(2, 1, 2, 2)):
        for (s, outer), given in pairs:
            if s < 3 and sizes.dp_replicate > 1:
                with pytest.raises(NotImplementedError, match="placements=.* with dp_replicate_size=2"):
                    mesh_placements(given, sizes)
                continue
            assert mesh_placements(given, sizes) == dp_placements(s, sizes, outer), (sizes, s, outer)
    assert mesh_placements(P.zero3("dp_shard"), MeshSizes(1, 4, 1, 1)) == P.zero3("dp_shard")
    assert mesh_placements(P.hfsdp("dp_replicate", "dp_shard"), MeshSizes(1, 2, 2, 1)) == P.zero3("dp_shard_cp")
    both = P.fully_sharded("dp_replicate", "dp_shard")  # beyond the integers: ZeRO-3 over both dims
    assert mesh_placements(both, MeshSizes(2, 2, 2, 1)).dp_axes == ("dp_replicate", "dp_shard_cp")
    # mfsdp train's manager route: each --parallel.placements name, as the Placements the bundled route
    # resolves, runs what its old integer translation ran.
    integers = {"zero3": (3, 0), "zero2": (2, 0), "zero1": (1, 0), "ddp": (0, 0), "hsdp": (3, 0), "hfsdp": (3, 1)}
    assert set(integers) == set(PLACEMENT_NAMES)
    for name, (s, outer) in integers.items():
        for sizes in (MeshSizes(1, 4, 1, 1), MeshSizes(2, 2, 1, 1)) if name in TWO_AXIS else (MeshSizes(1, 4, 1, 1),):
            assert mesh_placements(resolve_placements(name, "dp_shard"), sizes) == dp_placements(s, sizes, outer)
    c = MegatronFSDPConfig(placements=P.zero1("dp_shard"))
    assert c.placements == P.zero1("dp_shard") and dataclasses.replace(c, placements=both).placements == both


@pytest.mark.parametrize("kwargs,match", [
    ({"placements": "zero3"}, "must be a mfsdp.Placements"),
    ({"placements": mfsdp.Placements.zero3("dp")}, r"over the manager mesh's dims.*got Placements\(dp_axes=\('dp',\)"),
    ({"placements": mfsdp.Placements.hsdp("dp_shard", "dp_replicate")}, "over the manager mesh's dims"),
    ({"placements": mfsdp.Placements.zero3("dp_shard"), "zero_dp_strategy": 1}, "both say what dp shards; set one"),
    ({"placements": mfsdp.Placements.zero3("dp_shard"), "outer_dp_sharding_strategy": 1}, "both say"),
])
def test_placements_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronFSDPConfig(**kwargs)


def test_communication_policy_mapping():
    from mfsdp.manager import communication_policy

    sizes = MeshSizes(2, 2, 2, 1)  # dp = 8
    default = communication_policy(MegatronFSDPConfig(), sizes)
    assert (default.overlap, default.coalesce, default.gradient_divide_factor) == (True, True, 1.0)
    for flags in ({"overlap_grad_reduce": False}, {"overlap_param_gather": False},
                  {"overlap_grad_reduce": False, "overlap_param_gather": False}):
        assert communication_policy(MegatronFSDPConfig(**flags), sizes).overlap is False
    assert communication_policy(MegatronFSDPConfig(disable_bucketing=True), sizes).coalesce is False
    assert default.double_buffer is False
    assert communication_policy(MegatronFSDPConfig(fsdp_double_buffer=True), sizes).double_buffer is True
    assert communication_policy(MegatronFSDPConfig(calculate_per_token_loss=True), sizes).gradient_divide_factor \
        == 1 / 8
    assert communication_policy(MegatronFSDPConfig(calculate_per_token_loss=True), MeshSizes(1, 1, 1, 2)) \
        .gradient_divide_factor == 1.0
    assert dp_placements(3, sizes).dp_axes == ("dp_replicate", "dp_shard_cp")


def test_resolve_sizes():
    assert resolve_sizes(8, tp_size=2, dp_replicate_size=2) == MeshSizes(2, 2, 1, 2)
    assert resolve_sizes(1) == MeshSizes(1, 1, 1, 1)
    assert resolve_sizes(8, cp_size=None).dp == 8
    with pytest.raises(ValueError, match="not divisible"):
        resolve_sizes(6, tp_size=4)
    with pytest.raises(ValueError, match="do not match the world size"):
        resolve_sizes(8, dp_shard_size=3)


def test_unit_modules_resolution():
    model = make_hf("llama")
    default = resolve_unit_modules(model)
    assert [n for n, _ in default] == ["model.layers.1", "model.layers.0"]
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP

    nested = resolve_unit_modules(model, ["LlamaDecoderLayer", LlamaMLP])
    names = [n for n, _ in nested]
    assert names.index("model.layers.0.mlp") < names.index("model.layers.0"), names  # children first
    assert len(resolve_unit_modules(model, ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"])) == 2
    assert resolve_unit_modules(model, [LlamaDecoderLayer])[0][1] is model.model.layers[1]
    with pytest.raises(ValueError, match="matches no submodule"):
        resolve_unit_modules(model, ["Qwen2DecoderLayer"])
    with pytest.raises(ValueError, match="cannot import"):
        resolve_unit_modules(model, ["transformers.nope.Layer"])
    with pytest.raises(ValueError, match="_no_split_modules"):
        resolve_unit_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_tp_plan_selection_and_validation():
    from torch.distributed.tensor.parallel import ColwiseParallel

    for family in ("llama", "qwen2"):
        plan = select_tp_plan(make_hf(family))
        assert "model.layers.*.self_attn.q_proj" in plan and "lm_head" in plan
    user = {"lm_head": ColwiseParallel()}
    assert select_tp_plan(make_hf(), user) == user
    with pytest.raises(TypeError, match="ParallelStyle"):
        select_tp_plan(make_hf(), {"lm_head": "colwise"})
    with pytest.raises(ValueError, match="no built-in tensor-parallel plan"):
        select_tp_plan(torch.nn.Linear(2, 2))
    validate_tp(make_hf(heads=4, kv_heads=2), 2)
    with pytest.raises(ValueError, match="num_attention_heads=4, num_key_value_heads=2"):
        validate_tp(make_hf(heads=4, kv_heads=2), 3)


def test_helpers_without_sharding():
    model = make_hf("llama")
    assert snapshot_distributed_param_attrs(model) is None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert maybe_shard_optimizer(model, opt, MegatronFSDPConfig()) is opt  # no process group: world size 1
