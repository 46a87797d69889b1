"""Pretrained Hugging Face weights: the fine-tuning recipe, the learning-rate schedules, the first line
of a run, the gradient dtype, and the bundled route (``--model.hf_impl``): a Llama or Qwen2 directory
trained as the bundled Llama on 2 gloo ranks, its logits those of transformers (fp32, eager
attention) before training and those of its export after, planned as the preset of its shape."""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_eval_loss import run_trainer
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config
from mfsdp.train.command.errors import CheckpointError
from mfsdp.train.run.recipes import FINE_TUNING, RECIPES
from mfsdp.train.loop.step import lr_at

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=260, max_position_embeddings=64, rms_norm_eps=1e-5)
TRAIN = ["--data.seq_len", "16", "--data.local_batch", "2", "--train.sample_tokens", "0", "--train.progress",
         "false", "--train.device", "cpu", "--train.eval_every", "0"]
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
    """Weights of a Llama and a Qwen2, a config-only Llama, and a Llama the bundled model cannot run."""
    root = tmp_path_factory.mktemp("hf")
    models = {family: _save(_config(family), root / family) for family in ("llama", "qwen2")}
    _config("llama").save_pretrained(root / "config_only")
    _config("llama", attention_bias=True).save_pretrained(root / "biased")
    return root, models


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    path = tmp_path_factory.mktemp("corpus") / "small.tokens"
    prepare(stdlib_source(), path, glob="a*.py")
    return path


# ------------------------------------------------------------------------------------ recipes
def test_pretrained_weights_get_the_fine_tuning_recipe(dirs):
    from mfsdp.train.build.model import adamw

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
    with pytest.raises(ConfigError, match="--model.hf_impl and --model.random_init apply to --model.hf DIR runs"):
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
    num_samples = None

    def __len__(self):
        return 1000


def test_the_first_line_names_the_model_and_the_recipe(dirs):
    from mfsdp.train.report.record import run_line

    root, _ = dirs
    cpu = torch.device("cpu")
    line = run_line(load_config(["--model.hf", str(root / "llama"), "--train.steps", "1000"]), 1, cpu, _Data())
    assert line.startswith(f"mfsdp train: LlamaForCausalLM from {root / 'llama'}, 0.0M parameters, lr 2e-05 "
                           "(warm-up 100 steps, cosine to 0x; the fine-tuning recipe), 1 process(es)"), line
    line = run_line(load_config(["--model.preset", "8b", "--train.steps", "100000"]), 8, cpu, _Data())
    assert line.startswith("mfsdp train: 8b model, 8030.3M parameters, lr 0.0003 (warm-up 2000 steps, cosine to "
                           "0.1x; the 8b recipe), 8 process(es)"), line


def test_main_grads_auto_is_the_compute_dtype_for_every_model(dirs):
    from mfsdp.train.command.plan import planned_run

    root, _ = dirs
    for args in ([], ["--model.hf", str(root / "llama")], ["--model.hf", str(root / "llama"), "--model.hf_impl",
                                                           "manager"]):
        cfg = load_config(args)
        assert (cfg.main_grads_name("cuda"), cfg.main_grads_name("cpu")) == ("bf16", "fp32")
        assert cfg.main_grads_dtype() is None  # the core's default: the compute dtype
        assert planned_run(cfg).auto_grads == "bf16" and planned_run(cfg).grads_dtypes["auto"] is None
        fp32 = load_config([*args, "--parallel.main_grads_dtype", "fp32"])
        assert fp32.main_grads_name("cuda") == "fp32" and fp32.main_grads_dtype() == torch.float32


# ------------------------------------------------------------------------------------- routes
def test_auto_takes_the_bundled_route_where_it_can(dirs):
    root, _ = dirs
    for family in ("llama", "qwen2"):
        cfg = load_config(["--model.hf", str(root / family)])
        assert cfg.model.hf_impl == "bundled" and not cfg.model.uses_manager and cfg.route_note() is None
        assert cfg.resolved.shape.qkv_bias == (family == "qwen2")
        assert cfg.resolved.shape.rope_theta == (1e6 if family == "qwen2" else 10000.0)
    biased = load_config(["--model.hf", str(root / "biased")])
    assert biased.model.hf_impl == "manager" and biased.model.uses_manager
    note = biased.route_note()
    assert "\n" not in note and "attention_bias=True" in note and "through the manager" in note, note
    manager = load_config(["--model.hf", str(root / "llama"), "--model.hf_impl", "manager"])
    assert manager.model.uses_manager and manager.route_note() is None  # asked for, nothing to explain


def test_bundled_refuses_an_unsupported_config_and_float8_needs_the_bundled_route(dirs):
    root, _ = dirs
    with pytest.raises(ConfigError) as err:
        load_config(["--model.hf", str(root / "biased"), "--model.hf_impl", "bundled"])
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"--model.hf_impl bundled: {root / 'biased'} cannot run as the bundled Llama: attention_bias=True"), err.value
    assert load_config(["--model.hf", str(root / "llama"), "--model.float8", "tensorwise"]).model.float8 == "tensorwise"
    with pytest.raises(ConfigError, match="--model.float8 needs the bundled Llama, and --model.hf_impl manager"):
        load_config(["--model.hf", str(root / "llama"), "--model.float8", "rowwise", "--model.hf_impl", "manager"])
    with pytest.raises(ConfigError, match="--model.float8 needs the bundled Llama, which cannot run"):
        load_config(["--model.hf", str(root / "biased"), "--model.float8", "rowwise"])


