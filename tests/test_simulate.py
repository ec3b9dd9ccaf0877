"""The simulator and the processor-sharing engine: exact numbers on small cases, invariants on random plans."""

import json

import pytest
from hypothesis import given, settings

from opweave import examples, schedulers
from opweave.backends.render import chrome_trace, gantt
from opweave.backends.simulate import simulate
from opweave.costs import Costs, GpuModel, from_graph
from opweave.costs.contention import FluidDevice, run_streams
from opweave.ir import Edge, Op, OpGraph, chain
from opweave.plan.lower import lower
from opweave.schedulers.schedule import Schedule
from test_lower import scheduled_dags

NO_OVERHEAD = GpuModel(launch_overhead_ms=0.0, graph_launch_overhead_ms=0.0, event_overhead_ms=0.0)


def fork(utilization: float) -> OpGraph:
    return OpGraph([Op("a", latency_ms=2, utilization=utilization), Op("b", latency_ms=2, utilization=utilization)])


# ---- contention engine ----------------------------------------------------------------------------------------------
def test_full_ops_share_the_device_small_ones_do_not():
    assert run_streams([[("a", 2, 1.0)], [("b", 2, 1.0)]]) == {"a": 4.0, "b": 4.0}
    assert run_streams([[("a", 2, 0.5)], [("b", 2, 0.5)]]) == {"a": 2.0, "b": 2.0}
    assert run_streams([[("a", 2, 0.6)], [("b", 2, 0.6)]]) == pytest.approx({"a": 2.4, "b": 2.4})


def test_streams_are_fifo_and_rates_change_at_every_finish():
    # a and c share (rate 1/2) until a finishes at 2; then b and c share until both finish at 4
    assert run_streams([[("a", 1, 1.0), ("b", 1, 1.0)], [("c", 2, 1.0)]], start_ms=0.0) == {"a": 2, "b": 4, "c": 4}
    assert run_streams([[("a", 1, 1.0)]], start_ms=5.0) == {"a": 6.0}
    assert run_streams([]) == {}


def test_arrival_in_the_middle():
    device = FluidDevice()
    device.add("a", 4.0, 1.0)
    assert device.advance(1.0) == []
    device.add("b", 2.0, 1.0)  # from 1 ms: both at rate 1/2; b done at 5 ms, a has 1 ms left, done at 6 ms
    assert device.advance(10.0) == [("b", 5.0), ("a", 6.0)]
    assert device.now_ms == 10.0


def test_stage_latency_under_the_gpu_model():
    costs = Costs({"a": 2.0, "b": 2.0}, utilization={"a": 0.5, "b": 0.5}, model="gpu", gpu=NO_OVERHEAD)
    assert costs.stage_latency_ms([["a"], ["b"]]) == 2.0
    assert Costs({"a": 2.0, "b": 2.0}).stage_latency_ms([["a"], ["b"]]) == 2.0


# ---- replay ---------------------------------------------------------------------------------------------------------
def test_lios_fig3_replay_is_38_of_73():
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    sched = schedulers.run("lios", graph, costs, streams=3)
    result = simulate(graph, lower(graph, sched), costs)
    assert result.makespan_ms == sched.predicted_ms == 38.0
    assert result.sequential_ms == 73.0
    assert result.syncs == 5
    assert (result.start_ms["v9"], result.finish_ms["v9"]) == (23.0, 36.0)
    assert sum(result.busy_ms.values()) == 73.0


def test_chain_on_one_stream():
    graph = chain([1.0, 2.0, 3.0])
    plan = lower(graph, schedulers.run("sequential", graph, from_graph(graph)))
    result = simulate(graph, plan, from_graph(graph))
    assert result.makespan_ms == result.sequential_ms == 6.0
    assert result.busy_ms == {(0, 0): 6.0}


def test_gpu_contention_between_streams():
    two_streams = Schedule("t", ["a", "b"], {"a": 0, "b": 1})
    for utilization, makespan in [(1.0, 4.0), (0.5, 2.0)]:
        graph = fork(utilization)
        result = simulate(graph, lower(graph, two_streams), from_graph(graph, "gpu", NO_OVERHEAD))
        assert result.makespan_ms == makespan
        assert result.sequential_ms == 4.0


