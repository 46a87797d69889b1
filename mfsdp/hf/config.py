"""A Hugging Face ``config.json`` as the bundled model's ``LlamaConfig``: every key that changes the
forward is honoured or refused, never ignored.

The bundled ``Llama`` (compiled blocks, FP8, document masks, a memory plan that predicts it) runs
``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM`` checkpoints once their weights
are loaded into it (``mfsdp.hf.names``). ``bundled_config_from_hf`` translates the config;
whatever the bundled model cannot represent raises ``UnsupportedHFConfig``, one line naming the key
and its value. ``supports_bundled`` gives the same verdict as a value, for a caller that picks
between this route and the manager (which runs the Hugging Face modeling code itself).

Honoured: the shape (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``vocab_size``), ``rope_theta``, ``rms_norm_eps``,
``tie_word_embeddings``, ``initializer_range``, ``head_dim`` when it is ``hidden_size /
num_attention_heads``, rotary scaling of ``rope_type`` llama3, Qwen2's query/key/value biases, and
a sliding window no shorter than the sequences trained on (it then masks nothing).

Refused: another ``model_type`` or architecture, other rotary types (linear, dynamic, yarn,
longrope...), ``partial_rotary_factor`` below 1, ``attention_bias`` (Llama: the output projection's
bias too) and ``mlp_bias``, a ``hidden_act`` other than silu, a ``head_dim`` of another width,
``attention_dropout``, a sliding window shorter than the sequences, and ``quantization_config``.

Both layouts of the rotary keys are read: transformers 4.x (``rope_theta``, ``rope_scaling``) and
5.x (``rope_parameters``). A key the file lacks takes the transformers class's default
(``_DEFAULTS``), as ``from_pretrained`` would give it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from mfsdp.models.llama import Llama3RopeScaling, LlamaConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
"""``model_type`` -> the causal-LM architecture the bundled model can stand in for."""

_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "initializer_range": 0.02, "attention_dropout": 0.0}
_DEFAULTS = {  # transformers' class defaults (4.x and 5.x agree) of the keys read below
    "llama": {**_COMMON, "num_key_value_heads": None, "attention_bias": False, "mlp_bias": False},
    "qwen2": {**_COMMON, "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "mistral": {**_COMMON, "num_key_value_heads": 8, "sliding_window": 4096},
}
_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_MANAGER = "train it through the manager (Hugging Face's own modeling code)"


class UnsupportedHFConfig(ValueError):
    """A Hugging Face config the bundled Llama cannot represent; the message is one line that names
    the key, its value and why."""

    def __init__(self, key: str, value, why: str) -> None:
        self.key, self.value = key, value
        super().__init__(f"{key}={value!r}: {why}")


def load_hf_config(source) -> dict:
    """The config as a dict: a dict as it is, a transformers config through ``to_dict()``, or the
    ``config.json`` of a model directory (or the file itself)."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{source}: no config.json there (a local Hugging Face model directory "
                                "is needed)")
    return json.loads(path.read_text())


def supports_bundled(config, max_seq_len: int | None = None) -> str | None:
    """None when the bundled Llama can run this config, else the one-line reason.

    ``max_seq_len``: the longest sequence to be trained; a sliding window at least that long masks
    nothing. None checks against the config's ``max_position_embeddings``.
    """
    c = load_hf_config(config)
    length = max_seq_len or c.get("max_position_embeddings") or 4096
    try:
        bundled_config_from_hf(c, int(length))
    except UnsupportedHFConfig as err:
        return str(err)
    return None


def bundled_config_from_hf(source, max_seq_len: int) -> LlamaConfig:
    """The ``LlamaConfig`` of the bundled model equivalent to a Hugging Face config, with rotary
    tables for ``max_seq_len`` tokens; raises ``UnsupportedHFConfig`` (a ValueError) naming the first
    key it cannot honour."""
    c = load_hf_config(source)
    model_type = c.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedHFConfig("model_type", model_type, "the bundled Llama stands in for "
                                  f"{', '.join(ARCHITECTURES)} only; {_MANAGER}")
    for architecture in c.get("architectures") or ():
        if architecture not in ARCHITECTURES.values():
            raise UnsupportedHFConfig("architectures", architecture, "the bundled Llama is a causal LM "
                                      f"like {', '.join(ARCHITECTURES.values())}; {_MANAGER}")
    defaults = _DEFAULTS[model_type]

    def get(key: str):
        return c[key] if key in c else defaults.get(key)

    missing = [key for key in _SHAPE if c.get(key) is None]
    if missing:
        raise UnsupportedHFConfig(missing[0], None, "config.json lacks this shape key; is it a "
                                  "complete Hugging Face config?")
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    _refuse_unrepresentable(c, model_type, get, dim, heads)
    theta, scaling = _rotary(c, get)
    _refuse_short_window(c, model_type, get, max_seq_len)
    try:
        return LlamaConfig(
            dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
            n_kv_heads=get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
            vocab_size=c["vocab_size"], max_seq_len=max_seq_len, rope_theta=float(theta),
            norm_eps=float(get("rms_norm_eps")), init_std=float(get("initializer_range")),
            tie_embeddings=bool(get("tie_word_embeddings")), qkv_bias=model_type == "qwen2",
            rope_scaling=scaling)
    except ValueError as err:  # the shape checks of LlamaConfig, e.g. an odd head width
        raise UnsupportedHFConfig("model_type", model_type, f"this shape does not build the bundled "
                                  f"Llama ({err})") from None


