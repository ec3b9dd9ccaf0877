"""Fluid processor sharing: how concurrent ops slow each other down under the ``gpu`` cost model.

Model (:class:`opweave.costs.GpuModel`): an op alone fills ``utilization`` (0–1) of its device and needs
``latency_ms`` at full speed. While the running ops' utilizations sum to ``U``, every running op progresses at rate
``1 / max(1, U)``: ops that together fit on the device do not slow each other, ops that do not fit share it in
proportion (generalized processor sharing).

:class:`FluidDevice` integrates this exactly, event by event (the next finish or the next arrival), with no time
step; the simulator drives one per device. :func:`run_streams` runs independent FIFO streams on one device (what
:meth:`opweave.costs.Costs.stage_latency_ms` needs).

Example: two ops of 2 ms at utilization 1 each finish at 4 ms together; at utilization 0.5 each, at 2 ms.
Complexity: each arrival or finish costs O(running ops), so n ops cost O(n²) in the worst case.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

# Remaining work below this (ms at full speed) counts as finished: absorbs rounding in the subtractions.
_EPS_MS = 1e-12


class FluidDevice:
    """One device's running ops under processor sharing, advanced in exact events.

    ``add`` starts an op at the current time; ``next_finish_ms`` says when the first running op will finish if
    nothing arrives before; ``advance(t)`` moves the clock to ``t`` and returns the ops that finished on the way,
    with their finish times. With ``sharing=False`` every op runs at full speed (the ``ideal`` model).
    """

    def __init__(self, start_ms: float = 0.0, *, sharing: bool = True):
        self.now_ms = start_ms
        self.sharing = sharing
        self.remaining_ms: dict[Hashable, float] = {}  # work left, in ms at full speed
        self.utilization: dict[Hashable, float] = {}

    def rate(self) -> float:
        """Progress per ms of wall time of every running op."""
        if not self.sharing:
            return 1.0
        return 1.0 / max(1.0, sum(self.utilization.values()))

    def add(self, op: Hashable, latency_ms: float, utilization: float = 1.0) -> None:
        if op in self.remaining_ms:
            raise ValueError(f"op {op!r} is already running")
        self.remaining_ms[op] = latency_ms
        self.utilization[op] = utilization

    def next_finish_ms(self) -> float:
        if not self.remaining_ms:
            return math.inf
        return self.now_ms + min(self.remaining_ms.values()) / self.rate()

    def advance(self, to_ms: float) -> list[tuple[Hashable, float]]:
        """Run until ``to_ms``; return the ops that finished by then, in finish order, with their finish times."""
        finished: list[tuple[Hashable, float]] = []
        while self.remaining_ms:
            least_ms = min(self.remaining_ms.values())
            finish_ms = self.now_ms + least_ms / self.rate()
            if finish_ms > to_ms:
                break
            for op in self.remaining_ms:  # subtract the exact least work so the first finisher lands on 0
                self.remaining_ms[op] -= least_ms
            done = [op for op, left in self.remaining_ms.items() if left <= _EPS_MS]
            for op in done:
                del self.remaining_ms[op], self.utilization[op]
                finished.append((op, finish_ms))
            self.now_ms = finish_ms
        if to_ms > self.now_ms:
            progress = (to_ms - self.now_ms) * self.rate()
            for op in self.remaining_ms:
                self.remaining_ms[op] -= progress
            self.now_ms = to_ms
        return finished


def run_streams(streams: Sequence[Sequence[tuple[Hashable, float, float]]],
                start_ms: float = 0.0) -> dict[Hashable, float]:
    """Finish time (ms) of every op when independent FIFO streams share one device.

    ``streams`` lists, per stream, ``(op, latency_ms, utilization)`` in the order the stream runs them; every
    stream starts at ``start_ms``. Example: ``run_streams([[("a", 2, 1)], [("b", 2, 1)]])`` gives
    ``{"a": 4.0, "b": 4.0}``.
    """
    device = FluidDevice(start_ms)
    position = [0] * len(streams)
    stream_of: dict[Hashable, int] = {}
    finish: dict[Hashable, float] = {}

    def start_next(s: int) -> None:
        if position[s] < len(streams[s]):
            op, latency_ms, utilization = streams[s][position[s]]
            position[s] += 1
            stream_of[op] = s
            device.add(op, latency_ms, utilization)

    for s in range(len(streams)):
        start_next(s)
    while device.remaining_ms:
        for op, finish_ms in device.advance(device.next_finish_ms()):
            finish[op] = finish_ms
            start_next(stream_of[op])
    return finish
