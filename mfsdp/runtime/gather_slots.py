"""Persistent gather buffers ("double buffering"): same-size modules take turns in fixed slots.

[Note: gather slots]
By default each group's unsharded buffer is a storage that is re-allocated from the caching
allocator at every unshard and released at every reshard. With ``CommunicationPolicy(double_buffer
=True)`` the repeated modules of a model (the transformer blocks: same numel, same dtype) instead
gather into ``prefetch_depth + 1`` persistent buffers per size, and module ``k`` of that size
*always* uses slot ``k % (prefetch_depth + 1)``.

Why a fixed slot per module rather than "whichever slot is free": autograd saves views of the
unsharded weights in forward (``weight.t()`` for a matmul, for instance) and reads them again in
backward. Those views point at the storage the module had in forward. With a fixed slot, the
module re-gathers into the very same storage before its backward, exactly as the default path does
with its re-allocated storage, so the saved views see the right weights again.

Why ``prefetch_depth + 1``: while module ``k`` computes, modules ``k+1 .. k+depth`` are gathered
ahead; module ``k - 1``, the last to share ``k + depth``'s slot, has been resharded by then. The
same holds in backward order, which is the reverse. A schedule that breaks this (a block called
twice out of order, a module kept unsharded across forward) would overwrite live weights, so an
unshard into a busy slot raises instead, and a *prefetch* into a busy slot is skipped (the module
then gathers just in time, when its slot is free).

Trade-off: the slots are never freed, so resting memory grows by ``(depth + 1)`` block-sized
gather buffers. The root (which keeps its weights from forward into backward) and sizes shared by
no more than ``depth + 1`` modules (an untied embedding and head) keep the allocator path. In exchange no storage is allocated on the hot path, the memory
layout is identical every step, and the slots can be registered once with NCCL
(``use_symm_mem``/``nccl_ub``), which needs buffers that never move.
"""

from __future__ import annotations

import warnings
from typing import Optional, Protocol

import torch

from mfsdp import _compat


class FsdpParameterGroup(Protocol):
    """What a slot needs of the group it serves (``parameter_group.FsdpParameterGroup``)."""

    label: str
    geometry: object

    def gather_key(self) -> Optional[tuple]: ...

    def bind_gather_slot(self, slot: "GatherSlot") -> None: ...


class GatherSlot:
    """One persistent gather buffer, held by at most one group at a time."""

    def __init__(self, tensor: torch.Tensor, label: str) -> None:
        self.tensor = tensor
        self.label = label
        self.holder: Optional["FsdpParameterGroup"] = None

    def is_free_for(self, group: "FsdpParameterGroup") -> bool:
        return self.holder is None or self.holder is group

    def acquire(self, group: "FsdpParameterGroup") -> None:
        if not self.is_free_for(group):
            raise RuntimeError(
                f"mfsdp double_buffer: {group.label} must gather into {self.label}, which "
                f"{self.holder.label} still holds. The schedule keeps more same-size modules unsharded "
                "at once than prefetch_depth + 1 (a module called twice out of order, or one never "
                "resharded). Use CommunicationPolicy(double_buffer=False) for this model."
            )
        self.holder = group

    def release(self, group: "FsdpParameterGroup") -> None:
        if self.holder is group:
            self.holder = None


class GatherSlots:
    """The slots of one context: built once, on the root's first forward."""

    def __init__(self) -> None:
        self.slots: list[GatherSlot] = []
        self._pool = None  # the NCCL memory pool backing registered slots; kept alive with them

    @classmethod
    def build(cls, groups_in_order: list["FsdpParameterGroup"], depth: int, register: bool) -> "GatherSlots":
        """Bind every group whose gather size more than ``depth + 1`` groups share to a fixed slot.

        ``groups_in_order``: gathered groups of the non-root modules, in forward order.
        ``register``: allocate the slots from NCCL's allocator and register them with every gather
        process group (user-buffer / symmetric-memory collectives).
        """
        built, per_size = cls(), depth + 1
        shared = list(slotted(groups_in_order, lambda g: g.gather_key(), depth).items())
        if not shared:
            return built
        specs = [key for key, _ in shared for _ in range(per_size)]
        if register:
            process_groups = {id(pg): pg for _, members in shared for g in members for pg in g.geometry.groups}
            tensors, built._pool = _compat.nccl_registered_buffers(specs, list(process_groups.values()),
                                                                   registration)
        else:
            tensors = [torch.empty(numel, dtype=dtype, device=device) for numel, dtype, device in specs]
        for c, ((numel, dtype, _), members) in enumerate(shared):
            slots = [GatherSlot(t, f"gather slot {i} of size {numel} ({dtype})")
                     for i, t in enumerate(tensors[c * per_size:(c + 1) * per_size])]
            built.slots.extend(slots)
            for k, group in enumerate(members):
                group.bind_gather_slot(slots[k % per_size])
        return built


def slotted(groups_in_order: list, key, depth: int) -> dict:
    """The slot rule, which ``mfsdp.memory`` plans with too: gather size (``key`` of a group) -> its
    groups, for the sizes shared by more than ``depth + 1`` groups. A persistent buffer per module
    would only keep memory that the allocator path frees between uses (an untied embedding and head)."""
    by_key: dict = {}
    for group in groups_in_order:
        by_key.setdefault(key(group), []).append(group)
    return {k: members for k, members in by_key.items() if len(members) > depth + 1}


def registration(group_sizes: list[int], allocator_problem: Optional[str]) -> bool:
    """Whether ``use_symm_mem`` slots come from NCCL's allocator, registered with the gather groups of
    ``group_sizes``. Not where every group is one rank (nothing is sent: persistent plain slots do
    the same work), nor where this torch's NCCL has no allocator (``allocator_problem``: one warning
    and plain persistent slots, the same numbers without registered-buffer collectives)."""
    if all(size == 1 for size in group_sizes):
        return False
    if allocator_problem is not None:
        warnings.warn(f"mfsdp: use_symm_mem / nccl_ub asked for NCCL-registered gather buffers, but {allocator_problem}; "
                      "the gather slots are persistent unregistered buffers instead (the same numbers, ordinary "
                      "collectives). Set use_symm_mem=False (nccl_ub=False) to silence this", stacklevel=2)
        return False
    return True
