"""The plan validator: proves that every dependency of the graph is ordered by the plan.

:func:`validate` accepts a :class:`~opweave.plan.LaunchPlan` only if

* every op of the graph is launched exactly once, and nothing else is launched;
* every ``wait`` and ``recv`` pairs with a ``record`` / ``send`` issued before it (the pairing rule of
  :mod:`opweave.plan.semantics`, which every backend implements);
* for every edge ``u -> v`` (data and write-after-read alike) the launch of ``u`` *happens before* the launch of
  ``v``;
* for a data edge across devices, ``v``'s device also received ``u``'s output: some ``recv`` of ``u`` on ``v``'s
  device happens before ``v``, and the ``send`` it pairs with was issued on ``u``'s device after ``u``'s launch
  happened (a send issued before ``u`` ran would ship a stale buffer);
* given a stage schedule, the stage order: every op of stage k+1 of a device happens after every op of stage k of
  that device. Checked from this definition on the clocks (for consecutive stages present on the device; the rest
  follows by transitivity), *not* through lowering's :func:`~opweave.plan.lower.stage_barriers`, so a wrong
  barrier in lowering shows here.

Happens-before is that of :mod:`opweave.plan.semantics`: the validator is a
:class:`~opweave.plan.semantics.PlanInterpreter` whose ``launch`` and ``recv`` steps check the rules above on the
clocks at that instruction. Because happens-before implies issue order, a consumer's producers are all issued
before it; the stage order is checked once the walk is done, from each launch's clock.

Example: ``launch a (s0); record e0 (s0); wait e0 (s1); launch b (s1)`` orders a -> b; dropping the wait does not.
Complexity O(I·S) for I instructions and S streams, plus O(E) edge checks and O(V·S) for the stage order.
"""

from __future__ import annotations

from itertools import pairwise

from opweave.errors import PlanError
from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Clock, Lane, PlanInterpreter, Point, covers
from opweave.schedulers.schedule import Schedule


def validate(graph: OpGraph, plan: LaunchPlan, sched: Schedule | None = None) -> None:
    """Raise :class:`PlanError` unless ``plan`` orders every dependency of ``graph`` (see the module docstring)."""
    _Validator(graph, None if sched is None else sched.stage_of).run(plan)


class _Validator(PlanInterpreter):
    """Checks each launch when it is issued, against the clocks the interpreter keeps."""

    def __init__(self, graph: OpGraph, stage_of: dict[str, int] | None) -> None:
        super().__init__()
        self.graph = graph
        self.stage_of = stage_of
        self.launched_at: dict[str, Point] = {}
        self.launch_clock: dict[str, Clock] = {}  # kept only for a stage schedule
        self.received: dict[tuple[str, int], list[Point]] = {}  # (op, device) -> recvs that carry op's output

    def recv(self, i: int, ins: Instr, at: Point) -> None:
        u, source = ins.op, self.source[i]
        assert u is not None and source is not None  # a recv names its op and pairs with a send (PlanInterpreter.pair)
        if u in self.launched_at and self.launched_at[u][0][0] == ins.peer \
                and covers(self.snapshot[source], self.launched_at[u]):
            self.received.setdefault((u, ins.device), []).append(at)

    def launch(self, i: int, ins: Instr, at: Point) -> None:
        v, graph = ins.op, self.graph
        if v not in graph.op:
            raise PlanError(f"instruction {i}: launch of unknown op {v!r}")
        if v in self.launched_at:
            raise PlanError(f"op {v!r} is launched twice (device {ins.device} stream {ins.stream})")
        for u in graph.preds[v]:
            self._check_edge(u, v, at[0])
        self.launched_at[v] = at
        if self.stage_of is not None:
            self.launch_clock[v] = dict(self.clock[at[0]])

    def _check_edge(self, u: str, v: str, lane: Lane) -> None:
        kind = self.graph.edge[(u, v)].kind
        name = f"edge {u!r} -> {v!r}" + (" (write-after-read)" if kind == "war" else "")
        device, stream = lane
        if u not in self.launched_at:
            raise PlanError(f"{name}: consumer launched on device {device} stream {stream} before the producer")
        (du, su), _ = self.launched_at[u]
        if not self.ordered(self.launched_at[u], lane):
            where = f"stream {su}" if du == device else f"device {du} stream {su}"
            raise PlanError(f"{name}: consumer launched on device {device} stream {stream} is not ordered after "
                            f"producer on {where}")
        if du != device and kind == "data" \
                and not any(self.ordered(at, lane) for at in self.received.get((u, device), ())):
            raise PlanError(f"{name}: no recv of {u!r} on device {device} (sent from device {du} after {u!r} ran) "
                            f"is ordered before the consumer (stream {stream})")

    def output(self) -> None:
        missing = [o for o in self.graph.ids if o not in self.launched_at]
        if missing:
            raise PlanError(f"op {missing[0]!r} is never launched ({len(missing)} op(s) missing)")
        if self.stage_of is not None:
            self._check_stage_order()

    def _check_stage_order(self) -> None:
        """Every op of a device's stage is ordered after every op of the device's previous stage (module docstring).

        An op is ordered after all of a stage when its launch clock covers that stage's frontier: per lane, the
        latest launch of the stage there (earlier ones on the lane precede it in program order).
        """
        stage_of = self.stage_of or {}
        by_stage: dict[int, dict[int, list[str]]] = {}  # device -> stage -> ops in issue order
        for op, ((device, _), _) in self.launched_at.items():
            if op not in stage_of:
                raise PlanError(f"op {op!r} has no stage in the stage schedule")
            by_stage.setdefault(device, {}).setdefault(stage_of[op], []).append(op)
        for device, stages in sorted(by_stage.items()):
            for earlier, later in pairwise(sorted(stages)):
                frontier: dict[Lane, tuple[int, str]] = {}  # lane -> (latest position of the stage there, its op)
                for x in stages[earlier]:
                    lane, pos = self.launched_at[x]
                    frontier[lane] = max(frontier.get(lane, (0, x)), (pos, x))
                for v in stages[later]:
                    for lane, (pos, x) in sorted(frontier.items()):
                        if not covers(self.launch_clock[v], (lane, pos)):
                            raise PlanError(f"stage order: op {v!r} (stage {later}, device {device} stream "
                                            f"{self.launched_at[v][0][1]}) is not ordered after op {x!r} (stage "
                                            f"{earlier}, stream {lane[1]})")
