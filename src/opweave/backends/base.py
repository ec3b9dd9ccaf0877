"""What every backend needs from a LaunchPlan: per (device, stream) the steps it runs, with each wait resolved.

A ``wait`` waits for the latest ``record`` of its event issued before it on the same device (DESIGN.md §3); a
``recv`` waits for the matching ``send`` (same op, devices swapped). Resolving both here, once, lets a backend treat
every synchronization as "wait for signal k" / "raise signal k" without re-reading the plan's issue order.
"""

from __future__ import annotations

from dataclasses import dataclass

from opweave.plan import LaunchPlan, PlanError

Lane = tuple[int, int]  # (device, stream)


@dataclass(frozen=True)
class Step:
    kind: str  # "launch" | "signal" | "wait"
    op: str | None = None
    signal: int | None = None


@dataclass
class Program:
    """A plan split into lanes. ``lanes[(device, stream)]`` lists that stream's steps in issue order."""

    lanes: dict[Lane, list[Step]]
    num_signals: int
    issue_order: list[tuple[Lane, Step]]

    @classmethod
    def from_plan(cls, plan: LaunchPlan) -> Program:
        lanes: dict[Lane, list[Step]] = {}
        issue_order: list[tuple[Lane, Step]] = []
        latest_record: dict[tuple[int, int], int] = {}  # (device, event) -> signal of its latest record
        sent: dict[tuple[str, int, int], int] = {}  # (op, from device, to device) -> signal
        num_signals = 0
        for ins in plan.instrs:
            lane = (ins.device, ins.stream)
            if ins.kind == "launch":
                step = Step("launch", op=ins.op)
            elif ins.kind in ("record", "send"):
                step = Step("signal", signal=num_signals)
                if ins.kind == "record":
                    latest_record[(ins.device, ins.event)] = num_signals
                else:
                    sent[(ins.op, ins.device, ins.peer)] = num_signals
                num_signals += 1
            elif ins.kind == "wait":
                if (ins.device, ins.event) not in latest_record:
                    raise PlanError(f"wait on device {ins.device} stream {ins.stream} for event {ins.event} "
                                    "that no earlier record sets")
                step = Step("wait", signal=latest_record[(ins.device, ins.event)])
            elif ins.kind == "recv":
                if (ins.op, ins.peer, ins.device) not in sent:
                    raise PlanError(f"recv of op {ins.op!r} on device {ins.device} from device {ins.peer} "
                                    "has no matching send before it")
                step = Step("wait", signal=sent[(ins.op, ins.peer, ins.device)])
            else:
                raise PlanError(f"unknown instruction kind {ins.kind!r}")
            lanes.setdefault(lane, []).append(step)
            issue_order.append((lane, step))
        return cls(lanes, num_signals, issue_order)
