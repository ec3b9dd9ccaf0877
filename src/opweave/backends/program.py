"""What every backend needs from a LaunchPlan: per (device, stream) the steps it runs, with each wait resolved.

Which record a ``wait`` (and which send a ``recv``) waits for is the pairing rule of :mod:`opweave.plan.semantics`;
:meth:`Program.from_plan` runs that module's :class:`~opweave.plan.semantics.PlanInterpreter` and turns each pair
into "raise signal k" (the record or send) and "wait for signal k" (the wait or recv), so a backend need not re-read
the plan's issue order. The program keeps its plan, so analyses that need happens-before
(:mod:`opweave.backends.liveness`) run the same interpreter on it.

Every backend builds its program here, so the lanes and signals a backend runs are logged once, at DEBUG level on
``opweave.backends.program`` (silent by default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Lane, PlanInterpreter, Point

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    kind: str  # "launch" | "signal" | "wait"
    op: str | None = None
    signal: int | None = None


@dataclass
class Program:
    """A plan split into lanes. ``lanes[(device, stream)]`` lists that stream's steps in issue order (step ``k`` of a
    lane is the instruction at position ``k + 1`` of :mod:`opweave.plan.semantics`)."""

    lanes: dict[Lane, list[Step]]
    num_signals: int
    issue_order: list[tuple[Lane, Step]]
    plan: LaunchPlan

    @classmethod
    def from_plan(cls, plan: LaunchPlan) -> Program:
        """Split ``plan``; raises :class:`~opweave.errors.PlanError` for a malformed instruction or an unpaired
        wait/recv."""
        split = _Split()
        split.run(plan)
        program = cls(split.lanes, len(split.signal_of), split.issue_order, plan)
        if log.isEnabledFor(logging.DEBUG):
            launches = {lane: sum(s.kind == "launch" for s in steps) for lane, steps in program.lanes.items()}
            log.debug("program: %d lanes (device, stream): ops %s; %d signals", len(program.lanes),
                      dict(sorted(launches.items())), program.num_signals)
        return program


class _Split(PlanInterpreter):
    """One step per instruction; records and sends raise dense signals, waits and recvs wait for their source's."""

    def __init__(self) -> None:
        super().__init__()
        self.lanes: dict[Lane, list[Step]] = {}
        self.issue_order: list[tuple[Lane, Step]] = []
        self.signal_of: dict[int, int] = {}  # instruction index of a record/send -> its signal

    def _add(self, at: Point, step: Step) -> None:
        self.lanes.setdefault(at[0], []).append(step)
        self.issue_order.append((at[0], step))

    def launch(self, i: int, ins: Instr, at: Point) -> None:
        self._add(at, Step("launch", op=ins.op))

    def record(self, i: int, ins: Instr, at: Point) -> None:
        self.signal_of[i] = len(self.signal_of)
        self._add(at, Step("signal", signal=self.signal_of[i]))

    def wait(self, i: int, ins: Instr, at: Point) -> None:
        self._add(at, Step("wait", signal=self.signal_of[self.source[i]]))

    send = record
    recv = wait
