"""The validator on hand-made plans: what it accepts, what it rejects, and that its message names the culprit."""

import pytest

from opweave.ir import Edge, Op, OpGraph
from opweave.plan import Instr, LaunchPlan, PlanError
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule


def graph_of(ids: str, edges: list[tuple[str, str]], war: tuple[tuple[str, str], ...] = ()) -> OpGraph:
    return OpGraph([Op(x, latency_ms=1) for x in ids],
                   [Edge(u, v) for u, v in edges] + [Edge(u, v, kind="war") for u, v in war])


def launch(op, stream=0, device=0):
    return Instr(device, "launch", stream, op=op)


def record(event, stream=0, device=0):
    return Instr(device, "record", stream, event=event)


def wait(event, stream=0, device=0):
    return Instr(device, "wait", stream, event=event)


def test_fork_with_record_and_wait_passes():
    graph = graph_of("ab", [("a", "b")])
    validate(graph, LaunchPlan([launch("a", 0), record(0, 0), wait(0, 1), launch("b", 1)]))


def test_missing_wait_names_the_edge():
    graph = graph_of("ab", [("a", "b")])
    with pytest.raises(PlanError) as err:
        validate(graph, LaunchPlan([launch("a", 0), launch("b", 1)]))
    assert str(err.value) == ("edge 'a' -> 'b': consumer launched on device 0 stream 1 is not ordered after "
                              "producer on stream 0")


def test_write_after_read_edges_are_checked_too():
    graph = graph_of("ab", [], war=(("a", "b"),))
    with pytest.raises(PlanError, match=r"edge 'a' -> 'b' \(write-after-read\)"):
        validate(graph, LaunchPlan([launch("a", 0), launch("b", 1)]))


def test_wait_must_follow_its_record_in_issue_order():
    graph = graph_of("ab", [("a", "b")])
    with pytest.raises(PlanError, match="no earlier record"):
        validate(graph, LaunchPlan([wait(0, 1), launch("a", 0), record(0, 0), launch("b", 1)]))


def test_wait_sees_the_record_before_it_not_a_later_re_record():
    # e0 is recorded after x, then waited on by stream 1, then re-recorded after a: the wait only covers x
    graph = graph_of("xab", [("a", "b")])
    plan = [launch("x", 0), record(0, 0), wait(0, 1), launch("a", 0), record(0, 0), launch("b", 1)]
    with pytest.raises(PlanError, match="edge 'a' -> 'b'"):
        validate(graph, LaunchPlan(plan))


def test_a_re_recorded_event_covers_what_precedes_the_latest_record():
    graph = graph_of("xab", [("x", "b"), ("a", "b")])
    validate(graph, LaunchPlan([launch("x", 0), record(0, 0), launch("a", 0), record(0, 0), wait(0, 1),
                                launch("b", 1)]))


def test_happens_before_is_transitive_across_streams():
    # a (s0) -> b (s1) by e0, b's stream -> s2 by e1: c on s2 may read a
    graph = graph_of("abc", [("a", "b"), ("a", "c"), ("b", "c")])
    validate(graph, LaunchPlan([launch("a", 0), record(0, 0), wait(0, 1), launch("b", 1), record(1, 1),
                                wait(1, 2), launch("c", 2)]))


def test_events_are_per_device():
    graph = graph_of("ab", [("a", "b")])
    with pytest.raises(PlanError, match="no earlier record on that device"):
        validate(graph, LaunchPlan([launch("a", 0, 0), record(0, 0, 0), wait(0, 0, 1), launch("b", 0, 1)]))


def test_cross_device_send_recv():
    graph = graph_of("ab", [("a", "b")])
    send = Instr(0, "send", 0, op="a", peer=1)
    recv = Instr(1, "recv", 2, op="a", peer=0)
    validate(graph, LaunchPlan([launch("a", 0, 0), send, recv, launch("b", 2, 1)]))
    with pytest.raises(PlanError, match="recv of op 'a' on device 1 from device 0 has no matching send"):
        validate(graph, LaunchPlan([launch("a", 0, 0), recv, send, launch("b", 2, 1)]))
    with pytest.raises(PlanError, match="edge 'a' -> 'b': consumer launched on device 1 stream 2 is not ordered "
                                        "after producer on device 0 stream 0"):
        validate(graph, LaunchPlan([send, launch("a", 0, 0), recv, launch("b", 2, 1)]))
    with pytest.raises(PlanError, match="edge 'a' -> 'b'"):  # the recv is on another stream, nobody waits for it
        validate(graph, LaunchPlan([launch("a", 0, 0), send, recv, launch("b", 1, 1)]))
    validate(graph, LaunchPlan([launch("a", 0, 0), send, recv, record(0, 2, 1), wait(0, 1, 1), launch("b", 1, 1)]))


