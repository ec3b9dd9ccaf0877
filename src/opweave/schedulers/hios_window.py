"""HIOS intra-GPU grouping (Kundu & Shu, HIOS 2024, paper 002, §IV-B, Algorithm 2) and the stage-plan evaluator
that HIOS-LP, HIOS-MR and Algorithm 2 share.

A *plan* gives every device a sequence of stages; a stage is a tuple of independent ops (integer op indices) that
run concurrently, one per stream. Stages of one device run one after the other (a barrier per device); stages of
different devices are not synchronized, and a cross-device edge (u, v) adds ``costs.transfer_ms(u, v)`` (§III-A).

Timing of a stage (:func:`evaluate`):

* ``ideal`` cost model — each op of a stage starts as soon as the device's previous stage has finished and its own
  inputs have arrived, and takes its ``latency_ms``; the stage finishes with its last op. This is what the lowered
  plan does, so the prediction equals the simulator's ideal replay (``_listsched.ideal_finish_times``).
  Departure: §III-A assumes all ops of a stage start together once *all* their inputs are ready (an upper bound).
* any other cost model — §III-A's rule: the stage starts when the device is free and every input of every op has
  arrived, and lasts ``t(S) = costs.stage_latency_ms([[op] for op in S])``.

Algorithm 2 (``parallelize``): visit ops in descending priority; for op v_i still alone in its stage on GPU g_i,
try windows W = v_i plus the next p stages on g_i (p = 1 … w−1). Choices where the text is loose:

* a window only takes following stages that are still single ops (it never swallows a group formed earlier) and
  stops at the first dependent op (Line 7: the ops of W must be pairwise independent);
* the cycle check (Line 10) runs on the stage graph *including* each device's stage order (the "implicit
  dependencies" of §I); without those edges a merge can deadlock two GPUs waiting on each other. The check is
  Kahn's algorithm inside :func:`evaluate`, which returns ``None`` on a cycle;
* of the windows of one v_i the lowest latency L' wins, and only if L' < L (Lines 13–15); Line 11's ``G = G'``
  before that test is read as part of accepting the candidate (the example of Fig. 5 keeps only improving merges).

A candidate only changes stages from v_i's stage on, so Algorithm 2 re-times only the stages that the current
plan's walk reaches at or after v_i's stage, reusing the finish times before it (same result, about half the work).

Complexity: each evaluation is O(V + E); Algorithm 2 runs at most (w−1)·V of them: O(w·V·(V + E)) (the paper's
bound is O(w²·V·E³) with its own cycle check).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from opweave.costs import Costs
from opweave.ir import OpGraph

Plan = list[list[tuple[int, ...]]]  # device -> stages -> op indices


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


def evaluate(problem: Problem, device_of: Sequence[int], plan: Plan,
             timed: tuple[list[int], list[float], list[float]] | None = None) -> Timing | None:
    """Time a plan; None if it deadlocks (a cycle in the stage graph).

    The stage graph has an edge from each stage to the next on its device and from the stage of u to the stage of v
    for every data edge (u, v); Kahn's algorithm walks it. ``timed = (stages_done, finish_ms, device_free_ms)``
    says that the first ``stages_done[d]`` stages of every device d are already timed (a predecessor-closed part
    of the stage graph shared with an earlier plan): only the other stages are walked, and ``walk`` lists only them.
    """
    n, devices = len(device_of), len(plan)
    if timed is None:
        timed = ([0] * devices, [0.0] * n, [0.0] * devices)
    stages_done, finish_ms, device_free_ms = timed[0], timed[1][:], timed[2][:]
    stage_of = [-1] * n
    stages: list[tuple[int, ...]] = []
    where: list[tuple[int, int]] = []
    indegree: list[int] = []
    has_next: list[bool] = []
    for dev, seq in enumerate(plan):
        for k in range(stages_done[dev], len(seq)):
            sid = len(stages)
            stages.append(seq[k])
            where.append((dev, k))
            indegree.append(1 if k > stages_done[dev] else 0)
            has_next.append(k + 1 < len(seq))
            for op in seq[k]:
                stage_of[op] = sid
    succs = problem.succs
    for sid, stage in enumerate(stages):
        for v in stage:
            for w in succs[v]:
                if stage_of[w] != sid:
                    indegree[stage_of[w]] += 1
    preds, latency_ms, ideal = problem.preds, problem.latency_ms, problem.ideal
    ready = [sid for sid, d in enumerate(indegree) if d == 0]
    walk: list[tuple[int, int]] = []
    while ready:
        sid = ready.pop()
        walk.append(where[sid])
        stage = stages[sid]
        dev = where[sid][0]
        barrier_ms = end_ms = device_free_ms[dev]
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
        device_free_ms[dev] = end_ms
        if has_next[sid]:
            indegree[sid + 1] -= 1
            if not indegree[sid + 1]:
                ready.append(sid + 1)
        for v in stage:
            for w in succs[v]:
                other = stage_of[w]
                if other != sid:
                    indegree[other] -= 1
                    if not indegree[other]:
                        ready.append(other)
    if len(walk) < len(stages):
        return None
    return Timing(max(device_free_ms, default=0.0), finish_ms, walk)


def parallelize(problem: Problem, device_of: Sequence[int], plan: Plan, priority_order: Sequence[int],
                window: int) -> tuple[float, Plan]:
    """Algorithm 2: merge windows of consecutive independent ops on a GPU into stages while latency drops."""
    plan = [list(seq) for seq in plan]
    timing = evaluate(problem, device_of, plan)
    assert timing is not None, "the initial plan must be acyclic"
    for v in priority_order[:-1]:
        dev = device_of[v]
        seq = plan[dev]
        pos = seq.index((v,)) if (v,) in seq else -1
        if pos < 0:
            continue  # v is already grouped
        timed = None
        choice: tuple[Timing, list[tuple[int, ...]]] | None = None
        for p in range(1, window):
            if pos + p >= len(seq) or len(seq[pos + p]) > 1:
                break
            merged = (v,) + tuple(stage[0] for stage in seq[pos + 1:pos + p + 1])
            if not problem.independent(merged):
                break
            if timed is None:  # what the current plan's walk timed before v's stage stays valid
                timed = _timed_before(plan, timing, dev, pos)
            merged = tuple(sorted(merged, key=problem.topo_pos.__getitem__))
            candidate = seq[:pos] + [merged] + seq[pos + p + 1:]
            result = evaluate(problem, device_of, [candidate if s is seq else s for s in plan], timed)
            if result is None:
                break  # a cycle stays a cycle when the window grows
            best_ms = choice[0].makespan_ms if choice else timing.makespan_ms - 1e-9
            if result.makespan_ms < best_ms:
                choice = (result, candidate)
        if choice is not None:
            result, plan[dev] = choice
            timing = Timing(result.makespan_ms, result.finish_ms, timing.walk[:sum(timed[0])] + result.walk)
    return timing.makespan_ms, plan


def _timed_before(plan: Plan, timing: Timing, dev: int, pos: int) -> tuple[list[int], list[float], list[float]]:
    """The part of ``timing.walk`` before stage ``pos`` of device ``dev``: stages per device, finishes, device ends."""
    cut = timing.walk.index((dev, pos))
    stages_done = [0] * len(plan)
    for d, _ in timing.walk[:cut]:
        stages_done[d] += 1
    device_free_ms = [max((timing.finish_ms[v] for v in plan[d][k - 1]), default=0.0) if k else 0.0
                      for d, k in enumerate(stages_done)]
    return stages_done, timing.finish_ms, device_free_ms

