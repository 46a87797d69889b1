"""``--model.head_loss fused``: the chunked head and cross entropy (``mfsdp.models.loss``) in ``mfsdp train``
trains as the plain one does (losses, gradient norms, validation losses and final weights of two gloo
ranks in fp32), the memory plan measures the loss chosen, and the manager's route refuses it or, under
``--model.hf_impl auto``, trains with the plain one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mfsdp.data import write_token_file
from mfsdp.train.run.config import ConfigError, ModelSection
from mfsdp.train.run.resolve import load_config
from test_eval_loss import SMALL, run_trainer
from test_model_only_checkpoint import tensors

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]


def run_counting_fused(rank, world_size, argv):
    """``run_trainer`` with every call of the fused loss counted, by whether it ran under autograd:
    proof that the run took it, in training and in evaluation (no_grad)."""
    from mfsdp.models import llama

    fused, calls = llama.HEAD_LOSSES["fused"], []
    llama.HEAD_LOSSES["fused"] = lambda *args, **kwargs: calls.append(torch.is_grad_enabled()) or fused(*args, **kwargs)
    try:
        return run_trainer(rank, world_size, argv), calls
    finally:
        llama.HEAD_LOSSES["fused"] = fused


def test_fused_head_loss_trains_as_the_plain_one(world, tmp_path):
    """Two gloo ranks, fp32 (the CPU's compute dtype), the same seeds and data: 3 steps with the
    evaluation after steps 2 and 3, plain then fused."""
    data = write_token_file(tmp_path / "t.tokens", torch.randint(0, 257, (20_000,),
                                                                 generator=torch.Generator().manual_seed(0)), 257, "bytes")
    args = [*SMALL, "--data.path", str(data), "--data.local_batch", "4", "--train.steps", "3",
            "--train.eval_every", "2", "--train.eval_batches", "1", "--train.save_only_model", "true",
            "--train.save_dtype", "fp32"]
    runs = {}
    for head_loss in ("plain", "fused"):
        out = tmp_path / head_loss
        [(records, calls), (_, other_calls)] = world(2).run(
            run_counting_fused, argv=[*args, "--train.out_dir", str(out), "--model.head_loss", head_loss])
        runs[head_loss] = records, tensors(out / "checkpoints" / "step_3", "model.")
        # Each rank: the training forwards under autograd, the evaluations (after steps 2 and 3) under no_grad.
        assert calls == other_calls == ([True, True, False, True, False] if head_loss == "fused" else []), calls
    (plain, plain_weights), (fused, fused_weights) = runs["plain"], runs["fused"]
    assert [r["step"] for r in fused] == [r["step"] for r in plain] == [1, 2, 3]
    for key in ("loss", "grad_norm", "val_loss"):  # the gradient norm catches a gradient scaled wrongly
        pairs = [(p[key], f[key]) for p, f in zip(plain, fused) if key in p]
        assert len(pairs) == (2 if key == "val_loss" else 3), (key, plain)
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in pairs), (key, pairs)
    assert plain_weights.keys() == fused_weights.keys() and "model.output.weight" in plain_weights
    # Adam moves a weight by about lr (1e-2) a step whatever the gradient's size, so a gradient wrong in
    # direction moves weights by ~1e-2; the two roundings differed by 3e-6 at most here.
    errors = {k: (plain_weights[k] - fused_weights[k]).abs().max().item() for k in plain_weights}
    assert max(errors.values()) < 1e-4, errors


def _planned(*args):
    from mfsdp.memory.plan import estimate_run
    from mfsdp.train.command.plan import planned_run

    return estimate_run(planned_run(load_config(list(args))), 1)


def test_the_plan_measures_the_head_loss_of_the_run():
    """A vocabulary-heavy shape (131,072 tokens, width 64, 8,192 tokens a microbatch: four chunks of the
    fused loss), through the config as `mfsdp plan` reads it: the eager plain loss holds the fp32 logits
    and log-probabilities of the microbatch; compiled with the blocks (a GPU run's default), the bf16
    logits and their bf16 gradient (``CompiledPlainLoss``, as measured on one H200); the fused one a
    chunk's."""
    shape = ["--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "128",
             "--model.vocab_size", "131072", "--data.seq_len", "2048", "--data.local_batch", "4"]
    eager = _planned(*shape, "--parallel.compile", "false")
    plain, fused = _planned(*shape), _planned(*shape, "--model.head_loss", "fused")
    assert (plain.settings.head_loss, fused.settings.head_loss) == ("plain", "fused")
    logits = 4 * 2048 * 131072 * 4  # the microbatch's (tokens, vocab) in fp32
    assert eager.component_max("logits and loss") > 2 * logits  # the log-probabilities and their gradient
    assert logits <= plain.component_max("logits and loss") < 1.01 * logits  # 2 x (tokens, vocab) in bf16
    assert fused.component_max("logits and loss") < logits  # a chunk's (bf16, upcast, log-probabilities)
    assert fused.peak_bytes < plain.peak_bytes < eager.peak_bytes
    assert plain.breakdown["main weights"] == fused.breakdown["main weights"]


def _hf_dir(path, **extra):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, vocab_size=260,
        max_position_embeddings=64, **extra)))
    return str(path)


def test_the_manager_route_refuses_the_fused_loss_and_auto_trains_it_plain(tmp_path):
    llama, biased = _hf_dir(tmp_path / "llama"), _hf_dir(tmp_path / "biased", attention_bias=True)
    with pytest.raises(ConfigError) as err:
        load_config(["--model.hf", llama, "--model.hf_impl", "manager", "--model.head_loss", "fused"])
    assert str(err.value) == (
        "--model.head_loss fused needs the bundled Llama, and --model.hf_impl manager runs Hugging Face's "
        "modeling code, which returns logits; use --model.hf_impl auto (or bundled), or --model.head_loss plain")
    with pytest.raises(ConfigError, match="model.head_loss must be one of plain, fused, got 'chunked'"):
        load_config(["--model.head_loss", "chunked"])
    assert load_config(["--model.hf", llama, "--model.head_loss", "fused"]).model.head_loss == "fused"  # bundled
    auto = load_config(["--model.hf", biased, "--model.head_loss", "fused"])  # to the manager: plain there
    assert (auto.model.hf_impl, auto.model.head_loss) == ("manager", "plain")
    # A checkpoint's config from before the flag: plain, the loss it trained with, whatever the default.
    assert ModelSection.recorded({"hf": llama, "hf_impl": "manager"}).head_loss == "plain"


def test_the_compiled_head_loss_gives_the_eager_loss_and_gradients():
    """``Llama.set_head_loss(name, compiled=True)`` (what a compiled ``mfsdp train`` run sets): the loss
    sum, the count and the gradients of a tiny Llama match the eager loss's in fp32, with -100 labels."""
    from mfsdp.models import LlamaConfig, build_model

    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32)
    tokens = torch.randint(0, 97, (2, 16))
    labels = tokens.clone()
    labels[:, ::3] = -100
    results = []
    for compiled in (False, True):
        model.set_head_loss("plain", compiled=compiled)
        model.zero_grad()
        loss, count = model(tokens, labels=labels)
        loss.backward()
        results.append((loss.detach(), count, [p.grad.clone() for p in model.parameters()]))
    (eager, n_eager, g_eager), (comp, n_comp, g_comp) = results
    assert int(n_eager) == int(n_comp) == int((labels != -100).sum())
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=0)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
