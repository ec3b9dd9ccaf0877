import pytest

from opweave.ir.synth import random_dag


def test_default_hios_point():
    g = random_dag(ops=200, layers=14, seed=1)
    assert len(g) == 200 and len(g.edges) == 400
    lat = g.latencies()
    assert all(0.1 <= v <= 4.0 for v in lat.values())
    for e in g.edges:
        assert e.transfer_ms == pytest.approx(max(0.1, 0.8 * lat[e.src]), abs=1e-4)
    # depth equals the layer count: the longest path counted in ops
    depth = {}
    for u in g.topo_order:
        depth[u] = 1 + max((depth[p] for p in g.preds[u]), default=0)
    assert max(depth.values()) == 14


def test_same_seed_same_graph_other_seed_other_graph():
    assert random_dag(50, 6, seed=3).to_dict() == random_dag(50, 6, seed=3).to_dict()
    assert random_dag(50, 6, seed=3).to_dict() != random_dag(50, 6, seed=4).to_dict()


def test_impossible_edge_counts_are_refused():
    with pytest.raises(ValueError, match="edges"):
        random_dag(ops=10, layers=2, edges=100)
    with pytest.raises(ValueError, match="layers"):
        random_dag(ops=3, layers=5)
