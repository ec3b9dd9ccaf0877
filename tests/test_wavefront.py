"""Wavefront / simple greedy baseline (Rammer-style levels, one stage per level)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.schedulers.wavefront import levels
from oracle import replay_ms


def test_fig3_levels_and_makespans():
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    assert levels(graph) == {"v1": 0, "v2": 1, "v3": 1, "v4": 1, "v5": 1, "v6": 2, "v7": 2, "v8": 2, "v9": 3,
                             "v10": 4}
    # levels take max(3) + max(5, 5, 5, 8) + max(15, 10, 7) + 13 + 2 with one stream per op
    unlimited = schedulers.run("wavefront", graph, costs)
    assert unlimited.predicted_ms == 41.0 and unlimited.streams_used == 4
    assert unlimited.stage_of == levels(graph)
    # 3 streams: level 1 is v5 | v2 v4 | v3 = 8, 10, 5; 2 streams: v5 v4 | v2 v3 = 13, level 2 v6 | v7 v8 = 17
    assert schedulers.run("wavefront", graph, costs, streams=3).predicted_ms == 3 + 10 + 15 + 13 + 2
    assert schedulers.run("wavefront", graph, costs, streams=2).predicted_ms == 3 + 13 + 17 + 13 + 2
    assert schedulers.run("wavefront", graph, costs, streams=1).predicted_ms == 73.0


@settings(max_examples=60, deadline=None)
@given(graph=dags(max_ops=60, shuffle=True), streams=st.one_of(st.none(), st.integers(1, 5)))
def test_random_dags(graph, streams):
    costs = from_graph(graph)
    sched = schedulers.run("wavefront", graph, costs, streams=streams)  # checks coverage, order, stages
    if streams is not None:
        assert sched.streams_used <= streams
    level = levels(graph)
    assert sched.stage_of == level
    for u, v in graph.edge:
        assert level[u] < level[v]
    # the prediction (sum of the levels' heaviest streams) is what the simulator's ideal replay of the plan takes
    assert sched.predicted_ms == pytest.approx(replay_ms(graph, sched, costs), abs=1e-9)
    assert graph.critical_path_ms() - 1e-9 <= sched.predicted_ms <= graph.total_work_ms() + 1e-9
