"""Models that know nothing about parallelism, and the FLOP counting that goes with them.

``mfsdp.models.parallelize`` (imported on its own) applies mfsdp sharding to them; ``mfsdp.hf``
runs Llama-family Hugging Face checkpoints (Llama, Qwen2, Mistral) as the bundled ``Llama``.
"""

from mfsdp.models.flops import flops_per_token, mfu, param_counts, peak_flops
from mfsdp.models.llama import (PRESETS, Block, Llama, Llama3RopeScaling, LlamaConfig, get_config,
                                plain_linear_cross_entropy)
from mfsdp.models.moe import MoEFeedForward, MoELlama, build_model

__all__ = ["Block", "Llama", "Llama3RopeScaling", "LlamaConfig", "MoEFeedForward", "MoELlama", "PRESETS",
           "build_model", "get_config", "plain_linear_cross_entropy", "flops_per_token", "mfu", "param_counts",
           "peak_flops"]
