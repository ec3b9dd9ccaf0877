"""Plan semantics: the validator against an independent oracle, on lowered plans and on corrupted ones.

The oracle below is written from the rules, not from :mod:`opweave.plan.semantics`: it pairs every wait and recv by
scanning the plan backwards (O(n²)), builds a networkx DiGraph over instruction indices with program-order edges
(consecutive instructions of a (device, stream) lane) and sync edges (record -> wait, send -> recv), and asks
reachability questions of it. ``validate`` must accept a plan exactly when the oracle does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import networkx as nx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dags import dags
from opweave import examples, schedulers
from opweave.costs import from_graph
from opweave.ir import Op, OpGraph
from opweave.plan import Instr, LaunchPlan, PlanError
from opweave.plan.lower import lower
from opweave.plan.semantics import PlanInterpreter
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule
from test_lower import scheduled_dags

# ---- the oracle ------------------------------------------------------------------------------------------------------


def pairs_with(source: Instr, sink: Instr) -> bool:
    """A wait waits for a record of its event on its device; a recv for a send of its op from its peer to it."""
    if sink.kind == "wait":
        return source.kind == "record" and source.device == sink.device and source.event == sink.event
    return (source.kind == "send" and source.op == sink.op and source.device == sink.peer
            and source.peer == sink.device)


def oracle(graph: OpGraph, plan: LaunchPlan, stage_of: dict[str, int] | None) -> str | None:
    """``None`` when the plan orders every dependency, else the first rule it breaks."""
    instrs = plan.instrs
    g = nx.DiGraph()
    g.add_nodes_from(range(len(instrs)))
    last: dict[tuple[int, int], int] = {}
    for i, ins in enumerate(instrs):
        lane = (ins.device, ins.stream)
        if lane in last:
            g.add_edge(last[lane], i)
        last[lane] = i
    source: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if ins.kind in ("wait", "recv"):
            earlier = [j for j in range(i) if pairs_with(instrs[j], ins)]
            if not earlier:
                return f"instruction {i} ({ins.kind}) pairs with nothing"
            source[i] = earlier[-1]  # the latest one issued before it
            g.add_edge(source[i], i)
    launched = [ins.op for ins in instrs if ins.kind == "launch"]
    if sorted(launched) != sorted(graph.ids):
        return "not every op launched exactly once"
    at = {ins.op: i for i, ins in enumerate(instrs) if ins.kind == "launch"}
    after = functools.cache(functools.partial(nx.descendants, g))

    def before(a: int, b: int) -> bool:
        return b in after(a)

    for e in graph.edges:
        u, v = at[e.src], at[e.dst]
        if not before(u, v):
            return f"edge {e.src} -> {e.dst} not ordered"
        du, dv = instrs[u].device, instrs[v].device
        if e.kind == "data" and du != dv and not any(
                ins.kind == "recv" and ins.op == e.src and ins.device == dv and ins.peer == du
                and before(u, source[r]) and before(r, v) for r, ins in enumerate(instrs)):
            return f"edge {e.src} -> {e.dst}: {e.src}'s output never reaches device {dv} before {e.dst}"
    if stage_of is not None:
        for device in {ins.device for ins in instrs}:
            stages: dict[int, list[int]] = {}
            for op, i in at.items():
                if instrs[i].device == device:
                    stages.setdefault(stage_of[op], []).append(i)
            present = sorted(stages)
            for k, k_next in zip(present, present[1:], strict=False):
                if any(not before(a, b) for a in stages[k] for b in stages[k_next]):
                    return f"device {device}: stage {k_next} not after stage {k}"
    return None


def accepts(graph: OpGraph, plan: LaunchPlan, sched: Schedule | None) -> bool:
    try:
        validate(graph, plan, sched)
    except PlanError:
        return False
    return True


# ---- random plans and their corruptions ------------------------------------------------------------------------------


@st.composite
def graphs(draw, max_ops: int = 16) -> OpGraph:
    """A random DAG whose edges are data or write-after-read."""
    graph = draw(dags(max_ops=max_ops))
    kinds = [draw(st.sampled_from(["data", "data", "war"])) for _ in graph.edges]
    return OpGraph(graph.ops, [replace(e, kind=k) for e, k in zip(graph.edges, kinds, strict=True)], graph.name)


@st.composite
def lowered(draw) -> tuple[OpGraph, Schedule, LaunchPlan]:
    """A random graph scheduled by any registered scheduler (1–4 streams, 1–4 devices where the scheduler places
    ops on devices) or by a random schedule (any topological order, lanes and stages), then lowered."""
    if draw(st.booleans()):
        graph = draw(graphs())
        name = draw(st.sampled_from(schedulers.names()))
        devices = draw(st.integers(1, 4)) if name in schedulers.MULTI_DEVICE else 1
        sched = schedulers.run(name, graph, from_graph(graph), streams=draw(st.integers(1, 4)), devices=devices)
    else:
        graph, sched = draw(scheduled_dags(max_streams=4, max_devices=4, graphs=graphs()))
    return graph, sched, lower(graph, sched)


CORRUPTIONS = ("drop a wait or recv", "move a launch", "swap two instructions", "change an event",
               "record or send again", "reorder stages")


@st.composite
def corrupted(draw, plan: LaunchPlan, sched: Schedule) -> tuple[LaunchPlan, Schedule]:
    """One corruption of ``plan`` (or of the schedule's stages); the result may still be a correct plan."""
    instrs = list(plan.instrs)
    index_of = {kind: [i for i, ins in enumerate(instrs) if ins.kind in kind] for kind in
                (("wait", "recv"), ("launch",), ("record", "wait"))}
    sources = [i for i, ins in enumerate(instrs) if ins.kind in ("record", "send")]
    possible = [c for c, ok in zip(CORRUPTIONS, [index_of[("wait", "recv")], True, len(instrs) > 1,
                                                 index_of[("record", "wait")], sources, sched.stage_of], strict=True)
                if ok]
    what = draw(st.sampled_from(possible))
    event(what)
    if what == "drop a wait or recv":
        del instrs[draw(st.sampled_from(index_of[("wait", "recv")]))]
    elif what == "move a launch":
        i = draw(st.sampled_from(index_of[("launch",)]))
        stream = (instrs[i].stream + draw(st.integers(1, 4))) % 5  # another of streams 0-4
        device = draw(st.sampled_from([instrs[i].device, *plan.devices]))
        instrs[i] = replace(instrs[i], device=device, stream=stream)
    elif what == "swap two instructions":
        i, j = draw(st.lists(st.integers(0, len(instrs) - 1), min_size=2, max_size=2, unique=True))
        instrs[i], instrs[j] = instrs[j], instrs[i]
    elif what == "change an event":  # to another event of the device (so that it collides) or a fresh one
        i = draw(st.sampled_from(index_of[("record", "wait")]))
        events = sorted({ins.event for ins in instrs if ins.kind == "record" and ins.device == instrs[i].device})
        fresh = max(events, default=0) + 1
        instrs[i] = replace(instrs[i], event=draw(st.sampled_from([e for e in [*events, fresh]
                                                                    if e != instrs[i].event])))
    elif what == "record or send again":  # later, maybe on another stream: the waits (recvs) after it pair with it
        i = draw(st.sampled_from(sources))
        stream = draw(st.sampled_from(plan.streams(instrs[i].device)))
        instrs.insert(draw(st.integers(i + 1, len(instrs))), replace(instrs[i], stream=stream))
    else:  # reorder stages: swap the stages of two ops, or move one op to another stage
        ops = draw(st.lists(st.sampled_from(sched.order), min_size=2, max_size=2, unique=True)) \
            if len(sched.order) > 1 else sched.order * 2
        stage_of = dict(sched.stage_of)
        if draw(st.booleans()):
            stage_of[ops[0]], stage_of[ops[1]] = stage_of[ops[1]], stage_of[ops[0]]
        else:
            stage_of[ops[0]] = draw(st.integers(0, max(stage_of.values()) + 1))
        sched = replace(sched, stage_of=stage_of)
    return LaunchPlan(instrs), sched


# ---- the tests -------------------------------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(case=lowered(), data=st.data())
def test_validate_agrees_with_the_oracle_on_lowered_and_corrupted_plans(case, data):
    graph, sched, plan = case
    assert oracle(graph, plan, sched.stage_of) is None
    assert accepts(graph, plan, sched)
    for _ in range(data.draw(st.integers(1, 2))):
        plan, sched = data.draw(corrupted(plan, sched))
    verdict = oracle(graph, plan, sched.stage_of)
    event("oracle accepts" if verdict is None else "oracle rejects")
    assert accepts(graph, plan, sched) == (verdict is None), verdict or "validate rejects a correct plan"


@settings(max_examples=100, deadline=None)
@given(case=lowered())
def test_every_wait_lower_emits_is_needed(case):
    graph, sched, plan = case
    for i, ins in enumerate(plan.instrs):
        if ins.kind == "wait":
            dropped = LaunchPlan(plan.instrs[:i] + plan.instrs[i + 1:])
            assert oracle(graph, dropped, sched.stage_of) is not None
            with pytest.raises(PlanError):
                validate(graph, dropped, sched)


def test_stage_order_is_checked_from_its_definition_not_from_lowerings_barriers():
    # stage 0 = {a (stream 0), b (stream 1)}, stage 1 = {c (stream 1)}: c must follow a although no edge says so.
    # A barrier that only waited for the previous stage's last op *on the same stream* would miss a.
    ops = ["a", "b", "c"]
    graph = OpGraph([Op(o, latency_ms=1) for o in ops])
    sched = Schedule("t", ops, {"a": 0, "b": 1, "c": 1}, stage_of={"a": 0, "b": 0, "c": 1})
    plan = LaunchPlan([Instr(0, "launch", 0, op="a"), Instr(0, "launch", 1, op="b"), Instr(0, "launch", 1, op="c")])
    assert oracle(graph, plan, sched.stage_of) is not None
    with pytest.raises(PlanError, match=r"stage order: op 'c' \(stage 1, device 0 stream 1\) is not ordered after "
                                        r"op 'a' \(stage 0, stream 0\)"):
        validate(graph, plan, sched)
    assert accepts(graph, lower(graph, sched), sched)


def test_interpreter_steps_and_clocks_on_the_docstring_example():
    seen = []

    class Steps(PlanInterpreter):
        def run_instr(self, i, ins, at):
            seen.append((ins.kind, at, dict(self.clock[at[0]])))
            super().run_instr(i, ins, at)

    plan = LaunchPlan([Instr(0, "launch", 0, op="a"), Instr(0, "record", 0, event=7), Instr(0, "wait", 1, event=7),
                       Instr(0, "launch", 1, op="b")])
    hb = Steps().run(plan)
    s0, s1 = (0, 0), (0, 1)
    assert seen == [("launch", (s0, 1), {s0: 1}), ("record", (s0, 2), {s0: 2}),
                    ("wait", (s1, 1), {s1: 1, s0: 2}), ("launch", (s1, 2), {s1: 2, s0: 2})]
    assert hb.source == [None, None, 1, None]
    assert hb.predecessors(3) == [2] and hb.predecessors(2) == [1]
    assert hb.ordered((s0, 1), s1)
    assert not PlanInterpreter().run(LaunchPlan([plan.instrs[0], plan.instrs[3]])).ordered((s0, 1), s1)


def test_lower_logs_its_decisions_at_debug_level_only(caplog):
    graph = examples.load("lios-fig3")
    sched = schedulers.run("lios", graph, from_graph(graph), streams=3)
    with caplog.at_level(logging.INFO, logger="opweave.plan.lower"):
        lower(graph, sched)
    assert caplog.records == []
    with caplog.at_level(logging.DEBUG, logger="opweave.plan.lower"):
        plan = lower(graph, sched)
    (record,) = caplog.records
    assert plan.syncs == 5
    assert record.getMessage() == ("lower lios: device 0: 10 ops on streams [0, 1, 2]; 5 waits on 4 events "
                                   "(7 dependencies already ordered, no wait); 0 sends, 0 recvs")

