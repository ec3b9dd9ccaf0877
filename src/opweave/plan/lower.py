"""Lowering: a :class:`~opweave.schedulers.schedule.Schedule` becomes a :class:`~opweave.plan.launchplan.LaunchPlan`.

Ops are issued in the schedule's ``order``. Before launching ``v`` on ``(device d, stream s)`` lowering makes
every dependency of ``v`` visible to stream ``s``:

* a predecessor on the same stream — nothing (streams are FIFO);
* a predecessor ``u`` on another stream of ``d`` — ``wait(s, e)`` on the event ``e`` recorded right after ``u``;
* a predecessor ``u`` on another device — ``send(u)`` on ``u``'s stream right after ``u`` (one per consumer
  device) and ``recv(u)`` on stream ``s`` unless a ``recv`` of ``u`` on another stream of ``d`` is already
  ordered before this point. One ``send`` may thus serve recvs on several streams of the peer (each pairs with the
  latest send before it, as ``backends/program.py`` does). A recv per consuming stream, rather than one recv per
  device plus event waits, lets each stream get the tensor at ``finish(u) + transfer``: a shared recv would sit
  behind whatever else the first consumer's stream receives (the ideal replay would then lag the schedulers'
  own predictions). Recvs come before the launch's waits (a wait may then prove unneeded, never a recv), so a
  stream may receive a tensor that a wait emitted for the same launch would also have ordered: at worst an extra
  transfer, never an extra wait;
* stage schedules: the first op of each stream in a stage waits for the last op of every stream of the device's
  previous stage.

A wait is emitted only when the stream's vector clock (the same happens-before that :mod:`opweave.plan.validate`
computes) does not already order the dependency. The dependencies of one launch are taken latest-recorded first:
an event's clock only holds work issued before its record, so no later-taken wait can cover an earlier-taken one,
and every emitted wait is needed — dropping any one makes the validator reject the plan. Events are recorded only
where some wait uses them, one event per recorded point, numbered densely per device in issue order.

Complexity O((V + E)·S) for V ops, E edges and S streams.
"""

from __future__ import annotations

from dataclasses import replace

from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Clock, Lane, join_clocks, stage_barriers
from opweave.schedulers.schedule import Schedule


class _Builder:
    """The instruction list being built, with each stream's position and vector clock."""

    def __init__(self) -> None:
        self.instrs: list[Instr] = []
        self.position: dict[Lane, int] = {}
        self.clock: dict[Lane, Clock] = {}
        self.snapshot: dict[int, Clock] = {}  # clock at each record and send, by instruction index

    def emit(self, ins: Instr, joins: Clock | None = None) -> tuple[Lane, int]:
        """Append ``ins``; return where it sits (lane, position on the lane)."""
        lane = (ins.device, ins.stream)
        self.position[lane] = pos = self.position.get(lane, 0) + 1
        here = self.clock.setdefault(lane, {})
        here[lane] = pos
        if joins is not None:
            join_clocks(here, joins)
        self.instrs.append(ins)
        if ins.kind in ("record", "send"):
            self.snapshot[len(self.instrs) - 1] = dict(here)
        return lane, pos

    def record(self, lane: Lane) -> int:
        """A provisional record right after the lane's last instruction; its index serves as its event id."""
        index = len(self.instrs)
        self.emit(Instr(lane[0], "record", lane[1], event=index))
        return index

    def ordered(self, lane: Lane, at: tuple[Lane, int]) -> bool:
        return self.clock.get(lane, {}).get(at[0], 0) >= at[1]


def lower(graph: OpGraph, sched: Schedule) -> LaunchPlan:
    """Lower ``sched`` to a launch plan with only the waits the validator needs (see the module docstring)."""
    lane_of = {op: (sched.device(op), sched.stream_of[op]) for op in sched.order}
    barriers: dict[str, list[str]] = {}
    if sched.stage_of is not None:
        barriers = stage_barriers(((op, *lane_of[op]) for op in sched.order), sched.stage_of)

    b = _Builder()
    launched_at: dict[str, tuple[Lane, int]] = {}
    record_after: dict[str, int] = {}  # op -> provisional event recorded right after its launch
    recvs: dict[tuple[str, int], list[tuple[Lane, int]]] = {}  # (op, device) -> where it was received
    send_index: dict[tuple[str, int], int] = {}  # (op, consumer device) -> index of the send
    waited: set[int] = set()

    for v in sched.order:
        lane = device, stream = lane_of[v]
        # (where the dependency sits, the event recorded right after it); the event id is its record's index
        needs: list[tuple[tuple[Lane, int], int]] = []
        for u in graph.preds[v]:
            du = lane_of[u][0]
            if du == device:
                needs.append((launched_at[u], record_after[u]))
            elif not any(b.ordered(lane, at) for at in recvs.get((u, device), ())):
                at = b.emit(Instr(device, "recv", stream, op=u, peer=du), joins=b.snapshot[send_index[(u, device)]])
                recvs.setdefault((u, device), []).append(at)
        needs.extend((launched_at[x], record_after[x]) for x in barriers.get(v, ()))
        for at, event in sorted(set(needs), key=lambda need: -need[1]):
            if not b.ordered(lane, at):
                b.emit(Instr(device, "wait", stream, event=event), joins=b.snapshot[event])
                waited.add(event)
        launched_at[v] = b.emit(Instr(device, "launch", stream, op=v))
        record_after[v] = b.record(lane)
        for peer in sorted({lane_of[w][0] for w in graph.succs[v]} - {device}):
            send_index[(v, peer)] = len(b.instrs)
            b.emit(Instr(device, "send", stream, op=v, peer=peer))
    return LaunchPlan(_keep_used_events(b.instrs, waited))


def _keep_used_events(instrs: list[Instr], waited: set[int]) -> list[Instr]:
    """Drop records no wait uses; renumber the rest densely per device in issue order."""
    number: dict[int, int] = {}
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
