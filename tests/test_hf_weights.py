"""Hugging Face weights in the bundled Llama: the logits of transformers' own forward (fp32, eager
attention) for Llama 3.1 (llama3 rotary scaling, grouped-query attention, tied and untied) and Qwen2
(query/key/value biases, rope_theta 1e6); the same logits from a zero3-sharded load on 2 gloo
ranks; each bad checkpoint refused in one line naming the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mfsdp.hf.config import bundled_config_from_hf
from mfsdp.hf.files import HFWeightsError
from mfsdp.hf.names import hf_weight_names, load_hf_weights
from mfsdp.models import Llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::UserWarning")]

SEQ = 24
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=101, rms_norm_eps=1e-5)
# original_max_position_embeddings 64 puts the 8 frequencies of a 16-wide head in all three
# regimes of the llama3 rule: kept (wavelength 2 pi < 16), smoothed (~33) and divided (> 64).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _llama_config(tied: bool):
    rope = {"rope_scaling": LLAMA3, "rope_theta": 500000.0}
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope = {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}
    return transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tied, **rope)


def _save(config, path, seed: int, biases: bool = False, max_shard_size=None):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and biases:
                p.normal_(0.0, 0.5)  # far from the zeros a forgotten bias would be
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not ones: a norm loaded in the wrong place shows
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    qwen = transformers.Qwen2Config(**SHAPE, rope_theta=1e6) if int(transformers.__version__[0]) < 5 else \
        transformers.Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    models = {
        "llama": _save(_llama_config(tied=False), root / "llama", 0),
        "llama_tied": _save(_llama_config(tied=True), root / "llama_tied", 1),
        "qwen2": _save(qwen, root / "qwen2", 2, biases=True),
    }
    shutil.copytree(root / "llama", root / "llama_index")
    (root / "llama_index" / "model.safetensors").unlink()
    models["llama"].save_pretrained(root / "llama_index", max_shard_size="40KB")  # several files + index
    models["llama_index"] = models["llama"]
    return root, models


def _tokens():
    return torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "llama_index"])
def test_logits_match_transformers(hf_dirs, name):
    root, models = hf_dirs
    if name == "llama_index":
        assert (root / name / "model.safetensors.index.json").is_file()
    cfg = bundled_config_from_hf(root / name, SEQ)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.tie_embeddings == (name == "llama_tied")
    assert (cfg.rope_scaling is not None) == name.startswith("llama")
    model = Llama(cfg)
    load_hf_weights(model, root / name)
    tokens = _tokens()
    with torch.no_grad():
        ours, theirs = model(tokens), models[name](tokens).logits
    assert _rel(ours, theirs) < 1e-5
    # The names cover the checkpoint exactly (a tied checkpoint holds no lm_head).
    assert {hf for hf, _ in hf_weight_names(cfg)} == set(models[name].state_dict()) - (
        {"lm_head.weight"} if cfg.tie_embeddings else set())


def test_llama3_scaling_is_what_makes_the_logits_match(hf_dirs):
    """Without the rescaled frequencies the same weights give other logits: the test above sees them."""
    import dataclasses

    root, models = hf_dirs
    cfg = dataclasses.replace(bundled_config_from_hf(root / "llama", SEQ), rope_scaling=None)
    model = Llama(cfg)
    load_hf_weights(model, root / "llama")
    with torch.no_grad():
        assert _rel(model(_tokens()), models["llama"](_tokens()).logits) > 1e-3


def _write_without(src, dst, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for key in drop:
        del tensors[key]
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_a_bad_checkpoint_is_refused_naming_the_tensor(hf_dirs, tmp_path):
    root, _ = hf_dirs
    cfg = bundled_config_from_hf(root / "llama", SEQ)
    _write_without(root / "llama", tmp_path / "missing", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(HFWeightsError, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight \(for "
                       r"layers\.1\.feed_forward\.w3\.weight\)"):
        load_hf_weights(Llama(cfg), tmp_path / "missing")
    _write_without(root / "llama", tmp_path / "extra", add={"model.layers.0.self_attn.o_proj.bias": torch.ones(64)})
    with pytest.raises(HFWeightsError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias has no place"):
        load_hf_weights(Llama(cfg), tmp_path / "extra")
    config = json.loads((root / "llama" / "config.json").read_text())
    wider = bundled_config_from_hf({**config, "intermediate_size": 128}, SEQ)
    with pytest.raises(HFWeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in model\.safetensors has shape \(96, 64\), "
                       r"the bundled layers\.0\.feed_forward\.w1\.weight \(128, 64\)") as err:
        load_hf_weights(Llama(wider), root / "llama")
    assert "\n" not in str(err.value)
    with torch.device("meta"):
        meta = Llama(cfg)
    with pytest.raises(HFWeightsError, match="still on the meta device"):
        load_hf_weights(meta, root / "llama")
    with pytest.raises(HFWeightsError, match="neither model.safetensors"):
        load_hf_weights(Llama(cfg), tmp_path)


# --------------------------------------------------------------------------- sharded (2 ranks)
def sharded_load(rank, ws, hf_dir, seq, tokens, checkpointing):
    """Meta build -> zero3 parallelize -> to_empty -> load_hf_weights; logits, and one backward of
    the labels loss over packed documents (gathered gradients), on every rank."""
    from mfsdp.mesh import build_mesh
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    cfg = bundled_config_from_hf(hf_dir, seq)
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize(model, build_mesh("cpu", ws), ParallelizeConfig("zero3", activation_checkpointing=checkpointing))
    model.to_empty(device="cpu")
    load_hf_weights(model, hf_dir)
    local = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(tokens)
    loss, count = model(tokens, *_packed(tokens))
    (loss / count).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return logits, float(loss), int(count), grads, local


def _packed(tokens):
    """Positions, document ids and labels of two documents per row (split at 9 and at 15)."""
    batch, seq = tokens.shape
    split = torch.tensor([9, 15])[:, None]
    index = torch.arange(seq)[None].expand(batch, seq)
    documents = (index >= split).long()
    positions = torch.where(index >= split, index - split, index)
    labels = torch.roll(tokens, -1, dims=1)
    labels[index == split - 1] = -100  # no document predicts the next one's first token
    labels[:, -1] = -100
    return positions, documents, labels


@pytest.mark.parametrize("name,checkpointing", [("llama", False), ("qwen2", True)])
def test_sharded_load_gives_the_unsharded_logits_and_gradients(world, hf_dirs, name, checkpointing):
    root, _ = hf_dirs
    tokens = _tokens()
    out = world(2).run(sharded_load, hf_dir=str(root / name), seq=SEQ, tokens=tokens, checkpointing=checkpointing)
    cfg = bundled_config_from_hf(root / name, SEQ)
    ref = Llama(cfg)
    load_hf_weights(ref, root / name)
    with torch.no_grad():
        logits = ref(tokens)
    loss, count = ref(tokens, *_packed(tokens))
    (loss / count).backward()
    total = sum(p.numel() for p in ref.parameters())
    for got_logits, got_loss, got_count, grads, local in out:
        assert local < 0.6 * total  # each rank holds about half
        assert _rel(got_logits, logits) < 1e-5
        assert got_count == int(count) and abs(got_loss - float(loss)) < 1e-5 * float(loss)
        for n, p in ref.named_parameters():
            assert _rel(grads[n], p.grad) < 1e-5, n
