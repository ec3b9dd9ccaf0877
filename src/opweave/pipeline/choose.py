"""The CUDA default's choice: the scheduler and stream cap a fitted device predicts fastest; and what the fit of
that device (:mod:`opweave.costs.calibrate`) replays, :func:`replay`.

:func:`choose` runs every single-device scheduler at every stream cap through schedule → lower → validate →
simulate (the fitted ``gpu`` model of :mod:`opweave.costs.calibrated`) and returns the predicted-fastest with every
prediction, so that a caller can say what it picked and why. It is a pure function of the graph, the costs and the
device: no torch, no GPU.

The schedulers see ``costs`` as given (a profile's latencies, or the fitted op times, under the ``ideal`` model: what
they were measured on); HEFT's cross-stream cost is what the device's cross-stream edge costs beyond a same-stream
one (:func:`sync_options`), as the replay charges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from opweave import schedulers
from opweave.costs.calibrated import Device
from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.plan.make import plan_for

STREAM_CAPS = (2, 4, 8)
SYNC_SCHEDULERS = ("heft",)  # the schedulers with a sync_ms option


def sync_options(name: str, dev: Device) -> dict[str, Any]:
    """The options that give scheduler ``name`` the device's fitted cost of a cross-stream edge (ms): what it costs
    beyond a same-stream edge (the kernel gap every edge pays), none when it costs less."""
    extra_us = max(0.0, dev.event_wait_us - dev.kernel_gap_us)
    return {"sync_ms": extra_us / 1e3} if name in SYNC_SCHEDULERS else {}


@dataclass(frozen=True)
class Prediction:
    scheduler: str
    streams: int
    makespan_ms: float
    streams_used: int
    syncs: int


@dataclass(frozen=True)
class Choice:
    """The predicted-fastest plan and every prediction it was picked from (fastest first)."""

    scheduler: str
    streams: int
    makespan_ms: float
    predictions: list[Prediction] = field(default_factory=list)
    device: str = ""

    def reason(self) -> str:
        """One line: what was picked, its predicted time, and the runner-up's."""
        text = (f"{self.scheduler} on at most {self.streams} streams: {self.makespan_ms:.3f} ms predicted on "
                f"{self.device}")
        others = [p for p in self.predictions if (p.scheduler, p.streams) != (self.scheduler, self.streams)]
        if others:
            text += f" (next: {others[0].scheduler}/{others[0].streams} {others[0].makespan_ms:.3f} ms"
            text += f", of {len(self.predictions)} plans)"
        return text


def choose(graph: OpGraph, costs: Costs, dev: Device, *, dtype: str = "float32",
           names: Sequence[str] | None = None, stream_caps: Sequence[int] = STREAM_CAPS) -> Choice:
    """The (scheduler, stream cap) whose plan ``dev`` predicts fastest for ``graph``; ties go to the earlier
    scheduler of ``names`` (default every single-device scheduler, in :func:`opweave.schedulers.names` order) and
    the smaller cap. ``costs`` are what the schedulers see; the replay prices each op at its latency in ``costs``
    on the fitted device (its kernels in ``costs`` where given, gaps, waits, sharing, the call)."""
    from opweave.backends.simulate import makespan_ms
    from opweave.costs import calibrated

    names = [n for n in (names or schedulers.names()) if n not in schedulers.MULTI_DEVICE]
    replay = calibrated.costs(graph, dev, dtype, latency_ms=costs.latency_ms, launches=costs.kernels)
    ideal = replace(costs, model="ideal")
    predictions = []
    for name in names:
        for cap in stream_caps[:1] if name == "sequential" else stream_caps:  # one stream whatever the cap
            sched, launch_plan = plan_for(graph, ideal, name, streams=cap, **sync_options(name, dev))
            predictions.append(Prediction(name, cap, makespan_ms(graph, launch_plan, replay), sched.streams_used,
                                          launch_plan.syncs))
    ranked = sorted(predictions, key=lambda p: (p.makespan_ms, names.index(p.scheduler), p.streams))
    best = ranked[0]
    return Choice(best.scheduler, best.streams, best.makespan_ms, ranked, dev.name)


def benchmark_graph(model: str, batch: int) -> OpGraph:
    """The graph the GPU benchmark schedules: the model captured one op per fx node (float32 capture; the dtype is
    the cost model's)."""
    from opweave.capture import load

    return load(model, batch_size=batch, coarsen=False)[2].graph


def replay() -> Any:
    """What :mod:`opweave.costs.calibrate` replays the GPU benchmark's rows with: :func:`benchmark_graph`, a
    scheduler's validated plan (:func:`opweave.plan.make.plan_for`) and the simulator's whole call
    (:func:`opweave.backends.simulate.makespan_ms`)."""
    from opweave.backends.simulate import makespan_ms
    from opweave.costs.calibrate import Replay

    return Replay(benchmark_graph, lambda graph, costs, name, streams: plan_for(graph, costs, name, streams=streams)[1],
                  makespan_ms)
