"""The engine in simulation: virtual time (:class:`SimClock`), combined blocks timed by the simulator
(:class:`SimExecutor`, through the pipeline's :class:`~opweave.pipeline.targets.SimTarget`), and arrivals fed to
an engine on that clock (:class:`Simulation`, :func:`simulate_arrivals`): how policies are compared and trained
without a device, with the same engine and the same policy code a server runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from opweave.costs.model import Costs
from opweave.costs.roofline import estimate
from opweave.costs.roofline import preset as find_preset
from opweave.errors import UsageError
from opweave.pipeline import Compiled, Options
from opweave.pipeline.targets import SimTarget
from opweave.serve.engine.blocks import BlockedModel
from opweave.serve.engine.combined import Part, Signature, name_of, signature, union_costs, union_graph
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.executors import Executor, StepCost
from opweave.serve.engine.requests import QueueFull, Request


class SimClock:
    """Virtual time (seconds) that moves only by ``spend`` (a combined block ran) and ``advance_to`` (idle)."""

    simulated = True

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


class SimExecutor(Executor):
    """Combined blocks timed by the simulator: each part's block graph at its batch
    (:meth:`~opweave.serve.engine.blocks.BlockedModel.graph_at`), costs from the roofline ``preset`` (or ``profiles``)
    under the options' ``cost_model`` (the serving preset's ``gpu``: concurrent ops share the device), planned and
    replayed through the pipeline's simulation target (:class:`~opweave.pipeline.targets.SimTarget`: the scheduler,
    lowering, validation, and the simulator's replay of the plan). A step takes the makespan plus
    ``step_overhead_ms``.

    ``step_overhead_ms`` (default 0.03 ms) stands for what a real step adds around the graph: the engine's decision,
    stacking the inputs and one CUDA Graph launch and synchronization. It is an assumption, not a measurement.

    ``profiles`` maps a model to measured profiles (:class:`opweave.costs.profile.Profile`, by the batch they were
    measured at, for the whole model: op ids are the model's): an op's latency at batch ``n`` is its measured latency
    at the nearest profiled batch ``m`` times the roofline ratio ``estimate(n) / estimate(m)``. Utilization comes from
    the profile where it was measured, else from the roofline.
    """

    device = "sim"
    serves = "sim"  # a GPU's plans, simulated: streams capped at its hardware queues

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, preset: str = "h100",
                 dtype: str = "float32", profiles: dict[str, dict[int, Any]] | None = None,
                 step_overhead_ms: float = 0.03, pad: bool = True):
        super().__init__(models, options, pad=pad)
        find_preset(preset)
        self.preset, self.dtype = preset, dtype
        self.profiles = profiles or {}
        self.step_overhead_ms = step_overhead_ms
        self._part_costs: dict[tuple[str, int, int], Costs] = {}

    def part_costs(self, model: str, block: int, batch: int) -> Costs:
        """What block ``block`` of ``model`` costs at ``batch`` on the simulated device (the class docstring)."""
        key = (model, block, batch)
        if key not in self._part_costs:
            graph = self.models[model].graph_at(block, batch)
            costs = estimate(graph, self.preset, self.dtype, model=self.options.cost_model)
            measured = self.profiles.get(model)
            if measured:
                at = min(measured, key=lambda m: (abs(m - batch), m))
                ref = estimate(self.models[model].graph_at(block, at), self.preset, self.dtype)
                prof = measured[at]
                costs = replace(costs, source=f"profile@{at}", latency_ms={
                    op: prof.latency_ms[op] * costs.latency_ms[op] / ref.latency_ms[op] for op in graph.ids},
                    utilization={op: prof.utilization.get(op, u) for op, u in costs.utilization.items()})
            self._part_costs[key] = costs
        return self._part_costs[key]

    def _build(self, sig: Signature) -> Compiled:
        graph = union_graph([self.models[m].graph_at(b, n) for m, b, n in sig], name_of(sig))
        costs = union_costs([self.part_costs(*key) for key in sig], self.options.cost_model)
        return SimTarget().build(graph, costs, self.options)

    def run(self, parts: list[Part]) -> StepCost:
        makespan_ms, utilization = self.combined_block(signature(parts, self.bucket))()
        seconds = (makespan_ms + self.step_overhead_ms) / 1e3
        return StepCost(seconds, utilization * makespan_ms / (makespan_ms + self.step_overhead_ms))


# ---- the driver ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    time: float
    model: str
    batch: int = 1


@dataclass
class SimRun:
    """What a simulated run produced: every request (answered, timed out), the rejections, and queue-length samples
    ``(time, {model: length})`` every ``sample_s``."""

    requests: list[Request]
    rejected: list[Arrival]
    samples: list[tuple[float, dict[str, int]]]
    end: float
    stats: dict


class Simulation:
    """``arrivals`` (sorted by time) fed to ``engine`` on its simulated clock, advanced on demand: :meth:`advance`
    steps until a virtual time, :meth:`finish` until every accepted request is answered. An arrival during a step
    is submitted at its own time once the step ends: queues change only at step starts, so it sees the queue it
    would have seen. Queue lengths are sampled every ``sample_s``."""

    def __init__(self, engine: Engine, arrivals: list[Arrival], *, sample_s: float = 0.05):
        if not getattr(engine.clock, "simulated", False):
            raise UsageError("simulate_arrivals needs an engine on a SimClock")
        self.engine, self.arrivals, self.sample_s = engine, arrivals, sample_s
        self.requests: list[Request] = []
        self.rejected: list[Arrival] = []
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.i, self.next_sample = 0, engine.clock.now()

    def _catch_up(self, now: float) -> None:
        arrivals, engine = self.arrivals, self.engine
        while True:
            t_arrival = arrivals[self.i].time if self.i < len(arrivals) else math.inf
            if self.next_sample <= now and self.next_sample <= t_arrival:
                self.samples.append((self.next_sample, engine.queue_lengths()))
                self.next_sample += self.sample_s
            elif t_arrival <= now:
                a = arrivals[self.i]
                self.i += 1
                try:
                    self.requests.append(engine.submit(a.model, batch=a.batch, at=a.time))
                except QueueFull:
                    self.rejected.append(a)
            else:
                return

    def advance(self, until: float = math.inf) -> bool:
        """Step until virtual time ``until`` (or until nothing is left to do); False once nothing is left."""
        engine, clock, arrivals = self.engine, self.engine.clock, self.arrivals
        while True:
            now = clock.now()
            self._catch_up(now)
            if now >= until:
                return True
            if engine.step():
                continue
            nxt = min(arrivals[self.i].time if self.i < len(arrivals) else math.inf, engine.next_wake())
            if nxt == math.inf:
                if not engine.busy():
                    return False
                nxt = now + 1e-4  # instances wait on nothing timed: let the policy see the time move
            clock.advance_to(min(max(nxt, now), until))
            if nxt <= now:
                clock.spend(1e-6)

    def result(self) -> SimRun:
        return SimRun(self.requests, self.rejected, self.samples, self.engine.clock.now(), dict(self.engine.stats))


def simulate_arrivals(engine: Engine, arrivals: list[Arrival], *, sample_s: float = 0.05,
                      max_time_s: float | None = None) -> SimRun:
    """Feed ``arrivals`` to ``engine`` on its simulated clock and step until every accepted request is answered (or
    ``max_time_s`` of virtual time); see :class:`Simulation`."""
    sim = Simulation(engine, arrivals, sample_s=sample_s)
    sim.advance(math.inf if max_time_s is None else max_time_s)
    return sim.result()


__all__ = ["Arrival", "SimClock", "SimExecutor", "SimRun", "Simulation", "simulate_arrivals"]
