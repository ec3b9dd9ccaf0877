"""Buffer lifetimes planned from the schedule: where each buffer may be freed, the proof that every release is safe,
and the waits that let a buffer read on other streams be freed early.

A **buffer** is one allocation of a run: the op that allocates it runs on its *allocating lane* (device, stream),
and its *users* are every op that touches it (the allocating op, readers, in-place writers, ops holding a view). The
caller finds them (the CUDA backend runs the model once on fake tensors: :func:`opweave.backends.liveness.
static_buffers`); this module only sees names, lanes, users and sizes, and plans with no device.

**The allocator's rule** (CUDA's caching allocator; ``docs/design.md`` §4 rule 3). A freed block goes back to the
pool of the stream that allocated it and is handed to that stream's next allocation at once, without waiting for
other streams. Freeing a buffer right after instruction ``p`` of its allocating lane is therefore safe when every
use of the buffer *happens before* ``p`` (:mod:`opweave.plan.semantics`): whatever reuses the block is issued to
that lane after ``p``, so it runs after every use (FIFO order), and an op reuses the block only when every reader of
its previous value happens before it. That is all a reuse needs; blocks are never shared between streams.

* :func:`release_points` — the earliest such point of every buffer (``(lane, position)``, the semantics' 1-based
  position on the lane); a buffer with none is kept until the final join (the end of the run).
* :func:`validate_releases` — the proof, from the plan's semantics alone: each release is on the buffer's allocating
  lane and after every use there; a :class:`~opweave.errors.PlanError` names the buffer and the op otherwise.
* :func:`live_bytes` — the bytes live at each instruction of the plan's issue order, a buffer allocated when its
  allocating op is issued and freed at its release (one host thread issues the plan and frees as it goes, so this
  is the peak a run allocates, within what the buffers cover).
* :func:`free_joins` — the **added waits**. A buffer read by ops on other lanes can be freed only once its lane
  waits for those reads; when no wait of the plan does so, it is kept to the end of the run, and with many streams
  such buffers pile up. :func:`free_joins` adds, on the allocating lane, a ``wait`` for an event recorded after the
  reads (an existing ``record`` of the reading lane, or a new one right after the last read), placed before a
  launch that the plan's simulated timing starts after the event has happened (plus ``slack_ms``, the cost model's
  price of a wait): a *free join*, which delays nothing in the simulation. It adds one only where it lowers the
  planned peak (:func:`live_bytes`): at the peak, a buffer kept past it becomes free before it, and stops once
  ``max_waits`` waits are reached or when no free join lowers the peak. An added wait only orders more (the plan
  stays valid: every dependency the plan ordered is still ordered), so lowering's rule that every wait is needed
  holds for the plan a scheduler gets lowered to, not for the plan with added waits.
* :func:`capped_joins` — waits that may **cost time**, for a plan whose planned peak is still over a cap (the CUDA
  target's is 1.25x the one-stream plan's, :func:`opweave.pipeline.memory_pass.memory_pass`): the same joins, placed
  right before the peak's instruction (the latest place that frees the buffer before it), the one that lowers the
  peak most first, each kept only if the caller's ``accept`` takes the plan (a budget on the simulated makespan).
  A peak made of buffers that are all still to be read is beyond any wait: the issue order itself holds them.

Complexity: :func:`release_points` O(I·L) for the clocks (I instructions, L lanes) and O(U·log I) per buffer with U
users; :func:`free_joins` and :func:`capped_joins` that, times the joins they try (at most ``tries`` per wait
added), plus a scan of the buffers live at the peak each time.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

from opweave.errors import PlanError
from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Clock, Lane, PlanInterpreter, Point, covers


@dataclass(frozen=True)
class Buffer:
    """One allocation: its allocating lane, the ops that touch it, its size in bytes.

    ``keys`` name what holds it at run time (the environment entries a backend drops together); ``nbytes`` is what
    :func:`live_bytes` counts (0 when unknown).
    """

    name: str
    alloc_lane: Lane
    users: frozenset[str]
    keys: tuple[str, ...] = ()
    nbytes: int = 0


class Timeline(PlanInterpreter):
    """The plan's clocks at every instruction, by lane, and where each op is launched: what the analyses below read.

    ``clocks[lane][k]`` is the clock at the instruction at position ``k + 1`` of ``lane``; ``launched[op]`` the
    point of ``op``'s launch; ``index[lane][k]`` that instruction's index in the plan.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict[Lane, list[Clock]] = {}
        self.index: dict[Lane, list[int]] = {}
        self.launched: dict[str | None, Point] = {}  # a launch's op -> where it was issued

    def run_instr(self, i: int, ins: Instr, at: Point) -> None:
        self.clocks.setdefault(at[0], []).append(dict(self.clock[at[0]]))
        self.index.setdefault(at[0], []).append(i)
        if ins.kind == "launch":
            self.launched[ins.op] = at


