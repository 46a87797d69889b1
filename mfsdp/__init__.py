"""mfsdp: fully sharded data-parallel training for PyTorch.

Public API::

    fully_shard(module, mesh, placements=None, mixed_precision_policy=None, use_symm_mem=False)
    Placements, MixedPrecisionPolicy, CommunicationPolicy
    fully_shard_optimizer(model, optimizer, offload=None), OffloadPolicy
    microbatch(module, is_last)
    FsdpModule, FsdpContext
    mfsdp.float8: enable_fp8_all_gather(model), precompute_fp8_scales(model)  (torchao float8 linears)
"""

from mfsdp.transforms import float8_linear as float8
from mfsdp.api import fully_shard
from mfsdp.communication import CommunicationPolicy
from mfsdp.microbatch import microbatch
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.offload import OffloadPolicy
from mfsdp.optimizer import fully_shard_optimizer
from mfsdp.placement import Placements
from mfsdp.runtime.context import FsdpContext
from mfsdp.runtime.module import FsdpModule, ModulePhase
from mfsdp.runtime.errors import CollectiveMismatchError
from mfsdp.runtime.parameter_group import FsdpParameterGroup

__version__ = "0.1.0"

__all__ = ["fully_shard", "float8", "fully_shard_optimizer", "microbatch", "MixedPrecisionPolicy", "OffloadPolicy",
           "CommunicationPolicy", "Placements", "FsdpModule", "FsdpContext", "FsdpParameterGroup", "ModulePhase",
           "CollectiveMismatchError"]
