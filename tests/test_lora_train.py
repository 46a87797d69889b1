"""LoRA in ``mfsdp train``: the one transform list (float8 first, then LoRA) from the config, its
errors before any worker starts, the LoRA recipe, the planner's model state of a LoRA 8B, and a
short run on a tiny Hugging Face directory on both routes (the adapters train, the base stays
bit-identical to the directory's weights, the first line names LoRA)."""

from __future__ import annotations

import json

import pytest
import torch

from mfsdp.transforms.float8 import Float8Transform
from mfsdp.transforms.lora import LoraTransform, lora_linears
from mfsdp.train.command import launcher
from mfsdp.train.run.resolve import load_config
from mfsdp.train.build.model import transforms_for
from mfsdp.train.command.errors import ConfigError
from mfsdp.train.run.recipes import FINE_TUNING, LORA
from test_eval_loss import run_trainer

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from test_manager_models import make_hf

    path = tmp_path_factory.mktemp("lora_train") / "tiny-llama"
    make_hf("llama", vocab=260).save_pretrained(path)  # the byte tokenizer has 257 ids
    return path


def test_the_list_is_float8_then_lora_and_applies_on_the_meta_model():
    cfg = load_config(["--model.float8", "tensorwise", "--peft.method", "lora", "--peft.lora_r", "8",
                       "--peft.lora_alpha", "4", "--peft.target_modules", "q_proj,w2", "--peft.use_rslora", "true"])
    fp8, lora = transforms_for(cfg)
    assert isinstance(fp8, Float8Transform) and lora == LoraTransform(8, 4.0, 0.0, ("q_proj", "w2"), True)
    assert transforms_for(load_config([])) == ()
    from mfsdp.models import build_model
    from mfsdp.transforms import apply_transforms

    with torch.device("meta"):
        model = apply_transforms(build_model(cfg.resolved.shape), transforms_for(cfg))
    adapted = {n: type(m).__name__ for n, m in lora_linears(model)}
    assert adapted and set(adapted.values()) == {"LoraFloat8Linear"}  # the frozen base computes in float8
    assert {n.rpartition(".")[2] for n in adapted} == {"wq", "w2"}


def test_config_errors_are_one_line_and_exit_code_2_before_any_worker(monkeypatch, capsys, tmp_path):
    with pytest.raises(ConfigError, match="pattern 'nothing_proj' matches no linear of the blocks; use"):
        load_config(["--peft.method", "lora", "--peft.target_modules", "nothing_proj"])
    with pytest.raises(ConfigError, match="--peft.lora_r must be an integer >= 1"):
        load_config(["--peft.method", "lora", "--peft.lora_r", "0"])
    with pytest.raises(ConfigError, match="--peft.lora_r applies to --peft.method lora"):
        load_config(["--peft.lora_r", "8"])
    started = []
    monkeypatch.setattr(launcher, "run", lambda *args: started.append(args) or 0)
    code = launcher.main(["--nproc-per-node", "2", "--train.device", "cpu", "--train.out_dir", str(tmp_path),
                          "--peft.method", "lora", "--peft.target_modules", "nothing_proj"])
    err = capsys.readouterr().err
    assert code == 2 and not started and err.count("\n") == 1 and "matches no linear" in err


def test_the_experts_grouped_weights_of_a_hugging_face_moe_are_refused_by_name(tmp_path):
    import transformers

    transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=64, num_local_experts=4).save_pretrained(tmp_path)
    args = ["--model.hf", str(tmp_path), "--model.hf_impl", "manager", "--peft.method", "lora"]
    with pytest.raises(ConfigError, match=r"names the experts' grouped weights \(model\.layers\.0\.mlp\.experts\."
                                          r"down_proj, one 3-D parameter.*out of scope"):
        load_config([*args, "--peft.target_modules", "down_proj"])
    assert transforms_for(load_config(args))  # all-linear: the attention linears, the experts frozen


def test_lora_on_pretrained_weights_takes_the_lora_recipe(hf_dir):
    cfg = load_config(["--model.hf", str(hf_dir), "--peft.method", "lora", "--train.steps", "2000"])
    assert cfg.recipe()[0] == "LoRA" and (cfg.train.lr, cfg.train.weight_decay) == (2e-4, 0.0)
    assert (cfg.train.warmup_steps, cfg.train.lr_schedule, cfg.train.min_lr_ratio) == (
        FINE_TUNING.warmup_steps, FINE_TUNING.schedule, FINE_TUNING.min_lr_ratio)
    assert LORA.lr == 10 * FINE_TUNING.lr
    assert load_config(["--model.hf", str(hf_dir)]).train.lr == FINE_TUNING.lr


