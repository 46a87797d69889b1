"""Reductions in flight: their inputs stay alive until the compute stream may reuse the memory.

Gradients produced on the compute stream are reduced on the reduce-scatter stream. Their tensors
are kept, with the event of their reduction, until the next module's reduction starts; the compute
stream then waits on that event before dropping them, so the reduction of module ``i`` overlaps the
backward of module ``i - 1`` and its inputs are never reused early. A module whose reduction is small
next to the pending ones (the root's norms after the output head) does not wait: it would stall
compute on a large reduction to free memory it does not need. At most two reductions are pending,
so memory stays bounded by the two largest.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class InFlightReduction:
    event: Optional[torch.Event]
    """Recorded on the reduction's stream after it was issued; None where there are no streams."""
    keep_alive: list
    """Every tensor the reduction reads (the autograd gradients, the staging buffer)."""
    nbytes: int


def keeps_pending(pending_nbytes: list[int], incoming_bytes: int) -> bool:
    """The release rule, which ``mfsdp.memory`` plans with too: before a reduction of
    ``incoming_bytes``, the pending ones (``pending_nbytes``, oldest first) stay while there is only
    one and it is over 4x that size; otherwise the oldest is released."""
    return len(pending_nbytes) < 2 and 4 * incoming_bytes < sum(pending_nbytes)


class PendingReductions:
    """The reductions of one context whose inputs the compute stream has not released yet."""

    def __init__(self) -> None:
        self._pending: collections.deque[InFlightReduction] = collections.deque()

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self):
        return iter(self._pending)

    def track(self, stream: Optional[torch.Stream], keep_alive: list, nbytes: int) -> None:
        """Hold the inputs of a reduction just issued on ``stream``."""
        event = stream.record_event() if stream is not None else None
        self._pending.append(InFlightReduction(event, keep_alive, nbytes))

    def release(self, current: Optional[torch.Stream], incoming_bytes: Optional[int] = None) -> None:
        """Let the compute stream ``current`` wait for pending reductions and drop their inputs.

        ``incoming_bytes``: the size of the reduction about to be issued (``keeps_pending``); None
        releases everything (end of backward).
        """
        pending = self._pending
        while pending:
            if incoming_bytes is not None and keeps_pending([r.nbytes for r in pending], incoming_bytes):
                break
            reduction = pending.popleft()
            if reduction.event is not None and current is not None:
                current.wait_event(reduction.event)
