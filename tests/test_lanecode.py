"""CPU lanes as generated code (opweave.backends.lanecode) and their thread budgets (opweave.backends.threads)."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch import nn

import opweave
from opweave import zoo
from opweave.backends.cpu import CpuBackend
from opweave.backends.lanecode import code_of
from opweave.backends.simulate import simulate
from opweave.backends.threads import budgets, enter_budget
from opweave.capture import capture
from opweave.cores import intra_op_threads
from opweave.costs.roofline import estimate
from opweave.outputs import compare
from opweave.pipeline import plan_for
from opweave.pipeline.thread_budgets import op_threads

_seen: dict[str, weakref.ref] = {}
_alive_at_probe: list[bool] = []


@torch.library.custom_op("opweave_tests::remember", mutates_args=())
def remember(x: torch.Tensor) -> torch.Tensor:
    """Returns a copy of ``x`` and keeps only a weak reference to that copy."""
    out = x * 2
    _seen["big"] = weakref.ref(out)
    return out


@remember.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("opweave_tests::probe", mutates_args=())
def probe(x: torch.Tensor) -> torch.Tensor:
    """Records whether the tensor :func:`remember` made is still alive."""
    ref = _seen.get("big")
    _alive_at_probe.append(ref is not None and ref() is not None)
    return x + 1


@probe.register_fake
def _(x):
    return torch.empty_like(x)


class Chain(nn.Module):
    def forward(self, x):
        big = torch.ops.opweave_tests.remember(x)  # its last reader is the sum just after it
        small = big.sum(dim=1, keepdim=True)
        return torch.ops.opweave_tests.probe(small)


def test_an_intermediate_is_freed_at_its_last_use_not_at_the_end_of_the_call():
    model, x = Chain(), torch.randn(4, 1000)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="sequential", coarsen=False)
    _alive_at_probe.clear()
    with torch.inference_mode():
        assert compare(model(x), fast(x)).ok
    assert _alive_at_probe == [True, False]  # eager keeps it to the end of forward(); the lane drops it after the sum


class Fork(nn.Module):
    """Two branches of the input joined at the end: the right branch's values cross to the left lane."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        left = torch.relu(self.a(x))
        right = torch.tanh(self.b(x))
        mid = self.c(right)  # read by the join only
        return left + mid, right.sum()


def test_two_lanes_are_two_generated_functions_with_signals_slots_and_releases():
    model, x = Fork().eval(), torch.randn(3, 16)
    captured = capture(model, (x,))
    graph = captured.graph
    _, plan = plan_for(graph, estimate(graph, "cpu", model="ideal"), "heft", streams=2)
    backend = CpuBackend(captured, plan)
    code = code_of(backend.code)
    assert code.count("# lane") == 2 == len(backend.code.functions)
    assert "signal(" in code and "wait(" in code and "slots[" in code
    with torch.inference_mode():
        assert compare(model(x), backend(x)).ok
        for _ in range(3):  # calls reuse the functions; every call has fresh slots
            y = torch.randn(3, 16)
            assert compare(model(y), backend(y)).ok
    backend.close()


def test_every_zoo_model_under_generated_lanes_equals_eager_on_two_and_three_lanes():
    for name in ("googlenet", "deepfm", "bert_base"):
        model, inputs = zoo.create(name, batch_size=1, **({"num_layers": 2} if name == "bert_base" else {}))
        with torch.inference_mode():
            reference = model(*inputs)
        for lanes in (2, 3):
            fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=lanes)
            with torch.inference_mode():
                assert compare(reference, fast(*inputs)).ok, (name, lanes)
            fast.close()


def test_budgets_split_the_cores_and_a_lone_op_gets_them_all():
    assert budgets([(0, 0), (0, 1)], total=2) == {(0, 0): 1, (0, 1): 1}
    assert budgets([(0, 0), (0, 1), (0, 2)], total=8) == {(0, 0): 6, (0, 1): 1, (0, 2): 1}
    model, x = Fork().eval(), torch.randn(3, 16)
    captured = capture(model, (x,))
    costs = estimate(captured.graph, "cpu", model="ideal")
    _, plan = plan_for(captured.graph, costs, "heft", streams=2)
    sim = simulate(captured.graph, plan, costs)
    threads = op_threads(sim, total=4)
    first = min(sim.lane_of.values())
    assert {threads[op] for op, lane in sim.lane_of.items() if lane == first} <= {2, 4}
    assert 2 in threads.values() and 4 in threads.values()
    assert {threads[op] for op, lane in sim.lane_of.items() if lane != first} == {1}


def test_only_the_callers_thread_runs_more_than_one_intra_op_thread():
    """A worker that held a two-thread OpenMP team made libgomp throttle its spin-wait for the whole process (eager
    GoogLeNet 64 against 40 ms, benchmarks/omp_teams.py): the first lane runs in the caller's thread, the workers'
    ops on one thread each, and the caller's count is what it was after a call."""
    model, x = Fork().eval(), torch.randn(3, 16)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2)
    assert fast.schedule.streams_used == 2
    backend = fast.backend
    lanes = sorted(backend.program.lanes)
    assert [w.lane for w in backend._pool.workers] == lanes[1:]
    budget = {step.op: backend.code._threads.get(step.op) for lane, step in backend.program.issue_order
              if step.kind == "launch" and lane != lanes[0]}
    assert budget and set(budget.values()) == {1}
    caller = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            assert compare(model(x), fast(x)).ok
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
        fast.close()


def test_a_worker_thread_count_is_its_own_and_does_not_leak_into_later_threads():
    caller = torch.get_num_threads()
    seen = {}

    def worker():
        enter_budget(1)
        seen["worker"] = torch.get_num_threads()

    with intra_op_threads():  # the worker's count set the process-wide default too: put back at the exit
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen["worker"] == 1 and torch.get_num_threads() == caller
    t = threading.Thread(target=lambda: seen.update(later=(torch.ones(64).sum(), torch.get_num_threads())[1]))
    t.start()
    t.join()
    assert seen["later"] == caller


def test_a_failing_lane_names_the_op_and_the_call_does_not_hang():
    class Bad(nn.Module):
        def forward(self, x, index):
            return torch.relu(x).gather(1, index), torch.tanh(x)

    model = Bad()
    x, index = torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.long)
    fast = opweave.compile(model, (x, index), device="cpu", scheduler="heft", streams=2, coarsen=False)
    with pytest.raises(opweave.OpweaveError, match=r"gather.*float32\[2, 3\].*int64\[2, 1\]"):
        fast(x, torch.full((2, 1), 7))
    with torch.inference_mode():  # the backend is still usable
        assert compare(model(x, index), fast(x, index)).ok
