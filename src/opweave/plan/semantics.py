"""Plan semantics: when one instruction of a :class:`~opweave.plan.launchplan.LaunchPlan` is ordered before another.

* a ``wait`` waits for the latest ``record`` of its event issued before it on the same device; a ``recv`` for the
  latest ``send`` of the same op from its peer to its device earlier in the plan (:func:`sync_sources`);
* happens-before is tracked with vector clocks over lanes ``(device, stream)`` (:func:`join_clocks`);
* stage schedules add barriers between consecutive stages of a device (:func:`stage_barriers`).
"""

from __future__ import annotations

from collections.abc import Iterable

from opweave.errors import PlanError
from opweave.plan.launchplan import KINDS, Instr, LaunchPlan

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