def _on_lane(lane: Lane, clock: Clock) -> int:
    """How far ``clock`` has seen ``lane`` (0: not at all)."""
    return clock.get(lane, 0)


def timeline(plan: LaunchPlan) -> Timeline:
    """The :class:`Timeline` of ``plan`` (raises :class:`PlanError` for a malformed plan)."""
    line = Timeline()
    line.run(plan)
    return line


def release_points(plan: LaunchPlan, buffers: Iterable[Buffer], *,
                   line: Timeline | None = None) -> dict[Point, list[str]]:
    """The earliest safe release of every buffer: ``{(lane, position): [buffer names]}``, freed right after the
    instruction at that point (see the module docstring). Buffers in no entry are kept to the end.

    >>> plan = LaunchPlan([Instr(0, "launch", 0, op="x"), Instr(0, "record", 0, event=0),
    ...                    Instr(0, "wait", 1, event=0), Instr(0, "launch", 1, op="y"),
    ...                    Instr(0, "record", 1, event=1), Instr(0, "launch", 0, op="z"),
    ...                    Instr(0, "wait", 0, event=1)])
    >>> release_points(plan, [Buffer("x_out", (0, 0), frozenset({"x", "y"}))])  # after stream 0 waits for y
    {((0, 0), 4): ['x_out']}
    """
    line = line or timeline(plan)
    out: dict[Point, list[str]] = {}
    for buf in buffers:
        at = _earliest(line, buf)
        if at is not None:
            out.setdefault(at, []).append(buf.name)
    return out


def _earliest(line: Timeline, buf: Buffer) -> Point | None:
    """The first point of the buffer's allocating lane whose clock covers every use (None: no such point)."""
    if not buf.users:
        raise PlanError(f"buffer {buf.name!r} has no users (its allocating op at least must be one)")
    missing = sorted(u for u in buf.users if u not in line.launched)
    if missing:
        raise PlanError(f"buffer {buf.name!r}: user op {missing[0]!r} is not launched by the plan")
    clocks = line.clocks.get(buf.alloc_lane)
    if clocks is None:
        raise PlanError(f"buffer {buf.name!r}: allocating lane {buf.alloc_lane} has no instructions")
    # Clocks only grow along a lane, so the first covering point of each use is found by bisection.
    earliest = 0
    for lane, position in (line.launched[u] for u in buf.users):
        earliest = max(earliest, bisect_left(clocks, position, key=functools.partial(_on_lane, lane)))
    return (buf.alloc_lane, earliest + 1) if earliest < len(clocks) else None


