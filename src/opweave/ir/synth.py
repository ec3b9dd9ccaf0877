"""Random layered DAGs as in the HIOS simulation study (HIOS §V-A).

HIOS presets 200 operators in 14 layers, 2 × ops inter-operator dependencies, operator latency uniform in 0.1–4 ms,
and a cross-GPU transfer time of ``max(0.1 ms, p × producer latency)`` with p = 0.8. The text does not say how ops
are spread over layers nor how edges are drawn; opweave's choice:

* layers get ``ops // layers`` ops each, the first ``ops % layers`` layers one more;
* every op outside layer 0 gets one predecessor drawn from the layer right before it (so the layer count is the
  depth of the DAG, ``layers`` = longest path in ops);
* the remaining edges join a random op to a random op of a strictly later layer, without duplicates.

Deterministic for a given seed (``random.Random(seed)``). Complexity O(edges) expected.
"""

from __future__ import annotations

import random

from opweave.errors import UsageError
from opweave.ir.graph import Edge, Op, OpGraph


def random_dag(ops: int = 200, layers: int = 14, edges: int | None = None, seed: int = 0, *,
               comm_ratio: float = 0.8, min_latency_ms: float = 0.1, max_latency_ms: float = 4.0,
               min_transfer_ms: float = 0.1) -> OpGraph:
    """A layered random DAG with ``ops`` ops, ``layers`` layers and ``edges`` edges (default ``2 * ops``)."""
    edges = 2 * ops if edges is None else edges
    if ops < 1 or not 1 <= layers <= ops:
        raise UsageError(f"need ops >= 1 and 1 <= layers <= ops, got ops={ops}, layers={layers}")
    sizes = [ops // layers + (i < ops % layers) for i in range(layers)]
    layer_of: list[int] = [i for i, n in enumerate(sizes) for _ in range(n)]
    later_pairs = sum(a * b for i, a in enumerate(sizes) for b in sizes[i + 1:])
    if not ops - sizes[0] <= edges <= later_pairs:
        raise UsageError(f"{ops} ops in {layers} layers take between {ops - sizes[0]} and {later_pairs} edges, "
                         f"asked for {edges}")
    rng = random.Random(seed)
    first = [sum(sizes[:i]) for i in range(layers)]
    pairs: set[tuple[int, int]] = set()
    for v in range(sizes[0], ops):
        prev = layer_of[v] - 1
        pairs.add((first[prev] + rng.randrange(sizes[prev]), v))
    while len(pairs) < edges:
        u, v = rng.randrange(ops), rng.randrange(ops)
        if layer_of[u] < layer_of[v]:
            pairs.add((u, v))
    latency = [round(rng.uniform(min_latency_ms, max_latency_ms), 4) for _ in range(ops)]
    graph_ops = [Op(f"op{i}", latency_ms=latency[i]) for i in range(ops)]
    graph_edges = [Edge(f"op{u}", f"op{v}", transfer_ms=round(max(min_transfer_ms, comm_ratio * latency[u]), 4))
                   for u, v in sorted(pairs)]
    return OpGraph(graph_ops, graph_edges, name=f"synth-{ops}-{layers}-{edges}-s{seed}")