def _refuse_unrepresentable(c: dict, model_type: str, get, dim: int, heads: int) -> None:
    if get("hidden_act") != "silu":
        raise UnsupportedHFConfig("hidden_act", get("hidden_act"), "the bundled feed-forward is SwiGLU "
                                  f"(silu); {_MANAGER}")
    for key, why in (("attention_bias", "biases on all four attention projections, and the bundled output "
                      "projection has none"), ("mlp_bias", "the bundled feed-forward has no biases")):
        if model_type == "llama" and get(key):
            raise UnsupportedHFConfig(key, get(key), f"{why}; {_MANAGER}")
    kv_heads = get("num_key_value_heads") or heads
    if dim % heads or heads % kv_heads:
        key, value = ("num_attention_heads", heads) if dim % heads else ("num_key_value_heads", kv_heads)
        raise UnsupportedHFConfig(key, value, f"the bundled attention needs num_key_value_heads | "
                                  f"num_attention_heads | hidden_size ({kv_heads}, {heads}, {dim})")
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * heads != dim:
        raise UnsupportedHFConfig("head_dim", head_dim, f"the bundled attention's heads are hidden_size / "
                                  f"num_attention_heads = {dim / heads:g} wide; {_MANAGER}")
    if get("attention_dropout"):
        raise UnsupportedHFConfig("attention_dropout", get("attention_dropout"), "the bundled attention has "
                                  "no dropout; set it to 0.0 in config.json")
    if c.get("quantization_config"):
        raise UnsupportedHFConfig("quantization_config", c["quantization_config"].get("quant_method", "?")
                                  if isinstance(c["quantization_config"], Mapping) else c["quantization_config"],
                                  "quantized weights cannot be loaded for training; use the unquantized "
                                  "checkpoint")


def _rotary(c: dict, get) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from 5.x ``rope_parameters`` or 4.x ``rope_scaling``."""
    params, legacy = c.get("rope_parameters"), c.get("rope_scaling")
    key = "rope_parameters" if params else "rope_scaling"
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedHFConfig("rope_parameters", sorted(params), "rotary parameters per layer type; "
                                  f"the bundled Llama has one set; {_MANAGER}")
    legacy = legacy if isinstance(legacy, Mapping) else {}
    params = params if isinstance(params, Mapping) else {}
    types = [r.get("rope_type", r.get("type")) or "default" for r in (legacy, params) if r]
    if len(set(types)) > 1:
        raise UnsupportedHFConfig("rope_scaling.rope_type", types[0], f"disagrees with rope_parameters."
                                  f"rope_type={types[1]!r}; keep one of the two in config.json")
    rope = {**legacy, **params}
    rope_type = types[-1] if types else "default"
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedHFConfig("partial_rotary_factor", partial, "the bundled Llama rotates whole "
                                  f"heads; {_MANAGER}")
    theta = rope.get("rope_theta", get("rope_theta"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedHFConfig(f"{key}.rope_type", rope_type, "the bundled Llama has the default and "
                                  f"llama3 rotary frequencies only; {_MANAGER}")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [f for f in fields if rope.get(f) is None]
    if absent:
        raise UnsupportedHFConfig(f"{key}.{absent[0]}", None, "llama3 rotary scaling needs factor, "
                                  "low_freq_factor, high_freq_factor and original_max_position_embeddings")
    try:
        return theta, Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    except ValueError as err:
        raise UnsupportedHFConfig(key, {f: rope[f] for f in fields}, str(err)) from None


def _refuse_short_window(c: dict, model_type: str, get, max_seq_len: int) -> None:
    """A sliding window masks a token's keys further back than ``sliding_window`` positions: nothing
    within ``max_seq_len`` tokens when the window is at least that long, which the bundled model
    then matches; a shorter one it cannot represent."""
    if model_type == "mistral":
        key, window, sliding = "sliding_window", get("sliding_window"), True
    elif model_type == "qwen2" and get("use_sliding_window"):
        key, window = "use_sliding_window", get("sliding_window")
        layer_types = c.get("layer_types")
        sliding = ("sliding_attention" in layer_types if layer_types
                   else c["num_hidden_layers"] > get("max_window_layers"))
    else:
        return
    if sliding and window is not None and max_seq_len > window:
        value = window if key == "sliding_window" else True
        raise UnsupportedHFConfig(key, value, f"attention limited to the last {window} tokens, shorter than "
                                  f"the {max_seq_len} trained on; train on sequences of at most {window} "
                                  f"tokens or {_MANAGER}")


def hf_config_of(cfg: LlamaConfig) -> dict:
    """The Hugging Face ``config.json`` of the bundled model of ``cfg``: ``LlamaForCausalLM``
    (``Qwen2ForCausalLM`` with the query/key/value biases, ``MixtralForCausalLM`` with experts), the
    inverse of ``bundled_config_from_hf``; its ``dtype`` keys are the export's to stamp."""
    model_type = "mixtral" if cfg.num_experts else "qwen2" if cfg.qkv_bias else "llama"
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    config = {
        "architectures": [ARCHITECTURES.get(model_type, "MixtralForCausalLM")], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope if cfg.rope_scaling is not None else None, "rope_parameters": rope,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "use_cache": True, "bos_token_id": None, "eos_token_id": None, "dtype": None, "torch_dtype": None,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    else:
        config.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, output_router_logits=False,
                      router_aux_loss_coef=cfg.moe_aux_loss_coef, router_jitter_noise=0.0, sliding_window=None)
    return config
