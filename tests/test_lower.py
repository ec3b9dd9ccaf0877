"""Lowering: plans pass the validator, carry no redundant wait, and handle streams, devices and stages."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.errors import ScheduleError
from opweave.ir import Edge, Op, OpGraph
from opweave.plan import LaunchPlan, PlanError
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule


@st.composite
def scheduled_dags(draw, max_ops: int = 30, max_streams: int = 4, max_devices: int = 2, graphs=None):
    """A random DAG (from ``graphs``, default :func:`dags`) with a random schedule: any topological order, streams,
    devices, and maybe stages."""
    graph = draw(graphs if graphs is not None else dags(max_ops=max_ops))
    priority = {op: draw(st.integers(0, 1000)) for op in graph.ids}
    order = list(nx.lexicographical_topological_sort(graph.nx(), key=priority.__getitem__))
    stream_of = {op: draw(st.integers(0, max_streams - 1)) for op in order}
    device_of = {op: draw(st.integers(0, max_devices - 1)) for op in order}
    stage_of = None
    if draw(st.booleans()):  # stages rise along the order, so they never decrease on a device or along an edge
        stage, stage_of = 0, {}
        for op in order:
            stage += draw(st.integers(0, 1))
            stage_of[op] = stage
    return graph, Schedule("random", order, stream_of, device_of, stage_of)


def drop(plan: LaunchPlan, index: int) -> LaunchPlan:
    return LaunchPlan(plan.instrs[:index] + plan.instrs[index + 1:])


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(scheduled_dags())
def test_plans_validate_and_every_wait_is_needed(case):
    graph, sched = case
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    assert sorted(i.op for i in plan.instrs if i.kind == "launch") == sorted(graph.ids)
    for index, ins in enumerate(plan.instrs):
        if ins.kind == "wait":
            with pytest.raises(PlanError):
                validate(graph, drop(plan, index), sched)


@settings(max_examples=60, deadline=None)
@given(scheduled_dags())
def test_events_are_dense_recorded_once_and_used(case):
    graph, sched = case
    plan = lower(graph, sched)
    for device in plan.devices:
        recorded = [i.event for i in plan.on_device(device) if i.kind == "record"]
        waited = {i.event for i in plan.on_device(device) if i.kind == "wait"}
        assert recorded == list(range(len(recorded)))
        assert set(recorded) == waited


def test_single_stream_needs_no_event():
    graph = examples.load("lios-fig3")
    sched = schedulers.run("sequential", graph, from_graph(graph))
    plan = lower(graph, sched)
    assert [i.kind for i in plan.instrs] == ["launch"] * len(graph)
    assert [i.op for i in plan.instrs] == sched.order


def test_lios_fig3_fork_and_join():
    graph = examples.load("lios-fig3")
    sched = schedulers.run("lios", graph, from_graph(graph), streams=3)
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    # v1 forks to streams 1 and 2 (one record, two waits); v6 needs v3 across streams; v9 joins v6 and v7.
    # v8 -> v9 and v5 -> v8 stay on stream 0; v2 -> v6 and v4 -> v7 stay on their streams.
    assert plan.syncs == 5
    assert sum(i.kind == "record" for i in plan.instrs) == 4


def test_redundant_wait_is_skipped_through_transitivity():
    # a (s0) -> b (s1) -> c (s2), and a -> c: c's wait for b already implies a
    graph = OpGraph([Op("a", latency_ms=1), Op("b", latency_ms=1), Op("c", latency_ms=1)],
                    [Edge("a", "b"), Edge("b", "c"), Edge("a", "c")])
    plan = lower(graph, Schedule("t", ["a", "b", "c"], {"a": 0, "b": 1, "c": 2}))
    assert plan.syncs == 2
    validate(graph, plan)


def test_cross_device_one_send_and_a_recv_per_consuming_stream():
    # a on device 0 feeds b (device 1, stream 0) and c (device 1, stream 1): each stream receives a itself
    graph = OpGraph([Op("a", latency_ms=1), Op("b", latency_ms=1), Op("c", latency_ms=1)],
                    [Edge("a", "b"), Edge("a", "c")])
    sched = Schedule("t", ["a", "b", "c"], {"a": 0, "b": 0, "c": 1}, {"a": 0, "b": 1, "c": 1})
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    assert [i.to_dict() for i in plan.instrs] == [
        {"device": 0, "kind": "launch", "stream": 0, "op": "a"},
        {"device": 0, "kind": "send", "stream": 0, "op": "a", "peer": 1},
        {"device": 1, "kind": "recv", "stream": 0, "op": "a", "peer": 0},
        {"device": 1, "kind": "launch", "stream": 0, "op": "b"},
        {"device": 1, "kind": "recv", "stream": 1, "op": "a", "peer": 0},
        {"device": 1, "kind": "launch", "stream": 1, "op": "c"},
    ]


def test_cross_device_recv_reused_when_already_ordered():
    # d (device 1, stream 1) waits for b, which follows the recv of a on stream 0: c after d needs no recv of a
    graph = OpGraph([Op(x, latency_ms=1) for x in "abdc"], [Edge("a", "b"), Edge("b", "d"), Edge("a", "c")])
    sched = Schedule("t", list("abdc"), {"a": 0, "b": 0, "d": 1, "c": 1}, {"a": 0, "b": 1, "d": 1, "c": 1})
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    assert [i.kind for i in plan.instrs] == ["launch", "send", "recv", "launch", "record", "wait", "launch", "launch"]


def test_stage_barrier_waits_for_every_stream_of_the_previous_stage():
    ops = [Op(x, latency_ms=1) for x in "abcd"]  # no edges: only the barrier orders stage 1 after stage 0
    graph = OpGraph(ops)
    sched = Schedule("t", list("abcd"), {"a": 0, "b": 1, "c": 0, "d": 1}, stage_of={"a": 0, "b": 0, "c": 1, "d": 1})
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    assert plan.syncs == 2  # c waits for b, d waits for a
    assert lower(graph, Schedule("t", list("abcd"), sched.stream_of)).syncs == 0


def test_stages_must_not_decrease_along_the_order_of_a_device():
    """The stage invariant has one owner, Schedule.check; lower calls it for schedules built by hand."""
    graph = OpGraph([Op("a", latency_ms=1), Op("b", latency_ms=1)])
    backwards = Schedule("t", ["a", "b"], {"a": 0, "b": 1}, stage_of={"a": 1, "b": 0})
    with pytest.raises(ScheduleError, match="op 'b' of stage 0 is issued after stage 1 on device 0"):
        backwards.check(graph)
    with pytest.raises(ScheduleError, match="stage 0 is issued after stage 1"):
        lower(graph, backwards)
    on_two_devices = Schedule("t", ["a", "b"], {"a": 0, "b": 0}, {"a": 0, "b": 1}, stage_of={"a": 1, "b": 0})
    on_two_devices.check(graph)  # stages are per device
    validate(graph, lower(graph, on_two_devices), on_two_devices)
    with pytest.raises(ScheduleError, match="op 'b' has no stage"):  # was a KeyError
        Schedule("t", ["a", "b"], {"a": 0, "b": 1}, stage_of={"a": 0}).check(graph)


def compact(plan: LaunchPlan) -> str:
    """One token per instruction: ``device.stream kind argument`` (``e3`` an event, ``v1>1`` a send to device 1)."""
    arg = {"launch": lambda i: i.op, "record": lambda i: f"e{i.event}", "wait": lambda i: f"e{i.event}",
           "send": lambda i: f"{i.op}>{i.peer}", "recv": lambda i: f"{i.op}<{i.peer}"}
    return " | ".join(f"{i.device}.{i.stream} {i.kind} {arg[i.kind](i)}" for i in plan.instrs)


PINNED_LIOS_FIG3 = {  # lower's output on the LIOS paper's Fig. 3 graph, 3 streams (taken before semantics.py owned it)
    ("lios", 1): "0.0 launch v1 | 0.0 record e0 | 0.0 launch v5 | 0.0 launch v8 | 0.1 wait e0 | 0.1 launch v2 | "
                 "0.2 wait e0 | 0.2 launch v3 | 0.2 record e1 | 0.1 wait e1 | 0.1 launch v6 | 0.1 record e2 | "
                 "0.2 launch v4 | 0.2 launch v7 | 0.2 record e3 | 0.0 wait e3 | 0.0 wait e2 | 0.0 launch v9 | "
                 "0.0 launch v10",
    ("ios", 1): "0.0 launch v1 | 0.0 record e0 | 0.0 launch v2 | 0.0 record e1 | 0.1 wait e0 | 0.1 launch v3 | "
                "0.1 record e2 | 0.0 wait e2 | 0.0 launch v6 | 0.1 wait e1 | 0.1 launch v4 | 0.1 launch v7 | "
                "0.1 record e3 | 0.2 wait e2 | 0.2 wait e1 | 0.2 launch v5 | 0.2 launch v8 | 0.2 record e4 | "
                "0.0 wait e4 | 0.0 wait e3 | 0.0 launch v9 | 0.0 launch v10",
    ("hios-lp", 1): "0.0 launch v1 | 0.0 record e0 | 0.0 launch v2 | 0.0 record e1 | 0.1 wait e0 | 0.1 launch v3 | "
                    "0.1 record e2 | 0.2 wait e0 | 0.2 launch v4 | 0.2 record e3 | 0.0 wait e3 | 0.0 wait e2 | "
                    "0.0 launch v5 | 0.1 wait e3 | 0.1 wait e1 | 0.1 launch v6 | 0.1 record e4 | 0.2 wait e2 | "
                    "0.2 wait e1 | 0.2 launch v7 | 0.2 record e5 | 0.0 wait e5 | 0.0 wait e4 | 0.0 launch v8 | "
                    "0.0 launch v9 | 0.0 launch v10",
    ("hios-lp", 2): "0.0 launch v1 | 0.0 send v1>1 | 1.0 recv v1<0 | 1.0 launch v4 | 1.1 recv v1<0 | 1.1 launch v5 | "
                    "1.1 record e0 | 1.0 wait e0 | 1.0 launch v7 | 1.0 send v7>0 | 1.0 launch v8 | 1.0 send v8>0 | "
                    "0.0 launch v2 | 0.0 launch v3 | 0.0 launch v6 | 0.0 recv v7<1 | 0.0 recv v8<1 | 0.0 launch v9 | "
                    "0.0 launch v10",
}


@pytest.mark.parametrize(("scheduler", "devices"), sorted(PINNED_LIOS_FIG3))
def test_lowered_lios_fig3_is_pinned(scheduler, devices):
    graph = examples.load("lios-fig3")
    sched = schedulers.run(scheduler, graph, from_graph(graph), streams=3, devices=devices)
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    assert compact(plan) == PINNED_LIOS_FIG3[(scheduler, devices)]
