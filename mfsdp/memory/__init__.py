"""Memory planner: predict every rank's peak memory of a training step before launch.

``estimate`` sizes model state with the runtime's own layout code and measures activations on fake
tensors; ``mfsdp plan`` (``mfsdp.memory.plan``) prints the breakdown and the settings that fit.
``checkpoint_bytes`` sizes a training checkpoint on disk from the same model state.
"""

from mfsdp.memory.api import checkpoint_bytes, estimate, mesh_for
from mfsdp.memory.estimate import COMPONENTS, MemoryEstimate, Phase, StepSettings
from mfsdp.memory.tensor_parallel import TensorParallel

__all__ = ["COMPONENTS", "MemoryEstimate", "Phase", "StepSettings", "TensorParallel", "checkpoint_bytes", "estimate",
           "mesh_for"]
