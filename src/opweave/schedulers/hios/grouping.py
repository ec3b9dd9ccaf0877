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
When every stage sits on one device (HIOS on one GPU), :class:`ChainPlan` times a candidate as a running sum of
stage durations, with the same arithmetic.

Complexity: :func:`evaluate` is O(V + E), and so is one candidate at worst (typically far less); Algorithm 2 times
at most (w−1)·V candidates: O(w·V·(V + E)) (the paper's bound is O(w²·V·E³) with its own cycle check). On one
device a candidate costs O(V) additions in C and O(w) Python steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from opweave.schedulers.hios.stages import Plan, Problem, StageTimes, evaluate, time_stage


class StagePlan:
    """Algorithm 2's plan (``plan[d]`` holds ops of ``device_of`` d) as it changes, without its times. A stage is
    named by its *leader*, its first op in the initial plan (a merged stage keeps v_i's name); each device's stages
    form a linked list (``prev_stage``/``next_stage``, -1 at the ends)."""

    def __init__(self, problem: Problem, device_of: Sequence[int], plan: Plan):
        n = len(device_of)
        self.problem, self.device_of = problem, device_of
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

    def _regroup(self, window: list[int], merged: tuple[int, ...]) -> None:
        """Merge the stages of ``window`` (consecutive stages of one device) into the stage ``merged``: stage names
        and links."""
        stage_of, first, last = self.stage_of, window[0], window[-1]
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


class WorkingPlan(StagePlan):
    """A :class:`StagePlan` with its times: ``finish_ms``/``end_ms`` time every op/stage and ``makespan_ms`` the
    plan.

    Stage ends never decrease along a device, so an input from the same device is in by the stage's barrier and
    cannot delay it (nor change it when it changes): timing needs only ``remote_preds``/``remote_succs``."""

    def __init__(self, problem: Problem, device_of: Sequence[int], plan: Plan):
        timing = evaluate(problem, device_of, plan)
        assert timing is not None, "the initial plan must be acyclic"
        super().__init__(problem, device_of, plan)
        self.order = [plan[dev][k][0] for dev, k in timing.walk]  # the leaders in a topological order
        n = len(device_of)
        self.remote_preds = [[(u, t) for u, t in problem.preds[v] if device_of[u] != device_of[v]] for v in range(n)]
        self.remote_succs = [[w for w in problem.succs[v] if device_of[w] != device_of[v]] for v in range(n)]
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
            return StageTimes(math.inf, finish_ms, end_ms)
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
                return StageTimes(math.inf, finish_ms, end_ms)
            for v in self.ops_of[x]:
                if remote_succs[v] and finish_ms[v] != old_finish_ms[v]:
                    to_time.update(stage_of[w] for w in remote_succs[v])
            if end_ms[x] != old_end_ms[x] and next_stage[x] >= 0:
                to_time.add(next_stage[x])
        makespan_ms = max((end_ms[last] for last in self.last_stages if last >= 0), default=0.0)
        return StageTimes(makespan_ms, finish_ms, end_ms)

    def merge(self, window: list[int], merged: tuple[int, ...], times: StageTimes) -> None:
        """Make the candidate that :meth:`time_merge` timed (as ``times``) the current plan."""
        self.makespan_ms, self.finish_ms, self.end_ms = times.makespan_ms, times.finish_ms, times.end_ms
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
        self._regroup(window, merged)


class ChainTimes(NamedTuple):
    """A candidate's makespan as :class:`ChainPlan` times it."""

    makespan_ms: float


class ChainPlan(StagePlan):
    """Algorithm 2's plan when every stage sits on one device (HIOS on one GPU), timed with O(1) Python steps per
    candidate instead of one per later stage, and with :class:`WorkingPlan`'s makespans bit for bit.

    On one device every input of a stage comes from an earlier stage, finished by the stage's barrier (the end of
    the stage before it), so a stage ends at ``barrier + duration``: under the ideal model the duration is its
    longest op (rounding is monotonic, so the latest of the rounded finishes ``barrier + latency`` that
    :func:`.stages.time_stage` takes is the rounded sum with the longest latency), otherwise t(S). A plan's makespan
    is the running sum of its stages' durations, added left to right along the chain, and a candidate's is that sum
    continued from the merged stage's end over the stages after the window. ``numpy.add.accumulate`` adds them in
    that order (``r[i] = r[i-1] + a[i]``; unlike ``sum`` it does not sum pairwise), in C.

    ``duration_ms`` is indexed by a stage's position in the initial chain (``position``), which never changes: a
    stage merged into the one before it keeps its slot with duration 0, and adding 0 to a non-negative sum changes
    no bit. ``end_ms`` (the running sums) is extended when a window further on needs its barrier (Algorithm 2 walks
    the chain forwards, so each end is summed about once) and cut back at a merge. The ops' finish times are not
    kept: on one device nothing reads them."""

    def __init__(self, problem: Problem, device_of: Sequence[int], plan: Plan):
        super().__init__(problem, device_of, plan)
        (chain,) = [seq for seq in plan if seq]
        self.position = [-1] * len(device_of)
        for k, stage in enumerate(chain):
            self.position[stage[0]] = k
        self.duration_ms = np.array([self._duration_ms(stage) for stage in chain], dtype=np.float64)
        self._scratch = np.empty_like(self.duration_ms)  # accumulate()'s output
        self.end_ms: list[float] = []
        self.makespan_ms = self._sum_from(0.0, 0)

    def _duration_ms(self, stage: tuple[int, ...]) -> float:
        if self.problem.ideal:
            return max(map(self.problem.latency_ms.__getitem__, stage))
        return self.problem.stage_ms(stage)

    def _sum_from(self, start_ms: float, position: int) -> float:
        """``start_ms`` plus the durations from chain position ``position`` on, added left to right."""
        duration_ms = self.duration_ms
        if position == len(duration_ms):
            return start_ms
        first_ms = duration_ms[position]
        duration_ms[position] = start_ms + first_ms  # then + d[position + 1], …
        end_ms = np.add.accumulate(duration_ms[position:], out=self._scratch[position:])[-1]
        duration_ms[position] = first_ms
        return float(end_ms)

    def _barrier_ms(self, position: int) -> float:
        """The end of the stages before chain position ``position`` (0 for the first)."""
        end_ms = self.end_ms
        while len(end_ms) < position:
            end_ms.append((end_ms[-1] if end_ms else 0.0) + float(self.duration_ms[len(end_ms)]))
        return end_ms[position - 1] if position else 0.0

    def creates_cycle(self, window: list[int]) -> bool:
        """Never: every edge of the stage graph goes forward along the chain, also after merging consecutive
        stages."""
        return False

    def time_merge(self, window: list[int], merged: tuple[int, ...], beat_ms: float) -> ChainTimes:
        """The makespan with ``window`` merged into the stage ``merged`` (``beat_ms`` is not needed: the exact
        makespan costs no more)."""
        end_ms = self._barrier_ms(self.position[window[0]]) + self._duration_ms(merged)
        return ChainTimes(self._sum_from(end_ms, self.position[window[-1]] + 1))

    def merge(self, window: list[int], merged: tuple[int, ...], times: ChainTimes) -> None:
        """Make the candidate that :meth:`time_merge` timed (as ``times``) the current plan."""
        self._regroup(window, merged)
        for w in window[1:]:
            self.duration_ms[self.position[w]] = 0.0
        start = self.position[window[0]]
        self.duration_ms[start] = self._duration_ms(merged)
        del self.end_ms[start:]
        self.makespan_ms = times.makespan_ms


# The functional form keeps the fields' types objects, not strings that only this module could resolve.
Candidate = NamedTuple("Candidate", [("times", Any), ("window", list[int]), ("merged", tuple[int, ...])])  # noqa: UP014
Candidate.__doc__ = ("A window of Algorithm 2 that beats the plan, with its merged stage and its times (``times``: "
                     "what its plan's time_merge gives, StageTimes for a WorkingPlan or ChainTimes for a ChainPlan).")


def parallelize(problem: Problem, device_of: Sequence[int], plan: Plan, priority_order: Sequence[int],
                window: int) -> tuple[float, Plan]:
    """Algorithm 2: merge windows of consecutive independent ops on a GPU into stages while latency drops."""
    one_device = sum(1 for seq in plan if seq) == 1
    work = ChainPlan(problem, device_of, plan) if one_device else WorkingPlan(problem, device_of, plan)
    for v in priority_order[:-1]:
        if work.ops_of[work.stage_of[v]] != (v,):
            continue  # v is already grouped
        stages = [v]  # the window: v's stage and the single-op stages after it on v's GPU
        choice: Candidate | None = None
        for _ in range(1, window):
            following = work.next_stage[stages[-1]]
            if following < 0 or len(work.ops_of[following]) > 1:
                break
            stages.append(following)
            if not problem.independent(stages) or work.creates_cycle(stages):
                break  # a cycle stays a cycle when the window grows
            merged = tuple(sorted(stages, key=problem.topo_pos.__getitem__))
            best_ms = choice.times.makespan_ms if choice else work.makespan_ms - 1e-9
            times = work.time_merge(stages, merged, best_ms)
            if times.makespan_ms < best_ms:
                choice = Candidate(times, stages[:], merged)
        if choice is not None:
            work.merge(choice.window, choice.merged, choice.times)
    return work.makespan_ms, work.plan()