def test_cross_device_data_edge_needs_the_tensor_not_only_the_order():
    # a is ordered before b through x's send/recv, but a's output never reaches device 1
    graph = graph_of("axb", [("a", "b"), ("x", "b")])
    plan = [launch("a", 0, 0), launch("x", 0, 0), Instr(0, "send", 0, op="x", peer=1),
            Instr(1, "recv", 0, op="x", peer=0), launch("b", 0, 1)]
    with pytest.raises(PlanError, match="no recv of 'a' on device 1"):
        validate(graph, LaunchPlan(plan))
    # a write-after-read edge needs the order only
    validate(graph_of("axb", [("x", "b")], war=(("a", "b"),)), LaunchPlan(plan))


def test_cross_device_recv_must_carry_the_output_sent_after_the_producer_ran():
    # the recv of a pairs with a send issued before a was launched (a stale buffer); a -> b is ordered through x
    graph = graph_of("axb", [("a", "b")])
    stale = [Instr(0, "send", 0, op="a", peer=1), launch("a", 0, 0), launch("x", 0, 0),
             Instr(0, "send", 0, op="x", peer=1), Instr(1, "recv", 0, op="a", peer=0),
             Instr(1, "recv", 0, op="x", peer=0), launch("b", 0, 1)]
    with pytest.raises(PlanError, match=r"no recv of 'a' on device 1 \(sent from device 0 after 'a' ran\)"):
        validate(graph, LaunchPlan(stale))
    validate(graph, LaunchPlan([stale[1], stale[0], *stale[2:]]))  # send after the launch: fine


def test_every_op_launched_exactly_once():
    graph = graph_of("ab", [])
    with pytest.raises(PlanError, match="op 'b' is never launched"):
        validate(graph, LaunchPlan([launch("a")]))
    with pytest.raises(PlanError, match="op 'a' is launched twice"):
        validate(graph, LaunchPlan([launch("a"), launch("b"), launch("a")]))
    with pytest.raises(PlanError, match="unknown op 'z'"):
        validate(graph, LaunchPlan([launch("a"), launch("b"), launch("z")]))


def test_consumer_before_producer():
    graph = graph_of("ab", [("a", "b")])
    with pytest.raises(PlanError, match="edge 'a' -> 'b': consumer launched on device 0 stream 0 before"):
        validate(graph, LaunchPlan([launch("b"), launch("a")]))


def test_malformed_instructions():
    graph = graph_of("a", [])
    for bad, message in [(Instr(0, "fork", 0), "unknown kind"), (Instr(0, "wait", 1), "has no event"),
                         (Instr(0, "send", 0, op="a", peer=0), "needs another device")]:
        with pytest.raises(PlanError, match=message):
            validate(graph, LaunchPlan([launch("a"), bad]))


def test_stage_barrier_is_checked_when_the_schedule_is_given():
    graph = graph_of("abc", [])
    sched = Schedule("t", list("abc"), {"a": 0, "b": 1, "c": 1}, stage_of={"a": 0, "b": 0, "c": 1})
    racy = LaunchPlan([launch("a", 0), launch("b", 1), launch("c", 1)])
    validate(graph, racy)  # no edges: fine without the schedule
    with pytest.raises(PlanError, match=r"stage order: op 'c' \(stage 1, device 0 stream 1\) is not ordered "
                                        r"after op 'a' \(stage 0, stream 0\)"):
        validate(graph, racy, sched)
    validate(graph, LaunchPlan([launch("a", 0), record(0, 0), launch("b", 1), wait(0, 1), launch("c", 1)]), sched)