def test_the_planned_model_state_of_a_lora_8b():
    """Frozen base in bf16 only (no fp32 copy, gradient or optimizer state); adapters with fp32 main
    weights, fp32 main gradients and AdamW's two fp32 states; counted here from the shapes, not from
    the meta model."""
    from mfsdp.memory import plan
    from mfsdp.models import flops
    from mfsdp.train.command.plan import planned_run

    cfg = load_config(["--model.preset", "8b", "--peft.method", "lora", "--parallel.main_grads_dtype", "fp32"])
    c = cfg.resolved.shape
    kv = c.n_kv_heads * c.head_dim
    per_block = 16 * (2 * (c.dim + c.dim) + 2 * (c.dim + kv) + 3 * (c.dim + c.ffn_dim))
    adapters, total = c.n_layers * per_block, flops.param_counts(c)["total"]
    assert round(adapters / 1e6, 1) == 41.9 and round(total / 1e6) == 8030
    e = plan.estimate_run(planned_run(cfg), 1)
    assert e.breakdown["main weights"] == 2 * total + 4 * adapters
    assert e.component_max("optimizer states") == 8 * adapters
    grads = e.component_max("main grads")  # plus each group's int64 usage row (runtime bookkeeping)
    assert 4 * adapters < grads < 4 * adapters * (1 + 1e-4)
    from mfsdp.memory import estimate

    partial = estimate("tiny", world_size=1, placements="zero3", seq_len=64, device="cpu",
                       transforms=(LoraTransform(target_modules="layers.0.*"),))
    assert any(note.startswith("LoRA r 16: blocks of 2 kinds") for note in partial.notes)  # adapted or not


def _run_and_check(rank, world_size, argv):
    """``run_trainer`` with the built model kept: returns rank 0's records and printed lines, and
    whether every frozen weight ends bit-identical to the loaded one while every B moved."""
    from mfsdp.train.loop import trainer

    built, build = [], trainer.build

    def keep(*args, **kwargs):
        model, optimizer = build(*args, **kwargs)
        full = {n: _full(p).clone() for n, p in model.named_parameters()}
        built.append((model, full))
        return model, optimizer

    trainer.build = keep
    try:
        out = run_trainer(rank, world_size, argv, stdout=True)
    finally:
        trainer.build = build
    model, before = built[0]
    after = {n: _full(p) for n, p in model.named_parameters()}
    frozen_same = all(torch.equal(before[n], after[n]) for n, p in model.named_parameters() if not p.requires_grad)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    b_moved = all(after[n].abs().max() > 0 for n in trained if n.endswith("lora_B"))
    return out, frozen_same, b_moved, trained


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


@pytest.mark.parametrize("route", ["bundled", "manager"])
def test_a_lora_run_trains_the_adapters_only(world, hf_dir, tmp_path, route):
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="ab*.py")
    argv = ["--model.hf", str(hf_dir), "--model.hf_impl", route, "--peft.method", "lora", "--data.path",
            str(corpus), "--data.seq_len", "16", "--data.local_batch", "2", "--train.steps", "6",
            "--train.warmup_steps", "0", "--train.lr", "3e-2", "--train.sample_tokens", "0",
            "--train.progress", "false", "--train.device", "cpu", "--train.out_dir", str(tmp_path / "run"),
            "--train.checkpoint_every", "0"]
    results = world(2).run(_run_and_check, argv=argv)
    (records, printed), frozen_same, b_moved, trained = results[0]
    assert all(r[1:] == (True, True, trained) for r in results)
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    lines = printed.splitlines()
    assert lines[0].startswith("mfsdp train: ") and "LoRA r 16, alpha 32 on all-linear" in lines[0]
    blocks = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    assert any(line.startswith(f"LoRA r 16, alpha 32, 7 linears × {blocks} blocks, ") for line in lines)
    assert route == "manager" or any(line.startswith("loaded the weights of") for line in lines)
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_lora_block_activations_by_hand():
    """What a LoRA block saves, counted by hand (tiny shape, exact bytes): each frozen base linear's
    input is still saved, for its adapter's A (the same tensor a trained linear saves for its weight
    gradient, so no new bytes), plus the r-wide x @ A.T for B's gradient; the frozen norms save
    nothing for their weights' gradient (a trained norm keeps its normalised input, tokens x dim)."""
    from mfsdp.memory.activations import measure_llama
    from mfsdp.models import build_model, get_config
    from mfsdp.transforms import apply_transforms

    cfg = get_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    batch, seq, r, isz = 2, 16, 4, 2
    with torch.device("meta"):
        meta = apply_transforms(build_model(cfg, dtype=torch.bfloat16), (LoraTransform(r=r),))
    full = measure_llama(cfg, torch.bfloat16, batch, seq, False)
    lora = measure_llama(cfg, torch.bfloat16, batch, seq, False, block=meta.layers[0])
    tokens = batch * seq
    assert lora.block_bytes == full.block_bytes - 2 * tokens * cfg.dim * isz + 7 * tokens * r * isz
    adapters = sum(p.numel() for n, p in meta.layers[0].named_parameters() if p.requires_grad) * isz
    assert 0 < lora.block_weight_grad_bytes <= adapters < full.block_weight_grad_bytes  # only adapters' grads


def test_the_plan_stages_a_lora_checkpoint_of_the_adapters_alone(capsys, tmp_path):
    """`mfsdp plan`'s host-RAM line sizes a LoRA run's checkpoint staging from its adapters (fp32 main
    weights and two AdamW moments: 12 bytes each), not from the frozen base."""
    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.command.plan import main as plan_main

    flags = ["--model.preset", "1b", "--peft.method", "lora", "--train.async_checkpoint", "true"]
    assert plan_main([*flags, "--nproc-per-node", "1", "--out", str(tmp_path / "p.png")]) == 0
    expected = load_config(flags).resolved.adapter_params * 12 / 2**30
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("host RAM"))
    assert expected > 0.05 and line.endswith(f"checkpoint staging {expected:.2f})"), (line, expected)
