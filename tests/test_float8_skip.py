"""``--model.float8_skip``: linears kept in the compute dtype under ``--model.float8``.

The rule is ``mfsdp.transforms.float8_linear.float8_linears``; ``Float8Transform`` (which parallelize applies and the
planner replays) and the config check call it.
Float8 is emulated on CPU (torchao's casts and scaled matmuls run in plain torch)."""
import copy
import dataclasses

import pytest
import torch

pytest.importorskip("torchao")

from mfsdp.transforms.float8_linear import float8_linears  # noqa: E402
from mfsdp.transforms.float8 import Float8Transform  # noqa: E402
from mfsdp.models.parallelize import ParallelizeConfig  # noqa: E402
from mfsdp.train.run.config import ConfigError  # noqa: E402
from mfsdp.train.run.resolve import load_config  # noqa: E402
from test_float8 import LLAMA, codecs, train_and_compare  # noqa: E402

SKIP = ("layers.0.*", "*.w2")
"""Block 0 wholly in the compute dtype, and every block's down projection."""


def tiny_meta():
    from mfsdp.models import build_model, get_config

    with torch.device("meta"):
        return build_model(get_config("tiny"))


def test_patterns_pick_the_linears_and_a_pattern_that_names_none_is_an_error():
    model = tiny_meta()
    every = float8_linears(model)
    n = len(model.layers)
    assert len(every) == 7 * n and "output" not in every and all(name.startswith("layers.") for name in every)
    kept = float8_linears(model, SKIP)
    assert kept == [name for name in every if not name.startswith("layers.0.") and not name.endswith(".w2")]
    assert len(kept) == 6 * (n - 1)
    with pytest.raises(ValueError, match=r"skip pattern 'layers\.0\.attention\.wz' matches none of the float8 "
                                         r"linears \(their names: layers\.0\.attention\.wq"):
        float8_linears(model, ("layers.0.attention.wz",))
    with pytest.raises(ValueError, match="the head is never float8"):
        float8_linears(model, ("output",))
    with pytest.raises(ValueError, match=r"the skip patterns layers\.\* leave no linear in float8"):
        float8_linears(model, ("layers.*",))


def test_the_transform_checks_the_skip():
    """Its fields at construction; the patterns against the model at ``apply`` (a meta model here), with
    ``float8_linears``' errors, before any linear is converted."""
    assert ParallelizeConfig(transforms=(Float8Transform("tensorwise", SKIP),)).transforms[0].skip == SKIP
    with pytest.raises(ValueError, match="skip must be a tuple of name patterns"):
        Float8Transform("tensorwise", "layers.0.*")
    with pytest.raises(ValueError, match="skip must be a tuple of name patterns"):
        Float8Transform("tensorwise", ("layers.0.*", ""))
    model = tiny_meta()
    with pytest.raises(ValueError, match=r"skip pattern 'layers\.9\.\*' matches none of the float8 linears"):
        Float8Transform("tensorwise", ("layers.9.*",)).apply(model)
    with pytest.raises(ValueError, match=r"the skip patterns layers\.\* leave no linear in float8"):
        Float8Transform("rowwise", ("layers.*",)).apply(model)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def test_the_flag_is_parsed_and_checked_against_the_model():
    cfg = load_config(["--model.float8", "tensorwise", "--model.float8_skip", "layers.0.*, *.w2"])
    assert cfg.model.float8_skip_patterns() == SKIP
    assert load_config([]).model.float8_skip_patterns() == ()
    with pytest.raises(ConfigError, match="--model.float8 is none; set --model.float8 tensorwise"):
        load_config(["--model.float8_skip", "layers.0.*"])
    with pytest.raises(ConfigError, match=r"--model.float8_skip: the skip pattern 'layers\.9\.\*' matches none"):
        load_config(["--model.float8", "tensorwise", "--model.float8_skip", "layers.9.*"])  # tiny has 2 blocks
    with pytest.raises(ConfigError, match="has an empty pattern"):
        load_config(["--model.float8", "tensorwise", "--model.float8_skip", "layers.0.*,"])


