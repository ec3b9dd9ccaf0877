"""Opara (Chen et al., IEEE TC 2024 [1]): greedy stream allocation (Alg. 1) + resource- and
interference-aware launch order (Alg. 2).

**Alg. 1, stream allocation.** Ops are visited in topological order. Each op carries a SYNC flag, False until one
successor has taken over its stream. An op ``v`` joins the stream of its first predecessor (in edge order) whose
flag is still False, and sets that flag; if every predecessor has already handed its stream on (or ``v`` is a
source), ``v`` opens a new stream. So a stream is only ever *reused* by a direct successor of its last op, every
stream is a path of graph edges, and a finished stream is never recycled for unrelated work (Opara launched 28
streams for GoogLeNet). Syncs: every edge whose ends sit on different streams needs an event recorded after the
producer and waited on by the consumer's stream (the reference code adds one ``wait_event`` per such input);
lowering (``opweave.plan``) inserts them, skipping waits already implied by earlier ones.

**Alg. 2, launch order.** Two ready lists, memory-bound (``costs.category == "memory"``) and compute-bound ops with
in-degree 0 among unlaunched ops. Each step takes the list other than the one used last (the first step takes the
compute list; an empty list is skipped), launches the op of least *resource demand* in it (ties: first to become
ready; ops freed by the same launch enter in capture order), then releases its successors.

*Resource demand* — the paper uses the per-block shared memory, registers and threads that its profiler records;
the device limits are not in :class:`Costs`, so each resource kind is normalized by the largest value of that
kind in the graph and the demand is the largest normalized share (the op's dominant resource). Ops without
``costs.resources`` fall back to ``costs.utilization`` (share of the GPU the op fills alone; missing counts as 1,
i.e. launched after ops known to be small). With neither, all demands tie and the order is ready-list FIFO.

Departures: the reference code (icloud-ecnu/Opara, OperatorLauncher.py) ranks by shared memory alone and flips
between the lists every iteration even when one is empty; we alternate relative to the list used last, as the
text says. Optional ``streams`` cap K (Opara has none): the Alg. 1 streams, heaviest total latency first, go to
the least-loaded of K streams (ties: lowest id); a merged stream issues its ops in launch order. ``devices`` > 1
is ignored (every op on device 0). ``predicted_ms`` replays the result under the ideal model.

Complexity: Alg. 1 O(V + E); Alg. 2 O(V·W + E) for ready lists of width W; the cap O(S log S + S·K).

References
----------
.. [1] A. Chen, F. Xu, L. Han, Y. Dong, L. Chen, Z. Zhou and F. Liu, "Opara: Exploiting Operator Parallelism for
   Expediting DNN Inference on GPUs", *IEEE Transactions on Computers*, 2024. DOI: 10.1109/TC.2024.3475589.
"""

from __future__ import annotations

from collections.abc import Iterable

from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.schedulers._listsched import ideal_finish_times, makespan_ms, merge_streams, renumber_streams
from opweave.schedulers.schedule import Schedule


def allocate_streams(graph: OpGraph) -> dict[str, int]:
    """Alg. 1: stream of every op, streams numbered in the order they are launched."""
    stream_of: dict[str, int] = {}
    handed_on: set[str] = set()  # ops whose SYNC flag is True
    stream_count = 0
    for op in graph.topo_order:
        for pred in graph.preds[op]:
            if pred not in handed_on:
                stream_of[op] = stream_of[pred]
                handed_on.add(pred)
                break
        else:
            stream_of[op] = stream_count
            stream_count += 1
    return stream_of


def resource_demand(graph: OpGraph, costs: Costs) -> dict[str, float]:
    """Each op's dominant normalized resource share (see the module docstring), in [0, 1]."""
    largest: dict[str, float] = {}
    for amounts in costs.resources.values():
        for kind, amount in amounts.items():
            largest[kind] = max(largest.get(kind, 0.0), amount)
    demand = {}
    for op in graph.ids:
        needs = costs.resources.get(op)
        if needs:
            demand[op] = max((amount / largest[kind] if largest[kind] else 0.0) for kind, amount in needs.items())
        else:
            demand[op] = costs.util(op)
    return demand


def launch_order(graph: OpGraph, costs: Costs) -> list[str]:
    """Alg. 2: resource- and interference-aware launch order (a topological order)."""
    demand = resource_demand(graph, costs)
    indegree = {op: len(graph.preds[op]) for op in graph.ids}
    ready: dict[str, list[str]] = {"memory": [], "compute": []}

    def release(ops: Iterable[str]) -> None:
        for op in sorted(ops, key=graph.index.__getitem__):
            ready["memory" if costs.category.get(op) == "memory" else "compute"].append(op)

    release(op for op in graph.ids if indegree[op] == 0)
    order: list[str] = []
    last_kind = "memory"  # so that the first pick comes from the compute list when both have ops
    while ready["memory"] or ready["compute"]:
        kind = "compute" if last_kind == "memory" else "memory"
        if not ready[kind]:
            kind = last_kind
        queue = ready[kind]
        op = min(queue, key=demand.__getitem__)  # min() keeps the first of equals: FIFO ties
        queue.remove(op)
        order.append(op)
        last_kind = kind
        freed = []
        for succ in graph.succs[op]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                freed.append(succ)
        release(freed)
    return order


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1) -> Schedule:
    stream_of = allocate_streams(graph)
    if streams is not None and len(set(stream_of.values())) > streams:
        stream_of = merge_streams(stream_of, streams, costs.latency_ms)
    order = launch_order(graph, costs)
    stream_of = renumber_streams(order, stream_of)
    times = ideal_finish_times(graph, costs, order, stream_of)
    return Schedule("opara", order, stream_of, {op: 0 for op in order}, predicted_ms=makespan_ms(times),
                    options={"streams": streams} if streams is not None else {})
