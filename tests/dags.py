"""Hypothesis strategy for random operator DAGs, shared by the scheduler tests.

    from dags import dags          # pytest puts tests/ on sys.path (rootdir-based "prepend" import mode)

    @given(dags(max_ops=30))
    def test_something(graph): ...

Each graph has ops ``v0 … v{n-1}``, latencies drawn from 0.1–4 ms, a random category (compute/memory) and
utilization (0.05–1), and for every op up to ``max_preds`` predecessors among the ops before it (so long-range and
transitively implied edges occur, and so do several sources and sinks). With ``shuffle=True`` the capture order is
a random permutation (not necessarily topological).
"""

from __future__ import annotations

from hypothesis import strategies as st

from opweave.ir import CATEGORIES, Edge, Op, OpGraph


@st.composite
def dags(draw, max_ops: int = 60, min_ops: int = 1, max_preds: int = 4, shuffle: bool = False) -> OpGraph:
    n = draw(st.integers(min_ops, max_ops))
    ops: list[Op] = []
    edges: list[Edge] = []
    for j in range(n):
        latency_ms = draw(st.floats(0.1, 4.0, allow_nan=False, allow_infinity=False))
        category = draw(st.sampled_from(CATEGORIES))
        utilization = draw(st.floats(0.05, 1.0, allow_nan=False, allow_infinity=False))
        ops.append(Op(f"v{j}", latency_ms=latency_ms, category=category, utilization=utilization))
        if j:
            preds = draw(st.sets(st.integers(0, j - 1), max_size=min(j, max_preds)))
            edges += [Edge(f"v{i}", f"v{j}") for i in sorted(preds)]
    if shuffle:
        ops = draw(st.permutations(ops))
    return OpGraph(ops, edges, name="hypothesis-dag")
