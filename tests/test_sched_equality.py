"""Every scheduler's schedule is pinned: a digest of each Schedule, recorded before the schedulers were sped up
(issue 8, item 6; from commit 8c51061, the first to make Nimble's schedule the same in every process), must not
change.

A digest covers ``order`` and, per op in that order, ``stream_of``, ``device_of`` and ``stage_of``, plus
``predicted_ms`` to the bit (``float.hex``). Cases: every zoo model (captured once per module, roofline latencies for
the h100 preset) under the ``gpu`` cost model that :func:`opweave.costs.roofline.estimate` returns and under the
``ideal`` one (what ``opweave schedule`` and ``benchmarks/sched_time.py`` use), and HIOS-style random DAGs (their
own latencies and transfer times). Streams 8 (the benchmark's setting) and uncapped (``opweave schedule``'s); the
HIOS variants on 2 devices and on 1. IOS, the exponential DP, runs on the random DAGs and on the zoo graphs where it
takes well under a second.

An intended change of a schedule regenerates the fixture: ``.venv/bin/python tests/test_sched_equality.py``
(it captures every zoo model: minutes), then the diff of ``tests/data/sched_digests.json`` shows what changed.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave import schedulers, zoo
from opweave.costs import from_graph
from opweave.costs.model import Costs
from opweave.costs.roofline import estimate
from opweave.ir.graph import OpGraph, chain
from opweave.ir.synth import random_dag
from opweave.schedulers.hios.stages import Problem, evaluate
from opweave.schedulers.schedule import Schedule
from test_hios import merge_windows, merged_plan

FIXTURE = Path(__file__).parent / "data" / "sched_digests.json"
COST_MODELS = ("gpu", "ideal")
STREAMS = 8
# IOS's chunked DP takes seconds to tens of seconds on these zoo graphs: pinned on the others only.
IOS_SKIP = ("inception_v3", "nasnet_a_mobile", "randwire", "deepfm")
# (ops, layers, edges, seed) of the random DAGs
RANDOM_DAGS = ((30, 6, 60, 0), (60, 8, 120, 1), (120, 14, 240, 2), (200, 14, 400, 3))


def digest(sched: Schedule) -> str:
    """A hash of what the scheduler decided: launch order, and per op its stream, device and stage, and the
    predicted makespan to the bit."""
    data = {
        "order": sched.order,
        "stream": [sched.stream_of[o] for o in sched.order],
        "device": [sched.device(o) for o in sched.order],
        "stage": None if sched.stage_of is None else [sched.stage_of[o] for o in sched.order],
        "predicted_ms": None if sched.predicted_ms is None else float(sched.predicted_ms).hex(),
    }
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()[:20]


def runs(graph_name: str) -> list[tuple[str, str, int | None, int]]:
    """(scheduler, cost model, streams, devices) of every pinned run on a graph."""
    out = []
    for model in COST_MODELS:
        for streams in (STREAMS, None):
            for name in schedulers.names():
                if name == "ios" and graph_name in IOS_SKIP:
                    continue
                for devices in (2, 1) if name in schedulers.MULTI_DEVICE else (1,):
                    out.append((name, model, streams, devices))
    return out


def key(graph_name: str, name: str, model: str, streams: int | None, devices: int) -> str:
    return f"{graph_name}/{name}/{model}/streams={streams}/devices={devices}"


@functools.cache
def zoo_graph(model: str) -> OpGraph:
    """The captured graph of a zoo model (batch 1), once per test module."""
    from opweave.capture import capture

    module, inputs = zoo.create(model)
    return capture(module, inputs, name=model).graph


def zoo_costs(graph: OpGraph, model: str) -> Costs:
    costs = estimate(graph, "h100")
    return costs if costs.model == model else dataclasses.replace(costs, model=model)


def random_graph(spec: tuple[int, int, int, int]) -> OpGraph:
    return random_dag(*spec)


def random_name(spec: tuple[int, int, int, int]) -> str:
    return "random_dag-{}-{}-{}-{}".format(*spec)


def digests_of(graph_name: str, graph_factory, costs_for) -> dict[str, dict]:
    """Digest and predicted makespan of every pinned run on one graph; a fresh graph per run, so that every
    scheduler also builds the graph's cached structure itself."""
    out = {}
    for name, model, streams, devices in runs(graph_name):
        graph = graph_factory()
        sched = schedulers.run(name, graph, costs_for(graph, model), streams=streams, devices=devices)
        out[key(graph_name, name, model, streams, devices)] = {"digest": digest(sched),
                                                               "predicted_ms": sched.predicted_ms}
    return out


