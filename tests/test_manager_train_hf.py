"""`mfsdp train --model.hf DIR`: a tiny Hugging Face model trained through the manager on two ranks (the
trainer in the test session's world; the launch itself is test_train_e2e.py's)."""

from __future__ import annotations

import math

import pytest

from test_manager_models import make_hf
from test_eval_loss import run_trainer
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    import torch

    model = make_hf("qwen2", vocab=260)  # the byte tokenizer has 257 ids
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # confident, wrong logits: a loss far above a fresh init's ln 260
    model.save_pretrained(path)
    return path


def test_train_hf_two_processes(world, hf_dir, tmp_path):
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="a*.py")
    out = tmp_path / "run"
    records = world(2).run(run_trainer, argv=[
        "--model.hf", str(hf_dir), "--model.hf_impl", "manager", "--data.path", str(corpus), "--data.seq_len", "16",
        "--data.local_batch", "2", "--train.steps", "3", "--train.warmup_steps", "1", "--train.lr", "1e-2",
        "--train.sample_tokens", "4", "--train.progress", "false", "--train.device", "cpu",
        "--train.out_dir", str(out)])[0]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    # Loaded weights, not a fresh init (which would start at about ln 260).
    assert records[0]["loss"] > math.log(260) + 1, records[0]
    assert (out / "checkpoints" / "step_3").is_dir()


def test_hf_config_errors(hf_dir, tmp_path):
    cfg = load_config(["--model.hf", str(hf_dir)])
    shape = cfg.resolved.shape
    assert (shape.dim, shape.n_layers, shape.vocab_size) == (16, 2, 260)
    with pytest.raises(ConfigError, match="unset --model.dim"):
        load_config(["--model.hf", str(hf_dir), "--model.dim", "8"]).resolved.shape
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(["--model.hf", str(tmp_path)]).resolved.shape
