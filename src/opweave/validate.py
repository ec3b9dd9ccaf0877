"""The plan validator: proves that every dependency of the graph is ordered by the plan (DESIGN.md §2, §4).

:func:`validate` accepts a :class:`~opweave.plan.LaunchPlan` only if

* every op of the graph is launched exactly once, and nothing else is launched;
* every ``wait`` refers to an event recorded earlier on its device, every ``recv`` to a ``send`` of the same op
  between the same two devices earlier in the plan (backends pair them the same way, ``backends/base.py``);
* for every edge ``u -> v`` (data and write-after-read alike) the launch of ``u`` *happens before* the launch of
  ``v``; for a data edge across devices, a ``recv`` of ``u`` on ``v``'s device also happens before ``v``;
* given a stage schedule, every op of a stage is ordered after every op of the device's previous stage.

Happens-before is computed with vector clocks over streams ``(device, stream)``: each instruction is numbered
by its position on its stream; a stream's clock says, per stream, up to which position everything is known to be
complete. Program order on a stream advances the stream's own entry; a ``wait`` joins the clock its event had at
the latest ``record`` issued before the wait on that device; a ``recv`` joins the clock of its ``send``. The plan's
flat list puts every source (record, send) before its sink, so one pass in list order sees each clock complete.

Example: ``launch a (s0); record e0 (s0); wait e0 (s1); launch b (s1)`` orders a -> b; dropping the wait does not.
Complexity O(I·S) for I instructions and S streams (a join or a copy touches at most S entries) plus O(E).
"""

from __future__ import annotations

from collections.abc import Iterable

from opweave.ir import OpGraph
from opweave.plan import KINDS, Instr, LaunchPlan, PlanError
from opweave.schedule import Schedule

Lane = tuple[int, int]  # (device, stream)
Clock = dict[Lane, int]  # lane -> highest position known complete


def sync_sources(plan: LaunchPlan) -> list[int | None]:
    """Per instruction, the index of the instruction it waits for (``None`` for none).

    A ``wait`` waits for the latest ``record`` of its event issued before it on the same device; a ``recv`` for the
    latest ``send`` of the same op from its peer to its device earlier in the plan. Raises :class:`PlanError` for a
    malformed instruction or a wait/recv with nothing to wait for.
    """
    latest_record: dict[tuple[int, int], int] = {}  # (device, event) -> index
    latest_send: dict[tuple[str, int, int], int] = {}  # (op, from device, to device) -> index
    sources: list[int | None] = []
    for i, ins in enumerate(plan.instrs):
        _check_instr(i, ins)
        source = None
        if ins.kind == "record":
            latest_record[(ins.device, ins.event)] = i
        elif ins.kind == "send":
            latest_send[(ins.op, ins.device, ins.peer)] = i
        elif ins.kind == "wait":
            source = latest_record.get((ins.device, ins.event))
            if source is None:
                raise PlanError(f"instruction {i}: wait on device {ins.device} stream {ins.stream} for event "
                                f"{ins.event}, which no earlier record on that device sets")
        elif ins.kind == "recv":
            source = latest_send.get((ins.op, ins.peer, ins.device))
            if source is None:
                raise PlanError(f"instruction {i}: recv of op {ins.op!r} on device {ins.device} from device "
                                f"{ins.peer} has no matching send before it")
        sources.append(source)
    return sources


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


def stage_barriers(launches: Iterable[tuple[str, int, int]], stage_of: dict[str, int]) -> dict[str, list[str]]:
    """Ops each launch must follow because of stage barriers.

    ``launches`` lists ``(op, device, stream)`` in issue order. The first op of each stream in a stage must follow
    the last op of every stream in the device's previous stage (FIFO streams and transitivity then order every op
    of every earlier stage before every op of the later one). Raises :class:`PlanError` when a device's stages
    decrease along the issue order (the barrier would wait on an op issued later).
    """
    stage_now: dict[int, int] = {}
    last_in_stage: dict[int, dict[int, str]] = {}  # device -> stream -> last op of the current stage
    last_in_previous: dict[int, dict[int, str]] = {}
    barriers: dict[str, list[str]] = {}
    for op, device, stream in launches:
        stage = stage_of[op]
        if device in stage_now and stage < stage_now[device]:
            raise PlanError(f"op {op!r} of stage {stage} is issued after stage {stage_now[device]} on device "
                            f"{device}; order the ops of a device by stage")
        if stage != stage_now.get(device):
            stage_now[device] = stage
            last_in_previous[device] = last_in_stage.get(device, {})
            last_in_stage[device] = {}
        if stream not in last_in_stage[device]:
            barriers[op] = [x for _, x in sorted(last_in_previous[device].items())]
        last_in_stage[device][stream] = op
    return barriers


