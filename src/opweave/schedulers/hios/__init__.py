"""HIOS: hierarchical inter-operator scheduling on M GPUs (Kundu & Shu [1], §III–IV).

Two inter-GPU mappings, each followed by Algorithm 2's intra-GPU grouping (:mod:`.grouping`):

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
evaluation of :func:`.stages.evaluate`, which under the ideal model equals the simulator's replay.
``options["inter_gpu_ms"]`` holds the makespan before Algorithm 2.

Complexity: priorities O(V + E). LP: at most V paths, each O(V + E) to find plus M list schedules of O(V + E):
O(M·V·(V + E)). MR: O(M²·V·(d + M)) where d is how far back (in priority order) an op's earliest predecessor lies,
O(M²·V²) at worst. Algorithm 2: O(w·V·(V + E)); on one GPU O(w·V) Python steps and O(w·V²) additions in C.

References
----------
.. [1] T. Kundu and T. Shu, "HIOS: Hierarchical Inter-Operator Scheduler for Real-Time Inference of DAG-Structured
   Deep Learning Models on Multiple GPUs", 2023 (the copy this module follows prints no venue or DOI).
"""

from __future__ import annotations

import math
from typing import Any

from opweave.costs.model import Costs
from opweave.errors import UsageError, did_you_mean
from opweave.ir.graph import OpGraph
from opweave.schedulers.hios.grouping import parallelize
from opweave.schedulers.hios.mapping import map_lp, map_mr, priorities
from opweave.schedulers.hios.stages import Plan, Problem, evaluate
from opweave.schedulers.schedule import Schedule

DEFAULT_WINDOW = 3


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1, variant: str = "lp",
             window: int = DEFAULT_WINDOW) -> Schedule:
    """HIOS-LP or HIOS-MR on ``devices`` GPUs, each GPU running stages of at most min(window, streams) ops."""
    if variant not in ("lp", "mr"):
        raise UsageError(f"unknown HIOS variant {variant!r}{did_you_mean(variant, ('lp', 'mr'))}; choose 'lp' or "
                         "'mr'")
    if window < 1:
        raise UsageError(f"window must be at least 1, got {window}")
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
    timing = evaluate(problem, device_of, plan)
    assert timing is not None  # single-op stages in priority order on every GPU: no cycle in the stage graph
    inter_gpu_ms = timing.makespan_ms
    latency_ms, plan = parallelize(problem, device_of, plan, order, window) if window > 1 else (inter_gpu_ms, plan)
    return _to_schedule(name, problem, device_of, plan, latency_ms,
                        {"variant": variant, "window": window, "devices": devices, "inter_gpu_ms": inter_gpu_ms})


def _to_schedule(name: str, problem: Problem, device_of: list[int], plan: Plan, latency_ms: float,
                 options: dict[str, Any]) -> Schedule:
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
