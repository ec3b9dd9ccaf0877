"""IOS dynamic programming (MLSys'21): the DP equals a brute-force optimum over all stage sequences, and beats
sequential execution; block partitioning, ending enumeration and the emitted schedule."""

from __future__ import annotations

import math
from functools import cache

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import Costs, from_graph
from opweave.ir import Edge, Op, OpGraph
from opweave.schedulers import ios
from oracle import replay_ms


class OverlapCosts(Costs):
    """A stage model that is neither ideal nor additive: concurrent groups overlap only half of the shorter ones."""

    def stage_latency_ms(self, groups):
        group_ms = [sum(self.latency_ms[o] for o in g) for g in groups]
        return max(group_ms) + 0.5 * (sum(group_ms) - max(group_ms))


def brute_force_ms(graph: OpGraph, costs: Costs, max_group_ops: int, max_groups: int) -> float:
    """The best total latency over every sequence of stages, by exhaustive search.

    A stage is any non-empty subset E of the remaining ops with no edge from E to the remaining ops outside E; its
    groups are E's weakly connected components (networkx), each run in topological order; a stage is admitted iff
    every group has ≤ max_group_ops ops and there are ≤ max_groups groups. Subsets are enumerated blindly (all 2^|S|
    of them); the cache on the remaining set only avoids re-solving the same suffix.
    """
    g = graph.nx()
    topo = {op: i for i, op in enumerate(graph.topo_order)}

    @cache
    def best(remaining: frozenset) -> float:
        if not remaining:
            return 0.0
        items = sorted(remaining)
        result = math.inf
        for mask in range(1, 1 << len(items)):
            ending = {op for i, op in enumerate(items) if mask >> i & 1}
            if any(w in remaining and w not in ending for v in ending for w in graph.succs[v]):
                continue
            groups = [sorted(c, key=topo.__getitem__) for c in nx.weakly_connected_components(g.subgraph(ending))]
            if len(groups) > max_groups or any(len(group) > max_group_ops for group in groups):
                continue
            result = min(result, best(remaining - ending) + costs.stage_latency_ms(groups))
        return result

    return best(frozenset(graph.ids))


@settings(max_examples=60, deadline=None)
@given(graph=dags(max_ops=9), max_group_ops=st.integers(1, 3), max_groups=st.sampled_from([1, 2, 8]),
       model=st.sampled_from(["ideal", "overlap", "gpu"]))
def test_dp_equals_brute_force(graph, max_group_ops, max_groups, model):
    costs = OverlapCosts(graph.latencies()) if model == "overlap" else from_graph(graph, model)
    sched = schedulers.run("ios", graph, costs, max_group_ops=max_group_ops, max_groups=max_groups)
    assert sched.predicted_ms == pytest.approx(brute_force_ms(graph, costs, max_group_ops, max_groups))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(graph=dags(max_ops=40, shuffle=True), streams=st.one_of(st.none(), st.integers(1, 4)))
def test_valid_and_never_worse_than_sequential(graph, streams):
    costs = from_graph(graph)
    sched = schedulers.run("ios", graph, costs, streams=streams)  # run() checks order and stage monotonicity
    assert sched.predicted_ms <= sum(costs.latency_ms.values()) + 1e-9
    assert set(sched.device_of.values()) <= {0}
    assert max(sched.stream_of.values(), default=0) < (streams or ios.DEFAULT_MAX_GROUPS)
    stages = {}
    for op in sched.order:
        stages.setdefault(sched.stage_of[op], []).append(op)
    assert list(stages) == sorted(stages), "stages are issued one after the other"
    for ops in stages.values():
        per_stream = {}
        for op in ops:
            per_stream.setdefault(sched.stream_of[op], []).append(op)
        assert len(per_stream) <= ios.DEFAULT_MAX_GROUPS
        assert all(len(group) <= ios.DEFAULT_MAX_GROUP_OPS for group in per_stream.values())
    # the sum of stage latencies is what the simulator's ideal replay of the lowered plan takes
    assert replay_ms(graph, sched, costs) == pytest.approx(sched.predicted_ms, abs=1e-9)


def test_lios_fig3_reaches_the_critical_path():
    graph = examples.load("lios-fig3")
    sched = schedulers.run("ios", graph, from_graph(graph))
    assert sched.predicted_ms == 38.0 == graph.critical_path_ms()


