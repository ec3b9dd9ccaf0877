"""The plan validator: proves that every dependency of the graph is ordered by the plan.

:func:`validate` accepts a :class:`~opweave.plan.LaunchPlan` only if

* every op of the graph is launched exactly once, and nothing else is launched;
* every ``wait`` refers to an event recorded earlier on its device, every ``recv`` to a ``send`` of the same op
  between the same two devices earlier in the plan (backends pair them the same way, ``backends/program.py``);
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

from opweave.errors import PlanError
from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import LaunchPlan
from opweave.plan.semantics import Clock, Lane, join_clocks, stage_barriers, sync_sources
from opweave.schedulers.schedule import Schedule


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
