"""mfsdp.manager: a drop-in for NeMo Automodel's Megatron-FSDP manager, built on mfsdp's public API.

::

    mesh = build_device_mesh("cuda", tp_size=1, dp_replicate_size=1)
    model, optimizer = MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(model, optimizer)

See ``docs/manager.md``.
"""

import logging

from mfsdp.manager.config import MegatronFSDPConfig
from mfsdp.manager.context_parallel import attention_context, shard_sequence, shift_labels, use_causal_sdpa
from mfsdp.manager.core_options import communication_policy, dp_placements, precision_policy, resolve_unit_modules
from mfsdp.hf.sharded import (init_weights_shard_local, load_hf_weights, materialize_meta_buffers,
                              meta_model_from_config, save_hf_checkpoint)
from mfsdp.manager.manager import (MegatronFSDPManager, MegatronFSDPModel, NonFiniteGradientError,
                                   fully_shard_optimizer, maybe_shard_optimizer)
from mfsdp.manager.mesh import MESH_DIM_NAMES, build_device_mesh, build_device_mesh_from_config
from mfsdp.manager.param_attrs import restore_distributed_param_attrs, snapshot_distributed_param_attrs
from mfsdp.mesh import resolve_sizes

HAS_MEGATRON_FSDP = True
"""Always True: the backend is mfsdp itself, which is importable wherever this module is."""

logger = logging.getLogger("mfsdp.manager")

__all__ = ["MegatronFSDPConfig", "use_causal_sdpa", "MegatronFSDPManager", "MegatronFSDPModel",
           "NonFiniteGradientError", "fully_shard_optimizer", "maybe_shard_optimizer",
           "snapshot_distributed_param_attrs", "restore_distributed_param_attrs", "HAS_MEGATRON_FSDP", "logger",
           "MESH_DIM_NAMES", "build_device_mesh", "build_device_mesh_from_config", "resolve_sizes", "dp_placements",
           "precision_policy", "resolve_unit_modules", "communication_policy", "load_hf_weights", "save_hf_checkpoint",
           "init_weights_shard_local", "materialize_meta_buffers", "meta_model_from_config", "shard_sequence",
           "shift_labels", "attention_context"]