def _fresh_zoo(model: str):
    """A factory of fresh copies of a zoo graph (so cached properties are rebuilt per run)."""
    return lambda: OpGraph.from_dict(zoo_graph(model).to_dict())


def _expected() -> dict[str, dict]:
    return json.loads(FIXTURE.read_text())["digests"]


def _check(got: dict[str, dict]) -> None:
    expected = _expected()
    missing = sorted(set(got) - set(expected))
    assert not missing, f"no pinned digest for {missing[:3]}: regenerate {FIXTURE.name} (see the module docstring)"
    changed = [(k, expected[k], got[k]) for k in got if got[k]["digest"] != expected[k]["digest"]]
    assert not changed, "schedules changed: " + "; ".join(
        f"{k} (predicted {e['predicted_ms']!r} -> {g['predicted_ms']!r})" for k, e, g in changed[:5])


@pytest.mark.parametrize("spec", RANDOM_DAGS, ids=random_name)
def test_random_dag_schedules_unchanged(spec):
    _check(digests_of(random_name(spec), lambda: random_graph(spec), lambda g, m: from_graph(g, model=m)))


@pytest.mark.slow
@pytest.mark.parametrize("model", zoo.names())
def test_zoo_schedules_unchanged(model):
    _check(digests_of(model, _fresh_zoo(model), zoo_costs))


def _draw_random_dag(ops: int, seed: int, data) -> OpGraph:
    """A layered random DAG of ``ops`` ops, with as many layers and edges as ``data`` draws."""
    layers = data.draw(st.integers(1, ops))
    sizes = [ops // layers + (i < ops % layers) for i in range(layers)]
    most = sum(a * b for i, a in enumerate(sizes) for b in sizes[i + 1:])
    return random_dag(ops, layers, data.draw(st.integers(ops - sizes[0], max(ops - sizes[0], most))), seed)


@settings(max_examples=200, deadline=None)
@given(ops=st.integers(1, 40), seed=st.integers(0, 10**6), data=st.data())
def test_topo_order_and_reachability_match_networkx(ops, seed, data):
    """The graph's cached structure, which every scheduler reads, as networkx computes it, also when the capture
    order is not topological (ops shuffled)."""
    base = _draw_random_dag(ops, seed, data)
    shuffled = data.draw(st.permutations(base.ops))
    graph = OpGraph(list(shuffled), base.edges, "shuffled")
    ref = graph.nx()
    assert graph.topo_order == list(nx.lexicographical_topological_sort(ref, key=graph.index.__getitem__))
    for u in graph.ids:
        assert {v for v in graph.ids if graph.reaches(u, v)} == nx.descendants(ref, u)


LATENCIES_MS = (0.0, 1e-3, 0.1, 0.2, 0.3, 0.7, 1.0, 1 / 3, 2.5, 1e3)  # ties, zeros, inexact binary fractions


@settings(max_examples=150, deadline=None)
@given(ops=st.integers(1, 30), seed=st.integers(0, 10**6), model=st.sampled_from(COST_MODELS), data=st.data())
def test_chain_plan_times_like_working_plan_and_evaluate(ops, seed, model, data):
    """HIOS's one-device grouping (:class:`ChainPlan`) gives the makespans of :class:`WorkingPlan` and of
    ``evaluate()``, bit for bit, for every window on a chain in priority order, also after random merges."""
    from opweave.schedulers.hios.grouping import ChainPlan, WorkingPlan  # here: main() runs on older trees too

    base = _draw_random_dag(ops, seed, data)
    lat = data.draw(st.lists(st.sampled_from(LATENCIES_MS), min_size=ops, max_size=ops))
    graph = OpGraph([dataclasses.replace(o, latency_ms=t) for o, t in zip(base.ops, lat, strict=True)], base.edges)
    problem = Problem(graph, from_graph(graph, model=model))
    chain = _topological_order(problem, data.draw(st.lists(st.floats(0, 1), min_size=ops, max_size=ops)))
    device_of = [0] * ops
    plan = [[(v,) for v in chain]]
    fast, slow = ChainPlan(problem, device_of, plan), WorkingPlan(problem, device_of, plan)
    assert fast.makespan_ms == slow.makespan_ms
    for v in chain:
        for window, merged in merge_windows(fast, problem, v):
            assert not fast.creates_cycle(window) and not slow.creates_cycle(window)
            fast_times, slow_times = fast.time_merge(window, merged, 0.0), slow.time_merge(window, merged, math.inf)
            expected = evaluate(problem, device_of, merged_plan(fast.plan(), window, merged))
            assert fast_times.makespan_ms == slow_times.makespan_ms == expected.makespan_ms
            if data.draw(st.booleans()):
                fast.merge(window, merged, fast_times)
                slow.merge(window, merged, slow_times)
                assert fast.plan() == slow.plan()
                assert fast.makespan_ms == slow.makespan_ms == evaluate(problem, device_of, fast.plan()).makespan_ms
                break


def _topological_order(problem: Problem, keys: list[float]) -> list[int]:
    """The topological order that always takes the ready op of smallest key (as HIOS's priority order does)."""
    indegree = [len(p) for p in problem.preds]
    ready = [(keys[v], v) for v, d in enumerate(indegree) if not d]
    order = []
    while ready:
        ready.sort()
        _, v = ready.pop(0)
        order.append(v)
        for w in problem.succs[v]:
            indegree[w] -= 1
            if not indegree[w]:
                ready.append((keys[w], w))
    return order


_DIGESTS_IN_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_sched_equality import digest
from opweave import schedulers
from opweave.costs import from_graph
from opweave.ir.synth import random_dag
g = random_dag(30, 6, 60, 0)
print(json.dumps({{n: digest(schedulers.run(n, g, from_graph(g), streams=s, devices=2 if n.startswith("hios") else 1))
                  for n in schedulers.names() for s in (None, 4)}}))
"""


def test_schedules_do_not_depend_on_the_hash_seed():
    """The same schedule in every process: iterating a set of op ids (strings, whose hashes change with
    PYTHONHASHSEED) must not steer a scheduler. Nimble did, through networkx's matching on string nodes."""
    code = _DIGESTS_IN_CHILD.format(tests=str(Path(__file__).parent))
    results = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]


