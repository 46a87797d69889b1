"""FsdpContext: the runtime state one root shares with every FSDP module under it.

[Note: streams, events and memory]
On CUDA, all-gathers run on ``allgather_stream`` and reductions on ``reduce_scatter_stream``; the
compute stream never waits on a whole stream, only on the event of the module it needs.

* Unsharded storage is allocated on the all-gather stream and released there *after* that stream
  has waited for the compute that used it. The caching allocator hands a freed block only to later
  work on the same stream, which is then ordered after that compute: no ``record_stream``, and
  memory is reused deterministically.
* Gradients produced on the compute stream are packed (cast to the reduction dtype, padded) and
  reduced on the reduce-scatter stream, so the compute stream spends no time on the copy. Their
  tensors are kept alive, with the event of their reduction, until the next module's reduction
  starts; the compute stream waits on that event before dropping them, so the reduction of module
  ``i`` overlaps the backward of module ``i - 1`` and its inputs are never reused early. A module
  whose reduction is small next to the pending ones (the root's norms after the output head) does
  not wait: it would stall compute on a large reduction to free memory it does not need. At most
  two reductions are pending, so memory stays bounded by the two largest.
* At the end of backward the final callback makes the compute stream wait for the last reduction,
  so the optimizer reads finished gradients.

Trade-off: two streams let all-gathers and reductions overlap each other, at the price of a
second memory pool; on CPU (gloo) the same calls run synchronously and streams are None.
"""

from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from mfsdp import _compat
from mfsdp.communication import CommunicationPolicy
from mfsdp.runtime import collectives
from mfsdp.runtime.gather_slots import GatherSlots
from mfsdp.runtime.indexed_order import IndexedOrder

if TYPE_CHECKING:
    from mfsdp.runtime.module import FsdpModule


class FsdpContext:
    """Runtime stream and prefetch state shared by one FSDP subtree."""

    def __init__(
        self, device: torch.device, root_module: "FsdpModule", policy: Optional[CommunicationPolicy] = None
    ) -> None:
        policy = policy or CommunicationPolicy()
        self.device = device
        # Without overlap every collective runs on the compute stream, exactly as on CPU.
        has_streams = device.type == "cuda" and policy.overlap
        self.allgather_stream: Optional[torch.Stream] = torch.cuda.Stream(device) if has_streams else None
        self.reduce_scatter_stream: Optional[torch.Stream] = (
            self.allgather_stream if policy.unify_streams else torch.cuda.Stream(device) if has_streams else None
        )
        self.prefetch_depth = policy.prefetch_depth if policy.overlap else 0
        self.backward_count = 0
        self.is_last_microbatch = True
        self._root = weakref.ref(root_module)
        self.forward_order: IndexedOrder["FsdpModule"] = IndexedOrder()
        self.backward_order: IndexedOrder["FsdpModule"] = IndexedOrder()
        self._callback_queued = False
        self._pending_reductions: collections.deque = collections.deque()  # (event, keep_alive, nbytes)
        self.gather_slots: Optional[GatherSlots] = None  # persistent gather buffers (double_buffer)

    @property
    def root_module(self) -> "FsdpModule":
        root = self._root()
        assert root is not None, "the root module of this FsdpContext was deleted"
        return root

    def current_stream(self) -> Optional[torch.Stream]:
        """Current stream on this context's device, or None where the device has no streams."""
        if self.allgather_stream is None:
            return None
        return torch.cuda.current_stream(self.device)

    # ------------------------------------------------------------------ forward / backward edges
    def begin_forward(self) -> None:
        """Root pre-forward: communication may read what the optimizer just wrote, and gradients
        the user dropped with ``zero_grad()`` stop occupying memory during forward."""
        current = self.current_stream()
        if current is not None:
            self.allgather_stream.wait_stream(current)
        for module in self.forward_order:
            for group in module.parameter_groups:
                if group.requires_grad:
                    group.release_unused_gradient_memory()

    def track_reduction(self, keep_alive: list, nbytes: int) -> None:
        """Hold the inputs of a reduction just issued until the compute stream may reuse them."""
        stream = self.reduce_scatter_stream
        event = stream.record_event() if stream is not None else None
        self._pending_reductions.append((event, keep_alive, nbytes))

    def release_finished_reductions(self, incoming_bytes: Optional[int] = None) -> None:
        """Let the compute stream wait for pending reductions and drop their inputs.

        ``incoming_bytes``: the size of the reduction about to be issued; reductions are kept
        pending while there is only one and it is over 4x that size (see the note above). None
        releases everything (end of backward).
        """
        pending, current = self._pending_reductions, self.current_stream()
        while pending:
            if (incoming_bytes is not None and len(pending) < 2
                    and 4 * incoming_bytes < sum(nbytes for _, _, nbytes in pending)):
                break
            event, _, _ = pending.popleft()
            if event is not None and current is not None:
                current.wait_event(event)

    def register_post_backward_final_callback(self) -> None:
        """Queue, once per backward pass, the callback that runs when autograd finishes.

        Root post_backward() means only that root-owned parameters have accumulated gradients;
        it may run before descendant reductions, or not at all when the root owns no trainable
        parameters. Waiting at autograd completion orders consumers after every reduction.
        """
        if self._callback_queued:
            return
        self._callback_queued = True
        _compat.queue_autograd_callback(self._post_backward_final_callback)

    def _post_backward_final_callback(self) -> None:
        with torch.profiler.record_function("mfsdp::post_backward_final_callback"):
            self._callback_queued = False
            for module in self.backward_order:
                module._finish_backward()  # modules whose reduction no gradient hook triggered
            self.release_finished_reductions()
            current = self.current_stream()
            if current is not None:
                current.wait_stream(self.reduce_scatter_stream)
                current.wait_stream(self.allgather_stream)
            self.backward_count += 1
            groups = [g for m in self.backward_order for g in m.parameter_groups if g.requires_grad]
            for group in groups:
                group.finalize_gradients()
            self._check_finite(groups)

    def _check_finite(self, groups) -> None:
        """The optional NaN/Inf check: one flag per group, one all-reduce, the same verdict everywhere."""
        checked = [(g, g.nonfinite_flag()) for g in groups if g.policy.check_finite_gradients]
        checked = [(g, flag) for g, flag in checked if flag is not None]
        if not checked:
            return
        flags = collectives.any_rank(torch.stack([flag for _, flag in checked]))
        bad = [g.label for (g, _), f in zip(checked, flags) if f]
        if bad:
            raise FloatingPointError(
                f"mfsdp: NaN or Inf in the reduced gradients after backward {self.backward_count} in "
                f"parameter group(s) {bad}; lower the learning rate, check the loss and inputs, or "
                "clip gradients")
