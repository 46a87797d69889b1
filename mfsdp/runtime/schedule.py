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

A module called again after the forward walk has reached it (weight-shared layers called once per
loop) re-gathers, and the backward walk of that pass gets a ``Visit`` for the call: its ENTER and
EXIT steps go where its backward runs, the gradients stay in ``.grad``, and the module reduces once,
at its static EXIT step. A call right after the module's previous one (``block(block(x))``)
continues that visit: one gather and one backward for both.

Cost: a module skipped on a rank still costs that rank its collectives (a gather, and a reduction of
zeros), which the ranks that ran it need anyway; and a module's reduction may wait for the next
module's backward to begin where no hook says it is finished sooner. Where the guarantee ends: a
module called again must be called again identically on every rank (the visits add collectives;
the debug mode names a rank that differs), and its calls' backwards must run in reverse call order;
one whose backward starts after its reduction raises an error that names it.
"""

from __future__ import annotations

import bisect
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

    def exit_backward(self, reduce: bool = True) -> None: ...


class StepKind(enum.Enum):
    ENTER = "enter"  # unshard for backward, prefetch what follows
    EXIT = "exit"  # reshard, reduce gradients


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    kind: StepKind
    module_ref: weakref.ref
    reduces: bool = True  # an EXIT step that reduces: only the module's last EXIT step in the walk

    @property
    def module(self) -> Unit:
        module = self.module_ref()
        assert module is not None, "an FSDP module of this context was deleted"
        return module


@dataclasses.dataclass
class Visit:
    """A call of a module made after the forward walk had reached it (a weight-shared block called
    again after the others), with the visits of the calls nested in it. Every rank must make the
    same ones. Its backward steps go at ``at``, a step of the static walk (``Schedule.repeat_point``):
    ENTER re-gathers for the call's backward, EXIT reshards and leaves the gradients in ``.grad``
    for the module's reduction at its static EXIT step."""

    module_ref: weakref.ref
    at: int
    children: list["Visit"] = dataclasses.field(default_factory=list)

    def steps(self) -> list[BackwardStep]:
        inner = [step for child in reversed(self.children) for step in child.steps()]
        return [BackwardStep(StepKind.ENTER, self.module_ref), *inner,
                BackwardStep(StepKind.EXIT, self.module_ref, reduces=False)]


class Walk:
    """The steps of one backward walk, and where each module's ENTER and EXIT steps are."""

    def __init__(self, steps: list[BackwardStep]) -> None:
        self.steps = tuple(steps)
        self.enters: dict[int, list[int]] = {}
        self.exits: dict[int, list[int]] = {}
        self._enter_steps = [i for i, step in enumerate(self.steps) if step.kind is StepKind.ENTER]
        for i, step in enumerate(self.steps):
            (self.enters if step.kind is StepKind.ENTER else self.exits).setdefault(id(step.module), []).append(i)

    def prefetched_at(self, position: int, count: int) -> list[Unit]:
        """What the ENTER step at ``position`` prefetches (the engine, and ``mfsdp.memory``, gather
        them): the modules of the ``count`` ENTER steps after it whose backward gathers."""
        rank = bisect.bisect_right(self._enter_steps, position)
        following = (self.steps[i].module for i in self._enter_steps[rank:rank + count])
        return [m for m in following if m.gathers_in_backward]


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
        # Depth first, children in reverse registration order; iterative, since a recursive closure
        # is a reference cycle that would keep these module lists alive until the garbage collector.
        stack: list[tuple[StepKind, Unit, frozenset[int]]] = [(StepKind.ENTER, forward[0], frozenset())]
        while stack:
            kind, module, ancestors = stack.pop()
            steps.append(BackwardStep(kind, weakref.ref(module)))
            if kind is StepKind.EXIT:
                continue
            self.ancestors[id(module)] = ancestors
            stack.append((StepKind.EXIT, module, ancestors))
            inner = ancestors | {id(module)}
            stack.extend((StepKind.ENTER, child, inner) for child in children[id(module)])  # last pops first
        self.walk = Walk(steps)  # the backward walk of a pass that called no module again
        self.backward: tuple[BackwardStep, ...] = self.walk.steps
        self.exit_position = {key: positions[0] for key, positions in self.walk.exits.items()}

    def forward_module(self, position: int) -> Unit:
        module = self._forward[position]()
        assert module is not None, "an FSDP module of this context was deleted"
        return module

    @property
    def num_forward(self) -> int:
        return len(self._forward)

    def issued_by(self, position: int, depth: int) -> int:
        """The forward cursor, which ``mfsdp.memory`` plans with too: how many forward positions
        have their unshard issued once the forward reached ``position`` (prefetching ``depth``).
        The next forward's first modules are the ``issued_by(0, depth)`` (``mfsdp.optimizer``)."""
        return min(position + 1 + depth, self.num_forward)

    def backward_modules(self) -> list[Unit]:
        """Modules in backward enter order (node first, children reversed)."""
        return [step.module for step in self.backward if step.kind is StepKind.ENTER]

    def is_ancestor_or_self(self, candidate: Unit, module: Unit) -> bool:
        return candidate is module or id(candidate) in self.ancestors[id(module)]

    def repeat_point(self, module: Unit, swept: int) -> int:
        """Where the backward of a call of ``module`` goes that the forward made once its walk had
        reached ``swept`` positions: before the first ENTER step, in the static walk, of a module
        the forward had reached by then, ``module``'s ancestors excepted (its own ENTER qualifies)."""
        ancestors = self.ancestors[id(module)]
        return next(i for i, step in enumerate(self.backward) if step.kind is StepKind.ENTER
                    and self.forward_position[id(step.module)] < swept and id(step.module) not in ancestors)

    def walk_with(self, repeats: list[Visit]) -> Walk:
        """The backward walk of a pass whose forward made the ``repeats`` (outermost, in call order):
        each one's steps at its place, a later call's before an earlier one's at the same place."""
        at: dict[int, list[Visit]] = {}
        for visit in repeats:
            at.setdefault(visit.at, []).insert(0, visit)
        steps = []
        for i, step in enumerate(self.backward):
            steps.extend(s for visit in at.get(i, ()) for s in visit.steps())
            steps.append(step)
        return Walk(steps)

    def reduction_tags(self, module: Unit, name: str) -> tuple[int, int]:
        """Two small integers identifying ``module``'s reductions (see ``tag_check``): its place in
        the backward walk, which differs between neighbours, and a hash of its name, which differs
        where ranks built different trees."""
        return self.exit_position[id(module)] % 61 + 1, zlib.crc32(name.encode()) % 61 + 1
