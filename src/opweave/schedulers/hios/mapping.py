"""HIOS inter-GPU mapping: priorities, HIOS-LP's longest valid paths (Algorithm 1) and HIOS-MR's n × M table
(Algorithm 3). The definitions and the choices made where the paper is loose are in :mod:`opweave.schedulers.hios`.
"""


from __future__ import annotations

import math

from opweave.schedulers.hios.stages import Problem


def priorities(problem: Problem, topo: list[int]) -> list[float]:
    """p(v) = latency(v) + max over successors s of (transfer(v, s) + p(s)); 0 successors → latency(v)."""
    priority = [0.0] * len(topo)
    for v in reversed(topo):
        tail_ms = max((transfer_ms + priority[w] for w, transfer_ms in problem.out_edges[v]), default=0.0)
        priority[v] = problem.latency_ms[v] + tail_ms
    return priority


def longest_valid_path(problem: Problem, topo: list[int], mapped: list[bool]) -> list[int]:
    """Alg. 1 Line 5: the longest valid path of unmapped ops (see the module docstring), as op indices in order."""
    lat, preds, out_edges = problem.latency_ms, problem.preds, problem.out_edges
    neg = -math.inf
    open_ms = [neg] * len(topo)  # best path ending at v that may continue through v (v first, or v free)
    open_from = [-1] * len(topo)
    best_ms, best_end, best_from = neg, -1, -1
    for v in topo:
        if mapped[v]:
            continue
        free, head_ms, tail_ms = True, 0.0, 0.0  # v touches no mapped op; heaviest edges from / to mapped ops
        for u, transfer_ms in preds[v]:
            if mapped[u]:
                free, head_ms = False, max(head_ms, transfer_ms)
        for w, transfer_ms in out_edges[v]:
            if mapped[w]:
                free, tail_ms = False, max(tail_ms, transfer_ms)
        via_ms, via = head_ms, -1
        for u, transfer_ms in preds[v]:
            if not mapped[u] and open_ms[u] + transfer_ms > via_ms:
                via_ms, via = open_ms[u] + transfer_ms, u
        if via_ms + lat[v] + tail_ms > best_ms:
            best_ms, best_end, best_from = via_ms + lat[v] + tail_ms, v, via
        open_ms[v], open_from[v] = (via_ms + lat[v], via) if free else (head_ms + lat[v], -1)
    path = [best_end]
    u = best_from
    while u >= 0:
        path.append(u)
        u = open_from[u]
    return path[::-1]


class ListSchedule:
    """Alg. 1 Lines 10–13: ops appended to their GPUs in priority order, each at max(GPU free, finish of each
    scheduled predecessor [+ transfer_ms when on another GPU]). Unscheduled predecessors are ignored."""

    def __init__(self, problem: Problem, devices: int):
        self.problem = problem
        self.finish_ms = [-1.0] * len(problem.latency_ms)  # -1: not scheduled
        self.free_ms = [0.0] * devices

    def copy(self) -> ListSchedule:
        other = ListSchedule.__new__(ListSchedule)
        other.problem, other.finish_ms, other.free_ms = self.problem, self.finish_ms[:], self.free_ms[:]
        return other

    def run(self, ops: list[int], device_of: list[int]) -> float:
        """Append ``ops`` (in priority order); return the makespan so far."""
        preds, latency_ms = self.problem.preds, self.problem.latency_ms
        finish_ms, free_ms = self.finish_ms, self.free_ms
        for v in ops:
            dev = device_of[v]
            start_ms = free_ms[dev]
            for u, transfer_ms in preds[v]:
                done_ms = finish_ms[u]
                if done_ms >= 0.0:
                    if device_of[u] != dev:
                        done_ms += transfer_ms
                    if done_ms > start_ms:
                        start_ms = done_ms
            finish_ms[v] = free_ms[dev] = start_ms + latency_ms[v]
        return max(free_ms)


def map_lp(problem: Problem, topo: list[int], order: list[int], devices: int) -> list[int]:
    """Algorithm 1, Lines 1–16: the GPU of every op."""
    n = len(topo)
    if devices == 1:
        return [0] * n  # nothing to choose
    mapped = [False] * n
    device_of = [-1] * n
    rank = [0] * n
    for i, v in enumerate(order):
        rank[v] = i
    left = n
    while left:
        path = longest_valid_path(problem, topo, mapped)
        for v in path:
            mapped[v] = True
        left -= len(path)
        members = [v for v in order if mapped[v]]
        # the ops before the path's first op (in priority order) land the same way whatever GPU the path gets
        split = members.index(min(path, key=rank.__getitem__))
        prefix = ListSchedule(problem, devices)
        prefix.run(members[:split], device_of)
        best_ms, best_dev = math.inf, 0
        for dev in range(devices):
            for v in path:
                device_of[v] = dev
            makespan_ms = prefix.copy().run(members[split:], device_of)
            if makespan_ms < best_ms - 1e-12:
                best_ms, best_dev = makespan_ms, dev
        for v in path:
            device_of[v] = best_dev
    return device_of


def map_mr(problem: Problem, order: list[int], devices: int) -> list[int]:
    """Algorithm 3, Lines 1–26: the GPU of every op, from the mapping-recording table."""
    n = len(order)
    if devices == 1:
        return [0] * n  # nothing to choose
    rank = {v: i for i, v in enumerate(order)}
    lat = problem.latency_ms
    finish = [[math.inf] * devices for _ in range(n)]  # t_{i,j}
    back = [[-1] * devices for _ in range(n)]  # g_{i,j}: GPU of v_{i-1}
    free: list[list[tuple[float, ...]]] = [[()] * devices for _ in range(n)]  # per schedule: latest finish per GPU
    finish[0][0] = lat[order[0]]
    free[0][0] = tuple(finish[0][0] if d == 0 else 0.0 for d in range(devices))
    for i in range(1, n):
        v = order[i]
        preds = [(rank[u], t) for u, t in problem.preds[v]]
        earliest = min((r for r, _ in preds), default=i)
        for k in range(min(devices, i)):  # v_{i-1} on GPU k
            if finish[i - 1][k] == math.inf:
                continue
            pred_at: dict[int, tuple[float, int]] = {}  # rank -> (finish, GPU) in the schedule recorded at (i-1, k)
            m = k
            for r in range(i - 1, earliest - 1, -1):
                pred_at[r] = (finish[r][m], m)
                m = back[r][m]
            for j in range(min(devices, i + 1)):  # v_i on GPU j
                start_ms: float = free[i - 1][k][j]
                for r, transfer_ms in preds:
                    done_ms, dev = pred_at[r]
                    start_ms = max(start_ms, done_ms + (transfer_ms if dev != j else 0.0))
                if start_ms + lat[v] < finish[i][j]:
                    finish[i][j] = start_ms + lat[v]
                    back[i][j] = k
                    free[i][j] = tuple(finish[i][j] if d == j else f for d, f in enumerate(free[i - 1][k]))
    last = min((j for j in range(devices) if finish[n - 1][j] < math.inf), key=lambda j: (max(free[n - 1][j]), j))
    device_of = [0] * n
    m = last
    for i in range(n - 1, -1, -1):
        device_of[order[i]] = m
        m = back[i][m]
    return device_of