def test_launch_overhead_without_cuda_graph():
    graph = fork(0.1)
    gpu = GpuModel(launch_overhead_ms=1.0, graph_launch_overhead_ms=0.5, event_overhead_ms=0.0)
    plan = lower(graph, Schedule("t", ["a", "b"], {"a": 0, "b": 1}))
    eager = simulate(graph, plan, from_graph(graph, "gpu", gpu), cuda_graph=False)
    assert (eager.start_ms, eager.makespan_ms) == ({"a": 1.0, "b": 2.0}, 4.0)  # one CPU thread issues a, then b
    graphed = simulate(graph, plan, from_graph(graph, "gpu", gpu), cuda_graph=True)
    assert (graphed.start_ms, graphed.makespan_ms) == ({"a": 0.5, "b": 0.5}, 2.5)
    assert graphed.sequential_ms == 4.5
    assert simulate(graph, plan, from_graph(graph)).makespan_ms == 2.0  # ideal: no overheads at all


def test_event_overhead_on_the_waiting_stream():
    graph = OpGraph([Op("a", latency_ms=1, utilization=0.1), Op("b", latency_ms=1, utilization=0.1)], [Edge("a", "b")])
    plan = lower(graph, Schedule("t", ["a", "b"], {"a": 0, "b": 1}))
    gpu = GpuModel(launch_overhead_ms=0.0, graph_launch_overhead_ms=0.0, event_overhead_ms=0.25)
    result = simulate(graph, plan, from_graph(graph, "gpu", gpu))
    assert result.start_ms["b"] == 1.25 and result.syncs == 1


def test_recv_arrives_after_the_slowest_edge_to_that_device():
    graph = OpGraph([Op("a", latency_ms=1), Op("b", latency_ms=1), Op("c", latency_ms=1)],
                    [Edge("a", "b", transfer_ms=1.0), Edge("a", "c", transfer_ms=3.0)])
    sched = Schedule("t", ["a", "b", "c"], {"a": 0, "b": 0, "c": 1}, {"a": 0, "b": 1, "c": 1})
    result = simulate(graph, lower(graph, sched), from_graph(graph))
    assert result.start_ms == {"a": 0.0, "b": 4.0, "c": 4.0}
    assert result.makespan_ms == 5.0 and result.sequential_ms == 3.0


@settings(max_examples=60, deadline=None)
@given(scheduled_dags(max_ops=25))
def test_replay_respects_every_dependency_and_gpu_is_never_faster(case):
    graph, sched = case
    plan = lower(graph, sched)
    ideal = simulate(graph, plan, from_graph(graph))
    gpu = simulate(graph, plan, from_graph(graph, "gpu"))
    for u, v in graph.edge:
        assert ideal.start_ms[v] >= ideal.finish_ms[u]
    for op in graph.ids:
        assert ideal.finish_ms[op] - ideal.start_ms[op] == pytest.approx(graph.op[op].latency_ms)
        assert gpu.start_ms[op] >= ideal.start_ms[op] - 1e-9
        assert gpu.finish_ms[op] >= ideal.finish_ms[op] - 1e-9
    by_lane: dict = {}
    for op in sched.order:  # FIFO: ops of one lane run one after another, in issue order
        by_lane.setdefault(ideal.lane_of[op], []).append(op)
    for ops in by_lane.values():
        for x, y in zip(ops, ops[1:], strict=False):
            assert ideal.start_ms[y] >= ideal.finish_ms[x]
    assert ideal.makespan_ms >= graph.critical_path_ms() - 1e-9
    assert gpu.sequential_ms >= ideal.sequential_ms - 1e-9


def test_gantt_png_and_chrome_trace(tmp_path):
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    result = simulate(graph, lower(graph, schedulers.run("lios", graph, costs, streams=3)), costs)
    gantt(result, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chrome_trace(result, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == sorted(graph.ids)
    v9 = next(e for e in spans if e["name"] == "v9")
    assert (v9["pid"], v9["tid"], v9["ts"], v9["dur"]) == (0, 0, 23000.0, 13000.0)
