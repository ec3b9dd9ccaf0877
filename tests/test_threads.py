"""``threads`` holds on every path that runs ops on the CPU: the intra-op threads an op runs with (what
``torch.get_num_threads()`` says inside it, or an ONNX Runtime session's thread count) are never more than the
budget :func:`opweave.backends.threads.budgets` gives it out of ``threads``. Before, a one-lane plan, its compiled
segments, ONNX Runtime's one-lane sessions and the CPU default's eager candidate ran on the caller's threads or
every core, and the server's executor took no budget at all."""

from __future__ import annotations

import warnings

import pytest
import torch

import opweave
from opweave.backends.threads import budgets, total_threads
from opweave.pipeline.thread_budgets import op_budgets
from threads_probe import plain, probe

BUDGET = 1  # fewer than the caller's threads wherever the machine has two cores or more


@pytest.fixture(autouse=True)
def caller_threads():
    """The caller runs with every core, so a path that ignores the budget shows it; its count is put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, total_threads()))
    yield torch.get_num_threads()
    assert torch.get_num_threads() == max(2, total_threads())  # no path leaves the caller's count changed
    torch.set_num_threads(before)


def seen_by_the_probes(fast, inputs) -> set[float]:
    with torch.no_grad():
        left, right, _ = fast(*inputs)
    return {left.max().item(), right.max().item()}


@pytest.mark.parametrize("options", [
    {"scheduler": "sequential"},  # one lane
    {},  # the CPU default: the guard keeps lanes, one lane or the model itself
    {"scheduler": "lios", "streams": 2},  # lanes
    {"scheduler": "sequential", "compiler": "inductor"},  # a segment compiled by Inductor, which calls the probe
    {"scheduler": "lios", "streams": 2, "compiler": "eager"},  # segments on lanes
    {"devices": 2},  # one rank process per device
], ids=["one lane", "default", "lanes", "inductor segment", "segments on lanes", "ranks"])
def test_every_op_runs_within_its_threads(options):
    model, inputs = probe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with opweave.compile(model, inputs, threads=BUDGET, **options) as fast:
            assert seen_by_the_probes(fast, inputs) == {float(BUDGET)}, options


@pytest.mark.own_pools
@pytest.mark.parametrize("options", [{"scheduler": "sequential", "compiler": "onnxruntime"},
                                     {"scheduler": "lios", "streams": 2, "compiler": "onnxruntime"},
                                     {"scheduler": "sequential", "graph": "onnxruntime"},
                                     {"scheduler": "heft", "streams": 2, "graph": "onnxruntime"}],
                         ids=["onnxruntime segment", "onnxruntime segments on lanes", "onnxruntime graph",
                              "onnxruntime graph on lanes"])
def test_every_onnx_runtime_session_runs_within_its_threads(options):
    pytest.importorskip("onnxruntime")
    model, inputs = plain()
    with opweave.compile(model, inputs, threads=BUDGET, **options) as fast:
        if fast.fused is not None:
            sessions = [compiled.fn.session for segment in fast.fused._segments.values()
                        for compiled in segment.compiled.values() if compiled is not None]
        else:
            sessions = list(fast.backend.sessions.values())
        assert sessions, options
        assert {s.get_session_options().intra_op_num_threads for s in sessions} == {BUDGET}, options
        with torch.no_grad():
            assert opweave.outputs.compare(model(*inputs), fast(*inputs)).ok


def test_the_servers_executor_runs_every_combined_block_within_its_threads():
    from opweave.capture import capture
    from opweave.serve.assemble import serving_options
    from opweave.serve.engine import blocks
    from opweave.serve.engine.combined import Part
    from opweave.serve.engine.cpu import CpuExecutor

    model, inputs = probe()
    blocked = blocks.split(capture(model, inputs), inputs, name="probe")
    executor = CpuExecutor({"probe": blocked}, serving_options("cpu", threads=BUDGET, compiler=None))
    assert executor.threads == BUDGET and executor.streams == BUDGET
    state = inputs
    for b in range(len(blocked.blocks)):
        part = Part("probe", b, 1, state)
        executor.run([part])
        state = part.state
    left, right, _ = state
    assert {left.max().item(), right.max().item()} == {float(BUDGET)}


def test_one_rule_gives_every_budget():
    assert budgets(["a"], total=3) == {"a": 3} and budgets(["a", "b"], total=1) == {"a": 1, "b": 1}
    assert budgets(["a"], ranks=2) == {"a": total_threads(ranks=2)} == {"a": max(1, total_threads() // 2)}
    assert op_budgets(1, 1) == [1] and op_budgets(2, 4) == [1, 2, 4] and op_budgets(2, 4, per_op=False) == [1, 3, 4]


def test_the_cores_are_those_this_process_may_run_on(monkeypatch):
    """Read one way, from the process's CPU affinity: a process kept on one CPU (a container, taskset, a pinned Ray
    replica) plans for one, and a benchmark's busy machine is judged on its CPUs. Before, the benchmarks' load check
    and a local Ray cluster's CPUs read ``os.cpu_count()``, every CPU of the machine."""
    import os

    from opweave.cores import cores
    from opweave.evaluate import bench
    from opweave.pipeline import resolve

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert cores() == 1 and total_threads() == 1 and resolve("cpu").threads == 1
    assert "load average 4.00 on 1 CPUs" in bench.busy_warning(None, [4.0, 4.0, 4.0])


def test_a_scoped_thread_count_is_put_back_when_the_block_raises():
    from opweave.cores import intra_op_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), intra_op_threads(1) as saved:
        assert torch.get_num_threads() == 1 and saved == before
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_every_thread_count_is_set_in_one_of_the_places_that_say_why():
    """A count that is put back is :func:`opweave.cores.intra_op_threads`'s; the others are set for good, by a
    worker for its own life (``enter_budget``), a lane's generated code between ops (put back by the backend's
    scope), a rank process or a tier's build process once. ``os.cpu_count()`` is read by
    :func:`opweave.cores.cores` alone."""
    from pathlib import Path

    import opweave

    root = Path(opweave.__file__).parent
    allowed = {"set_num_threads": {"cores.py", "backends/threads.py", "backends/lanecode.py",
                                   "backends/distributed/rank.py", "backends/distributed/torchrun.py",
                                   "pipeline/tiers.py"},
               "os.cpu_count": {"cores.py"}}
    for name, where in allowed.items():
        found = {str(p.relative_to(root)) for p in root.rglob("*.py") if f"{name}(" in p.read_text()}
        assert found <= where, (name, found - where)
