"""What a scheduler decides: per op its device, stream, launch position and (for stage schedulers) stage.

A :class:`Schedule` is plain data. ``order`` is the global launch order, a topological order of the graph; the ops
of one (device, stream) are issued in the order they appear in it. Stream numbers are local to a device.
Stage schedulers (IOS, HIOS, wavefront, TOP) set ``stage_of``: every op of stage k+1 starts after every op of
stage k on the same device has finished (lowering adds the barrier). :meth:`Schedule.check` is the one place that
checks a schedule against its graph, the stage invariant included (a device's stages never decrease along its
issue order); ``schedulers.run`` and ``lower`` call it, so nothing downstream checks it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opweave.errors import ScheduleError
from opweave.ir.graph import OpGraph


@dataclass
class Schedule:
    scheduler: str
    order: list[str]
    stream_of: dict[str, int]
    device_of: dict[str, int] = field(default_factory=dict)
    stage_of: dict[str, int] | None = None
    predicted_ms: float | None = None
    scheduling_time_s: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)

    def device(self, op: str) -> int:
        return self.device_of.get(op, 0)

    @property
    def streams_used(self) -> int:
        return len({(self.device(o), s) for o, s in self.stream_of.items()})

    @property
    def devices_used(self) -> int:
        return len({self.device(o) for o in self.order})

    def check(self, graph: OpGraph) -> None:
        """Raise :class:`ScheduleError` unless every op is placed once, ``order`` is topological and, for a stage
        schedule, every op has a stage and the stages of each device never decrease along ``order``."""
        if sorted(self.order) != sorted(graph.ids):
            missing = set(graph.ids) - set(self.order)
            extra = [o for o in self.order if o not in graph.op or self.order.count(o) > 1]
            raise ScheduleError(f"{self.scheduler}: order must list each op once (missing {sorted(missing)[:3]}, "
                                f"unknown or repeated {extra[:3]})")
        pos = {o: i for i, o in enumerate(self.order)}
        for (u, v) in graph.edge:
            if pos[u] > pos[v]:
                raise ScheduleError(f"{self.scheduler}: op {v!r} is launched before its predecessor {u!r}")
        for o in graph.ids:
            if o not in self.stream_of:
                raise ScheduleError(f"{self.scheduler}: op {o!r} has no stream")
        if self.stage_of is not None:
            self._check_stages()

    def _check_stages(self) -> None:
        """The stage invariant: a device's stages never decrease along its issue order (a barrier would otherwise
        wait for an op issued later). With a topological order it implies that no edge within a device goes back to
        an earlier stage. Lowering and the ideal replay rely on it."""
        stage_now: dict[int, int] = {}
        stage_of = self.stage_of or {}
        for o in self.order:
            if o not in stage_of:
                raise ScheduleError(f"{self.scheduler}: op {o!r} has no stage")
            device, stage = self.device(o), stage_of[o]
            if stage < stage_now.get(device, stage):
                raise ScheduleError(f"{self.scheduler}: op {o!r} of stage {stage} is issued after stage "
                                    f"{stage_now[device]} on device {device}; order the ops of a device by stage")
            stage_now[device] = stage
