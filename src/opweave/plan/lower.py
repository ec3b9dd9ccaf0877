"""Lowering: a :class:`~opweave.schedulers.schedule.Schedule` becomes a :class:`~opweave.plan.launchplan.LaunchPlan`.

Ops are issued in the schedule's ``order``. Before launching ``v`` on ``(device d, stream s)`` lowering makes
every dependency of ``v`` visible to stream ``s``:

* a predecessor on the same stream — nothing (streams are FIFO);
* a predecessor ``u`` on another stream of ``d`` — ``wait(s, e)`` on the event ``e`` recorded right after ``u``;
* a predecessor ``u`` on another device — ``send(u)`` on ``u``'s stream right after ``u`` (one per consumer
  device) and ``recv(u)`` on stream ``s`` unless a ``recv`` of ``u`` on another stream of ``d`` is already
  ordered before this point. One ``send`` may thus serve recvs on several streams of the peer (each pairs with
  the latest send before it: the pairing rule of :mod:`opweave.plan.semantics`). A recv per consuming stream,
  rather than one recv per device plus event waits, lets each stream get the tensor at ``finish(u) + transfer``:
  a shared recv would sit behind whatever else the first consumer's stream receives (the ideal replay would then
  lag the schedulers' own predictions). Recvs come before the launch's waits (a wait may then prove unneeded,
  never a recv), so a stream may receive a tensor that a wait emitted for the same launch would also have
  ordered: at worst an extra transfer, never an extra wait;
* stage schedules: the first op of each stream in a stage waits for the last op of every stream of the device's
  previous stage.

A wait is emitted only when the stream's vector clock does not already order the dependency; happens-before,
the pairing of waits with records and the clocks are those of :mod:`opweave.plan.semantics`, which the builder
below extends (it issues each instruction through :meth:`~opweave.plan.semantics.PlanInterpreter.issue` as it
emits it, so it reads the same clocks the validator checks). The dependencies of one launch are taken
latest-recorded first: an event's clock only holds work issued before its record, so no later-taken wait can cover
an earlier-taken one, and every emitted wait is needed — dropping any one makes the validator reject the plan.
Events are recorded only where some wait uses them, one event per recorded point, numbered densely per device in
issue order. Stage barriers (:func:`stage_barriers`) are lowering's own way to meet the stage order; the validator
checks that order from its definition, not through this function. Lowering checks the schedule against the graph
first (:meth:`~opweave.schedulers.schedule.Schedule.check`, the one owner of the stage invariant: a device's stages
never decrease along its issue order), since a schedule built by hand reaches it without ``schedulers.run``.

Decisions (streams, syncs emitted and avoided per device) are logged at DEBUG level on this module's logger.

Complexity O((V + E)·S) for V ops, E edges and S streams.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Lane, PlanInterpreter, Point
from opweave.schedulers.schedule import Schedule

logger = logging.getLogger(__name__)


class _Builder(PlanInterpreter):
    """The plan being emitted, its happens-before kept current by the interpreter after every instruction."""

    def __init__(self) -> None:
        super().__init__()
        self.avoided: Counter[int] = Counter()  # device -> dependencies found already ordered (no wait needed)

    def record_after(self, lane: Lane) -> int:
        """A provisional record right after the lane's last instruction; its index serves as its event id (unique,
        so the pairing rule finds exactly this record)."""
        index = len(self.instrs)
        self.issue(Instr(lane[0], "record", lane[1], event=index))
        return index


def lower(graph: OpGraph, sched: Schedule) -> LaunchPlan:
    """Lower ``sched`` to a launch plan with only the waits the validator needs (see the module docstring); a
    schedule that does not fit ``graph`` raises :class:`~opweave.errors.ScheduleError`.

    >>> from opweave import examples, schedulers
    >>> from opweave.costs.model import from_graph
    >>> from opweave.plan.validate import validate
    >>> graph = examples.load("lios-fig3")
    >>> plan = lower(graph, schedulers.run("lios", graph, from_graph(graph), streams=3))
    >>> validate(graph, plan)  # raises PlanError naming an unordered edge; here every edge is ordered
    >>> plan.streams(0), plan.syncs
    ([0, 1, 2], 5)
    """
    sched.check(graph)  # raises ScheduleError; everything below relies on it (stages included)
    lane_of = {op: (sched.device(op), sched.stream_of[op]) for op in sched.order}
    barriers: dict[str, list[str]] = {}
    if sched.stage_of is not None:
        barriers = stage_barriers(((op, *lane_of[op]) for op in sched.order), sched.stage_of)

    b = _Builder()
    launched_at: dict[str, Point] = {}
    record_after: dict[str, int] = {}  # op -> provisional event recorded right after its launch
    recvs: dict[tuple[str, int], list[Point]] = {}  # (op, device) -> where it was received
    waited: set[int] = set()

    for v in sched.order:
        lane = device, stream = lane_of[v]
        needs: list[tuple[Point, int]] = []  # (where the dependency sits, the event recorded right after it)
        for u in graph.preds[v]:
            du = lane_of[u][0]
            if du == device:
                needs.append((launched_at[u], record_after[u]))
            elif not any(b.ordered(at, lane) for at in recvs.get((u, device), ())):
                recvs.setdefault((u, device), []).append(b.issue(Instr(device, "recv", stream, op=u, peer=du)))
        needs.extend((launched_at[x], record_after[x]) for x in barriers.get(v, ()))
        for at, event in sorted(set(needs), key=lambda need: -need[1]):
            if b.ordered(at, lane):
                b.avoided[device] += 1
            else:
                b.issue(Instr(device, "wait", stream, event=event))
                waited.add(event)
        launched_at[v] = b.issue(Instr(device, "launch", stream, op=v))
        record_after[v] = b.record_after(lane)
        for peer in sorted({lane_of[w][0] for w in graph.succs[v]} - {device}):
            b.issue(Instr(device, "send", stream, op=v, peer=peer))
    plan = LaunchPlan(_keep_used_events(b.instrs, waited))
    if logger.isEnabledFor(logging.DEBUG):
        _log_decisions(sched, plan, b.avoided)
    return plan


def stage_barriers(launches: Iterable[tuple[str, int, int]], stage_of: dict[str, int]) -> dict[str, list[str]]:
    """Ops each launch must follow because of stage barriers: lowering's way to meet the stage order.

    ``launches`` lists ``(op, device, stream)`` in issue order. The first op of each stream in a stage must follow
    the last op of every stream in the device's previous stage (FIFO streams and transitivity then order every op
    of every earlier stage before every op of the later one). A device's stages must not decrease along
    ``launches``, as :meth:`~opweave.schedulers.schedule.Schedule.check` ensures.
    """
    stage_now: dict[int, int] = {}
    last_in_stage: dict[int, dict[int, str]] = {}  # device -> stream -> last op of the current stage
    last_in_previous: dict[int, dict[int, str]] = {}
    barriers: dict[str, list[str]] = {}
    for op, device, stream in launches:
        stage = stage_of[op]
        if stage != stage_now.get(device):
            stage_now[device] = stage
            last_in_previous[device] = last_in_stage.get(device, {})
            last_in_stage[device] = {}
        if stream not in last_in_stage[device]:
            barriers[op] = [x for _, x in sorted(last_in_previous[device].items())]
        last_in_stage[device][stream] = op
    return barriers


def _log_decisions(sched: Schedule, plan: LaunchPlan, avoided: Counter[int]) -> None:
    for device in plan.devices:
        instrs = plan.on_device(device)
        kinds = Counter(i.kind for i in instrs)
        logger.debug("lower %s: device %d: %d ops on streams %s; %d waits on %d events (%d dependencies already "
                     "ordered, no wait); %d sends, %d recvs", sched.scheduler, device, kinds["launch"],
                     plan.streams(device), kinds["wait"], kinds["record"], avoided[device], kinds["send"],
                     kinds["recv"])


def _keep_used_events(instrs: list[Instr], waited: set[int]) -> list[Instr]:
    """Drop records no wait uses; renumber the rest densely per device in issue order."""
    number: dict[int | None, int] = {}
    per_device: dict[int, int] = {}
    out: list[Instr] = []
    for ins in instrs:
        if ins.kind == "record":
            if ins.event not in waited:
                continue
            number[ins.event] = per_device.get(ins.device, 0)
            per_device[ins.device] = number[ins.event] + 1
        if ins.kind in ("record", "wait"):
            ins = replace(ins, event=number[ins.event])
        out.append(ins)
    return out
