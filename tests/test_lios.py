"""LIOS (Ping et al., IEEE TSC 2023): the running example of Fig. 3 / Table III, and Algorithm 1's invariants on
random DAGs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.schedulers.lios import DEFAULT_STREAMS, lios_schedule
from oracle import replay

# Table III, "Schedule Tuple" column: (op, stream p1..p3 -> 0..2, start, finish), in scheduling order.
# The table prints step 6 as (v6, p2, 8, 13); its own EFT column says 23, and 8 + 15 = 23.
TABLE_III = [
    ("v1", 0, 0, 3), ("v5", 0, 3, 11), ("v8", 0, 11, 18), ("v2", 1, 3, 8), ("v3", 2, 3, 8),
    ("v6", 1, 8, 23), ("v4", 2, 8, 13), ("v7", 2, 13, 23), ("v9", 0, 23, 36), ("v10", 0, 36, 38),
]


def fig3():
    graph = examples.load("lios-fig3")
    return graph, from_graph(graph)


def test_table_iii_step_by_step():
    graph, costs = fig3()
    assert [tuple(step) for step in lios_schedule(graph, costs, 3)] == TABLE_III


def test_fig3_makespan_38_vs_sequential_73():
    graph, costs = fig3()
    lios = schedulers.run("lios", graph, costs, streams=3)
    assert lios.predicted_ms == 38.0
    assert schedulers.run("sequential", graph, costs).predicted_ms == 73.0
    assert lios.order == [op for op, *_ in TABLE_III]
    assert lios.stream_of == {op: stream for op, stream, *_ in TABLE_III}
    assert lios.streams_used == 3 and set(lios.device_of.values()) == {0}
    # the simulator's ideal replay of the lowered plan gives back every tuple of the table
    result = replay(graph, lios, costs)
    assert {op: (result.start_ms[op], result.finish_ms[op]) for op in graph.ids} == {
        op: (start, finish) for op, _, start, finish in TABLE_III}


def test_stream_count_is_respected():
    graph, costs = fig3()
    assert schedulers.run("lios", graph, costs, streams=1).predicted_ms == 73.0
    assert schedulers.run("lios", graph, costs, streams=2).streams_used <= 2
    assert schedulers.run("lios", graph, costs).options["streams"] == DEFAULT_STREAMS


@settings(max_examples=60, deadline=None)
@given(graph=dags(max_ops=40, shuffle=True), streams=st.one_of(st.none(), st.integers(1, 6)))
def test_random_dags(graph, streams):
    costs = from_graph(graph)
    sched = schedulers.run("lios", graph, costs, streams=streams)  # run() checks coverage and topological order
    assert max(sched.stream_of.values()) < (streams or DEFAULT_STREAMS)
    steps = lios_schedule(graph, costs, streams or DEFAULT_STREAMS)
    result = replay(graph, sched, costs)
    for step in steps:  # LIOS's own times are the simulator's ideal replay of its lowered plan
        assert (result.start_ms[step.op], result.finish_ms[step.op]) == pytest.approx((step.start_ms, step.finish_ms))
    assert sched.predicted_ms == pytest.approx(result.makespan_ms, abs=1e-9)
    assert graph.critical_path_ms() - 1e-9 <= sched.predicted_ms <= graph.total_work_ms() + 1e-9
    if streams == 1:
        assert sched.predicted_ms == pytest.approx(graph.total_work_ms())
    # every step takes a highest-latency op among those whose predecessors are all scheduled
    scheduled: set[str] = set()
    for step in steps:
        ready = [op for op in graph.ids if op not in scheduled and set(graph.preds[op]) <= scheduled]
        assert costs.latency_ms[step.op] == max(costs.latency_ms[op] for op in ready)
        scheduled.add(step.op)
