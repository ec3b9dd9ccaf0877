"""The simulator: replays a :class:`~opweave.plan.LaunchPlan` under a cost model, with no device.

Every instruction runs once the instructions it directly follows in happens-before have completed: the previous
instruction of its (device, stream) (FIFO) and, for a wait or recv, the record or send it pairs with
(:meth:`opweave.plan.semantics.PlanInterpreter.predecessors`). Besides:

* ``launch`` runs its op. Under ``ideal`` it takes exactly ``latency_ms``; under ``gpu`` the device's running ops
  share it by processor sharing (:mod:`opweave.costs.contention`), so an op takes longer when others crowd it.
* ``record`` and ``send`` complete as soon as their stream reaches them (the send does not hold the sending
  stream: the copy engine moves the tensor).
* ``wait`` completes once its record has completed; under ``gpu`` the edge costs ``event_overhead_ms``: what waits
  on it starts no earlier than the record's completion plus that. The edge, not the waiting stream, pays it: a
  stream whose own earlier work ends later is not delayed.
* ``recv`` of ``u`` completes at ``send completion + transfer`` where transfer is the largest
  ``costs.transfer_ms(u, v)`` over the consumers ``v`` of ``u`` on the receiving device (the tensor crosses once
  for all of them, so it is there when the slowest edge says it is).

Overheads (``gpu`` only; ``ideal`` has none, so a list scheduler's own prediction equals the replay):
with a CUDA Graph the whole plan is one graph launch, so nothing starts before ``graph_launch_overhead_ms``. A
graph has kernels and edges only: a stream's order is a chain of edges, each wait an edge. An op's first kernel
starts ``kernel_gap_ms`` after its stream's previous kernel ends (its same-stream edge) and ``event_overhead_ms``
after the record of each of its waits completes (its cross-stream edges), whichever is later, and each further
kernel of the op (``Costs.kernels`` per op) ``kernel_gap_ms`` after the one before; the device's front end starts
one kernel every ``dispatch_ms`` whatever its stream, in the order the kernels become ready. Without a graph a
single CPU thread per device issues the launches one after another, so the k-th launch of a device (1-based, issue
order) cannot start before ``k × launch_overhead_ms``, and a wait's edge costs ``event_overhead_ms``.

``sequential_ms`` replays every op on one stream of one device in topological (capture-tie-broken) order under the
same model, so speed-ups compare like with like.

Complexity: O(I log I) for I instructions, plus O(n²) for the processor sharing of n ops on one device.

Each :func:`simulate` logs its makespan, sequential time and syncs at DEBUG level on this module's logger.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from opweave.costs.contention import FluidDevice
from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import Instr, LaunchPlan
from opweave.plan.semantics import Lane, PlanInterpreter

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    """A replay: per op its start and finish time (ms), per (device, stream) its busy time."""

    makespan_ms: float
    start_ms: dict[str, float]
    finish_ms: dict[str, float]
    busy_ms: dict[Lane, float]
    sequential_ms: float
    syncs: int
    lane_of: dict[str, Lane] = field(default_factory=dict)
    model: str = "ideal"
    name: str = "graph"

    @property
    def speedup(self) -> float:
        return self.sequential_ms / self.makespan_ms if self.makespan_ms else 1.0


def simulate(graph: OpGraph, plan: LaunchPlan, costs: Costs, *, cuda_graph: bool | None = None) -> SimResult:
    """Replay ``plan`` under ``costs.model``; ``cuda_graph`` defaults to ``costs.gpu.cuda_graph``.

    Under the ideal model a list scheduler's prediction is its replay (LIOS Table III: 38 ms against 73 in order):

    >>> from opweave import examples, schedulers
    >>> from opweave.costs.model import from_graph
    >>> from opweave.plan.lower import lower
    >>> graph = examples.load("lios-fig3")
    >>> costs = from_graph(graph)
    >>> [simulate(graph, lower(graph, schedulers.run(name, graph, costs, streams=3)), costs).makespan_ms
    ...  for name in ("sequential", "lios")]
    [73.0, 38.0]
    """
    if cuda_graph is None:
        cuda_graph = costs.gpu.cuda_graph
    start, finish, makespan = _replay(graph, plan, costs, cuda_graph)
    sequential = LaunchPlan([Instr(0, "launch", 0, op=o) for o in graph.topo_order])
    sequential_ms = _replay(graph, sequential, costs, cuda_graph)[2]
    lane_of = {i.target: (i.device, i.stream) for i in plan.instrs if i.kind == "launch"}
    busy: dict[Lane, float] = {}
    for op, lane in lane_of.items():
        busy[lane] = busy.get(lane, 0.0) + finish[op] - start[op]
    log.debug("simulate %s (%s model): makespan %.4f ms, sequential %.4f ms, %d lanes, %d syncs", graph.name,
              costs.model, makespan, sequential_ms, len(busy), plan.syncs)
    return SimResult(makespan, start, finish, busy, sequential_ms, plan.syncs, lane_of, costs.model, graph.name)


def makespan_ms(graph: OpGraph, plan: LaunchPlan, costs: Costs, *, cuda_graph: bool | None = None) -> float:
    """The makespan :func:`simulate` reports, without its sequential replay (for callers that time many plans)."""
    return _replay(graph, plan, costs, costs.gpu.cuda_graph if cuda_graph is None else cuda_graph)[2]


class Replay:
    """A plan replayed by the simulator, as the backend of a plan that runs nowhere (a server in simulation): the
    time it takes (``makespan_ms``) and the share of the device its ops keep busy on average (``utilization``: the
    ops' latency x utilization summed, over the makespan, at most 1). Calling it runs no op and returns both."""

    def __init__(self, graph: OpGraph, plan: LaunchPlan, costs: Costs):
        self.makespan_ms = makespan_ms(graph, plan, costs)
        work = sum(costs.latency_ms[o] * costs.util(o) for o in graph.ids)
        self.utilization = min(1.0, work / self.makespan_ms) if self.makespan_ms else 0.0
        self.stats: dict[str, Any] = {}

    def __call__(self, *args: Any) -> tuple[float, float]:
        return self.makespan_ms, self.utilization

    def close(self) -> None:
        pass


def _replay(graph: OpGraph, plan: LaunchPlan, costs: Costs,
            cuda_graph: bool) -> tuple[dict[str, float], dict[str, float], float]:
    """Event-driven replay: (start_ms per op, finish_ms per op, makespan_ms)."""
    instrs = plan.instrs
    gpu = costs.model == "gpu"
    deps: list[list[int]] = [[] for _ in instrs]
    dependents: list[list[int]] = [[] for _ in instrs]
    not_before_ms = [0.0] * len(instrs)  # earliest start from launch overheads
    launches_issued: dict[int, int] = {}
    device_of_op = {i.target: i.device for i in instrs if i.kind == "launch"}
    order = PlanInterpreter().run(plan)
    for i, ins in enumerate(instrs):
        deps[i] = order.predecessors(i)  # a recv's send comes last: ready() reads it as deps[i][-1]
        for j in deps[i]:
            dependents[j].append(i)
        if gpu and cuda_graph:
            not_before_ms[i] = costs.gpu.graph_launch_overhead_ms
        elif gpu and ins.kind == "launch":
            launches_issued[ins.device] = k = launches_issued.get(ins.device, 0) + 1
            not_before_ms[i] = k * costs.gpu.launch_overhead_ms

    def transfer_ms(recv: Instr) -> float:
        return max((costs.transfer_ms(recv.target, v) for v in graph.succs[recv.target]
                    if device_of_op.get(v) == recv.device), default=0.0)

    devices = {d: FluidDevice(sharing=gpu) for d in {i.device for i in instrs}}
    graphed = gpu and cuda_graph
    done_ms: list[float | None] = [None] * len(instrs)
    lane_ms = [0.0] * len(instrs)  # when the lane's own work up to each instruction is done
    edge_ms = [-math.inf] * len(instrs)  # in a graph: when the edges waited for since the lane's last launch arrive
    waiting = [len(d) for d in deps]
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    launch_index: dict[Hashable, int] = {ins.target: i for i, ins in enumerate(instrs) if ins.kind == "launch"}
    events: list[tuple[float, int, str]] = []  # (time, instruction, "ready" | "start" | "done")
    front_end = dict.fromkeys(devices, 0.0)  # when each device's front end can start the next kernel (CUDA graph)

    def ready(i: int) -> None:
        ins = instrs[i]
        prev = order.previous[i]
        lane = max(not_before_ms[i], lane_ms[prev] if prev is not None else 0.0)
        edge = edge_ms[prev] if prev is not None else -math.inf
        if ins.kind == "wait":
            source = order.source[i]
            arrival = done_ms[source] + (costs.gpu.event_overhead_ms if gpu else 0.0)
            if graphed:  # an edge of the graph: it holds the lane's next launch, not the lane
                lane_ms[i], edge_ms[i] = lane, max(edge, arrival)
                heapq.heappush(events, (max(lane, done_ms[source]), i, "done"))
                return
            heapq.heappush(events, (max(lane, arrival), i, "done"))
            return
        if ins.kind == "launch" and graphed:  # the first kernel after its lane's gap or its last edge
            gap = costs.gpu.kernel_gap_ms
            t = max(lane + gap, edge) + max(costs.kernel_count(ins.target) - 1, 0) * gap  # 0 kernels: as 1
            heapq.heappush(events, (t, i, "ready" if costs.gpu.dispatch_ms else "start"))
            return
        t = max(lane, edge)
        if ins.kind == "recv":
            sent = done_ms[deps[i][-1]]  # its send, done before the recv is ready
            assert sent is not None
            t = max(t, sent + transfer_ms(ins))
        if ins.kind == "launch" and gpu:
            heapq.heappush(events, (t, i, "start"))
        elif ins.kind == "launch":
            start[ins.target] = t
            heapq.heappush(events, (t + costs.latency_ms[ins.target], i, "done"))
        else:
            heapq.heappush(events, (t, i, "done"))

    def complete(i: int, t: float) -> None:
        done_ms[i] = t
        if not (graphed and instrs[i].kind == "wait"):
            lane_ms[i] = t
        if instrs[i].kind == "launch":
            finish[instrs[i].target] = t
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready(j)

    for i in range(len(instrs)):
        if not deps[i]:
            ready(i)
    while events or any(d.remaining_ms for d in devices.values()):
        now = min([events[0][0] if events else math.inf] + [d.next_finish_ms() for d in devices.values()])
        for d in devices.values():
            for op, t in d.advance(now):
                complete(launch_index[op], t)
        while events and events[0][0] <= now:
            t, i, what = heapq.heappop(events)
            if what == "done":
                complete(i, t)
            elif what == "ready":  # the front end starts the kernels in the order they became ready
                device = instrs[i].device
                begin = max(t, front_end[device])
                front_end[device] = begin + costs.kernel_count(instrs[i].target) * costs.gpu.dispatch_ms
                heapq.heappush(events, (begin, i, "start"))
            else:
                op = instrs[i].target
                start[op] = t
                devices[instrs[i].device].add(op, costs.latency_ms[op], costs.util(op))
    stuck = [i for i, t in enumerate(done_ms) if t is None]
    if stuck:  # cannot happen for a plan whose sync sources precede their sinks; kept as a guard
        raise RuntimeError(f"replay stuck at instruction {stuck[0]} ({instrs[stuck[0]]})")
    return start, finish, max((t for t in done_ms if t is not None), default=0.0)
