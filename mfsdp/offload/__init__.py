"""Optimizer offload: the master weights and optimizer states of chosen units live in host memory
and step there, overlapped with backward (``fully_shard_optimizer(..., offload=OffloadPolicy())``).

Rooms: ``policy`` (what to offload, and the pure rules the planner calls too), ``host`` (masters,
states, backup), ``staging`` (the pinned ring the gradients pass through), ``speculation`` (steps
started in backward, checked in ``step``) and ``step`` (the coordinator). The design and its
argument for exact clipping are in ``docs/design.md`` (Offload)."""

from mfsdp.offload.policy import OffloadPolicy
from mfsdp.offload.step import OffloadedStep, bind, offload_of

__all__ = ["OffloadPolicy", "OffloadedStep", "bind", "offload_of"]
