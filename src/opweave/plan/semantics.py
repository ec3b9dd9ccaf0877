"""Plan semantics, in one place: when one instruction of a :class:`~opweave.plan.launchplan.LaunchPlan` happens before
another. Lowering, the validator, the simulator and the backends all ask :class:`PlanInterpreter`; nothing else
pairs a wait with its record or computes a clock.

**Lanes.** Each ``(device, stream)`` is a lane; an instruction's *point* is ``(lane, position)``, its 1-based
position among the instructions of its lane in issue order (the plan's list order).

**Pairing** (the rule every backend implements). A ``wait`` waits for the latest ``record`` of its event issued
before it *on the same device*; a ``recv`` of op ``u`` for the latest ``send`` of ``u`` issued before it *from its
peer to its device*. A wait or recv with no such instruction is an error (:class:`PlanError`), so every sync source
precedes its sink in issue order.

**Happens-before** is the smallest transitive relation with

* program order: an instruction after every earlier instruction of its lane (streams are FIFO);
* sync order: a ``wait`` (``recv``) after the ``record`` (``send``) it pairs with.

It is tracked with vector clocks: ``clock[lane][m]`` is the highest position of lane ``m`` known complete at the
lane's latest instruction (its own entry counts that instruction). Issuing an instruction sets its own entry; a
wait or recv joins the clock its source had when issued. Because sources precede sinks, one pass in issue order
sees every clock complete, and "``a`` happens before ``b``" implies "``a`` is issued before ``b``".

Tiny example (device 0)::

    0  launch a  (stream 0)   point ((0, 0), 1)   clock[(0, 0)] = {(0, 0): 1}
    1  record 7  (stream 0)   point ((0, 0), 2)   clock[(0, 0)] = {(0, 0): 2}
    2  wait 7    (stream 1)   point ((0, 1), 1)   clock[(0, 1)] = {(0, 1): 1, (0, 0): 2}   pairs with 1
    3  launch b  (stream 1)   point ((0, 1), 2)   clock[(0, 1)] = {(0, 1): 2, (0, 0): 2}

``a`` (point ``((0, 0), 1)``) happens before ``b``: ``b``'s clock holds ``(0, 0): 2 >= 1``. Drop the wait and it
does not:

>>> from opweave.plan.launchplan import Instr, LaunchPlan
>>> plan = LaunchPlan([Instr(0, "launch", 0, op="a"), Instr(0, "record", 0, event=7),
...                    Instr(0, "wait", 1, event=7), Instr(0, "launch", 1, op="b")])
>>> hb = PlanInterpreter().run(plan)  # the base class's output() is the interpreter itself
>>> hb.clock[(0, 1)]
{(0, 1): 2, (0, 0): 2}
>>> hb.ordered(hb.point[0], (0, 1)), hb.source[2]
(True, 1)
>>> no_wait = PlanInterpreter().run(LaunchPlan([plan.instrs[0], plan.instrs[1], plan.instrs[3]]))
>>> no_wait.ordered(no_wait.point[0], (0, 1))
False

 Stage barriers are not part of the semantics: a stage schedule *requires* an order (the validator checks
it from this relation), and lowering meets it with ordinary record/wait pairs.

:class:`PlanInterpreter` is modelled on :class:`torch.fx.Interpreter`: ``run(plan)`` walks the plan and calls
overridable per-kind steps; subclasses (the validator, the backends' :class:`~opweave.backends.program.Program`,
the liveness analysis) extend it instead of copying the walk, and lowering's builder calls :meth:`~PlanInterpreter.
issue` directly while it emits instructions. Complexity O(I·L) for I instructions and L lanes (a join or a copy
touches at most L entries).
"""

from __future__ import annotations

from typing import Any

from opweave.errors import PlanError
from opweave.plan.launchplan import KINDS, Instr, LaunchPlan

Lane = tuple[int, int]  # (device, stream)
Clock = dict[Lane, int]  # lane -> highest position known complete
Point = tuple[Lane, int]  # where an instruction sits: (lane, 1-based position on the lane)


def covers(clock: Clock, at: Point) -> bool:
    """Whether ``clock`` orders the instruction at ``at`` (at or before the point the clock belongs to)."""
    lane, pos = at
    return clock.get(lane, 0) >= pos


def join_clocks(into: Clock, other: Clock) -> None:
    """Raise ``into`` to at least ``other``, lane by lane (the vector-clock join)."""
    get = into.get
    for lane, pos in other.items():
        if get(lane, 0) < pos:
            into[lane] = pos