def test_plan_of_a_bundled_route_directory_is_the_presets(dirs, tmp_path):
    """`mfsdp plan --model.hf DIR` plans the bundled Llama of DIR's shape, compiled, as it plans the
    same shape given by preset flags; through the manager it plans the Hugging Face model."""
    import contextlib
    import io

    from mfsdp.cli import main
    from mfsdp.memory.plan import estimate_run
    from mfsdp.train.command.plan import planned_run

    root, _ = dirs
    run = ["--data.seq_len", "64", "--data.local_batch", "2"]
    shape = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.ffn_dim", "48", "--model.vocab_size", "260", "--model.tie_embeddings", "false"]
    hf, preset = load_config(["--model.hf", str(root / "llama"), *run]), load_config([*shape, *run])
    a, b = estimate_run(planned_run(hf), 2), estimate_run(planned_run(preset), 2)
    assert planned_run(hf).compiled and not planned_run(hf).hf
    assert (a.peak_bytes, a.peak_phase, a.breakdown) == (b.peak_bytes, b.peak_phase, b.breakdown)
    assert any("compiled blocks" in note for note in a.notes)
    manager = estimate_run(planned_run(load_config(["--model.hf", str(root / "llama"), "--model.hf_impl", "manager",
                                                    *run])), 2)
    assert manager.peak_bytes != a.peak_bytes

    def plan(*args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", *args, *run, "--nproc-per-node", "2", "--gpu-memory", "4GiB",
                         "--out", str(tmp_path / "plan.png")]) == 0
        return out.getvalue().splitlines()

    from_dir, from_flags = plan("--model.hf", str(root / "llama")), plan(*shape)
    assert "(the bundled Llama)" in from_dir[0] and from_dir[1:] == from_flags[1:]


# ----------------------------------------------------------------------- the bundled route, trained
def built_logits(rank, world_size, argv, tokens):
    """The model `mfsdp train` builds for ``argv`` (meta, sharded, loaded): whether it is the bundled
    Llama, and its logits."""
    from mfsdp.models import Llama
    from mfsdp.train.build.model import build

    cfg = load_config(argv)
    model, _ = build(cfg, torch.device("cpu"), world_size, print)
    with torch.no_grad():
        return isinstance(model, Llama), model(tokens)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bundled_route_trains_resumes_and_exports(world, dirs, corpus, tmp_path, family):
    from test_export_hf import trained_state

    from mfsdp.cli import main as cli_main
    from mfsdp.hf.config import bundled_config_from_hf
    from mfsdp.models import Llama

    root, models = dirs
    source, out = root / family, tmp_path / "run"
    args = ["--model.hf", str(source), *TRAIN, "--data.path", str(corpus), "--train.out_dir", str(out),
            "--train.lr", "1e-3"]  # steps that move the weights visibly
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for bundled, logits in world(2).run(built_logits, argv=args, tokens=tokens):
        assert bundled and _rel(logits, models[family](tokens).logits.detach()) < 1e-5
    first = world(2).run(run_trainer, argv=[*args, "--train.steps", "2"])[0]
    records = world(2).run(run_trainer, argv=[*args, "--train.steps", "3", "--resume"])[0]
    assert [r["step"] for r in records] == [1, 2, 3] and records[:2] == first
    assert all(math.isfinite(r["loss"]) for r in records)
    meta = json.loads((out / "checkpoints" / "step_3" / "meta.json").read_text())
    assert meta["config"]["model"]["hf_impl"] == "bundled" and meta["hf_config"]["model_type"] == family
    assert cli_main(["export", str(out), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(exported) is type(models[family])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    trained = trained_state(out / "checkpoints" / "step_3", Llama(bundled_config_from_hf(source, 16)))
    with torch.no_grad():
        got, want = exported(tokens).logits, trained(tokens)
        assert _rel(got, want) < 1e-5
        assert _rel(got, models[family](tokens).logits) > 1e-7  # trained: not the source's weights


def test_a_resume_keeps_the_route_that_wrote_the_checkpoint(world, dirs, corpus, tmp_path):
    from mfsdp.train.run.preflight import check_run

    root, _ = dirs
    args = ["--model.hf", str(root / "llama"), *TRAIN, "--data.path", str(corpus), "--train.out_dir",
            str(tmp_path / "run"), "--train.steps", "2"]
    records = world(2).run(run_trainer, argv=[*args, "--model.hf_impl", "manager"])[0]
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    check_run(load_config([*args, "--model.hf_impl", "manager", "--resume"]), 2, "cpu")
    with pytest.raises(CheckpointError) as err:
        check_run(load_config([*args, "--resume"]), 2, "cpu")
    assert "\n" not in str(err.value) and "was trained on the manager route and this run takes the bundled one; " \
        "resume with --model.hf_impl manager" in str(err.value), err.value