def test_overlapping_closures_form_one_legal_ending():
    # a → c ← b: the closures {a, c} and {b, c} overlap; {a, b, c} is still an ending (one group of 3 ops), which
    # the original IOS enumeration misses (inter-operator-scheduler issue #10)
    desc = [0b100, 0b100, 0]  # a, b → c
    found = {ending: groups for ending, groups in ios.endings(0b111, desc, 3, 8)}
    assert found[0b111] == (0b111,)
    assert set(found) == {0b100, 0b101, 0b110, 0b111}  # {c}, {a,c}, {b,c}, {a,b,c}
    assert set(dict(ios.endings(0b111, desc, 2, 8))) == {0b100, 0b101, 0b110}


def test_dp_uses_an_ending_the_original_enumeration_misses():
    # a(1), b(1) → c(1), and d(3) independent: one stage {[a, b, c], [d]} takes 3 ms; without the overlapping
    # ending {a, b, c} the best is 4 ms ({a, b, d} then {c}, or {a, b} then {c, d})
    ops = [Op("a", latency_ms=1.0), Op("b", latency_ms=1.0), Op("c", latency_ms=1.0), Op("d", latency_ms=3.0)]
    graph = OpGraph(ops, [Edge("a", "c"), Edge("b", "c")])
    sched = schedulers.run("ios", graph, from_graph(graph))
    assert sched.predicted_ms == 3.0 == brute_force_ms(graph, from_graph(graph), 3, 8)
    assert len(set(sched.stage_of.values())) == 1
    assert sched.stream_of["a"] == sched.stream_of["b"] == sched.stream_of["c"] != sched.stream_of["d"]


def test_endings_of_an_antichain_respect_s():
    found = ios.endings(0b1111, [0, 0, 0, 0], 3, 2)
    assert sorted(ending for ending, _ in found) == sorted(m for m in range(1, 16) if m.bit_count() <= 2)
    assert all(len(groups) == ending.bit_count() for ending, groups in found)


def test_cut_ops_and_blocks():
    ops = [Op(i, latency_ms=1.0) for i in "abcdefg"]
    pairs = ["ab", "ac", "bd", "cd", "de", "df", "eg", "fg"]  # two diamonds joined at d
    graph = OpGraph(ops, [Edge(u, v) for u, v in pairs])
    assert ios.cut_ops(graph) == ["a", "d", "g"]
    assert ios.blocks(graph) == [["a"], ["b", "c"], ["d"], ["e", "f"], ["g"]]
    two_sources = OpGraph([Op("x"), Op("y"), Op("z")], [Edge("x", "z"), Edge("y", "z")])
    assert ios.cut_ops(two_sources) == ["z"]


@settings(max_examples=30, deadline=None)
@given(graph=dags(max_ops=40), max_block_ops=st.integers(1, 12), max_states=st.integers(2, 64))
def test_blocks_partition_a_topological_order_within_limits(graph, max_block_ops, max_states):
    parts = ios.blocks(graph, max_block_ops, max_states)
    flat = [op for block in parts for op in block]
    assert sorted(flat) == sorted(graph.ids)
    pos = {op: i for i, op in enumerate(flat)}
    assert all(pos[u] < pos[v] for u, v in graph.edge)
    assert all(1 <= len(block) <= max_block_ops for block in parts)
    costs = from_graph(graph)
    sched = schedulers.run("ios", graph, costs, max_block_ops=max_block_ops, max_states=max_states)
    assert sched.predicted_ms <= sum(costs.latency_ms.values()) + 1e-9


def test_wide_graph_chunks_stay_fast():
    # 12 independent ops have 4096 down-sets; with max_states=64 the segment is chunked and the DP stays small
    graph = OpGraph([Op(f"v{i}", latency_ms=1.0 + i) for i in range(12)])
    parts = ios.blocks(graph, max_block_ops=20, max_states=64)
    assert [len(p) for p in parts] == [6, 6]
    sched = schedulers.run("ios", graph, from_graph(graph), max_states=64)
    assert sched.predicted_ms == pytest.approx(6.0 + 12.0)  # two stages of 6 concurrent ops each