class PlanInterpreter:
    """Happens-before over a plan, built one instruction at a time in issue order (see the module docstring).

    Overridable methods, by call hierarchy (as :class:`torch.fx.Interpreter`'s)::

        run(plan)
        +-- issue(ins)                 pair, place on its lane, advance the lane's clock; callable alone
        |   +-- run_instr(i, ins, at)  dispatch by kind
        |       +-- launch() / record() / wait() / send() / recv()
        +-- output()                   what ``run`` returns

    Each step gets the instruction's index ``i``, the instruction and its point ``at``; when it runs,
    ``self.clock[at[0]]`` is the clock at that instruction and ``self.source[i]`` the record/send it pairs with.

    State, readable by subclasses and callers: ``instrs`` (issued so far), ``point[i]``, ``source[i]`` (``None``
    unless a wait/recv), ``previous[i]`` (the instruction before ``i`` on its lane, or ``None``), ``clock`` (per lane,
    at its latest instruction) and ``snapshot[i]`` (the clock at each record and send, what a sink joins).
    """

    def __init__(self) -> None:
        self.instrs: list[Instr] = []
        self.point: list[Point] = []
        self.source: list[int | None] = []
        self.previous: list[int | None] = []
        self.clock: dict[Lane, Clock] = {}
        self.snapshot: dict[int, Clock] = {}
        self._last_on_lane: dict[Lane, int] = {}
        self._latest_record: dict[tuple[int, int | None], int] = {}  # (device, event) -> index
        self._latest_send: dict[tuple[str | None, int | None, int | None], int] = {}  # (op, from, to) -> index

    def run(self, plan: LaunchPlan) -> Any:
        """Issue every instruction of ``plan`` in order, then return :meth:`output`."""
        for ins in plan.instrs:
            self.issue(ins)
        return self.output()

    def issue(self, ins: Instr) -> Point:
        """Append ``ins`` to the plan seen so far, run its step, and return its point.

        Raises :class:`PlanError` for a malformed instruction or a wait/recv with nothing to pair with.
        """
        i = len(self.instrs)
        _check_instr(i, ins)
        source = self.pair(i, ins)
        lane = (ins.device, ins.stream)
        here = self.clock.get(lane)
        if here is None:
            here = self.clock[lane] = {}
        at = (lane, here.get(lane, 0) + 1)
        here[lane] = at[1]
        if source is not None:
            join_clocks(here, self.snapshot[source])
        elif ins.kind == "record" or ins.kind == "send":
            self.snapshot[i] = here.copy()
        self.instrs.append(ins)
        self.point.append(at)
        self.source.append(source)
        self.previous.append(self._last_on_lane.get(lane))
        self._last_on_lane[lane] = i
        self.run_instr(i, ins, at)
        return at

    def pair(self, i: int, ins: Instr) -> int | None:
        """The pairing rule: the index of the record/send that instruction ``i`` waits for (``None`` for none)."""
        if ins.kind == "record":
            self._latest_record[(ins.device, ins.event)] = i
        elif ins.kind == "send":
            self._latest_send[(ins.op, ins.device, ins.peer)] = i
        elif ins.kind == "wait":
            source = self._latest_record.get((ins.device, ins.event))
            if source is None:
                raise PlanError(f"instruction {i}: wait on device {ins.device} stream {ins.stream} for event "
                                f"{ins.event}, which no earlier record on that device sets")
            return source
        elif ins.kind == "recv":
            source = self._latest_send.get((ins.op, ins.peer, ins.device))
            if source is None:
                raise PlanError(f"instruction {i}: recv of op {ins.op!r} on device {ins.device} from device "
                                f"{ins.peer} has no matching send before it")
            return source
        return None

    def ordered(self, at: Point, lane: Lane) -> bool:
        """Whether the instruction at ``at`` happens before (or is) the latest instruction issued on ``lane``."""
        return covers(self.clock.get(lane, {}), at)

    def predecessors(self, i: int) -> list[int]:
        """The instructions ``i`` directly follows (its lane predecessor, then its sync source); happens-before is
        the transitive closure of these edges."""
        return [j for j in (self.previous[i], self.source[i]) if j is not None]

    def run_instr(self, i: int, ins: Instr, at: Point) -> None:
        """Dispatch to the step named by ``ins.kind``; override to act on every instruction."""
        getattr(self, ins.kind)(i, ins, at)

    def launch(self, i: int, ins: Instr, at: Point) -> None:
        """Step for a ``launch``; does nothing here."""

    def record(self, i: int, ins: Instr, at: Point) -> None:
        """Step for a ``record``; does nothing here."""

    def wait(self, i: int, ins: Instr, at: Point) -> None:
        """Step for a ``wait``; does nothing here."""

    def send(self, i: int, ins: Instr, at: Point) -> None:
        """Step for a ``send``; does nothing here."""

    def recv(self, i: int, ins: Instr, at: Point) -> None:
        """Step for a ``recv``; does nothing here."""

    def output(self) -> Any:
        """What :meth:`run` returns; the interpreter itself here."""
        return self


def _check_instr(i: int, ins: Instr) -> None:
    if ins.kind not in KINDS:
        raise PlanError(f"instruction {i}: unknown kind {ins.kind!r}")
    if ins.kind in ("record", "wait") and ins.event is None:
        raise PlanError(f"instruction {i}: {ins.kind} on device {ins.device} stream {ins.stream} has no event")
    if ins.kind in ("launch", "send", "recv") and ins.op is None:
        raise PlanError(f"instruction {i}: {ins.kind} on device {ins.device} stream {ins.stream} has no op")
    if ins.kind in ("send", "recv") and (ins.peer is None or ins.peer == ins.device):
        raise PlanError(f"instruction {i}: {ins.kind} of op {ins.op!r} on device {ins.device} needs another "
                        f"device as peer, got {ins.peer!r}")