def test_sums_of_latencies_are_the_same_on_every_python():
    """Python 3.12's ``sum`` of floats compensates and 3.11's does not: ten 0.1 ms ops sum to 1.0 on one and to
    0.9999999999999999 on the other, and IOS's DP broke a tie on GoogLeNet differently on the two. Sequential's
    prediction and a stage's latency are correctly rounded (``math.fsum``), so every pinned digest holds on both."""
    graph = chain([0.1] * 10)
    costs = from_graph(graph)
    assert schedulers.run("sequential", graph, costs).predicted_ms == 1.0
    assert costs.stage_latency_ms([graph.topo_order]) == 1.0
    assert costs.stage_latency_ms([graph.topo_order[:5], graph.topo_order[5:]]) == math.fsum([0.1] * 5)


def test_run_logs_its_decisions_at_debug_level_only(caplog):
    graph = random_dag(30, 6, 60, 0)
    with caplog.at_level(logging.INFO, logger="opweave.schedulers"):
        schedulers.run("lios", graph, from_graph(graph))
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="opweave.schedulers"):
        sched = schedulers.run("lios", graph, from_graph(graph), streams=3)
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG
    message = record.getMessage()
    assert message.startswith(f"lios on {graph.name} (30 ops): {sched.streams_used} streams on 1 devices")
    assert f"predicted {sched.predicted_ms:.4f} ms, critical path {graph.critical_path_ms():.4f} ms" in message


def test_run_pauses_the_garbage_collector_only_while_the_scheduler_runs(monkeypatch):
    """A full collection of the caller's heap (a captured model's objects) is not billed as scheduling time."""
    from opweave.schedulers import lios

    seen = []

    def observed(*args, **kwargs):
        seen.append(gc.isenabled())
        if kwargs.get("streams") == 99:
            raise ValueError("scheduler failed")
        return schedule(*args, **kwargs)

    schedule = lios.schedule
    monkeypatch.setattr(lios, "schedule", observed)
    graph = random_dag(30, 6, 60, 0)
    assert gc.isenabled()
    schedulers.run("lios", graph, from_graph(graph))
    with pytest.raises(ValueError, match="scheduler failed"):
        schedulers.run("lios", graph, from_graph(graph), streams=99)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        schedulers.run("lios", graph, from_graph(graph))
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def test_fixture_covers_every_scheduler():
    pinned = {k.split("/")[1] for k in _expected()}
    assert pinned == set(schedulers.names())


def main() -> None:
    """Recompute every digest and write the fixture."""
    got: dict[str, dict] = {}
    for spec in RANDOM_DAGS:
        got.update(digests_of(random_name(spec), lambda spec=spec: random_graph(spec),
                              lambda g, m: from_graph(g, model=m)))
    for model in zoo.names():
        print(f"capturing and scheduling {model}", file=sys.stderr, flush=True)
        got.update(digests_of(model, _fresh_zoo(model), zoo_costs))
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({"about": "tests/test_sched_equality.py: digests of every pinned schedule",
                                   "digests": got}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(got)} digests to {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