def validate_releases(plan: LaunchPlan, buffers: Iterable[Buffer], releases: dict[Point, list[str]], *,
                      line: Timeline | None = None) -> None:
    """Prove ``releases`` safe from the plan's semantics alone, or raise :class:`PlanError` naming the buffer (and
    the op whose use is not ordered before its release): every release names a known buffer once, sits on the
    buffer's allocating lane at an instruction of the plan, and happens after the launch of every user.

    A buffer absent from ``releases`` is kept to the end, which is always safe.
    """
    line = line or timeline(plan)
    by_name = {b.name: b for b in buffers}
    released: set[str] = set()
    for (lane, position), names in releases.items():
        for name in names:
            buf = by_name.get(name)
            if buf is None:
                raise PlanError(f"release of unknown buffer {name!r} after position {position} of lane {lane}")
            if name in released:
                raise PlanError(f"buffer {name!r} is released twice")
            released.add(name)
            if lane != buf.alloc_lane:
                raise PlanError(f"buffer {name!r} is released on device {lane[0]} stream {lane[1]}, not on the "
                                f"stream that allocated it (device {buf.alloc_lane[0]} stream {buf.alloc_lane[1]})")
            clocks = line.clocks.get(lane, [])
            if not 1 <= position <= len(clocks):
                raise PlanError(f"buffer {name!r} is released after position {position} of device {lane[0]} stream "
                                f"{lane[1]}, which has {len(clocks)} instructions")
            clock = clocks[position - 1]
            for user in sorted(buf.users):
                at = line.launched.get(user)
                if at is None:
                    raise PlanError(f"buffer {name!r}: user op {user!r} is not launched by the plan")
                if not covers(clock, at):
                    raise PlanError(f"buffer {name!r} is released after instruction {line.index[lane][position - 1]} "
                                    f"(device {lane[0]} stream {lane[1]}) before its use by op {user!r} "
                                    f"(device {at[0][0]} stream {at[0][1]}) is ordered before that point: the "
                                    "stream's next allocation could overwrite it while the op reads it")


def live_bytes(plan: LaunchPlan, buffers: Iterable[Buffer], releases: dict[Point, list[str]], *,
               line: Timeline | None = None) -> list[int]:
    """Bytes of ``buffers`` live at each instruction of the plan, in issue order (see the module docstring): a
    buffer counts from the launch of its first user issued (the op that allocates it) up to the instruction it is
    released after, or to the end when it has none."""
    line = line or timeline(plan)
    delta = [0] * (len(plan.instrs) + 1)
    freed_at = {name: line.index[lane][position - 1] for (lane, position), names in releases.items()
                for name in names}
    for buf in buffers:
        if not buf.nbytes:
            continue
        delta[min(_issued(line, line.launched[u]) for u in buf.users)] += buf.nbytes
        delta[freed_at[buf.name] + 1 if buf.name in freed_at else len(plan.instrs)] -= buf.nbytes
    out, now = [], 0
    for d in delta[:-1]:
        now += d
        out.append(now)
    return out


def _issued(line: Timeline, at: Point) -> int:
    return line.index[at[0]][at[1] - 1]


def free_joins(plan: LaunchPlan, buffers: list[Buffer], start_ms: dict[str, float], finish_ms: dict[str, float], *,
               slack_ms: float = 0.0, max_waits: int = 16, tries: int = 4,
               accept: Callable[[LaunchPlan], bool] | None = None) -> tuple[LaunchPlan, int]:
    """``plan`` with added waits that lower the planned peak (:func:`live_bytes`), each placed
    where the plan's simulated timing (``start_ms``/``finish_ms`` per op, from a replay of ``plan`` under the cost
    model it was made with) says its event has already happened, ``slack_ms`` before the launch it precedes (see
    the module docstring). At each peak the ``tries`` largest buffers kept past it are tried, and the first join
    that lowers the peak is kept; ``accept``, when given, may refuse a plan (e.g. one whose simulated makespan grew).
    Stops once ``max_waits`` waits are reached (a join adds one wait per other lane that reads the buffer, so the
    last may pass it) or when no free join lowers the peak.

    Returns the plan and the number of waits added (the plan is ``plan`` itself when there are none).
    """
    added = 0
    while added < max_waits:
        line = timeline(plan)
        curve = live_bytes(plan, buffers, release_points(plan, buffers, line=line), line=line)
        if not curve:
            break
        peak = max(curve)
        at_peak = curve.index(peak)
        better = None
        for buf in _kept_past(line, buffers, release_points(plan, buffers, line=line), at_peak)[:tries]:
            candidate = _free_join(plan, line, buf, at_peak, start_ms, finish_ms, slack_ms)
            if candidate is None:
                continue
            new_line = timeline(candidate)
            new_curve = live_bytes(candidate, buffers, release_points(candidate, buffers, line=new_line),
                                   line=new_line)
            lower = max(new_curve) < peak or (max(new_curve) == peak and new_curve.count(peak) < curve.count(peak))
            if lower and (accept is None or accept(candidate)):
                better = candidate
                break
        if better is None:
            break
        plan = better
        added += sum(ins.kind == "wait" for ins in better.instrs) - sum(ins.kind == "wait" for ins in line.instrs)
    return plan, added


