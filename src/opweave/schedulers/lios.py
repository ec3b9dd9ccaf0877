"""LIOS: latency-based list scheduling (Ping et al., IEEE TSC 2023 [1]; §II-D, §IV, Algorithm 1).

Algorithm 1: a wait list holds the *data-independent* ops — every predecessor already **scheduled** (not
necessarily finished, §IV-B). Each step picks the op with the highest ``Rank(v) = latency_ms[v]`` (eq. 5) and puts
it on the stream ``p`` (of ``K``) with the smallest ``EFT(v, p) = max(free(p), max FT(pred)) + w(v)`` (eqs. 1, 2, 6),
where ``free(p)`` is the finish time of the last op placed on ``p`` (no back-filling into idle gaps, as Table III
shows: step 4 gives v2 EST 18 on p1 although p1 is idle from 0 to 3).

Tie-breaking, which the paper leaves to its running example (Table III):

* equal Rank — the op that entered the wait list first (the list is FIFO; ops freed by the same step enter it in
  capture order). Step 4 of Table III picks v2 among v2, v3, v4 (all 5 ms).
* equal EFT — the lowest-numbered stream ("the first stream that achieves the smallest EFT", §IV-C).

Departures: the wait list starts with every source op (Alg. 1 line 3 assumes one entry node); ``K`` defaults to
8 streams (the paper's P is an input); ``devices`` > 1 is ignored (single GPU, every op on device 0). Alg. 1 line 11
appends (v, p*, EFT, EST); we store (v, p*, start, finish) as Definition 6 and Table III do.

The launch order is the scheduling order, which is topological; replaying it under the ideal model reproduces
LIOS's own start/finish times exactly, so ``predicted_ms`` is LIOS's makespan.

Complexity O(V·(V + K) + E) with a linear scan of the wait list (a heap would give O(V log V + V·K + E)).

References
----------
.. [1] Y. Ping, H. Jiang, X. Liu, Z. Zhao, Z. Zhou and X. Chen, "Latency-Based Inter-Operator Scheduling for CNN
   Inference Acceleration on GPU", *IEEE Transactions on Services Computing*, 2023. DOI: 10.1109/TSC.2023.3345952.
"""

from __future__ import annotations

from typing import NamedTuple

from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.schedulers.schedule import Schedule

DEFAULT_STREAMS = 8


class ScheduleTuple(NamedTuple):
    """One entry of LIOS's schedule S (Definition 6)."""

    op: str
    stream: int
    start_ms: float
    finish_ms: float


def lios_schedule(graph: OpGraph, costs: Costs, stream_count: int = DEFAULT_STREAMS) -> list[ScheduleTuple]:
    """Algorithm 1's result list S (Definition 6): one (op, stream, start_ms, finish_ms) per op, in scheduling order.

    Streams are numbered from 0 (the paper's p1 is stream 0).
    """
    latency_ms = costs.latency_ms
    unscheduled_preds = {op: len(graph.preds[op]) for op in graph.ids}
    wait_list = [op for op in graph.ids if unscheduled_preds[op] == 0]
    arrival = {op: i for i, op in enumerate(wait_list)}  # FIFO position in the wait list breaks Rank ties
    stream_free_ms = [0.0] * stream_count
    finish_ms: dict[str, float] = {}
    result: list[ScheduleTuple] = []
    while wait_list:
        op = max(wait_list, key=lambda o: (latency_ms[o], -arrival[o]))  # highest Rank, first in on ties
        wait_list.remove(op)
        ready_ms = max((finish_ms[p] for p in graph.preds[op]), default=0.0)
        est = [max(free, ready_ms) for free in stream_free_ms]
        stream = min(range(stream_count), key=lambda s: (est[s] + latency_ms[op], s))
        finish_ms[op] = stream_free_ms[stream] = est[stream] + latency_ms[op]
        result.append(ScheduleTuple(op, stream, est[stream], finish_ms[op]))
        newly_ready = []
        for succ in graph.succs[op]:
            unscheduled_preds[succ] -= 1
            if unscheduled_preds[succ] == 0:
                newly_ready.append(succ)
        for succ in sorted(newly_ready, key=graph.index.__getitem__):
            arrival[succ] = len(arrival)
            wait_list.append(succ)
    return result


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1) -> Schedule:
    steps = lios_schedule(graph, costs, streams or DEFAULT_STREAMS)
    order = [step.op for step in steps]
    return Schedule("lios", order, {step.op: step.stream for step in steps}, {op: 0 for op in order},
                    predicted_ms=max((step.finish_ms for step in steps), default=0.0),
                    options={"streams": streams or DEFAULT_STREAMS})
