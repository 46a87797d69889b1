"""FsdpContext: the scheduling engine of one root, shared with every FSDP module under it: it
decides when each collective is issued (the streams, the walk over units, prefetch, the final callback).

[Note: streams, events and memory]
On CUDA, all-gathers run on ``allgather_stream`` and reductions on ``reduce_scatter_stream``; the
compute stream never waits on a whole stream, only on the event of the module it needs.

* Unsharded storage is allocated on the all-gather stream and released there *after* that stream
  has waited for the compute that used it. The caching allocator hands a freed block only to later
  work on the same stream, which is then ordered after that compute: no ``record_stream``, and
  memory is reused deterministically.
* Gradients produced on the compute stream are packed (cast to the reduction dtype, padded) and
  reduced on the reduce-scatter stream, so the compute stream spends no time on the copy; their
  inputs stay alive until the compute stream may reuse them (see ``in_flight``).
* At the end of backward the final callback makes the compute stream wait for the last reduction,
  so the optimizer reads finished gradients.

Trade-off: two streams let all-gathers and reductions overlap each other, at the price of a
second memory pool; on CPU (gloo) the same calls run synchronously and streams are None.

*When* each collective is issued is the schedule's business (see ``schedule``): the context is the
scheduling engine that holds the two cursors walking it, and performs the steps the module hooks
signal, driving each module through the small protocol ``schedule.Unit`` names (unshard,
reshard, enter and exit backward), never through its private state. ``module.build_context``
builds it for a root.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from torch import nn

from mfsdp import _compat
from mfsdp.communication import CommunicationPolicy
from mfsdp.runtime import collectives
from mfsdp.runtime.gather_slots import GatherSlots
from mfsdp.runtime.in_flight import PendingReductions
from mfsdp.runtime.schedule import Schedule, StepKind, Unit, Visit
from mfsdp.runtime.tag_check import TagCheck


class FsdpContext:
    """The scheduling engine of one FSDP tree: its streams, the cursors walking its ``Schedule``,
    prefetch and the final callback; it drives units through ``schedule.Unit`` only."""

    def __init__(self, device: torch.device, root_module: nn.Module, schedule: Schedule,
                 policy: CommunicationPolicy) -> None:
        self.device = device
        # Without overlap every collective runs on the compute stream, exactly as on CPU.
        has_streams = device.type == "cuda" and policy.overlap
        priority = -1 if policy.high_priority_streams else 0  # CUDA: lower is higher; -1 is the highest
        self.allgather_stream: Optional[torch.Stream] = (
            torch.cuda.Stream(device, priority=priority) if has_streams else None)
        self.reduce_scatter_stream: Optional[torch.Stream] = (
            self.allgather_stream if policy.unify_streams
            else torch.cuda.Stream(device, priority=priority) if has_streams else None)
        self.prefetch_depth = policy.prefetch_depth if policy.overlap else 0
        self.prefetch_across_step = policy.prefetch_across_step and policy.overlap
        self.backward_count = 0
        self.is_last_microbatch = True
        self._root = weakref.ref(root_module)
        self.schedule = schedule
        self._forward_issued = 0  # forward positions whose unshard has been issued this pass
        self._forward_swept = 0  # forward positions the pass has passed (the last one reached is next)
        self._backward_cursor = 0  # next backward step to perform
        self._walk = schedule.walk  # this pass's backward walk: the static one, or one with visits
        self._repeats: list[Visit] = []  # the calls of modules the forward walk had reached already
        self._open_repeats: list[Visit] = []  # those whose forward is still running, innermost last
        self._visits: dict[int, int] = {}  # per module: visits opened in this forward
        self._last_reached = 0  # id of the module whose forward began last
        self._backward_active = False  # between the first backward hook and the final callback
        self.pending_reductions = PendingReductions()
        self.gather_slots: Optional[GatherSlots] = None  # persistent gather buffers (double_buffer)
        steps = schedule.backward
        self.tag_check = TagCheck(len(steps), lambda i: steps[i].module.name or "<root>", device)
        # Fixed by the tree: built once, not per step. Every trainable group, in backward order.
        self.trainable_groups = [g for m in schedule.backward_modules() for g in m.parameter_groups if g.requires_grad]
        self._gathered_early: list = []  # (module, its groups' weights tokens) gathered during the step

    @property
    def root_module(self) -> nn.Module:
        root = self._root()
        assert root is not None, "the root module of this FsdpContext was deleted"
        return root

    def current_stream(self) -> Optional[torch.Stream]:
        """Current stream on this context's device, or None where the device has no streams."""
        return None if self.allgather_stream is None else torch.cuda.current_stream(self.device)

    # ------------------------------------------------------------------------------ forward walk
    def begin_forward(self) -> None:
        """Root pre-forward: communication may read what the optimizer just wrote, and gradients
        the user dropped with ``zero_grad()`` stop occupying memory during forward. A gather made
        during the step whose source changed since (``gather_for_next_forward``) is dropped."""
        self._gather_after_compute()
        self.tag_check.raise_if_mismatched(wait=False)
        for module, tokens in self._gathered_early:
            if any(g.weights_token() != t for g, t in zip(module.parameter_groups, tokens)):
                module.reshard()
        self._gathered_early.clear()
        self._forward_issued = self._forward_swept = 0
        self._repeats, self._open_repeats, self._visits = [], [], {}
        self._backward_active = False
        for group in self.trainable_groups:
            group.reducer.release_unused_memory()

    def forward_reached(self, module: Unit) -> Optional[int]:
        """``module`` is about to run forward: issue the unshards up to it, in schedule order
        (gathering and freeing the modules this rank skipped), then prefetch the next ones.

        Returns the index of the visit this call opens among the module's visits of this pass (0
        for its first call), or None where it continues its previous call (called twice in a row)."""
        key, position = id(module), self.schedule.forward_position[id(module)]
        last, self._last_reached = self._last_reached, key
        visits = self._visits.get(key, 0)
        if visits or position < self._forward_swept:  # called again, or after the walk swept past it
            # Gather again; the backward of this call gets its own steps unless it continues the last.
            module.unshard()
            if visits and (last == key or key in self.schedule.ancestors[last]):
                return None
            while self._open_repeats and self._open_repeats[-1].module_ref().is_idle():
                self._open_repeats.pop()  # its forward has ended
            visit = Visit(weakref.ref(module), self.schedule.repeat_point(module, self._forward_swept + 1))
            (self._open_repeats[-1].children if self._open_repeats else self._repeats).append(visit)
            self._open_repeats.append(visit)
            self._visits[key] = visits + 1
            return visits
        self._issue_forward(position, prefetch=False)
        self._release_skipped(position)
        module.unshard()
        self._forward_issued = max(self._forward_issued, position + 1)
        self._issue_forward(self.schedule.issued_by(position, self.prefetch_depth), prefetch=True)
        self._visits[key] = 1
        return 0

    def end_forward(self) -> None:
        """Root post-forward: the modules no rank-local call reached still take their turn."""
        self._issue_forward(self.schedule.num_forward, prefetch=False)
        self._release_skipped(self.schedule.num_forward)

    # ------------------------------------------------------------- across the optimizer step
    def first_forward_modules(self) -> list[Unit]:
        """The modules the next forward gathers first: the root and the ``prefetch_depth`` after it."""
        return [self.schedule.forward_module(i) for i in range(self.schedule.issued_by(0, self.prefetch_depth))]

    def gather_for_next_forward(self, modules: list[Unit]) -> None:
        """Unshard ``modules`` (``first_forward_modules``, their weights final for this step) now,
        so their gathers run while the optimizer updates the rest. See ``mfsdp.optimizer``.

        Every rank steps its bound optimizer at the same point, so the gathers keep one order
        everywhere. The next ``begin_forward`` drops a gather whose source changed since (a state
        load, an in-place edit followed by ``refresh_model_weights``) and the walk gathers afresh."""
        self._gather_after_compute()  # after the update and refresh just enqueued
        with torch.profiler.record_function("mfsdp::gather_for_next_forward"):
            held = next((i for i, m in enumerate(modules) if m.is_unsharded()), len(modules))
            gathered = modules[:self._unshard_in_order(modules[:held])]  # the forward walk gathers the rest
            self._gathered_early += [(m, [g.weights_token() for g in m.parameter_groups]) for m in gathered]

    def _gather_after_compute(self) -> None:
        """Order the gathers issued next after what the compute stream has enqueued."""
        if self.allgather_stream is not None:
            self.allgather_stream.wait_stream(self.current_stream())

    @staticmethod
    def _unshard_in_order(modules: Sequence[Unit], prefetch: bool = True) -> int:
        """Unshard ``modules`` in order; how many were issued. A prefetch that must wait for a busy
        gather slot stops there: later modules may not gather before it, or the ranks' orders
        would differ."""
        for issued, module in enumerate(modules):
            if not module.unshard(prefetch):
                return issued
        return len(modules)

    def _issue_forward(self, stop: int, prefetch: bool) -> None:
        modules = [self.schedule.forward_module(i) for i in range(self._forward_issued, stop)]
        self._forward_issued += self._unshard_in_order(modules, prefetch)

    def _release_skipped(self, stop: int) -> None:
        for position in range(self._forward_swept, stop):
            module = self.schedule.forward_module(position)
            if module.is_idle() and module is not self.root_module:
                module.reshard()
        self._forward_swept = max(self._forward_swept, stop)

    # ----------------------------------------------------------------------------- backward walk
    def backward_reached(self, kind: StepKind, module: Unit) -> bool:
        """Perform every backward step up to ``module``'s ``kind`` step; False if already passed."""
        if not self._backward_active:
            self._backward_active = True
            self._backward_cursor = 0
            self._walk = self.schedule.walk_with(self._repeats) if self._repeats else self.schedule.walk
            _compat.queue_autograd_callback(self._post_backward_final_callback)
        positions = (self._walk.enters if kind is StepKind.ENTER else self._walk.exits)[id(module)]
        target = next((p for p in positions if p >= self._backward_cursor), None)  # its visit's step
        if target is None:
            return False
        self._advance_backward(target, module)
        return True

    def has_reduced(self, module: Unit) -> bool:
        """Whether ``module``'s reduction already ran in the backward now in progress."""
        return self._backward_active and self._backward_cursor > self._walk.exits[id(module)][-1]

    def _advance_backward(self, target: int, signalled: Optional[Unit]) -> None:
        while self._backward_cursor <= target:
            step = self._walk.steps[self._backward_cursor]
            self._backward_cursor += 1
            module = step.module
            if step.kind is StepKind.ENTER:
                ran = signalled is not None and self.schedule.is_ancestor_or_self(module, signalled)
                module.enter_backward(ran)
                self._unshard_in_order(self._walk.prefetched_at(self._backward_cursor - 1, self.prefetch_depth))
            else:
                module.exit_backward(step.reduces)

    def _post_backward_final_callback(self) -> None:
        with torch.profiler.record_function("mfsdp::post_backward_final_callback"):
            self._advance_backward(len(self._walk.steps) - 1, None)  # what no hook reached
            self._backward_active = False
            current = self.current_stream()
            self.pending_reductions.release(current)
            if current is not None:
                current.wait_stream(self.reduce_scatter_stream)
                current.wait_stream(self.allgather_stream)
            self.backward_count += 1
            groups = self.trainable_groups
            for group in groups:
                group.reducer.finalize()
            self.tag_check.end_backward(self.backward_count, current)
            self._check_finite(groups)

    def _check_finite(self, groups) -> None:
        """The optional NaN/Inf check, after the last microbatch (the main gradients then hold every
        microbatch): one flag per group, one all-reduce, the same verdict everywhere. Only on a hit,
        one more all-reduce names the parameters."""
        if not self.is_last_microbatch:
            return
        checked = [(g, g.reducer.nonfinite_flag()) for g in groups if g.policy.check_finite_gradients]
        checked = [(g, flag) for g, flag in checked if flag is not None]
        if not checked:
            return
        self.tag_check.raise_if_mismatched(wait=True)  # this path syncs anyway: name a mismatch first
        flags = collectives.any_rank(torch.stack([flag for _, flag in checked]))
        hit = [g for (g, _), f in zip(checked, flags) if f]
        if not hit:
            return
        names = {id(p): n for n, p in self.root_module.named_parameters()}
        params = [p for g in hit for p in g.sharded_params]
        nonfinite = collectives.any_rank(torch.stack([
            torch.zeros((), dtype=torch.bool, device=self.device) if p.grad is None
            else ~torch.isfinite(p.grad.to_local()).all() for p in params]))
        bad = [names.get(id(p), "?") for p, f in zip(params, nonfinite) if f]
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise FloatingPointError(
            f"mfsdp: NaN or Inf in the reduced gradients after backward {self.backward_count} in "
            f"{sorted({g.issue.name for g in hit})}, parameters {bad[:8]}{more}; lower the learning rate, "
            "check the loss and inputs, or clip gradients")