def capped_joins(plan: LaunchPlan, buffers: list[Buffer], cap_bytes: int, *, accept: Callable[[LaunchPlan], bool],
                 max_waits: int = 32, tries: int = 8) -> tuple[LaunchPlan, int]:
    """``plan`` with waits added until its planned peak (:func:`live_bytes`) is at most ``cap_bytes``: waits that
    may cost time, where :func:`free_joins` adds only free ones (see the module docstring). At each peak, each of the
    ``tries`` largest buffers kept past it gets, on its allocating lane, the waits that order its uses on other lanes
    right before the peak's instruction (the latest place that frees it before the peak: the lane's next launch is
    the only one it may delay); the join that lowers the peak most and that ``accept`` takes (e.g. a budget on the
    simulated makespan, checked on the whole plan each time) is kept. Stops at the cap, once ``max_waits`` waits are
    reached (a join adds one wait per lane that reads the buffer, so the last may pass it),
    or when no accepted join lowers the peak; a plan over the cap is then as low as the budget let it go.

    Returns the plan and the number of waits added (the plan is ``plan`` itself when there are none).
    """
    added = 0
    while added < max_waits:
        line = timeline(plan)
        releases = release_points(plan, buffers, line=line)
        curve = live_bytes(plan, buffers, releases, line=line)
        if not curve or max(curve) <= cap_bytes:
            break
        peak = max(curve)
        at_peak = curve.index(peak)
        ranked: list[tuple[tuple[int, int], int, LaunchPlan]] = []
        for buf in _kept_past(line, buffers, releases, at_peak)[:tries]:
            candidate = _free_join(plan, line, buf, at_peak, latest=True)
            if candidate is None:
                continue
            new_curve = planned_curve(candidate, buffers)
            key = (max(new_curve), new_curve.count(max(new_curve)))
            if key < (peak, curve.count(peak)):
                ranked.append((key, len(ranked), candidate))
        better = next((c for _, _, c in sorted(ranked, key=lambda r: r[:2]) if accept(c)), None)
        if better is None:
            break
        added += better.syncs - plan.syncs
        plan = better
    return plan, added


def planned_curve(plan: LaunchPlan, buffers: Iterable[Buffer]) -> list[int]:
    """:func:`live_bytes` of ``plan`` with its earliest releases (:func:`release_points`)."""
    line = timeline(plan)
    return live_bytes(plan, buffers, release_points(plan, buffers, line=line), line=line)


def planned_peak(plan: LaunchPlan, buffers: Iterable[Buffer]) -> int:
    """The largest of :func:`planned_curve` (0 for an empty plan)."""
    return max(planned_curve(plan, buffers), default=0)


