"""Wavefront / "simple greedy" baseline (Rammer, OSDI 2020, as the IOS, LIOS and Opara papers run it).

Each op's *level* is its longest-path depth from a source (sources are level 0, an op sits one level below its
deepest predecessor). Every level is one stage (``stage_of``): its ops run concurrently, and the next level starts
only when the whole level has finished (lowering adds the barrier). A level's ops go to at most K streams, K =
``streams`` or, when unset, the width of the widest level (one stream per op). When a level has more ops than
streams we balance it greedily: longest latency first (ties: capture order) onto the least-loaded stream (ties:
fewest ops, then lowest id) — the LPT rule; with enough streams this puts every op on its own stream. Within a
level, ops are launched in capture order.

``predicted_ms`` = sum over levels of the most loaded stream's total latency, which is exactly what the ideal
replay with stage barriers gives. ``devices`` > 1 is ignored (every op on device 0).

Complexity O(V·K + V log V + E).

References
----------
.. [1] L. Ma, Z. Xie, Z. Yang, J. Xue, Y. Miao, W. Cui, W. Hu, F. Yang, L. Zhang and L. Zhou, "Rammer: Enabling
   Holistic Deep Learning Compiler Optimizations with rTasks", *14th USENIX Symposium on Operating Systems Design
   and Implementation (OSDI)*, 2020.
"""

from __future__ import annotations

from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.schedulers.schedule import Schedule


def levels(graph: OpGraph) -> dict[str, int]:
    """Longest-path depth (in edges) of every op from the sources."""
    level: dict[str, int] = {}
    for op in graph.topo_order:
        level[op] = max((level[p] + 1 for p in graph.preds[op]), default=0)
    return level


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1) -> Schedule:
    level = levels(graph)
    by_level: dict[int, list[str]] = {}
    for op in graph.topo_order:
        by_level.setdefault(level[op], []).append(op)
    stream_count = streams or max((len(ops) for ops in by_level.values()), default=1)
    stream_of: dict[str, int] = {}
    predicted_ms = 0.0
    for ops in by_level.values():
        load_ms = [0.0] * min(stream_count, len(ops))
        op_count = [0] * len(load_ms)  # so that zero-latency ops still get a stream each when there are enough
        for op in sorted(ops, key=lambda o: (-costs.latency_ms[o], graph.index[o])):
            stream = min(range(len(load_ms)), key=lambda s: (load_ms[s], op_count[s], s))
            stream_of[op] = stream
            load_ms[stream] += costs.latency_ms[op]
            op_count[stream] += 1
        predicted_ms += max(load_ms)
    order = [op for lvl in sorted(by_level) for op in by_level[lvl]]
    return Schedule("wavefront", order, {op: stream_of[op] for op in order}, {op: 0 for op in order},
                    stage_of={op: level[op] for op in order}, predicted_ms=predicted_ms,
                    options={"streams": stream_count})
