"""HIOS intra-GPU grouping (Kundu & Shu, HIOS 2024, §IV-B, Algorithm 2).

Algorithm 2 (``parallelize``): visit ops in descending priority; for op v_i still alone in its stage on GPU g_i,
try windows W = v_i plus the next p stages on g_i (p = 1 … w−1). Choices where the text is loose:

* a window only takes following stages that are still single ops (it never swallows a group formed earlier) and
  stops at the first dependent op (Line 7: the ops of W must be pairwise independent);
* the cycle check (Line 10) runs on the stage graph *including* each device's stage order (the "implicit
  dependencies" of §I); without those edges a merge can deadlock two GPUs waiting on each other. :func:`evaluate`
  returns ``None`` on a cycle; Algorithm 2 uses :meth:`WorkingPlan.creates_cycle`, which gives the same answer;
* of the windows of one v_i the lowest latency L' wins, and only if L' < L (Lines 13–15); Line 11's ``G = G'``
  before that test is read as part of accepting the candidate (the example of Fig. 5 keeps only improving merges).

Algorithm 2 times a candidate incrementally (:class:`WorkingPlan`), with :func:`evaluate`'s arithmetic and so its
makespans bit for bit: it keeps a topological order of the current stage graph and its times, re-times only the
stages whose inputs change, and drops a candidate once one of its stages ends too late to beat the best so far.

Complexity: :func:`evaluate` is O(V + E), and so is one candidate at worst (typically far less); Algorithm 2 times
at most (w−1)·V candidates: O(w·V·(V + E)) (the paper's bound is O(w²·V·E³) with its own cycle check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from opweave.schedulers.hios.stages import Plan, Problem, StageTimes, evaluate, time_stage


class WorkingPlan:
    """Algorithm 2's plan (``plan[d]`` holds ops of ``device_of`` d) as it changes. A stage is named by its *leader*,
    its first op in the initial plan (a merged stage keeps v_i's name); each device's stages form a linked list
    (``prev_stage``/``next_stage``, -1 at the ends), ``order`` lists the leaders in a topological order of the stage
    graph, ``finish_ms``/``end_ms`` time every op/stage and ``makespan_ms`` the plan.

    Stage ends never decrease along a device, so an input from the same device is in by the stage's barrier and
    cannot delay it (nor change it when it changes): timing needs only ``remote_preds``/``remote_succs``."""

    def __init__(self, problem: Problem, device_of: Sequence[int], plan: Plan):
        timing = evaluate(problem, device_of, plan)
        assert timing is not None, "the initial plan must be acyclic"
        n = len(device_of)
        self.problem, self.device_of = problem, device_of
        self.remote_preds = [[(u, t) for u, t in problem.preds[v] if device_of[u] != device_of[v]] for v in range(n)]
        self.remote_succs = [[w for w in problem.succs[v] if device_of[w] != device_of[v]] for v in range(n)]
        self.ops_of: list[tuple[int, ...]] = [()] * n  # leader -> the ops of its stage
        self.stage_of = [-1] * n  # op -> leader of its stage
        self.prev_stage, self.next_stage = [-1] * n, [-1] * n
        self.first_stages = [seq[0][0] if seq else -1 for seq in plan]  # per device, -1 if none
        self.last_stages = [seq[-1][0] if seq else -1 for seq in plan]
        for seq in plan:
            for k, stage in enumerate(seq):
                self.ops_of[stage[0]] = stage
                for op in stage:
                    self.stage_of[op] = stage[0]
                if k:
                    self.prev_stage[stage[0]], self.next_stage[seq[k - 1][0]] = seq[k - 1][0], stage[0]
        self.order = [plan[dev][k][0] for dev, k in timing.walk]
        self.finish_ms, self.end_ms, self.makespan_ms = timing.finish_ms, [0.0] * n, timing.makespan_ms
        for leader in self.order:  # the stage ends (evaluate() only kept each device's last one)
            self.end_ms[leader] = self._time(leader, self.ops_of[leader], self.finish_ms, self.end_ms)

    def _time(self, leader: int, stage: tuple[int, ...], finish_ms: list[float], end_ms: list[float]) -> float:
        """Time ``stage`` in the place of the stage ``leader``, given the ends of the stages before it."""
        before = self.prev_stage[leader]
        barrier_ms = end_ms[before] if before >= 0 else 0.0
        return time_stage(self.problem, self.remote_preds, self.device_of, stage, self.device_of[leader], barrier_ms,
                          finish_ms)

    def creates_cycle(self, window: list[int]) -> bool:
        """Whether merging ``window`` (consecutive single-op stages of one device) closes a cycle in the stage graph.

        ``order`` holds for every edge not touching the window, so a new cycle runs through the merged stage and
        stages that ``order`` puts between the window's first and last stages: only those are searched."""
        preds, stage_of = self.problem.preds, self.stage_of
        after_merged = set(window)  # the merged stage and the stages that wait, directly or not, for it
        feeds_merged = {stage_of[u] for w in window for u, _ in preds[w]} - after_merged
        for x in self.order[self.order.index(window[0]) + 1:self.order.index(window[-1])]:
            if x in after_merged:
                continue  # a stage of the window
            if self.prev_stage[x] in after_merged or any(stage_of[u] in after_merged
                                                         for v in self.ops_of[x] for u, _ in preds[v]):
                if x in feeds_merged:
                    return True
                after_merged.add(x)
        return False

    def time_merge(self, window: list[int], merged: tuple[int, ...], beat_ms: float) -> StageTimes:
        """The times of the plan with ``window`` merged into the stage ``merged`` (no cycle).

        Only stages whose inputs change are re-timed, in ``order`` (the merged stage first: nothing it waits for
        changes). The makespan is ``inf`` as soon as a stage ends at or after ``beat_ms``: the plan cannot beat it."""
        stage_of, remote_succs, next_stage = self.stage_of, self.remote_succs, self.next_stage
        old_finish_ms, old_end_ms = self.finish_ms, self.end_ms
        finish_ms, end_ms = old_finish_ms[:], old_end_ms[:]
        merged_end_ms = self._time(window[0], merged, finish_ms, end_ms)
        if merged_end_ms >= beat_ms:
            return math.inf, finish_ms, end_ms
        for w in window:  # so that the stage after the window waits for the merged stage
            end_ms[w] = merged_end_ms
        to_time = {stage_of[w] for v in merged for w in remote_succs[v]}
        if next_stage[window[-1]] >= 0:
            to_time.add(next_stage[window[-1]])
        for x in self.order[self.order.index(window[0]) + 1:]:
            if not to_time:
                break
            if x not in to_time:
                continue
            to_time.remove(x)
            end_ms[x] = self._time(x, self.ops_of[x], finish_ms, end_ms)
            if end_ms[x] >= beat_ms:
                return math.inf, finish_ms, end_ms
            for v in self.ops_of[x]:
                if remote_succs[v] and finish_ms[v] != old_finish_ms[v]:
                    to_time.update(stage_of[w] for w in remote_succs[v])
            if end_ms[x] != old_end_ms[x] and next_stage[x] >= 0:
                to_time.add(next_stage[x])
        makespan_ms = max((end_ms[last] for last in self.last_stages if last >= 0), default=0.0)
        return makespan_ms, finish_ms, end_ms

    def merge(self, window: list[int], merged: tuple[int, ...], times: StageTimes):
        """Make the candidate that :meth:`time_merge` timed (as ``times``) the current plan."""
        self.makespan_ms, self.finish_ms, self.end_ms = times
        stage_of, succs = self.stage_of, self.problem.succs
        first, last = window[0], window[-1]
        start, stop = self.order.index(first), self.order.index(last)
        between = self.order[start + 1:stop]
        before_merged = set(window)  # the merged stage and the stages of ``between`` it waits for
        for x in reversed(between):
            if self.next_stage[x] in before_merged or any(stage_of[w] in before_merged
                                                          for v in self.ops_of[x] for w in succs[v]):
                before_merged.add(x)
        self.order[start:stop + 1] = ([x for x in between if x in before_merged and x not in window] + [first]
                                      + [x for x in between if x not in before_merged])
        for w in window[1:]:
            self.ops_of[w] = ()
        self.ops_of[first] = merged
        for op in merged:
            stage_of[op] = first
        after = self.next_stage[first] = self.next_stage[last]
        if after >= 0:
            self.prev_stage[after] = first
        self.last_stages = [first if leader == last else leader for leader in self.last_stages]

    def plan(self) -> Plan:
        plan: Plan = []
        for leader in self.first_stages:
            plan.append([])
            while leader >= 0:
                plan[-1].append(self.ops_of[leader])
                leader = self.next_stage[leader]
        return plan


def parallelize(problem: Problem, device_of: Sequence[int], plan: Plan, priority_order: Sequence[int],
                window: int) -> tuple[float, Plan]:
    """Algorithm 2: merge windows of consecutive independent ops on a GPU into stages while latency drops."""
    work = WorkingPlan(problem, device_of, plan)
    for v in priority_order[:-1]:
        if work.ops_of[work.stage_of[v]] != (v,):
            continue  # v is already grouped
        stages = [v]  # the window: v's stage and the single-op stages after it on v's GPU
        choice: tuple[StageTimes, list[int], tuple[int, ...]] | None = None
        for _ in range(1, window):
            following = work.next_stage[stages[-1]]
            if following < 0 or len(work.ops_of[following]) > 1:
                break
            stages.append(following)
            if not problem.independent(stages) or work.creates_cycle(stages):
                break  # a cycle stays a cycle when the window grows
            merged = tuple(sorted(stages, key=problem.topo_pos.__getitem__))
            best_ms = choice[0][0] if choice else work.makespan_ms - 1e-9
            times = work.time_merge(stages, merged, best_ms)
            if times[0] < best_ms:
                choice = (times, stages[:], merged)
        if choice is not None:
            work.merge(choice[1], choice[2], choice[0])
    return work.makespan_ms, work.plan()
