"""Opara (Chen et al., IEEE TC 2024): Alg. 1 greedy stream allocation and Alg. 2 resource- and interference-aware
launch order."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.ir import Edge, Op, OpGraph
from opweave.schedulers.opara import allocate_streams, launch_order, resource_demand
from oracle import replay_ms


def test_alg1_on_fig3():
    graph = examples.load("lios-fig3")
    stream_of = allocate_streams(graph)
    # v1 opens stream 0 and hands it to v2; v3, v4, v5 find v1's flag set and open streams 1-3;
    # v6 follows v2 (its first predecessor), v7 follows v4, v8 follows v5, v9 follows v6, v10 follows v9
    assert stream_of == {"v1": 0, "v2": 0, "v3": 1, "v4": 2, "v5": 3, "v6": 0, "v7": 2, "v8": 3, "v9": 0, "v10": 0}
    crossing = [(u, v) for u, v in graph.edge if stream_of[u] != stream_of[v]]
    assert crossing == [("v1", "v3"), ("v1", "v4"), ("v1", "v5"), ("v3", "v6"), ("v7", "v9"), ("v8", "v9")]
    sched = schedulers.run("opara", graph, from_graph(graph))
    assert sched.streams_used == 4 and sched.predicted_ms == 38.0


def fan_out(categories, resources=None, utilization=None):
    """A source feeding one op per entry of ``categories``."""
    resources, utilization = resources or {}, utilization or {}
    ops = [Op("src", latency_ms=1.0)] + [
        Op(name, latency_ms=1.0, category=cat, resources=resources.get(name), utilization=utilization.get(name))
        for name, cat in categories.items()]
    return OpGraph(ops, [Edge("src", name) for name in categories])


def test_alg2_alternates_and_takes_least_demand_first():
    graph = fan_out({"m1": "memory", "m2": "memory", "m3": "memory", "c1": "compute", "c2": "compute"},
                    utilization={"m1": 0.9, "m2": 0.2, "m3": 0.5, "c1": 0.6, "c2": 0.1})
    # src is compute, so a memory op comes next; then compute, memory, compute; then only memory is left
    assert launch_order(graph, from_graph(graph)) == ["src", "m2", "c2", "m3", "c1", "m1"]


def test_alg2_resource_demand_is_dominant_normalized_share():
    graph = fan_out({"a": "compute", "b": "compute", "c": "compute"},
                    resources={"a": {"threads": 1024, "shared_memory": 0},
                               "b": {"threads": 128, "shared_memory": 48_000},
                               "c": {"threads": 256, "shared_memory": 12_000}})
    costs = from_graph(graph)
    demand = resource_demand(graph, costs)
    assert demand["a"] == 1.0 and demand["b"] == 1.0 and demand["c"] == pytest.approx(0.25)
    assert demand["src"] == 1.0  # no resources, no utilization: counts as filling the GPU
    assert launch_order(graph, costs) == ["src", "c", "a", "b"]  # equal demands keep ready-list order


def test_alg2_without_resources_is_ready_list_fifo():
    graph = examples.load("lios-fig3")
    assert launch_order(graph, from_graph(graph)) == graph.ids


def test_stream_cap():
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    for cap in (1, 2, 3):
        assert schedulers.run("opara", graph, costs, streams=cap).streams_used == cap
    assert schedulers.run("opara", graph, costs, streams=1).predicted_ms == 73.0


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(graph=dags(max_ops=60, shuffle=True), cap=st.one_of(st.none(), st.integers(1, 5)))
def test_random_dags(graph, cap):
    costs = from_graph(graph)
    sched = schedulers.run("opara", graph, costs, streams=cap)  # run() checks coverage and topological order
    if cap is not None:
        assert sched.streams_used <= cap
    else:  # uncapped, every stream is a path of graph edges (Alg. 1 only follows a predecessor)
        by_stream: dict[int, list[str]] = {}
        for op in sched.order:
            by_stream.setdefault(sched.stream_of[op], []).append(op)
        for ops in by_stream.values():
            assert all((a, b) in graph.edge for a, b in pairwise(ops))
    assert sched.predicted_ms == pytest.approx(replay_ms(graph, sched, costs), abs=1e-9)
    assert graph.critical_path_ms() - 1e-9 <= sched.predicted_ms <= graph.total_work_ms() + 1e-9
