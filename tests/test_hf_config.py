"""Hugging Face config.json -> the bundled LlamaConfig: each honoured key carried over, each key the
bundled model cannot represent refused in one line naming it (plain dicts, no transformers needed)."""

from __future__ import annotations

import pytest
import torch

from mfsdp.hf.config import UnsupportedHFConfig, bundled_config_from_hf, supports_bundled
from mfsdp.hf.names import hf_weight_names
from mfsdp.models import Llama, Llama3RopeScaling, param_counts

pytestmark = pytest.mark.timeout(120)

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 256, "attention_bias": False, "mlp_bias": False, "head_dim": 16,
         "tie_word_embeddings": False}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
QWEN2 = {**{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias", "head_dim")},
         "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
         "sliding_window": 4096, "max_window_layers": 28}
MISTRAL = {**{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias")},
           "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None}


def test_llama_keys_are_honoured_in_both_rope_layouts():
    v5 = bundled_config_from_hf({**LLAMA, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}, 32)
    v4 = bundled_config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": {
        **{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"}}, 32)
    assert v5 == v4
    assert (v5.dim, v5.n_layers, v5.n_heads, v5.n_kv_heads, v5.ffn_dim, v5.vocab_size) == (64, 2, 4, 2, 96, 128)
    assert (v5.rope_theta, v5.norm_eps, v5.max_seq_len, v5.qkv_bias, v5.tie_embeddings) == (5e5, 1e-5, 32, False, False)
    assert v5.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    tied = bundled_config_from_hf({**LLAMA, "tie_word_embeddings": True}, 32)
    assert tied.tie_embeddings and tied.rope_scaling is None and tied.rope_theta == 10000.0  # the class default


def test_qwen2_has_qkv_biases_and_a_harmless_window_is_accepted():
    cfg = bundled_config_from_hf({**QWEN2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 64)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6
    # Qwen2.5's own configs: a window recorded but not used, or one longer than the sequences.
    assert supports_bundled({**QWEN2, "sliding_window": 131072}, 64) is None
    assert supports_bundled({**QWEN2, "use_sliding_window": True, "sliding_window": 64}, 64) is None
    assert supports_bundled({**QWEN2, "use_sliding_window": True, "sliding_window": 8,
                             "layer_types": ["full_attention"] * 2}, 64) is None
    # Layers below max_window_layers keep full attention (transformers' rule): here both of them.
    assert supports_bundled({**QWEN2, "use_sliding_window": True, "sliding_window": 8}, 64) is None
    model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]
    names = [hf for hf, _ in hf_weight_names(cfg)]
    assert "model.layers.1.self_attn.k_proj.bias" in names and "model.layers.1.self_attn.o_proj.bias" not in names
    assert {b for _, b in hf_weight_names(cfg)} == set(dict(model.named_parameters()))


def test_mistral_without_window_and_a_window_longer_than_the_sequences():
    assert supports_bundled(MISTRAL, 64) is None
    assert supports_bundled({**MISTRAL, "sliding_window": 4096}, 64) is None
    no_key = {k: v for k, v in MISTRAL.items() if k != "sliding_window"}  # the class default: 4096
    assert supports_bundled(no_key, 4096) is None and "sliding_window=4096" in supports_bundled(no_key, 8192)


def test_tied_names_list_the_embedding_once():
    cfg = bundled_config_from_hf({**LLAMA, "tie_word_embeddings": True}, 32)
    pairs = hf_weight_names(cfg)
    assert "lm_head.weight" not in dict(pairs) and len(pairs) == len(set(pairs))
    assert {b for _, b in pairs} == set(dict(Llama(cfg).named_parameters()))


REFUSED = [
    ({**LLAMA, "model_type": "gemma"}, "model_type='gemma'"),
    ({**LLAMA, "architectures": ["LlamaForSequenceClassification"]},
     "architectures='LlamaForSequenceClassification'"),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn'"),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
    ({**LLAMA, "rope_parameters": {"rope_type": "default"}, "rope_scaling": LLAMA3},
     "rope_scaling.rope_type='llama3'"),
    ({**LLAMA, "rope_parameters": {**LLAMA3, "factor": None}}, "rope_parameters.factor=None"),
    ({**LLAMA, "attention_bias": True}, "attention_bias=True"),
    ({**LLAMA, "mlp_bias": True}, "mlp_bias=True"),
    ({**LLAMA, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**LLAMA, "head_dim": 32}, "head_dim=32"),
    ({**LLAMA, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({**LLAMA, "attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq"}}, "quantization_config='gptq'"),
    ({**{k: v for k, v in LLAMA.items() if k != "hidden_size"}}, "hidden_size=None"),
    ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({**LLAMA, "num_attention_heads": 8, "head_dim": None, "hidden_size": 40}, "model_type='llama'"),
    ({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "use_sliding_window=True"),
    ({**QWEN2, "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention"]}, "use_sliding_window=True"),
    ({**MISTRAL, "sliding_window": 8}, "sliding_window=8"),
]


@pytest.mark.parametrize("config,named", REFUSED, ids=[n.split("=")[0] + str(i) for i, (_, n) in enumerate(REFUSED)])
def test_unrepresentable_keys_are_refused_in_one_line(config, named):
    with pytest.raises(UnsupportedHFConfig) as err:
        bundled_config_from_hf(config, 64)
    message = str(err.value)
    assert message.startswith(named) and "\n" not in message, message
    assert isinstance(err.value, ValueError)
    assert supports_bundled(config, 64) == message


def test_config_is_read_from_a_directory_and_from_a_transformers_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert bundled_config_from_hf(tmp_path, 32) == bundled_config_from_hf(LLAMA, 32)
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=128)
    assert bundled_config_from_hf(config, 32).qkv_bias


def test_llama3_scaling_rescales_only_the_long_wavelengths():
    from mfsdp.models.llama import rotary_tables

    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    plain_cos, _ = rotary_tables(16, 32, 5e5)
    cos, _ = rotary_tables(16, 32, 5e5, scaling=scaling)
    # head_dim 16: wavelengths 2*pi (< 64/4: kept), ~33 (between: smoothed), the rest (> 64: / 8).
    assert torch.equal(cos[:, 0], plain_cos[:, 0])
    assert not torch.allclose(cos[:, 1:], plain_cos[:, 1:])
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        Llama3RopeScaling(8.0, 4.0, 1.0, 64)
