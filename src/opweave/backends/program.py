"""What every backend needs from a LaunchPlan: per (device, stream) the steps it runs, with each wait resolved.

A ``wait`` waits for the latest ``record`` of its event issued before it on the same device; a
``recv`` waits for the matching ``send`` (same op, devices swapped) — :func:`opweave.plan.semantics.sync_sources` pairs
them, the same rule the validator proves the plan with. Resolved once here, every synchronization becomes "wait for
signal k" / "raise signal k" and a backend need not re-read the plan's issue order.
"""

from __future__ import annotations

from dataclasses import dataclass

from opweave.plan.launchplan import LaunchPlan
from opweave.plan.semantics import Lane, sync_sources


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
        sources = sync_sources(plan)  # checks every instruction; each wait/recv -> the record/send it waits for
        raising = [i for i, ins in enumerate(plan.instrs) if ins.kind in ("record", "send")]
        signal_of = {i: signal for signal, i in enumerate(raising)}  # instruction index -> dense signal number
        lanes: dict[Lane, list[Step]] = {}
        issue_order: list[tuple[Lane, Step]] = []
        for i, ins in enumerate(plan.instrs):
            if ins.kind == "launch":
                step = Step("launch", op=ins.op)
            elif i in signal_of:
                step = Step("signal", signal=signal_of[i])
            else:
                step = Step("wait", signal=signal_of[sources[i]])
            lane = (ins.device, ins.stream)
            lanes.setdefault(lane, []).append(step)
            issue_order.append((lane, step))
        return cls(lanes, len(signal_of), issue_order)