def skipped_parity(rank, ws):
    """The small Llama of test_float8 through parallelize with ``SKIP``, against torchao's unsharded
    conversion of the same linears, trained on the full batch."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from mfsdp.mesh import build_mesh
    from mfsdp.models.llama import Llama, LlamaConfig
    from mfsdp.models.parallelize import parallelize

    net = Llama(LlamaConfig(**LLAMA), dtype=torch.float32)
    net.init_weights(seed=0)
    ref = copy.deepcopy(net)
    chosen = set(float8_linears(ref, SKIP))
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda mod, fqn: fqn in chosen)
    parallelize(net, build_mesh("cpu", ws), ParallelizeConfig(transforms=(Float8Transform("tensorwise", SKIP),)))
    kinds = {name: isinstance(m, Float8Linear) for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    tagged = [len(block.parameter_groups[0].encoded.tagged) if block.parameter_groups[0].encoded else 0
              for block in net.layers]
    train_and_compare(rank, ws, net, ref, precompute=False, steps=3)
    return kinds, tagged, len(codecs(net))


def test_skipped_linears_train_in_the_compute_dtype_with_parity(world):
    """Block 0 gathers no float8 bytes at all, block 1 gathers six float8 weights (its w2 travels in the
    compute dtype beside the norms); losses and weights match torchao's unsharded model."""
    kinds, tagged, n_codecs = world(2).run(skipped_parity)[0]
    assert kinds == {name: name.startswith("layers.1.") and not name.endswith(".w2") for name in kinds}, kinds
    assert tagged == [0, 6] and n_codecs == 1, (tagged, n_codecs)


def test_the_planner_plans_the_skipped_linears():
    """Model state is exact (block 0's weights gathered in bf16: two bytes an element where float8 has
    one); the blocks, of two kinds, are planned with the larger activations of the two; the memory
    check's run carries the flag."""
    from mfsdp.memory import estimate
    from mfsdp.memory.activations import measure_llama
    from mfsdp.models import build_model, get_config
    from mfsdp.train.command.plan import planned_run
    from mfsdp.transforms import apply_transforms

    cfg = get_config("1b")
    args = dict(world_size=8, placements="zero3", seq_len=1024)
    every = estimate("1b", transforms=(Float8Transform("tensorwise"),), **args)
    skipped = estimate("1b", transforms=(Float8Transform("tensorwise", ("layers.0.*",)),), **args)
    block = 2 * cfg.dim * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    by_name = {p.name: p.components for p in skipped.phases}
    for phase in every.phases:
        if phase.name in ("forward: layers.0", "backward: layers.0"):
            extra = by_name[phase.name]["unsharded (forward)"] + by_name[phase.name]["unsharded (backward)"] - \
                phase.components["unsharded (forward)"] - phase.components["unsharded (backward)"]
            assert extra == block, (phase.name, extra, block)  # one more byte an element of block 0
    assert any("blocks of 2 kinds" in note for note in skipped.notes), skipped.notes
    from mfsdp.memory.api import _resolve
    from mfsdp.memory.tensor_parallel import TensorParallel

    def acts(skip):  # the estimate's activation profile of a microbatch of 1 x 1024
        measure = _resolve(cfg, torch.bfloat16, 1024, False, TensorParallel(1), None,
                           (Float8Transform("tensorwise", skip),))[3]
        return dataclasses.asdict(measure(1, 1024, False))

    def block(skip):  # a block of the 1b model as it trains, on the meta device
        with torch.device("meta"):
            model = build_model(cfg, dtype=torch.bfloat16)
        return apply_transforms(model, (Float8Transform("tensorwise", skip),)).layers[1]

    small = dataclasses.replace(cfg, max_seq_len=1024)
    plain = dataclasses.asdict(measure_llama(small, torch.bfloat16, 1, 1024, False))
    fp8 = dataclasses.asdict(measure_llama(small, torch.bfloat16, 1, 1024, False, block=block(())))
    assert fp8 == acts(())
    mixed = acts(("layers.0.*",))
    assert mixed == {k: v if k == "grad_window" else max(v, plain[k]) for k, v in fp8.items()}, (mixed, fp8, plain)
    assert plain != fp8  # the two kinds of block differ (a float8 block's transients are not bf16's)
    w2 = measure_llama(small, torch.bfloat16, 1, 1024, False, block=block(("*.w2",)))
    assert acts(("*.w2",)) == dataclasses.asdict(w2) != fp8  # one kind of block: measured as it is
    run = planned_run(load_config(["--model.preset", "1b", "--model.float8", "tensorwise",
                                   "--model.float8_skip", "*.w2"]))
    assert run.transforms == (Float8Transform("tensorwise", ("*.w2",)),)
