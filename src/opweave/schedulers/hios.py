"""HIOS: hierarchical inter-operator scheduling on M GPUs (Kundu & Shu, 2024, paper 002, §III–IV).

Two inter-GPU mappings, each followed by Algorithm 2's intra-GPU grouping (:mod:`.hios_window`):

* ``variant="lp"`` — HIOS-LP, Algorithm 1: repeatedly take the longest *valid* path among unmapped ops and map the
  whole path to the GPU that gives the mapped subgraph the earliest finish.
* ``variant="mr"`` — HIOS-MR, Algorithm 3: map ops one by one in priority order with an n × M table recording, for
  v_i on GPU j, the earliest finish of v_i and the GPU of v_{i−1} in the schedule that achieved it.

Definitions and the choices made where the text is loose:

* **Priority** p(v) (§IV-A): length of the longest path from v to the end of G counting v's latency, every later
  op's latency and every edge's ``transfer_ms``. Priority order = descending p, ties by topological position (p
  alone ties when latencies or transfers are 0), so it is a topological order.
* **Unmapped subgraph G'** (Alg. 1 Line 6 and the note after it): the unmapped ops plus every edge with at least
  one unmapped end. A path in G' may so begin with an edge from a mapped op and end with an edge into one (Fig. 4's
  P2 = {e2, v3, e4, v5, e6}).
* **Valid path** (Line 5): a chain v_1 → … → v_k of unmapped ops whose intermediate ops v_2 … v_{k−1} have no edge
  from or to a mapped op; v_1 and v_k may. Its **length** (upper bound, §IV-A) is Σ latency(v_i) + Σ transfer of
  its edges, including the heaviest edge from a mapped op into v_1 and the heaviest edge from v_k to a mapped op
  when there are such edges. Found exactly by a DP over G' in topological order, O(V + E) per path (the paper's
  enumeration is O(V²·E)); ties go to the path ending earliest in topological order.
* **Mapping a path** (Lines 8–15): for each GPU i, the mapped ops (with P on i) are list-scheduled in priority order,
  each appended after the last op on its GPU (no back-filling, as the authors' simulator does) at
  max(GPU free, finish of each mapped predecessor [+ transfer when on another GPU]); unmapped predecessors are
  ignored. The GPU with the smallest makespan L' wins; ties go to the lowest GPU index (so the first path goes to
  GPU 0, "due to the homogeneity of GPUs").
* **HIOS-MR** (Alg. 3) as written, with "GPU free" = latest finish of the ops already on that GPU. Lines 7–8 only
  let v_i use GPUs 1 … min(M, i) (symmetry breaking) and v_1 sits on GPU 1. Line 22 picks the GPU j minimizing
  t_{n,j}; opweave picks the recorded schedule with the smallest *makespan*, which is the same thing when v_n is the
  only sink (the paper's generator) and the right thing otherwise. Reconstructing a recorded schedule walks the
  back-pointers only as far as v_i's earliest predecessor.
* **Window** w (Alg. 2, default 3; the authors' simulator uses 2, Fig. 5 uses 2), capped by ``streams`` (the
  paper's K/L streams per GPU); ``window=1`` turns Algorithm 2 off (the paper's "inter-GPU w/ LP|MR" baselines).

Output: ``device_of``; ``stage_of`` numbers each device's stages 0, 1, … (a barrier per device); ``stream_of`` is
an op's position in its stage; ``order`` is a global topological walk of the stages; ``predicted_ms`` is the
evaluation of :func:`.hios_window.evaluate`, which under the ideal model equals the simulator's replay.
``options["inter_gpu_ms"]`` holds the makespan before Algorithm 2.

Complexity: priorities O(V + E). LP: at most V paths, each O(V + E) to find plus M list schedules of O(V + E):
O(M·V·(V + E)). MR: O(M²·V·(d + M)) where d is how far back (in priority order) an op's earliest predecessor lies,
O(M²·V²) at worst. Algorithm 2: O(w·V·(V + E)).
"""

from __future__ import annotations

import math

from opweave.costs import Costs
from opweave.ir import OpGraph
from opweave.schedule import Schedule
from opweave.schedulers.hios_window import Plan, Problem, evaluate, parallelize

DEFAULT_WINDOW = 3


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
    rank = {v: i for i, v in enumerate(order)}
    lat = problem.latency_ms
    finish = [[math.inf] * devices for _ in range(n)]  # t_{i,j}
    back = [[-1] * devices for _ in range(n)]  # g_{i,j}: GPU of v_{i-1}
    free = [[()] * devices for _ in range(n)]  # per recorded schedule: latest finish on every GPU
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
                start_ms = free[i - 1][k][j]
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


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1, variant: str = "lp",
             window: int = DEFAULT_WINDOW) -> Schedule:
    """HIOS-LP or HIOS-MR on ``devices`` GPUs, each GPU running stages of at most min(window, streams) ops."""
    if variant not in ("lp", "mr"):
        raise ValueError(f"unknown HIOS variant {variant!r}; choose 'lp' or 'mr'")
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    window = min(window, streams) if streams else window
    name = f"hios-{variant}"
    if not len(graph):
        return Schedule(name, [], {}, {}, stage_of={}, predicted_ms=0.0)
    problem = Problem(graph, costs)
    topo = [graph.index[op] for op in graph.topo_order]
    priority = priorities(problem, topo)
    order = sorted(topo, key=lambda v: (-priority[v], problem.topo_pos[v]))
    device_of = map_lp(problem, topo, order, devices) if variant == "lp" else map_mr(problem, order, devices)
    plan: Plan = [[] for _ in range(max(device_of) + 1)]
    for v in order:
        plan[device_of[v]].append((v,))
    inter_gpu_ms = evaluate(problem, device_of, plan).makespan_ms
    latency_ms, plan = parallelize(problem, device_of, plan, order, window) if window > 1 else (inter_gpu_ms, plan)
    return _to_schedule(name, problem, device_of, plan, latency_ms,
                        {"variant": variant, "window": window, "devices": devices, "inter_gpu_ms": inter_gpu_ms})


def _to_schedule(name: str, problem: Problem, device_of: list[int], plan: Plan, latency_ms: float,
                 options: dict) -> Schedule:
    timing = evaluate(problem, device_of, plan)
    assert timing is not None and math.isclose(timing.makespan_ms, latency_ms)
    ids = problem.ids
    order: list[str] = []
    stream_of: dict[str, int] = {}
    stage_of: dict[str, int] = {}
    for dev, k in timing.walk:
        for stream, v in enumerate(plan[dev][k]):
            order.append(ids[v])
            stream_of[ids[v]] = stream
            stage_of[ids[v]] = k
    return Schedule(name, order, stream_of, {ids[v]: d for v, d in enumerate(device_of)}, stage_of=stage_of,
                    predicted_ms=latency_ms, options=options)
