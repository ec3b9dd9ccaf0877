"""HIOS stage plans and their evaluator, shared by HIOS-LP, HIOS-MR and Algorithm 2 (:mod:`.grouping`).

A *plan* gives every device a sequence of stages; a stage is a tuple of independent ops (integer op indices) that
run concurrently, one per stream. Stages of one device run one after the other (a barrier per device); stages of
different devices are not synchronized, and a cross-device edge (u, v) adds ``costs.transfer_ms(u, v)`` (§III-A).

Timing of a stage (:func:`time_stage`):

* ``ideal`` cost model — each op of a stage starts as soon as the device's previous stage has finished and its own
  inputs have arrived, and takes its ``latency_ms``; the stage finishes with its last op. This is what the lowered
  plan does, so the prediction equals the simulator's ideal replay (``_listsched.ideal_finish_times``).
  Departure: §III-A assumes all ops of a stage start together once *all* their inputs are ready (an upper bound).
* any other cost model — §III-A's rule: the stage starts when the device is free and every input of every op has
  arrived, and lasts ``t(S) = costs.stage_latency_ms([[op] for op in S])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph

Plan = list[list[tuple[int, ...]]]  # device -> stages -> op indices


class StageTimes(NamedTuple):
    """The times of a plan as Algorithm 2 keeps them (:class:`.grouping.WorkingPlan`)."""

    makespan_ms: float
    finish_ms: list[float]  # per op
    end_ms: list[float]  # per stage, indexed by the stage's leader


class Timing(NamedTuple):
    makespan_ms: float
    finish_ms: list[float]  # per op
    walk: list[tuple[int, int]]  # (device, stage position) in a topological order of the stage graph


class Problem:
    """The graph as integer-indexed lists, plus a cache of stage latencies (built once per schedule call)."""

    def __init__(self, graph: OpGraph, costs: Costs):
        self.ids = graph.ids
        index = graph.index
        self.latency_ms = [costs.latency_ms[op] for op in self.ids]
        self.preds = [[(index[u], costs.transfer_ms(u, v)) for u in graph.preds[v]] for v in self.ids]
        self.out_edges = [[(index[w], costs.transfer_ms(v, w)) for w in graph.succs[v]] for v in self.ids]
        self.succs = [[w for w, _ in edges] for edges in self.out_edges]
        self.descendants = [graph.descendants[v] for v in self.ids]
        self.topo_pos = [0] * len(self.ids)
        for pos, op in enumerate(graph.topo_order):
            self.topo_pos[index[op]] = pos
        self.costs = costs
        self.ideal = costs.model == "ideal"
        self._stage_ms: dict[tuple[int, ...], float] = {}

    def stage_ms(self, stage: tuple[int, ...]) -> float:
        """t(S) under a non-ideal cost model: every op of the stage on its own stream, started together."""
        if stage not in self._stage_ms:
            self._stage_ms[stage] = self.costs.stage_latency_ms([[self.ids[i]] for i in stage])
        return self._stage_ms[stage]

    def independent(self, ops: Sequence[int]) -> bool:
        return not any(self.descendants[u] >> v & 1 for u in ops for v in ops)


def time_stage(problem: Problem, preds: list[list[tuple[int, float]]], device_of: Sequence[int],
               stage: tuple[int, ...], dev: int, barrier_ms: float, finish_ms: list[float]) -> float:
    """Time ``stage`` on ``dev`` after its device's previous stage ended at ``barrier_ms``: set ``finish_ms`` of its
    ops from the finishes of their inputs ``preds`` (op -> [(input, transfer_ms)]), and return when it ends."""
    latency_ms, ideal = problem.latency_ms, problem.ideal
    end_ms = barrier_ms
    for v in stage:
        start_ms = barrier_ms
        for u, transfer_ms in preds[v]:
            arrival_ms = finish_ms[u] + transfer_ms if device_of[u] != dev else finish_ms[u]
            if arrival_ms > start_ms:
                start_ms = arrival_ms
        if ideal:
            finish_ms[v] = start_ms = start_ms + latency_ms[v]
        if start_ms > end_ms:
            end_ms = start_ms  # ideal: latest finish; otherwise: latest start
    if not ideal:
        end_ms += problem.stage_ms(stage)
        for v in stage:
            finish_ms[v] = end_ms
    return end_ms


def evaluate(problem: Problem, device_of: Sequence[int], plan: Plan) -> Timing | None:
    """Time a plan; None if it deadlocks (a cycle in the stage graph).

    The stage graph has an edge from each stage to the next on its device and from the stage of u to the stage of v
    for every data edge (u, v); Kahn's algorithm walks it."""
    n = len(device_of)
    stages = [stage for seq in plan for stage in seq]
    where = [(dev, k) for dev, seq in enumerate(plan) for k in range(len(seq))]
    indegree = [1 if k else 0 for _, k in where]
    stage_of = [-1] * n
    for sid, stage in enumerate(stages):
        for op in stage:
            stage_of[op] = sid
    succs = problem.succs
    for sid, stage in enumerate(stages):
        for v in stage:
            for w in succs[v]:
                if stage_of[w] != sid:
                    indegree[stage_of[w]] += 1
    finish_ms = [0.0] * n
    device_free_ms = [0.0] * len(plan)
    ready = [sid for sid, d in enumerate(indegree) if d == 0]
    walk: list[tuple[int, int]] = []
    while ready:
        sid = ready.pop()
        walk.append(where[sid])
        dev, k = where[sid]
        device_free_ms[dev] = time_stage(problem, problem.preds, device_of, stages[sid], dev, device_free_ms[dev],
                                         finish_ms)
        if k + 1 < len(plan[dev]):
            indegree[sid + 1] -= 1
            if not indegree[sid + 1]:
                ready.append(sid + 1)
        for v in stages[sid]:
            for w in succs[v]:
                other = stage_of[w]
                if other != sid:
                    indegree[other] -= 1
                    if not indegree[other]:
                        ready.append(other)
    if len(walk) < len(stages):
        return None
    return Timing(max(device_free_ms, default=0.0), finish_ms, walk)


