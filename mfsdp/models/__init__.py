"""Models that know nothing about parallelism, and the FLOP counting that goes with them.

``mfsdp.models.parallelize`` (imported on its own) applies mfsdp sharding to them.
``mfsdp.models.hf_config`` and ``mfsdp.models.hf_weights`` run Llama-family Hugging Face
checkpoints (Llama, Qwen2, Mistral) as the bundled ``Llama``.
"""

from mfsdp.models.flops import flops_per_token, mfu, param_counts, peak_flops
from mfsdp.models.hf_config import UnsupportedHFConfig, bundled_config_from_hf, supports_bundled
from mfsdp.models.hf_weights import HFWeightsError, hf_weight_names, load_hf_weights
from mfsdp.models.llama import (PRESETS, Block, Llama, Llama3RopeScaling, LlamaConfig, get_config,
                                plain_linear_cross_entropy)
from mfsdp.models.moe import MoEFeedForward, MoELlama, build_model

__all__ = ["Block", "HFWeightsError", "Llama", "Llama3RopeScaling", "LlamaConfig", "MoEFeedForward",
           "MoELlama", "PRESETS", "UnsupportedHFConfig", "build_model", "bundled_config_from_hf",
           "get_config", "hf_weight_names", "load_hf_weights", "plain_linear_cross_entropy",
           "supports_bundled", "flops_per_token", "mfu", "param_counts", "peak_flops"]
