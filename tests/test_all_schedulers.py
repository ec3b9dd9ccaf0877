"""Every registered scheduler: its module imports and runs (no scheduler is ever skipped), and on random DAGs of 1–60
ops (ties, zero latencies, write-after-read edges, transfer times) its plan validates and the simulator's ideal
replay of that plan equals its ``predicted_ms``."""

import importlib
import pkgutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opweave.schedulers
from dags import dags, per_edge_transfers
from opweave import examples, schedulers
from opweave.costs import from_graph
from oracle import replay

LIST_SCHEDULERS = ("sequential", "nimble", "opara", "lios", "wavefront")  # replay never exceeds sequential


@pytest.mark.parametrize("name", schedulers.names())
def test_registered_module_imports_and_runs(name):
    # a scheduler whose module fails to import (or whose schedule() fails) fails here and in every test below
    module_name, _ = schedulers._MODULES[name]
    module = importlib.import_module(f"opweave.schedulers.{module_name}")
    assert callable(module.schedule)
    graph = examples.load("lios-fig3")
    costs = from_graph(graph)
    sched = schedulers.run(name, graph, costs, streams=3, devices=2 if name in schedulers.MULTI_DEVICE else 1)
    assert sched.scheduler == name and sorted(sched.order) == sorted(graph.ids)
    assert replay(graph, sched, costs).makespan_ms == pytest.approx(sched.predicted_ms, abs=1e-9)


def test_every_scheduler_module_is_registered():
    # a new algorithm module (one with a schedule() function) that nobody registered would escape every test that
    # loops over schedulers.names()
    public = [m.name for m in pkgutil.iter_modules(opweave.schedulers.__path__) if not m.name.startswith("_")]
    algorithms = {name for name in public
                  if callable(getattr(importlib.import_module(f"opweave.schedulers.{name}"), "schedule", None))}
    assert algorithms == {module for module, _ in schedulers._MODULES.values()}


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=dags(max_ops=60), streams=st.sampled_from([None, 1, 2, 3]), data=st.data())
def test_every_scheduler_on_random_dags(graph, streams, data):
    # Transfer times are drawn per producer (dags' default) or, half the time, per edge. The simulator moves a tensor
    # to a device once, at the slowest of its edges there; HIOS prices each edge on its own. So HIOS's prediction is
    # the replay exactly when a producer's edges to one device share a transfer time, and a lower bound otherwise.
    per_edge = data.draw(st.booleans(), label="per-edge transfers")
    if per_edge:
        graph = data.draw(per_edge_transfers(graph), label="graph")
    costs = from_graph(graph)
    critical_ms = graph.critical_path_ms()
    sequential_ms = graph.total_work_ms()
    for name in schedulers.names():
        for devices in (1, 2) if name in schedulers.MULTI_DEVICE else (1,):
            sched = schedulers.run(name, graph, costs, streams=streams, devices=devices)
            result = replay(graph, sched, costs)  # lowers and validates
            assert sorted(result.start_ms) == sorted(graph.ids), name
            assert result.makespan_ms >= critical_ms - 1e-9, name
            if name in LIST_SCHEDULERS:
                assert result.makespan_ms <= sequential_ms + 1e-9, name
            if per_edge and devices > 1:
                assert result.makespan_ms >= sched.predicted_ms - 1e-9, (name, devices)
            else:
                assert result.makespan_ms == pytest.approx(sched.predicted_ms, abs=1e-9), (name, devices)
