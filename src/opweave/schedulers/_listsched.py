"""Shared helpers for list schedulers: replay a stream assignment under the ideal cost model.

The ideal model is the papers' own: an op takes ``costs.latency_ms[op]`` whatever runs beside it,
each (device, stream) is a FIFO queue, an op starts once its stream is free and its predecessors have finished
(plus ``costs.transfer_ms`` for a predecessor on another device), and launches and syncs are free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opweave.costs.model import Costs
from opweave.errors import ScheduleError
from opweave.ir.graph import OpGraph


def ideal_finish_times(graph: OpGraph, costs: Costs, order: Sequence[str], stream_of: Mapping[str, int], *,
                       stage_of: Mapping[str, int] | None = None,
                       device_of: Mapping[str, int] | None = None) -> dict[str, tuple[float, float]]:
    """Start and finish time (ms) of every op when ops are issued in ``order`` onto their streams.

    ``start = max(finish of the previous op on the same (device, stream), finish of every predecessor
    [+ transfer_ms when it ran on another device], finish of every op of an earlier stage on the same device)``.
    ``order`` must be topological (a :class:`ScheduleError` names an op issued before its predecessor); with
    ``stage_of`` its stages must not decrease along ``order`` on one device, the invariant
    :meth:`~opweave.schedulers.schedule.Schedule.check` owns (here a decrease would simply start a new stage).

    Example: v1(3) → v2(5), v3(5) on streams 0, 0, 1 gives v1 (0, 3), v2 (3, 8), v3 (3, 8).
    Complexity O(V + E).
    """
    device = (lambda o: device_of.get(o, 0)) if device_of is not None else (lambda o: 0)
    stream_free_ms: dict[tuple[int, int], float] = {}
    # per device: current stage, finish of everything in earlier stages, finish of everything so far
    stage_now: dict[int, int] = {}
    barrier_ms: dict[int, float] = {}
    done_ms: dict[int, float] = {}
    times: dict[str, tuple[float, float]] = {}
    for op in order:
        dev = device(op)
        key = (dev, stream_of[op])
        start = stream_free_ms.get(key, 0.0)
        for pred in graph.preds[op]:
            if pred not in times:
                raise ScheduleError(f"op {op!r} is issued before its predecessor {pred!r}")
            arrival = times[pred][1]
            if device(pred) != dev:
                arrival += costs.transfer_ms(pred, op)
            start = max(start, arrival)
        if stage_of is not None:
            stage = stage_of[op]
            if stage != stage_now.get(dev):
                stage_now[dev] = stage
                barrier_ms[dev] = done_ms.get(dev, 0.0)
            start = max(start, barrier_ms[dev])
        finish = start + costs.latency_ms[op]
        times[op] = (start, finish)
        stream_free_ms[key] = finish
        done_ms[dev] = max(done_ms.get(dev, 0.0), finish)
    return times


def makespan_ms(times: Mapping[str, tuple[float, float]]) -> float:
    """Latest finish time of a replay (0 for an empty graph)."""
    return max((finish for _, finish in times.values()), default=0.0)


def merge_streams(stream_of: Mapping[str, int], cap: int, latency_ms: Mapping[str, float]) -> dict[str, int]:
    """Fold streams onto at most ``cap`` streams, longest-processing-time first: streams in order of decreasing total
    latency (ties: lower id) each go whole onto the least-loaded target (ties: the one holding fewer streams, then
    lower id: streams of zero latency spread over empty targets instead of piling onto the first). Ops keep their
    launch order, so a target stream interleaves its merged streams in that order.

    Complexity O(V + S log S + S·cap) for S source streams.
    """
    load_ms: dict[int, float] = {}
    for op, s in stream_of.items():
        load_ms[s] = load_ms.get(s, 0.0) + latency_ms[op]
    target_load_ms = [0.0] * cap
    target_count = [0] * cap
    target: dict[int, int] = {}
    for s in sorted(load_ms, key=lambda s: (-load_ms[s], s)):
        t = min(range(cap), key=lambda t: (target_load_ms[t], target_count[t], t))
        target[s] = t
        target_load_ms[t] += load_ms[s]
        target_count[t] += 1
    return {op: target[s] for op, s in stream_of.items()}


def renumber_streams(order: Sequence[str], stream_of: Mapping[str, int]) -> dict[str, int]:
    """Streams renumbered 0, 1, … by the launch position of their first op (stream 0 starts the graph), keyed in
    launch order."""
    new_id: dict[int, int] = {}
    for op in order:
        new_id.setdefault(stream_of[op], len(new_id))
    return {op: new_id[stream_of[op]] for op in order}
