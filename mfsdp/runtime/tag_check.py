"""The always-on check that every reduction combined the same module on every rank.

[Note: reduction tags]
Each gradient reduction carries, beside the per-parameter usage counts, four entries per row: two
tags, ``a`` (the module's place in the backward walk) and ``b`` (a hash of its name), each folded
into 1..61, and their squares. Every rank contributes its own module's tags, so after the reduction
every rank must read back exactly its own: equal means and equal means of squares hold only when
all ranks sent the same tag (the variance is zero).

Exactness: an average over N ranks divides by N, so a single deviant rank moves a mean by 1/N,
which no floating-point tolerance can tell from rounding at scale. The counts and tags therefore
travel as int64 in their own tensor of the same coalesced launch, each contribution multiplied by
the number of ranks its path averages over: every intermediate average is then an exact integer,
and one deviant rank moves the result by at least one. Counts end as the number of ranks that used
the parameter.

Cost: three tiny kernels per reduction on the reduction stream, and at the end of backward one
asynchronous copy of one int32 per module to pinned host memory. The copy is read when it has
landed (at the next forward at the latest one step later), so no host synchronisation is added;
on CPU, and where the NaN check synchronises anyway, it is read at once.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import torch

from mfsdp.runtime.errors import MISMATCH_HELP, CollectiveMismatchError


class TagCheck:
    """Collects per-module mismatch flags during a backward and reports them without stalling.

    A flag per step of the static backward walk; ``name_at(position)`` names the module whose EXIT
    step is at ``position``."""

    def __init__(self, num_steps: int, name_at: Callable[[int], str], device: torch.device) -> None:
        self._name_at = name_at
        self._flags = torch.zeros(num_steps, dtype=torch.int32, device=device)
        self._pending: collections.deque = collections.deque()  # (host flags, event or None, backward)

    def record_for(self, position: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """What the groups running the reductions of the module whose EXIT step is at ``position``
        call on the stream that ran each: it flags the module if the reduced tag columns
        ``received`` differ from ``expected``."""
        flag = self._flags[position:position + 1]
        return lambda received, expected: flag.add_((received != expected).any().view(1))

    def end_backward(self, backward_count: int, stream: Optional[torch.Stream]) -> None:
        """After the compute stream ``stream`` (None without streams) has waited for every reduction
        of this backward."""
        if stream is None:  # read at once
            host, event = self._flags.clone(), None
        else:
            host = torch.empty(self._flags.shape, dtype=self._flags.dtype, pin_memory=True)
            host.copy_(self._flags, non_blocking=True)
            event = stream.record_event()
        self._flags.zero_()
        self._pending.append((host, event, backward_count))
        if stream is None:
            self.raise_if_mismatched(wait=True)
        while len(self._pending) > 2:  # never more than a step late
            self._check(*self._pending.popleft())

    def raise_if_mismatched(self, wait: bool) -> None:
        """Report every landed check; with ``wait``, wait for the outstanding ones first."""
        while self._pending:
            host, event, count = self._pending[0]
            if not wait and event is not None and not event.query():
                return
            self._pending.popleft()
            self._check(host, event, count)

    def _check(self, host: torch.Tensor, event: Optional[torch.Event], backward_count: int) -> None:
        if event is not None:
            event.synchronize()
        bad = [i for i, flag in enumerate(host.tolist()) if flag]
        if not bad:
            return
        names = [self._name_at(i) for i in bad]
        raise CollectiveMismatchError(
            f"mfsdp: collective mismatch in backward {backward_count}: on this rank the gradient reduction "
            f"of {names} was combined with another module's on some other rank (the reduction tags "
            f"differ), so the gradients of that step are wrong. {MISMATCH_HELP}"
        )