def _kept_past(line: Timeline, buffers: list[Buffer], releases: dict[Point, list[str]], at: int) -> list[Buffer]:
    """The buffers live after instruction ``at`` whose every use was issued before it: an added wait could free them
    before it. Largest first."""
    freed_at = {name: line.index[lane][position - 1] for (lane, position), names in releases.items()
                for name in names}
    out = []
    for buf in buffers:
        if not buf.nbytes or freed_at.get(buf.name, len(line.instrs)) < at:
            continue
        issued = [_issued(line, line.launched[u]) for u in buf.users]
        if max(issued) < at:
            out.append(buf)
    return sorted(out, key=lambda b: -b.nbytes)


def _free_join(plan: LaunchPlan, line: Timeline, buf: Buffer, before: int, start_ms: dict[str, float] | None = None,
               finish_ms: dict[str, float] | None = None, slack_ms: float = 0.0, *,
               latest: bool = False) -> LaunchPlan | None:
    """``plan`` with the waits (and records) on ``buf``'s allocating lane that order its uses on other lanes before
    a point of that lane issued before instruction ``before``, placed where the timing makes them free (module
    docstring), or, when ``latest``, right before instruction ``before``; None when there is no such place, or a use
    is on another device."""
    lane, instrs = buf.alloc_lane, plan.instrs
    device = lane[0]
    index = line.index[lane]
    k = bisect_left(index, before)
    clock = line.clocks[lane][k - 1] if k else {}
    last: dict[Lane, Point] = {}  # per other lane, the last use the allocating lane does not order yet
    for user in buf.users:
        at = line.launched[user]
        if at[0] != lane and not covers(clock, at):
            if at[0][0] != device:
                return None  # read on another device: a wait cannot order it (a recv would)
            last[at[0]] = max(last.get(at[0], at), at)
    if not last:
        return None
    records: dict[int, Instr] = {}  # plan index -> a new record to insert right before it
    events: list[int | None] = []
    after, ready = -1, 0.0
    next_event = 1 + max((ins.event for ins in instrs if ins.device == device and ins.event is not None), default=-1)
    for other, at in sorted(last.items()):
        use = _issued(line, at)
        lane_index = line.index[other]
        next_on_lane = lane_index[at[1]] if at[1] < len(lane_index) else None
        if next_on_lane is not None and next_on_lane < before and instrs[next_on_lane].kind == "record":
            events.append(instrs[next_on_lane].event)  # the record right after the use: done when the use is
            after = max(after, next_on_lane)
        else:  # a new record right after the use
            records[use + 1] = Instr(device, "record", other[1], event=next_event)
            events.append(next_event)
            next_event += 1
            after = max(after, use)
        if not latest:
            assert finish_ms is not None  # the timing the waits are placed by
            ready = max(ready, finish_ms[cast(str, instrs[use].op)])
    # Right before the first launch of the lane issued after the records that starts once they are done (after the
    # lane's other instructions before it: a record there must not be delayed), or after the lane's last one.
    place = before if latest else _free_place(plan, index, after, ready, start_ms or {}, slack_ms)
    if place > before:
        return None
    inserts = {i: [ins] for i, ins in records.items()}
    inserts.setdefault(place, []).extend(Instr(device, "wait", lane[1], event=e) for e in events)
    out: list[Instr] = []
    for i, ins in enumerate(instrs):
        out.extend(inserts.get(i, ()))
        out.append(ins)
    out.extend(inserts.get(len(instrs), ()))
    return LaunchPlan(out)


def _free_place(plan: LaunchPlan, index: list[int], after: int, ready: float, start_ms: dict[str, float],
                slack_ms: float) -> int:
    """Where :func:`_free_join` puts its waits: the plan index right before the first launch of the lane (``index``)
    issued after ``after`` that the timing starts ``slack_ms`` after ``ready``, past the lane's instructions before
    it; after the lane's last instruction when there is none."""
    previous = -1
    for i in index:
        if i > after and plan.instrs[i].kind == "launch" and start_ms[cast(str, plan.instrs[i].op)] >= ready + slack_ms:
            break
        previous = i
    return max(after, previous) + 1
