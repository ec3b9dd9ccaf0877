"""Hypothesis strategy for random operator DAGs, shared by the scheduler, lowering, validator and simulator tests.

    from dags import dags          # pytest puts tests/ on sys.path (rootdir-based "prepend" import mode)

    @given(dags(max_ops=30))
    def test_something(graph): ...

Each graph has ops ``v0 … v{n-1}`` and, for every op, up to ``max_preds`` data predecessors among the ops before it
(so long-range and transitively implied edges occur, and so do several sources and sinks). What is drawn, and why:

* **latencies** — often from a few round values (0.5, 1, 2, 4 ms), so that ties between ops are common (every
  scheduler breaks ties somewhere), sometimes exactly 0 (a view-like op; a zero-latency chain ties every start
  time), otherwise uniform in 0.1–4 ms;
* **category** (compute/memory) and **utilization** (0.05–1, often 1 or 0.5 so that ties occur there too);
* **write-after-read edges** (``kind="war"``) — with ``war=True`` each op may also get up to two WAR predecessors
  among the earlier ops; a pair may carry both a data and a WAR edge (``OpGraph.edge`` keeps the data edge);
* **transfer times** — with ``transfers=True`` every edge may carry a ``transfer_ms`` (None, 0, a round value or
  uniform in 0–2 ms). It is drawn per *producer*: all out-edges of one op share it, because the simulator moves
  a tensor to a device once for all its consumers there (``backends/simulate.py``), and per-edge values would
  make any scheduler that prices edges one by one disagree with it (:func:`per_edge_transfers` draws those).

With ``shuffle=True`` the capture order is a random permutation (not necessarily topological).
"""

from __future__ import annotations

from hypothesis import strategies as st

from opweave.ir import CATEGORIES, Edge, Op, OpGraph

ROUND_MS = (0.5, 1.0, 2.0, 4.0)

latencies = st.one_of(st.sampled_from(ROUND_MS), st.just(0.0),
                      st.floats(0.1, 4.0, allow_nan=False, allow_infinity=False))
utilizations = st.one_of(st.sampled_from((0.5, 1.0)), st.floats(0.05, 1.0, allow_nan=False, allow_infinity=False))
transfer_times = st.one_of(st.none(), st.just(0.0), st.sampled_from((0.5, 1.0)),
                           st.floats(0.0, 2.0, allow_nan=False, allow_infinity=False))


@st.composite
def dags(draw, max_ops: int = 60, min_ops: int = 1, max_preds: int = 4, shuffle: bool = False, war: bool = True,
         transfers: bool = True) -> OpGraph:
    n = draw(st.integers(min_ops, max_ops))
    ops: list[Op] = []
    edges: list[Edge] = []
    transfer_of = [draw(transfer_times) if transfers else None for _ in range(n)]
    for j in range(n):
        ops.append(Op(f"v{j}", latency_ms=draw(latencies), category=draw(st.sampled_from(CATEGORIES)),
                      utilization=draw(utilizations)))
        if not j:
            continue
        # a count, then that many predecessors (repeats collapse): fewer draws than st.sets, and it shrinks to none
        preds = sorted({draw(st.integers(0, j - 1)) for _ in range(draw(st.integers(0, min(j, max_preds))))})
        mine = [Edge(f"v{i}", f"v{j}", transfer_ms=transfer_of[i]) for i in preds]
        if war:
            readers = sorted({draw(st.integers(0, j - 1)) for _ in range(draw(st.integers(0, min(j, 2))))})
            war_edges = [Edge(f"v{i}", f"v{j}", transfer_ms=transfer_of[i], kind="war") for i in readers]
            # the order of an op's in-edges is its predecessors' order, which some schedulers break ties by
            mine = war_edges + mine if war_edges and draw(st.booleans()) else mine + war_edges
        edges += mine
    if shuffle:
        ops = draw(st.permutations(ops))
    return OpGraph(ops, edges, name="hypothesis-dag")


@st.composite
def per_edge_transfers(draw, graph: OpGraph) -> OpGraph:
    """``graph`` with an independently drawn ``transfer_ms`` on every edge (see the module docstring)."""
    edges = [Edge(e.src, e.dst, e.bytes, draw(transfer_times), e.kind) for e in graph.edges]
    return OpGraph(graph.ops, edges, graph.name)
