"""HEFT on identical lanes (opweave.schedulers.heft): upward ranks, earliest finish time, sync costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.errors import UsageError
from opweave.ir import Edge, Op, OpGraph
from opweave.schedulers.heft import upward_ranks
from oracle import replay


def graph_of(latency: dict[str, float], edges: list[tuple[str, str]]) -> OpGraph:
    return OpGraph([Op(o, latency_ms=ms) for o, ms in latency.items()], [Edge(u, v) for u, v in edges], "g")


def test_upward_rank_is_the_longest_path_to_an_exit_plus_syncs():
    g = graph_of({"a": 1, "b": 5, "c": 2, "d": 1}, [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    assert upward_ranks(g, from_graph(g).latency_ms) == {"d": 1, "b": 6, "c": 3, "a": 7}
    assert upward_ranks(g, from_graph(g).latency_ms, sync_ms=0.5) == {"d": 1, "b": 6.5, "c": 3.5, "a": 8}


def test_the_longest_path_gets_a_lane_of_its_own_before_shorter_work():
    # LIOS ranks by an op's own latency, so the three 2 ms ops go first and the 1 ms head of the 7 ms chain waits;
    # HEFT ranks the chain's head by the path behind it and starts it at once.
    g = graph_of({"x1": 2, "x2": 2, "x3": 2, "h": 1, "t": 6}, [("h", "t")])
    costs = from_graph(g)
    heft = schedulers.run("heft", g, costs, streams=2)
    lios = schedulers.run("lios", g, costs, streams=2)
    assert heft.predicted_ms == 7.0 and heft.stream_of["h"] == heft.stream_of["t"]
    assert lios.predicted_ms > heft.predicted_ms


def test_a_costly_sync_keeps_a_fork_on_one_lane():
    g = graph_of({"a": 1, "b": 1, "c": 1, "d": 1}, [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    costs = from_graph(g)
    assert schedulers.run("heft", g, costs, streams=2).streams_used == 2
    assert schedulers.run("heft", g, costs, streams=2, sync_ms=5.0).streams_used == 1


def test_lios_figure_3_on_three_streams_is_no_worse_than_lios():
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    heft = schedulers.run("heft", graph, costs, streams=3)
    assert heft.predicted_ms <= schedulers.run("lios", graph, costs, streams=3).predicted_ms
    assert heft.predicted_ms >= graph.critical_path_ms()


def test_negative_sync_is_refused():
    g = graph_of({"a": 1}, [])
    with pytest.raises(UsageError, match="sync_ms"):
        schedulers.run("heft", g, from_graph(g), sync_ms=-1)


@settings(max_examples=150, deadline=None)
@given(graph=dags(max_ops=40), lanes=st.integers(1, 4), sync=st.sampled_from([0.0, 0.05, 1.0]))
def test_on_random_dags_the_plan_validates_and_its_replay_is_the_prediction(graph, lanes, sync):
    costs = from_graph(graph)
    sched = schedulers.run("heft", graph, costs, streams=lanes, sync_ms=sync)
    result = replay(graph, sched, costs)  # lowers and validates
    assert result.makespan_ms == pytest.approx(sched.predicted_ms, abs=1e-9)
    assert graph.critical_path_ms() - 1e-9 <= sched.predicted_ms <= graph.total_work_ms() + 1e-9
    assert sched.streams_used <= lanes
