"""mfsdp's LoRA against PEFT's on random tiny Hugging Face Llama and Qwen2 directories (CPU, fp32):
the PEFT adapter directory mfsdp writes loads with ``PeftModel.from_pretrained`` and gives mfsdp's
logits; the adapter gradients and two AdamW steps of the bundled model (loaded from the directory)
and of LoRA on the Hugging Face model itself match ``peft.get_peft_model`` with the same weights,
data and targets. Unsharded; the sharded runtime is held to the unsharded model in test_lora.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mfsdp.transforms.lora import LoraTransform, lora_linears
from mfsdp.hf.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mfsdp.transforms.lora_export import hf_target_modules, peft_key, save_peft_adapter
from mfsdp.hf.config import bundled_config_from_hf
from mfsdp.hf.names import load_hf_weights
from mfsdp.models import Llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB, SEQ = 62, 12


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from test_manager_models import make_hf

    root = tmp_path_factory.mktemp("lora_hf")
    for family in ("llama", "qwen2"):
        model = make_hf(family, vocab=VOCAB)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)  # Qwen2's query/key/value biases, far from zero
        model.save_pretrained(root / family)
    return root


def bundled(hf_dir) -> Llama:
    model = Llama(bundled_config_from_hf(hf_dir, SEQ))
    load_hf_weights(model, hf_dir)
    return model


def hf_model(hf_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def lora_model(route: str, hf_dir, lora: LoraTransform):
    """mfsdp's LoRA on the bundled model loaded from ``hf_dir``, or on the Hugging Face model itself
    (the manager route), with nonzero B so that the adapters change the output and A has gradients."""
    model = bundled(hf_dir) if route == "bundled" else hf_model(hf_dir)
    lora.apply(model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, m in lora_linears(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.2)
    return model


def logits_of(model, tokens):
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def tokens_of(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(20 + step))


@pytest.mark.parametrize("family, targets", [("llama", "all-linear"), ("qwen2", "wq,down_proj")])
def test_the_adapter_directory_loads_in_peft_with_our_logits(hf_dirs, tmp_path, family, targets):
    lora = LoraTransform(r=4, alpha=12, target_modules=targets)
    ours = lora_model("bundled", hf_dirs / family, lora).eval()
    save_peft_adapter(ours, lora, tmp_path / "adapter", base_model_name_or_path=str(hf_dirs / family))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias", "use_rslora")} == dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=12, bias="none", use_rslora=False)
    want = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"] if targets == "all-linear" \
        else ["down_proj", "q_proj"]
    assert config["target_modules"] == want
    loaded = peft.PeftModel.from_pretrained(hf_model(hf_dirs / family), tmp_path / "adapter").eval()
    theirs = peft.get_peft_model(hf_model(hf_dirs / family), peft.LoraConfig(r=4, lora_alpha=12, target_modules=want))
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)) == set(peft.get_peft_model_state_dict(theirs))
    tokens = tokens_of(0)
    with torch.no_grad():
        got, expected = logits_of(loaded, tokens), ours(tokens)
    assert float((got - expected).abs().max()) < 1e-5


def adapter_pairs(ours, theirs):
    """(our parameter, PEFT's parameter) of every adapter, matched by PEFT's key."""
    named = dict(theirs.named_parameters())
    pairs = []
    for name, m in lora_linears(ours):
        for which in ("lora_A", "lora_B"):
            key = peft_key(f"{name}.{which}").replace(f".{which}.weight", f".{which}.default.weight")
            pairs.append((getattr(m, which), named[key]))
    assert len(pairs) == sum(p.requires_grad for p in theirs.parameters())  # PEFT trains nothing else
    return pairs


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("route", ["bundled", "hf"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gradients_and_adamw_steps_match_peft(hf_dirs, family, route):
    lora = LoraTransform(r=4, alpha=8, target_modules="all-linear" if family == "llama" else "q_proj,v_proj,w2")
    ours = lora_model(route, hf_dirs / family, lora)
    theirs = peft.get_peft_model(hf_model(hf_dirs / family), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=hf_target_modules(ours)))
    pairs = adapter_pairs(ours, theirs)
    with torch.no_grad():
        for mine, peft_param in pairs:
            peft_param.copy_(mine)
    opts = [torch.optim.AdamW([p for p, _ in pairs], lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW([q for _, q in pairs], lr=1e-2, weight_decay=0.1)]
    worst_grad = 0.0
    for step in range(2):
        tokens = tokens_of(step)
        for model, opt in zip((ours, theirs), opts):
            logits = logits_of(model, tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        worst_grad = max(worst_grad, max(rel(p.grad, q.grad) for p, q in pairs))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert worst_grad < 1e-5
    assert max(rel(p, q) for p, q in pairs) < 1e-5
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)

