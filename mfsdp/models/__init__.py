"""Models that know nothing about parallelism, and the FLOP counting that goes with them.

``mfsdp.models.parallelize`` (imported on its own) applies mfsdp sharding to them.
"""

from mfsdp.models.flops import flops_per_token, mfu, param_counts, peak_flops
from mfsdp.models.llama import (PRESETS, Block, Llama, Llama3RopeScaling, LlamaConfig, cross_entropy_sum,
                                get_config)
from mfsdp.models.moe import MoEFeedForward, MoELlama, build_model

__all__ = ["Block", "Llama", "Llama3RopeScaling", "LlamaConfig", "MoEFeedForward", "MoELlama", "PRESETS",
           "build_model", "cross_entropy_sum", "get_config",
           "flops_per_token", "mfu", "param_counts", "peak_flops"]
