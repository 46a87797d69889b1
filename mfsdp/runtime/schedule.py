"""The static collective schedule of one context: what every rank issues, in which order.

[Note: collectives in a rank-independent order]
Ranks do not run the same modules: an MoE layer skips experts that got no token, a vision encoder
runs only where the batch has images, a block is skipped on some steps. Every all-gather and
reduction is a collective, so each rank must issue them in the same order; if that order followed
autograd timing or which parameters got gradients, a skipped module would shift every later
collective by one, and the job would hang or silently add one module's gradients to another's.

So the order is fixed once, from the module tree, and every rank walks it with a cursor:

* forward: the modules in registration pre-order (parent before children). A module's unshard is
  issued when it runs or is prefetched; modules the cursor passes without running (skipped on this
  rank) are gathered anyway and freed at once.
* backward: a depth-first walk of the FSDP tree, children in reverse registration order, with an
  ENTER step (unshard for backward, prefetch the next modules) and an EXIT step (reshard, reduce the
  gradients) per module. Hooks only *signal* that the walk may advance to a step; the walk performs
  every step before it too, so a module that never ran backward here still gathers and reduces (its
  missing gradients count as zero) at its place in the order. The end of autograd finishes the walk.

Cost: a module skipped on a rank still costs that rank its collectives (a gather, and a reduction of
zeros), which the ranks that ran it need anyway; and a module's reduction may wait for the next
module's backward to begin where no hook says it is finished sooner. Where the guarantee ends: a
module must run at most once per forward pass in registration order and run backward in the reverse
order (consecutive repeated calls are fine). A module that runs after the walk has passed it costs a
re-gather, and is correct only if every rank does the same; one whose backward starts after its
reduction raises an error that names it.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
import zlib
from typing import Protocol


class Unit(Protocol):
    """A unit of the walk as the schedule and the engine (``context``) see it: they drive it
    through these names only (``runtime.module.FsdpModule`` implements them)."""

    gathers_in_backward: bool  # False for a bare embedding: its backward never reads its table

    @property
    def name(self) -> str: ...

    @property
    def parameter_groups(self) -> tuple: ...

    def is_idle(self) -> bool: ...

    def is_unsharded(self) -> bool: ...

    def unshard(self, prefetch: bool = False) -> bool: ...

    def reshard(self) -> None: ...

    def enter_backward(self, ran: bool) -> None: ...

    def exit_backward(self) -> None: ...


class StepKind(enum.Enum):
    ENTER = "enter"  # unshard for backward, prefetch what follows
    EXIT = "exit"  # reshard, reduce gradients


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    kind: StepKind
    module_ref: weakref.ref

    @property
    def module(self) -> Unit:
        module = self.module_ref()
        assert module is not None, "an FSDP module of this context was deleted"
        return module


class Schedule:
    """Static forward and backward walks of one root's FSDP modules."""

    def __init__(self, forward: list[Unit], parent_of: dict[int, Unit]) -> None:
        self._forward = [weakref.ref(m) for m in forward]
        self.forward_position = {id(m): i for i, m in enumerate(forward)}
        children: dict[int, list] = {id(m): [] for m in forward}
        for m in forward[1:]:
            children[id(parent_of[id(m)])].append(m)
        self.ancestors: dict[int, frozenset[int]] = {}
        steps: list[BackwardStep] = []
        enter_order: list[Unit] = []
        # Depth first, children in reverse registration order; iterative, since a recursive closure
        # is a reference cycle that would keep these module lists alive until the garbage collector.
        stack: list[tuple[StepKind, Unit, frozenset[int]]] = [(StepKind.ENTER, forward[0], frozenset())]
        while stack:
            kind, module, ancestors = stack.pop()
            steps.append(BackwardStep(kind, weakref.ref(module)))
            if kind is StepKind.EXIT:
                continue
            self.ancestors[id(module)] = ancestors
            enter_order.append(module)
            stack.append((StepKind.EXIT, module, ancestors))
            inner = ancestors | {id(module)}
            stack.extend((StepKind.ENTER, child, inner) for child in children[id(module)])  # last pops first
        self.backward: tuple[BackwardStep, ...] = tuple(steps)
        self.enter_position = {id(s.module): i for i, s in enumerate(steps) if s.kind is StepKind.ENTER}
        self.exit_position = {id(s.module): i for i, s in enumerate(steps) if s.kind is StepKind.EXIT}
        self._enter_order = [weakref.ref(m) for m in enter_order]
        self._enter_index = {id(m): i for i, m in enumerate(enter_order)}

    def forward_module(self, position: int) -> Unit:
        module = self._forward[position]()
        assert module is not None, "an FSDP module of this context was deleted"
        return module

    @property
    def num_forward(self) -> int:
        return len(self._forward)

    def forward_modules(self) -> list[Unit]:
        return [self.forward_module(i) for i in range(len(self._forward))]

    def backward_modules(self) -> list[Unit]:
        """Modules in backward enter order (node first, children reversed)."""
        return [ref() for ref in self._enter_order if ref() is not None]

    def next_in_backward(self, module: Unit, distance: int) -> list[Unit]:
        """The ``distance`` modules entered after ``module`` in backward."""
        start = self._enter_index[id(module)] + 1
        return [ref() for ref in self._enter_order[start:start + distance] if ref() is not None]

    def is_ancestor_or_self(self, candidate: Unit, module: Unit) -> bool:
        return candidate is module or id(candidate) in self.ancestors[id(module)]

    def reduction_tags(self, module: Unit, name: str) -> tuple[int, int]:
        """Two small integers identifying ``module``'s reductions (see ``tag_check``): its place in
        the backward walk, which differs between neighbours, and a hash of its name, which differs
        where ranks built different trees."""
        return self.exit_position[id(module)] % 61 + 1, zlib.crc32(name.encode()) % 61 + 1