def join_clocks(into: Clock, other: Clock) -> None:
    """Raise ``into`` to at least ``other``, lane by lane (the vector-clock join)."""
    for lane, pos in other.items():
        if into.get(lane, 0) < pos:
            into[lane] = pos


def validate(graph: OpGraph, plan: LaunchPlan, sched: Schedule | None = None) -> None:
    """Raise :class:`PlanError` unless ``plan`` orders every dependency of ``graph`` (see the module docstring)."""
    sources = sync_sources(plan)
    launches = [(ins.op, ins.device, ins.stream) for ins in plan.instrs if ins.kind == "launch" and ins.op in graph.op]
    barriers: dict[str, list[str]] = {}
    if sched is not None and sched.stage_of is not None:
        barriers = stage_barriers(launches, sched.stage_of)

    position: dict[Lane, int] = {}
    clock: dict[Lane, Clock] = {}
    snapshot: dict[int, Clock] = {}  # clocks of records and sends, by instruction index
    launched_at: dict[str, tuple[Lane, int]] = {}
    recvs: dict[tuple[str, int], list[tuple[Lane, int]]] = {}  # (op, device) -> where it was received

    def ordered(lane: Lane, at: tuple[Lane, int]) -> bool:
        return clock[lane].get(at[0], 0) >= at[1]

    for i, ins in enumerate(plan.instrs):
        lane = (ins.device, ins.stream)
        position[lane] = pos = position.get(lane, 0) + 1
        here = clock.setdefault(lane, {})
        here[lane] = pos
        if sources[i] is not None:
            join_clocks(here, snapshot[sources[i]])
        if ins.kind in ("record", "send"):
            snapshot[i] = dict(here)
        elif ins.kind == "recv":
            recvs.setdefault((ins.op, ins.device), []).append((lane, pos))
        elif ins.kind == "launch":
            v = ins.op
            if v not in graph.op:
                raise PlanError(f"instruction {i}: launch of unknown op {v!r}")
            if v in launched_at:
                raise PlanError(f"op {v!r} is launched twice (device {ins.device} stream {ins.stream})")
            for u in graph.preds[v]:
                _check_edge(graph, u, v, lane, launched_at, recvs, ordered)
            for x in barriers.get(v, ()):
                if not ordered(lane, launched_at[x]):  # x was issued before v: barriers follow issue order
                    (_, sx), _ = launched_at[x]
                    raise PlanError(f"stage barrier: op {v!r} (stage {sched.stage_of[v]}, device {ins.device} "
                                    f"stream {ins.stream}) is not ordered after op {x!r} (stage {sched.stage_of[x]}, "
                                    f"stream {sx})")
            launched_at[v] = (lane, pos)
    missing = [o for o in graph.ids if o not in launched_at]
    if missing:
        raise PlanError(f"op {missing[0]!r} is never launched ({len(missing)} op(s) missing)")


def _check_edge(graph, u, v, lane, launched_at, recvs, ordered) -> None:
    kind = graph.edge[(u, v)].kind
    name = f"edge {u!r} -> {v!r}" + (" (write-after-read)" if kind == "war" else "")
    device, stream = lane
    if u not in launched_at:
        raise PlanError(f"{name}: consumer launched on device {device} stream {stream} before the producer")
    (du, su), _ = launched_at[u]
    if not ordered(lane, launched_at[u]):
        where = f"stream {su}" if du == device else f"device {du} stream {su}"
        raise PlanError(f"{name}: consumer launched on device {device} stream {stream} is not ordered after "
                        f"producer on {where}")
    if du != device and kind == "data" and not any(ordered(lane, at) for at in recvs.get((u, device), ())):
        raise PlanError(f"{name}: no recv of {u!r} on device {device} is ordered before the consumer "
                        f"(stream {stream})")
