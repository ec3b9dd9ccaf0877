"""HEFT: Heterogeneous Earliest-Finish-Time list scheduling (Topcuoglu, Hariri and Wu, IEEE TPDS 2002 [1]; §4.1),
on identical lanes: the scheduler opweave gives CPU lanes, where a few cores are the processors.

The papers' GPU schedulers rank an op by its own latency (LIOS eq. 5) or by levels (IOS, wavefront): on a GPU with
8 streams that leaves little idle, but on two or four CPU lanes it leaves a lane idle while the longest path waits.
HEFT ranks an op by its *upward rank*, the longest path from it to an exit (§4.1, eq. 5):
``rank_u(v) = w(v) + max over successors s of (c(v, s) + rank_u(s))``, and puts each op on the lane where it
finishes first: ``EFT(v, p) = max(avail(p), max over preds u of (FT(u) + c(u, v) when u is on another lane)) +
w(v)``.

Choices where the text is for another setting:

* **Identical lanes.** ``w(v)`` is the op's latency (``costs.latency_ms``; the paper's mean over processors).
* **Communication is a synchronisation.** Lanes share memory, so an edge between lanes costs a signal and a wait,
  not a transfer: ``c(u, v) = sync_ms`` (option, default 0) for every edge between two lanes, 0 on one lane, and the
  mean cost in the rank is ``sync_ms`` too. On a CPU a cross-lane wait that blocks costs a thread wake-up, and each
  one splits a fused segment in two, so a measured ``sync_ms`` makes HEFT keep chains on one lane.
* **A ready list instead of insertion.** §4.1 takes the ops in decreasing rank and inserts an op into an idle
  gap of a processor when it fits. A lane here runs its ops in launch order (FIFO) and the launch order is the
  scheduling order, so an op can only go after the last one of its lane; taking ops in static rank order would
  then leave the gaps idle (a high-rank op whose inputs come late blocks its lane for the ready ones behind it,
  which lengthened RandWire's makespan on its CPU costs: docs/design.md, §3.4). So, as HLFET does (Adam, Chandy and
  Dickson, CACM 1974) and LIOS's Alg. 1 (§IV), each step takes the highest-ranked op among those whose
  predecessors are all scheduled.
* **Ties.** Equal ranks: the earlier op in the graph's topological order; equal EFTs: the lowest lane.
* ``predicted_ms`` is the ideal replay of the result (syncs free, as the simulator's ``ideal`` model), so it is
  what ``opweave simulate`` shows; with ``sync_ms = 0`` it is HEFT's own makespan.

Complexity O((V + E)·K + V log V) for K lanes.

References
----------
.. [1] H. Topcuoglu, S. Hariri and M.-Y. Wu, "Performance-Effective and Low-Complexity Task Scheduling for
   Heterogeneous Computing", *IEEE Transactions on Parallel and Distributed Systems* 13(3), 2002, pp. 260-274.
   DOI: 10.1109/71.993206.
"""

from __future__ import annotations

import heapq

from opweave.costs.model import Costs
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph
from opweave.schedulers._listsched import ideal_finish_times, makespan_ms, renumber_streams
from opweave.schedulers.schedule import Schedule

DEFAULT_STREAMS = 2


def upward_ranks(graph: OpGraph, latency_ms: dict[str, float], sync_ms: float = 0.0) -> dict[str, float]:
    """``rank_u`` of every op (eq. 5 with ``c = sync_ms``).

    >>> from opweave import examples
    >>> from opweave.costs.model import from_graph
    >>> graph = examples.load("lios-fig3")
    >>> ranks = upward_ranks(graph, from_graph(graph).latency_ms)
    >>> max(ranks.values()) == graph.critical_path_ms()
    True
    """
    rank: dict[str, float] = {}
    for op in reversed(graph.topo_order):
        rank[op] = latency_ms[op] + max((sync_ms + rank[s] for s in graph.succs[op]), default=0.0)
    return rank


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1,
             sync_ms: float = 0.0) -> Schedule:
    if sync_ms < 0:
        raise UsageError(f"sync_ms must be at least 0, got {sync_ms}")
    lanes = streams or DEFAULT_STREAMS
    latency = costs.latency_ms
    rank = upward_ranks(graph, latency, sync_ms)
    position = {op: i for i, op in enumerate(graph.topo_order)}
    unplaced_preds = {op: len(graph.preds[op]) for op in graph.ids}
    ready = [(-rank[op], position[op], op) for op in graph.ids if not unplaced_preds[op]]
    heapq.heapify(ready)
    avail = [0.0] * lanes
    finish: dict[str, float] = {}
    lane_of: dict[str, int] = {}
    order: list[str] = []
    while ready:
        *_, op = heapq.heappop(ready)
        best, best_finish = 0, float("inf")
        for lane in range(lanes):
            start = avail[lane]
            for pred in graph.preds[op]:
                start = max(start, finish[pred] + (sync_ms if lane_of[pred] != lane else 0.0))
            if start + latency[op] < best_finish:
                best, best_finish = lane, start + latency[op]
        lane_of[op], finish[op] = best, best_finish
        avail[best] = best_finish
        order.append(op)
        for succ in graph.succs[op]:
            unplaced_preds[succ] -= 1
            if not unplaced_preds[succ]:
                heapq.heappush(ready, (-rank[succ], position[succ], succ))
    lane_of = renumber_streams(order, lane_of)
    predicted = makespan_ms(ideal_finish_times(graph, costs, order, lane_of))
    return Schedule("heft", order, lane_of, {op: 0 for op in order}, predicted_ms=predicted,
                    options={"streams": lanes, "sync_ms": sync_ms})
