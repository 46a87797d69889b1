"""``OffloadPolicy`` (which units' optimizer step runs on the host, and how it overlaps backward)
and the pure rules that follow from it, which the planner (``mfsdp.memory``) calls too: which units
a fraction offloads, and the host bytes that costs. Nothing here needs torch."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Which units' optimizer step runs on the host (``fully_shard_optimizer(..., offload=...)``).

    Give ``fraction`` or ``units``, not both; with neither, every unit is offloaded."""

    fraction: Optional[float] = None
    """Share of the units (FSDP modules holding trainable parameters of the optimizer) to offload,
    in (0, 1], counted from the units whose gradients finish first in backward: the last blocks and
    a separately sharded head first, the root (embedding) last. Rounded up to whole units; the
    order is the reverse of the modules' registration order (``model.named_modules()``)."""
    units: Optional[tuple[str, ...]] = None
    """Names of the units to offload, as ``model.named_modules()`` names them ("" is the root)."""
    pin_memory: bool = True
    """Page-lock the host master weights and the staging buffer (fast, asynchronous copies).
    Ignored where the parameters are not on CUDA."""
    threads: Optional[int] = None
    """CPU threads for the host step (``torch.set_num_threads`` around it, restored after);
    None keeps torch's setting."""
    overlap: str = "step"
    """When the offloaded groups' work runs (``docs/design.md``, Offload): "step": each group's gradient
    copy and a speculative CPU step start when its last-microbatch reduction is issued, during
    backward, and ``step()`` validates them (exact; host memory for a backup of the master weights
    and states); "copy": the gradients stream down during backward, the CPU steps run in
    ``step()``; "none": everything in ``step()``, group after group (the serialized version)."""
    staging_buffers: int = 2
    """Staging buffers in the ring the gradients pass through (each the largest offloaded group's
    shard in the main dtype); more lets copies run further ahead of the CPU steps."""

    def __post_init__(self) -> None:
        if self.fraction is not None and self.units is not None:
            raise ValueError("OffloadPolicy: give fraction or units, not both")
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                    or not 0.0 < float(self.fraction) <= 1.0:
                raise ValueError(f"OffloadPolicy.fraction must be in (0, 1], got {self.fraction!r}")
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.units is not None:
            if isinstance(self.units, str):
                raise ValueError("OffloadPolicy.units is a sequence of module names, not one string")
            units = tuple(self.units)
            if not units or not all(isinstance(u, str) for u in units):
                raise ValueError(f"OffloadPolicy.units must be a non-empty sequence of module names, "
                                 f"got {self.units!r}")
            object.__setattr__(self, "units", units)
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"OffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"OffloadPolicy.threads must be a positive int or None, got {self.threads!r}")
        if self.overlap not in OVERLAP_CHOICES:
            raise ValueError(f"OffloadPolicy.overlap must be one of {OVERLAP_CHOICES}, got {self.overlap!r}")
        if isinstance(self.staging_buffers, bool) or not isinstance(self.staging_buffers, int) \
                or self.staging_buffers < 1:
            raise ValueError(f"OffloadPolicy.staging_buffers must be a positive int, got {self.staging_buffers!r}")


OVERLAP_CHOICES = ("step", "copy", "none")


def units_to_offload(units: Sequence, fraction: float) -> list:
    """The units ``fraction`` of ``units`` (in registration order, the root first) offloads, in the
    order it picks them: those whose gradients finish first in backward, that is the reverse of
    the registration order (the last blocks and a separately sharded head first, the root last),
    rounded up to whole units."""
    count = min(len(units), math.ceil(fraction * len(units) - 1e-9))
    return list(reversed(units))[:count]


def host_bytes(shard_bytes: Sequence[int], state_bytes: int, overlap: str,
               staging_buffers: int = 2) -> dict[str, int]:
    """One rank's host bytes for the offloaded groups, by use. ``shard_bytes``: each group's
    optimizer shard in the main dtype; ``state_bytes``: their optimizer states. "master": the fp32
    weights; "states"; "backup": ``overlap="step"``'s copy of both, to undo a speculation;
    "staging": the pinned ring, ``staging_buffers`` buffers of the largest group."""
    master = sum(shard_bytes)
    return {"master": master, "states": state_bytes, "backup": master + state_bytes if overlap == "step" else 0,
            "staging": staging_buffers * max(shard_bytes, default=0)}
