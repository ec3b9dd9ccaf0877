"""The memory pass a CUDA plan goes through before it runs (docs/design.md, section 4 rule 3): waits that free
buffers read on other streams early, found on one run on fake tensors per build (:class:`BuildBuffers`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from opweave.costs import Costs
from opweave.plan import LaunchPlan
from opweave.plan.make import plan_for

log = logging.getLogger(__name__)

PEAK_CAP = 1.25  # the planned peak a multi-stream plan may reach, over the one-stream plan's on the same buffers
CAP_BUDGET = 0.01  # the share of the simulated makespan the waits that bring a plan under PEAK_CAP may add


class BuildBuffers:
    """What :func:`memory_pass` finds once per build and reuses for every plan of it (one captured model, its example
    inputs, one set of costs): ``fake``, the model's run on fake tensors for the inputs
    (:class:`~opweave.backends.liveness.FakeRun`, which the CUDA backend reuses for the example's input signature),
    and the one-stream plan (the ``sequential`` scheduler's) with its planned peak on each set of buffers asked for
    (the plans' sets differ only where a plan allocates a group on several lanes, which leaves the group out)."""

    def __init__(self, captured: Any, inputs: tuple[Any, ...], costs: Costs):
        from opweave.backends.liveness import FakeRun

        self.captured, self.costs = captured, costs
        self.fake = FakeRun(captured, inputs)
        self._one_stream: LaunchPlan | None = None
        self._peaks: dict[frozenset[Any], int] = {}

    def one_stream_peak(self, buffers: Iterable[Any]) -> int:
        """The one-stream plan's planned peak on ``buffers``, every one of them on its one stream."""
        from opweave.plan import lifetimes

        if self._one_stream is None:
            self._one_stream = plan_for(self.captured.graph, self.costs, "sequential", streams=1)[1]
        first = self._one_stream.instrs[0]
        on_one = frozenset(replace(b, alloc_lane=(first.device, first.stream)) for b in buffers)
        if on_one not in self._peaks:
            self._peaks[on_one] = lifetimes.planned_peak(self._one_stream, on_one)
        return self._peaks[on_one]


def with_free_joins(captured: Any, plan: LaunchPlan, inputs: tuple[Any, ...], costs: Costs, *, cuda_graph: bool = True,
                    max_waits: int = 16, cap: float = PEAK_CAP, budget: float = CAP_BUDGET,
                    shared: BuildBuffers | None = None) -> LaunchPlan:
    """The plan of :func:`memory_pass`."""
    return memory_pass(captured, plan, inputs, costs, cuda_graph=cuda_graph, max_waits=max_waits, cap=cap,
                       budget=budget, shared=shared)[0]


def memory_pass(captured: Any, plan: LaunchPlan, inputs: tuple[Any, ...], costs: Costs, *, cuda_graph: bool = True,
                max_waits: int = 16, cap: float = PEAK_CAP, budget: float = CAP_BUDGET,
                shared: BuildBuffers | None = None) -> tuple[LaunchPlan, float | None]:
    """``plan`` with the waits the memory pass adds so that buffers read on other streams are freed before the
    planned peak, the result validated:

    * free ones (:func:`opweave.plan.lifetimes.free_joins`): each placed where the plan's replay under ``costs``
      (:func:`opweave.backends.simulate.simulate`) has its event done, kept only if the replay's makespan does not
      grow;
    * then, while the planned peak is over ``cap`` times the one-stream plan's (the ``sequential`` scheduler's
      plan, every buffer on its one stream), waits that may cost time (:func:`opweave.plan.lifetimes.capped_joins`),
      the one that lowers the peak most first, kept only while the replay's makespan stays within ``budget`` (a
      share) of ``plan``'s.

    The buffers come from the model's run on fake tensors (:func:`opweave.backends.liveness.static_buffers`), and
    the one-stream plan's peak from the one-stream plan, both taken from ``shared`` (a :class:`BuildBuffers` made
    for the same ``captured``, ``inputs`` and ``costs``), so that the plans of one build share them; made for this
    call alone when not given. Returns the plan and its planned peak over the one-stream plan's: ``plan`` itself
    and 1.0 for one stream, ``plan`` when no wait lowers the peak, ``plan`` and None when the model cannot run on
    fake tensors."""
    from opweave.backends.liveness import static_buffers
    from opweave.backends.program import Program
    from opweave.backends.simulate import makespan_ms, simulate
    from opweave.plan import lifetimes
    from opweave.plan.validate import validate

    program = Program.from_plan(plan)
    if len(program.lanes) < 2:
        return plan, 1.0
    shared = shared or BuildBuffers(captured, inputs, costs)
    try:
        buffers = static_buffers(captured, inputs, program, shared.fake)
    except Exception as exc:  # noqa: BLE001 - the backend learns its buffers from a real run then; no joins
        log.debug("%s: no added waits: %s", captured.graph.name, exc)
        return plan, None
    graph = captured.graph
    replay = simulate(graph, plan, costs, cuda_graph=cuda_graph)
    limit = replay.makespan_ms * (1 + 1e-9)
    slack_ms = costs.gpu.event_overhead_ms if costs.model == "gpu" else 0.0

    def within(limit_ms: float) -> Callable[[LaunchPlan], bool]:
        return lambda p: makespan_ms(graph, p, costs, cuda_graph=cuda_graph) <= limit_ms

    joined, added = lifetimes.free_joins(plan, buffers, replay.start_ms, replay.finish_ms, slack_ms=slack_ms,
                                      max_waits=max_waits, accept=within(limit))
    one_peak = shared.one_stream_peak(buffers)
    joined, over = lifetimes.capped_joins(joined, buffers, int(cap * one_peak), accept=within(limit * (1 + budget)))
    peak = lifetimes.planned_peak(joined, buffers)
    if added or over:
        validate(graph, joined)
        log.info("%s: %d waits free buffers early (%d over the cap of %.2fx the one-stream peak): planned peak "
                 "%.2f MB, was %.2f; predicted %.3f ms, was %.3f", graph.name, added + over, over, cap,
                 peak / 2**20, lifetimes.planned_peak(plan, buffers) / 2**20,
                 makespan_ms(graph, joined, costs, cuda_graph=cuda_graph), replay.makespan_ms)
    return joined, peak / one_peak if one_peak else 1.0



__all__ = ["CAP_BUDGET", "PEAK_CAP", "BuildBuffers", "memory_pass", "with_free_joins"]
