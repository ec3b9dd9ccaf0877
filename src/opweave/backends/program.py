"""What every backend needs from a LaunchPlan: per (device, stream) the steps it runs, with each wait resolved; the
one walker of those steps; and the :class:`Backend` protocol every backend meets.

Which record a ``wait`` (and which send a ``recv``) waits for is the pairing rule of :mod:`opweave.plan.semantics`;
:meth:`Program.from_plan` runs that module's :class:`~opweave.plan.semantics.PlanInterpreter` and turns each pair
into "raise signal k" (the record or send) and "wait for signal k" (the wait or recv), so a backend need not re-read
the plan's issue order. The program keeps its plan, so analyses that need happens-before
(:mod:`opweave.backends.liveness`) run the same interpreter on it.

:class:`Walker` runs steps, modelled on :class:`torch.fx.Interpreter`: :meth:`Walker.run` walks ``(lane, step)``
pairs and calls the overridable :meth:`~Walker.launch`, :meth:`~Walker.signal` and :meth:`~Walker.wait`, then
:meth:`~Walker.release` for a step that carries environment keys to drop. It is the only place that dispatches on a
step's kind: a CPU lane (:class:`~opweave.backends.cpu.LaneWorker`: threads and events), the CUDA lanes
(:class:`~opweave.backends.streams.CudaLanes`: streams and CUDA events, forked from and joined into the caller's
stream) and a rank of the distributed backend (whose signals may be messages) are subclasses.

Every backend builds its program here, so the lanes and signals a backend runs are logged once, at DEBUG level on
``opweave.backends.program`` (silent by default).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Lane, PlanInterpreter, Point

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What runs a plan for :class:`opweave.Compiled`: called like the model; ``close()`` releases what it
    holds (threads, streams, graphs, rank processes; also done when it is collected; calling it twice is harmless);
    ``stats`` counts what it did (keys depend on the backend). A backend that runs the plan at sizes it was not built
    for also has ``free(args) -> bool``: take inputs shaped like ``args`` from now on (:mod:`opweave.pipeline.sizes`;
    without it each size is built on its own)."""

    stats: dict[str, Any]

    def __call__(self, *args: Any) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Step:
    """One instruction of a lane: ``launch`` op, raise ``signal`` k (a record or send), or ``wait`` for signal k (a
    wait or recv). ``release``: environment keys a walker may drop right after the step
    (:func:`opweave.backends.liveness.steps_with_releases`; empty in a :class:`Program`)."""

    kind: str  # "launch" | "signal" | "wait"
    op: str = ""  # a launch's
    signal: int = -1  # a signal's or a wait's
    release: tuple[str, ...] = ()


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
        self._add(at, Step("launch", op=ins.target))

    def record(self, i: int, ins: Instr, at: Point) -> None:
        self.signal_of[i] = len(self.signal_of)
        self._add(at, Step("signal", signal=self.signal_of[i]))

    def wait(self, i: int, ins: Instr, at: Point) -> None:
        source = self.source[i]  # the record or send it pairs with (the interpreter refused a wait without one)
        assert source is not None
        self._add(at, Step("wait", signal=self.signal_of[source]))

    send = record
    recv = wait


class Walker:
    """Runs steps in the order given, one ``(lane, step)`` pair at a time (see the module docstring). Subclasses say
    what a launch, a signal and a wait are; :meth:`release` drops nothing unless overridden."""

    def run(self, steps: Iterable[tuple[Lane, Step]]) -> None:
        for lane, step in steps:
            kind = step.kind
            if kind == "launch":
                self.launch(lane, step.op)
            elif kind == "signal":
                self.signal(lane, step.signal)
            elif kind == "wait":
                self.wait(lane, step.signal)
            else:
                raise ValueError(f"unknown step kind {kind!r}")
            if step.release:
                self.release(lane, step.release)

    def launch(self, lane: Lane, op: str) -> None:
        raise NotImplementedError

    def signal(self, lane: Lane, number: int) -> None:
        raise NotImplementedError

    def wait(self, lane: Lane, number: int) -> None:
        raise NotImplementedError

    def release(self, lane: Lane, keys: tuple[str, ...]) -> None:
        """Drop ``keys`` from the environment after a step (the liveness analysis says it is safe)."""
