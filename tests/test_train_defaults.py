"""The learning-rate schedule follows the model's pretraining recipe unless a flag or the YAML sets it,
and the first line of a run says which rate it trains with (fine-tuning: tests/test_finetune_recipe.py)."""

import json

import pytest

from mfsdp.models.llama import PRESETS
from mfsdp.train.run.config import ConfigError, TrainSection
from mfsdp.train.command.args import usage
from mfsdp.train.run.resolve import load_config
from mfsdp.train.loop.step import lr_at
from mfsdp.train.run.recipes import RECIPES, WARMUP_FRACTION

pytestmark = pytest.mark.timeout(120)


def test_every_preset_has_a_recipe():
    assert set(RECIPES) == set(PRESETS)


def test_tiny_keeps_the_demo_schedule():
    t = load_config([]).train
    assert (t.lr, t.warmup_steps, t.min_lr_ratio) == (3e-3, 20, 0.1)


@pytest.mark.parametrize("preset, lr", [("1b", 3e-4), ("8b", 3e-4), ("70b", 1.5e-4), ("moe-1b", 3e-4)])
def test_large_presets_train_at_their_published_peak(preset, lr):
    long = load_config(["--model.preset", preset, "--train.steps", "100000"]).train
    assert (long.lr, long.warmup_steps, long.min_lr_ratio) == (lr, RECIPES[preset].warmup_steps, 0.1)
    assert long.warmup_steps == 2000
    # A short run warms up over at most a fifth of its steps, not all of them.
    short = load_config(["--model.preset", preset, "--train.steps", "20"]).train
    assert short.lr == lr and short.warmup_steps == int(WARMUP_FRACTION * 20) == 4


def test_explicit_values_win_over_the_preset(tmp_path):
    cfg = load_config(["--model.preset", "8b", "--train.lr", "1e-4", "--train.warmup_steps", "0",
                       "--train.min_lr_ratio", "0.5"])
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.min_lr_ratio) == (1e-4, 0, 0.5)
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: 8b\ntrain:\n  lr: 2.0e-4\n")
    cfg = load_config(["--config", str(path)])
    assert cfg.train.lr == 2e-4 and cfg.train.warmup_steps == 60  # the rest from the recipe
    assert "the 8b recipe, --train.lr given" in cfg.schedule_line()
    # The schedule a trainer runs is the resolved one.
    schedule = load_config(["--model.preset", "8b", "--train.steps", "100"]).train
    assert lr_at(schedule, 20) == pytest.approx(3e-4)
    assert lr_at(schedule, 100) == pytest.approx(3e-5)


def test_bad_explicit_values_are_still_refused():
    with pytest.raises(ConfigError, match="train.lr must be positive"):
        load_config(["--train.lr", "0"])
    with pytest.raises(ConfigError, match="train.warmup_steps must not be negative"):
        TrainSection(warmup_steps=-1)


def test_a_hugging_face_model_takes_the_recipe_of_its_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256)))
    cfg = load_config(["--model.hf", str(tmp_path), "--train.steps", "100000"])
    assert cfg.train.lr == 3e-4 and "the 8b-sized recipe" in cfg.schedule_line()


def test_help_says_the_schedule_comes_from_the_recipe():
    text = usage()
    assert "--train.lr (the recipe's)" in text and "--train.steps (300)" in text
    assert "--train.weight_decay (the recipe's)" in text and "--train.lr_schedule (the recipe's)" in text


def test_the_first_line_of_a_run_names_its_learning_rate(world, tmp_path):
    """What ``mfsdp train`` prints first, the trainer run in a world of one process (the launch
    itself is test_train_e2e.py's)."""
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source
    from test_eval_loss import run_trainer

    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="a*.py")
    args = ["--model.n_layers", "1", "--model.dim", "32", "--model.n_heads", "2", "--model.n_kv_heads",
            "1", "--model.ffn_dim", "64", "--data.seq_len", "16", "--data.local_batch", "2",
            "--train.steps", "1", "--train.sample_tokens", "0", "--train.progress", "false",
            "--train.device", "cpu", "--data.path", str(corpus), "--train.out_dir", str(tmp_path / "run")]
    _, printed = world(1).run(run_trainer, argv=args, stdout=True)[0]
    first = printed.splitlines()[0]
    assert first.startswith("mfsdp train: tiny model,") and "lr 0.003 (warm-up 0 steps" in first, printed


def test_the_adamw_kernel_is_flat_on_cuda_foreach_on_cpu_unless_set():
    """``--train.adamw_kernel``: auto picks by device (flat on CUDA, foreach on CPU); flat steps the
    groups flat, with torch's kernel of the device for any it cannot take; an explicit choice is
    what the optimizer gets."""
    import torch

    from mfsdp.train.build.model import adamw

    auto = load_config([]).train
    assert auto.flat_adamw("cuda") and auto.fused_adamw("cuda")  # fused: for groups flat cannot take
    assert not auto.flat_adamw("cpu") and not auto.fused_adamw("cpu")
    model = torch.nn.Linear(4, 4)
    for kernel, fused, flat in (("auto", False, False), ("foreach", False, False), ("fused", True, False),
                                ("flat", False, True)):
        t = load_config(["--train.adamw_kernel", kernel, "--train.lr", "1e-3"]).train
        assert t.fused_adamw("cuda") == (kernel != "foreach") and t.flat_adamw("cpu") == flat
        assert t.flat_adamw("cuda") == (flat or kernel == "auto")
        opt = adamw(model, t)
        assert bool(opt.defaults.get("fused")) == fused and bool(opt.defaults.get("foreach")) == (not fused)
    with pytest.raises(ConfigError, match="train.adamw_kernel must be one of auto, flat, fused, foreach, got 'apex'"):
        load_config(["--train.adamw_kernel", "apex"])
