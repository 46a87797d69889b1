"""Hugging Face weights for the bundled Llama: the one table of names, and a loader that reads only
each rank's own rows.

``hf_weight_names(cfg)`` is the one mapping between the bundled parameter names and those of
``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (its query/key/value biases) and ``MistralForCausalLM``,
and ``MixtralForCausalLM`` for the mixtures of experts, in both directions: the loader reads it, and
an exporter writes it, and LoRA names a block's linears by its pairs (``hf_module_name``,
``bundled_module_name``). A tied head appears once, as the embedding. The bundled attention uses
the same rotate-half rotary layout as these models, so no weight is permuted. The names are those of
the transformers 5 model: a mixture of experts' stacked experts pair with Mixtral's stacked
``mlp.experts.gate_up_proj`` and ``down_proj``, which its files store per expert under
``block_sparse_moe`` (``experts.3.w1.weight``), by the rule of ``mfsdp.hf.moe_names`` that the
manager's loader and every export follow (``hf_layout``).

``load_hf_weights(model, hf_dir)`` fills a model that was built on the meta device, sharded
(``mfsdp.models.parallelize``, or any DTensor sharding on dim boundaries) and materialised with
``to_empty``, or a plain unsharded one. For each parameter it reads just the block of the global
tensor this rank holds from the safetensors file (``mfsdp.hf.files.read_local``), cast into the
local shard. One tensor at a time, no collective: no rank ever holds the whole model, and
every rank checks the same files, so a bad checkpoint fails alike everywhere, before any write.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mfsdp.transforms.adapter_names import is_adapter
from mfsdp.hf.files import HFWeightsError, WeightFiles, read_local
from mfsdp.hf.moe_names import LAYOUTS, ExpertLayout
from mfsdp.hf.sharded import file_keys
from mfsdp.models.llama import Llama, LlamaConfig


_LAYER = (("attention_norm.weight", "input_layernorm.weight"),
          ("attention.wq.weight", "self_attn.q_proj.weight"),
          ("attention.wk.weight", "self_attn.k_proj.weight"),
          ("attention.wv.weight", "self_attn.v_proj.weight"),
          ("attention.wo.weight", "self_attn.o_proj.weight"),
          ("ffn_norm.weight", "post_attention_layernorm.weight"))
_QKV_BIAS = {f"attention.w{x}.weight": (f"attention.w{x}.bias", f"self_attn.{x}_proj.bias")
             for x in "qkv"}  # Qwen2's, each listed right after its weight
_DENSE_FFN = (("feed_forward.w1.weight", "mlp.gate_proj.weight"),
              ("feed_forward.w3.weight", "mlp.up_proj.weight"),
              ("feed_forward.w2.weight", "mlp.down_proj.weight"))
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints saved; rebuilt here
LINEARS = {m.removesuffix(".weight"): t.removesuffix(".weight") for m, t in _LAYER + _DENSE_FFN if "norm" not in m}
"""A bundled block's linears by their name in the block -> the Hugging Face Llama/Qwen2/Mistral name."""


def hf_module_name(name: str) -> str:
    """The Hugging Face name of the bundled model's module ``name`` (``layers.0.attention.wq`` ->
    ``model.layers.0.self_attn.q_proj``); any other name (a Hugging Face model's own) as it is."""
    return _renamed(name, "", "model.", LINEARS)


def bundled_module_name(name: str) -> str:
    """The bundled name of the Hugging Face module ``name``, the inverse of ``hf_module_name``."""
    return _renamed(name, "model.", "", {t: m for m, t in LINEARS.items()})


def _renamed(name: str, prefix: str, to: str, table: dict[str, str]) -> str:
    m = re.fullmatch(re.escape(prefix) + r"layers\.(\d+)\.(.+)", name)
    return f"{to}layers.{m[1]}.{table[m[2]]}" if m and m[2] in table else name


def hf_layout(cfg: LlamaConfig) -> ExpertLayout | None:
    """How the Hugging Face files of the bundled model of ``cfg`` store its experts (Mixtral's
    per-expert names, ``mfsdp.hf.moe_names``); None for a dense model."""
    return LAYOUTS["mixtral"] if cfg.num_experts else None


def hf_weight_names(cfg: LlamaConfig) -> list[tuple[str, str]]:
    """``(hf_name, bundled_name)`` for every tensor of the bundled model of ``cfg``, in the order
    Hugging Face lists them (embedding, layers, final norm, head); the Hugging Face names are the
    transformers 5 model's (its files' names: ``hf_layout``)."""
    pairs = [("model.embed_tokens.weight", "tok_embeddings.weight")]
    for i in range(cfg.n_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, t in _LAYER:
            pairs.append((theirs + t, mine + m))
            if cfg.qkv_bias and m in _QKV_BIAS:
                m_bias, t_bias = _QKV_BIAS[m]
                pairs.append((theirs + t_bias, mine + m_bias))
        if cfg.num_experts:
            pairs += [(theirs + "mlp.gate.weight", mine + "feed_forward.router.weight"),
                      (theirs + "mlp.experts.gate_up_proj", mine + "feed_forward.experts.gate_up_proj"),
                      (theirs + "mlp.experts.down_proj", mine + "feed_forward.experts.down_proj")]
        else:
            pairs += [(theirs + t, mine + m) for m, t in _DENSE_FFN]
    pairs.append(("model.norm.weight", "norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "output.weight"))
    return pairs


@torch.no_grad()
def load_hf_weights(model: Llama, hf_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint's weights into ``model``'s parameters (their local shards when
    sharded) and rebuild the rotary tables (LoRA adapters, which a base checkpoint lacks, are left to
    LoRA's ``init_adapters``); raises ``HFWeightsError`` naming every tensor that is
    missing, of another shape, or left over, before anything is written."""
    params = dict(model.named_parameters())  # a tied matrix once, as the embedding
    names = hf_weight_names(model.cfg)
    unfilled = sorted(set(params) - {name for _, name in names} - set(filter(is_adapter, params)))
    if unfilled:
        raise HFWeightsError(f"the bundled model's {unfilled[0]} has no Hugging Face name (a model "
                             f"{type(model).__name__} these weights cannot fill)")
    layout = hf_layout(model.cfg)
    with WeightFiles(hf_dir) as files:  # check everything before writing anything
        wanted = [(file_keys(files, [hf], params[name].shape, "model", layout), params[name], name,
                   f"{hf} (for {name})") for hf, name in names]
        plan, missing, mismatched, used = files.match(wanted, "the bundled")
        used |= {"lm_head.weight"} if model.cfg.tie_embeddings else set()  # some tied checkpoints keep a copy
        extra = sorted(k for k in files.files if k not in used and not k.endswith(_IGNORED_SUFFIXES))
        if missing or mismatched or extra:  # a left-over tensor would be a trained weight dropped
            raise HFWeightsError.of(hf_dir, missing=missing, mismatched=mismatched, extra=extra,
                                    model="the bundled model")
        for tensor, found, name in plan:
            read_local(tensor, found, name)
    model.reset_rotary_tables()
