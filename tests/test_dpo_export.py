"""Exports after preference tuning are those after fine-tuning, in the same place (issue 52): a full DPO
run's ``--train.export_hf`` writes a Hugging Face model that transformers loads, a LoRA DPO run's a PEFT
adapter that PEFT loads, and ``mfsdp export --peft.merge_on_export true`` the merged model. Each gives
the held-out pairs the mean chosen log-prob the run's last validation reported (``val_logps/chosen``):
the trained policy, not the reference. CPU, fp32, 2 gloo ranks, a tiny Hugging Face Llama."""

from __future__ import annotations

import math

import pytest
import torch

from mfsdp.data import TokenFile
from mfsdp.data.heldout import held_out_samples
from test_dpo_train import _pairs
from test_eval_loss import run_trainer

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

VAL_FRACTION = 0.25


@pytest.fixture(scope="module")
def base_and_pairs(tmp_path_factory):
    from test_manager_models import make_hf

    root = tmp_path_factory.mktemp("dpo_export")
    make_hf("llama", vocab=260).save_pretrained(root / "base")  # the byte tokenizer's 257 ids fit
    return root / "base", _pairs(root / "p.tokens", count=24)


def _train(world, base, pairs, out, *flags):
    argv = ["--model.hf", str(base), "--data.path", str(pairs), "--train.out_dir", str(out), "--data.seq_len", "24",
            "--data.local_batch", "2", "--data.val_fraction", str(VAL_FRACTION), "--train.steps", "3",
            "--train.eval_every", "3", "--train.warmup_steps", "0", "--train.lr", "3e-2", "--train.device", "cpu",
            "--train.progress", "false", "--train.sample_tokens", "0", "--train.export_hf", "true", *flags]
    return world(2).run(run_trainer, argv=argv)[0][-1]


def _mean_chosen_logp(model, pairs) -> float:
    """trl's ``logps/chosen`` of ``model`` (a transformers or PEFT model) over the held-out pairs."""
    data = TokenFile(pairs)
    held = held_out_samples(data.num_samples, VAL_FRACTION)
    sums = []
    for i in range(data.num_samples - held, data.num_samples):
        prompt, chosen, _ = data.pair(i)
        ids = torch.cat([prompt, chosen]).long()[None]
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        sums.append(float(logps[len(prompt) - 1:].sum()))
    return sum(sums) / len(sums)


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_a_full_dpo_run_exports_the_trained_model(world, base_and_pairs, tmp_path):
    base, pairs = base_and_pairs
    last = _train(world, base, pairs, tmp_path / "run")
    exported = _hf(tmp_path / "run" / "hf")
    assert type(exported).__name__ == "LlamaForCausalLM" and last["val_rewards/margins"] != 0
    assert math.isclose(_mean_chosen_logp(exported, pairs), last["val_logps/chosen"], rel_tol=1e-4)
    assert not math.isclose(_mean_chosen_logp(_hf(base), pairs), last["val_logps/chosen"], rel_tol=1e-4)


def test_a_lora_dpo_run_exports_a_peft_adapter_and_the_merged_model(world, base_and_pairs, tmp_path):
    peft = pytest.importorskip("peft")
    from mfsdp.cli import main as cli

    base, pairs = base_and_pairs
    run = tmp_path / "run"
    last = _train(world, base, pairs, run, "--peft.method", "lora", "--peft.lora_r", "4")
    assert (run / "hf" / "adapter_config.json").is_file() and not (run / "reference_logps.pt").exists()
    adapted = peft.PeftModel.from_pretrained(_hf(base), run / "hf").eval()
    assert math.isclose(_mean_chosen_logp(adapted, pairs), last["val_logps/chosen"], rel_tol=1e-4)
    assert cli(["export", str(run), str(tmp_path / "merged"), "--peft.merge_on_export", "true"]) == 0
    merged = _hf(tmp_path / "merged")
    assert math.isclose(_mean_chosen_logp(merged, pairs), last["val_logps/chosen"], rel_tol=1e-4)
    assert not math.isclose(_mean_chosen_logp(_hf(base), pairs), last["val_logps/chosen"], rel_tol=1e-4)
