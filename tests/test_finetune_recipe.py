"""Pretrained Hugging Face weights: the fine-tuning recipe, the learning-rate schedules, the first line
of a run and the gradient dtype."""

from __future__ import annotations

import math

import pytest
import torch

from mfsdp.train.config import ConfigError, load_config
from mfsdp.train.recipes import FINE_TUNING, RECIPES
from mfsdp.train.step import lr_at

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=260, max_position_embeddings=64, rms_norm_eps=1e-5)
V5 = int(transformers.__version__.split(".")[0]) >= 5


def _config(family: str, **extra):
    if family == "llama":
        return transformers.LlamaConfig(**SHAPE, **extra)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} if V5 else {"rope_theta": 1e6}
    return transformers.Qwen2Config(**SHAPE, **rope, **extra)


def _save(config, path, seed: int = 0):
    """A random model of ``config`` saved to ``path``; norms and biases far from their init values,
    so that one left behind by a load shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Weights of a Llama and a Qwen2, and a config-only Llama."""
    root = tmp_path_factory.mktemp("hf")
    models = {family: _save(_config(family), root / family) for family in ("llama", "qwen2")}
    _config("llama").save_pretrained(root / "config_only")
    return root, models


# ------------------------------------------------------------------------------------ recipes
def test_pretrained_weights_get_the_fine_tuning_recipe(dirs):
    from mfsdp.train.build import adamw

    root, _ = dirs
    for steps, warmup in ((100_000, 100), (500, 50), (30, 3)):
        cfg = load_config(["--model.hf", str(root / "llama"), "--train.steps", str(steps)])
        t = cfg.train
        assert cfg.loads_weights() and cfg.recipe() == ("fine-tuning", FINE_TUNING)
        assert (t.lr, t.warmup_steps, t.lr_schedule, t.min_lr_ratio) == (2e-5, warmup, "cosine", 0.0)
        assert (t.beta1, t.beta2, t.weight_decay, t.grad_clip) == (0.9, 0.999, 0.0, 1.0)
    opt = adamw(torch.nn.Linear(4, 4), t)
    assert opt.defaults["betas"] == (0.9, 0.999) and [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]


def test_no_weights_or_random_init_keeps_the_pretraining_recipe(dirs):
    root, _ = dirs
    for args in (["--model.hf", str(root / "config_only")],
                 ["--model.hf", str(root / "llama"), "--model.random_init", "true"]):
        cfg = load_config([*args, "--train.steps", "100000"])
        t, (name, recipe) = cfg.train, cfg.recipe()
        assert not cfg.loads_weights() and name == "tiny-sized" and recipe == RECIPES["tiny"]
        assert (t.lr, t.warmup_steps, t.min_lr_ratio, t.beta2, t.weight_decay) == (3e-3, 20, 0.1, 0.95, 0.1)
        assert "(random init)" in cfg.model_line()
    with pytest.raises(ConfigError, match="--model.random_init applies to --model.hf DIR runs"):
        load_config(["--model.random_init", "true"])


def test_explicit_flags_win_over_the_recipe(dirs, tmp_path):
    root, _ = dirs
    cfg = load_config(["--model.hf", str(root / "llama"), "--train.lr", "1e-5", "--train.weight_decay", "0.01",
                       "--train.beta2", "0.98", "--train.lr_schedule", "linear", "--train.warmup_steps", "7"])
    t = cfg.train
    assert (t.lr, t.weight_decay, t.beta2, t.lr_schedule, t.warmup_steps, t.min_lr_ratio) == (
        1e-5, 0.01, 0.98, "linear", 7, 0.0)
    line = cfg.schedule_line()
    assert line.startswith("lr 1e-05 (warm-up 7 steps, linear to 0x; the fine-tuning recipe, --train.lr and ")
    assert "--train.weight_decay" in line and "--train.beta2" in line and "--train.min_lr_ratio" not in line
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  hf: {root / 'llama'}\ntrain:\n  lr_schedule: constant\n  beta2: 0.99\n")
    t = load_config(["--config", str(path)]).train
    assert (t.lr_schedule, t.beta2, t.lr, t.weight_decay) == ("constant", 0.99, 2e-5, 0.0)
    # Pretraining presets keep Llama 2's AdamW settings.
    t = load_config(["--model.preset", "8b"]).train
    assert (t.beta2, t.weight_decay, t.lr_schedule) == (0.95, 0.1, "cosine")
    for flag, value, message in (("lr_schedule", "step", "train.lr_schedule must be one of cosine, linear, constant"),
                                 ("beta2", "1.0", r"train.beta2 must lie in \[0, 1\)"),
                                 ("weight_decay", "-1", "train.weight_decay must not be negative")):
        with pytest.raises(ConfigError, match=message):
            load_config([f"--train.{flag}", value])


@pytest.mark.parametrize("schedule, mid, last", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1), ("constant", 1.0, 1.0)])
def test_lr_at_each_schedule(schedule, mid, last):
    t = load_config(["--train.steps", "100", "--train.warmup_steps", "10", "--train.lr", "1.0",
                     "--train.min_lr_ratio", "0.1", "--train.lr_schedule", schedule]).train
    assert lr_at(t, 5) == pytest.approx(0.5) and lr_at(t, 10) == pytest.approx(1.0)  # warm-up, its end
    assert lr_at(t, 55) == pytest.approx(mid) and lr_at(t, 100) == pytest.approx(last)
    quarter = {"cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), "linear": 0.1 + 0.9 * 0.75, "constant": 1.0}
    assert lr_at(t, 32.5) == pytest.approx(quarter[schedule])
    rates = [lr_at(t, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert "then constant" in load_config(["--train.lr_schedule", "constant"]).schedule_line()


class _Data:
    path = "corpus.tokens"

    def __len__(self):
        return 1000


def test_the_first_line_names_the_model_and_the_recipe(dirs):
    from mfsdp.train.report import run_line

    root, _ = dirs
    cpu = torch.device("cpu")
    line = run_line(load_config(["--model.hf", str(root / "llama"), "--train.steps", "1000"]), 1, cpu, _Data())
    assert line.startswith(f"mfsdp train: LlamaForCausalLM from {root / 'llama'}, 0.0M parameters, lr 2e-05 "
                           "(warm-up 100 steps, cosine to 0x; the fine-tuning recipe), 1 process(es)"), line
    line = run_line(load_config(["--model.preset", "8b", "--train.steps", "100000"]), 8, cpu, _Data())
    assert line.startswith("mfsdp train: 8b model, 8030.3M parameters, lr 0.0003 (warm-up 2000 steps, cosine to "
                           "0.1x; the 8b recipe), 8 process(es)"), line


def test_main_grads_auto_is_the_compute_dtype_for_every_model(dirs):
    from mfsdp.train.plan import planned_run

    root, _ = dirs
    for args in ([], ["--model.hf", str(root / "llama")]):
        cfg = load_config(args)
        assert (cfg.main_grads_name("cuda"), cfg.main_grads_name("cpu")) == ("bf16", "fp32")
        assert cfg.main_grads_dtype() is None  # the core's default: the compute dtype
        assert planned_run(cfg).auto_grads == "bf16" and planned_run(cfg).grads_dtypes["auto"] is None
        fp32 = load_config([*args, "--parallel.main_grads_dtype", "fp32"])
        assert fp32.main_grads_name("cuda") == "fp32" and fp32.main_grads_dtype() == torch.float32
