"""Lanes over ONNX Runtime's optimized graph of the whole model (``graph="onnxruntime"``,
opweave.backends.ortgraph)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opweave
from opweave import zoo
from opweave.backends.ortgraph import OrtGraph, OrtLanes, stable_names
from opweave.backends.segments import whole_module
from opweave.capture import capture, coarsen
from opweave.errors import UsageError
from opweave.outputs import compare
from opweave.plan.validate import validate

pytest.importorskip("onnxruntime", reason="the onnx extra")


class Branches(nn.Module):
    """Four independent convolution branches: a plan with two lanes and several segments on each."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                                                    nn.Conv2d(16, 16, 3, padding=1)) for _ in range(4))

    def forward(self, x):
        x = torch.relu(self.stem(x))
        parts = [b(x) for b in self.branches]
        return {"sum": parts[0] + parts[1], "cat": torch.cat([parts[2], parts[3]], 1)}


def _model():
    torch.manual_seed(0)
    return Branches().eval(), (torch.randn(1, 3, 32, 32),)


@pytest.mark.parametrize("name", ["deepfm", "squeezenet", "bert_base"])
@pytest.mark.parametrize("scheduler", ["sequential", "heft"])
def test_ort_graph_lanes_equal_eager(name, scheduler):
    options = {"num_layers": 2} if name == "bert_base" else {"image_size": 64} if name == "squeezenet" else {}
    model, inputs = zoo.create(name, batch_size=1, **options)
    fast = opweave.compile(model, inputs, device="cpu", scheduler=scheduler, graph="onnxruntime",
                           streams=1 if scheduler == "sequential" else 2,
                           scheduler_options={"sync_ms": 0.0} if scheduler == "heft" else None)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs), tolerance=1e-4).ok
    if scheduler == "sequential":
        assert fast.backend.stats["segments"] == 1
    else:
        assert fast.schedule.streams_used == 2 and fast.backend.stats["segments"] >= 2
    assert fast.backend.stats["fallbacks"] == 0
    fast.close()


def test_the_plan_is_over_ort_nodes_validated_and_each_segment_is_one_session():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, graph="onnxruntime",
                           scheduler_options={"sync_ms": 0.0})
    backend = fast.backend
    assert isinstance(backend, OrtLanes) and fast.fused is None
    ort_model = backend.model
    assert set(fast.graph.ids) == {n.name for n in ort_model.model.graph.node}  # the optimized nodes
    validate(fast.graph, fast.plan, fast.schedule)
    launched = [i.op for i in fast.plan.instrs if i.kind == "launch"]
    assert sorted(launched) == sorted(fast.graph.ids)
    assert fast.schedule.streams_used == 2 and len(backend.sessions) == backend.stats["segments"] > 2
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_sessions_write_into_the_buffers_made_once_and_outputs_are_copied_out():
    """No allocation per call: the sessions write every boundary value into the one array made for it (its
    contents follow the inputs, its address stays); each call's outputs are its own (the next call does not
    overwrite them)."""
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, graph="onnxruntime",
                           scheduler_options={"sync_ms": 0.0})
    arrays = fast.backend.arrays
    addresses = {k: a.ctypes.data for k, a in arrays.items()}
    inside = [k for k in arrays if k not in fast.backend.model.outputs]
    assert inside
    other = torch.randn_like(inputs[0])
    with torch.inference_mode():
        first = fast(*inputs)
        seen = {k: arrays[k].copy() for k in inside}
        second = fast(other)
        assert compare(model(*inputs), first).ok and compare(model(other), second).ok
    assert all(not (arrays[k] == seen[k]).all() for k in inside)
    assert {k: a.ctypes.data for k, a in arrays.items()} == addresses
    assert not torch.equal(first["sum"], second["sum"])


class Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.a(x)) * torch.sigmoid(self.b(x))


def test_an_input_read_on_both_lanes_is_bound_in_each():
    model, x = Fork().eval(), torch.randn(4, 16)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2, graph="onnxruntime",
                           scheduler_options={"sync_ms": 0.0})
    readers = {fast.plan.instrs[i].stream for i, ins in enumerate(fast.plan.instrs) if ins.kind == "launch"
               and any(name == "in0" for name in fast.backend.model.node[ins.op].input)}
    assert readers == {0, 1}
    for _ in range(3):
        y = torch.randn(4, 16)
        with torch.inference_mode():
            assert compare(model(y), fast(y)).ok


def test_an_error_in_a_worker_lane_reaches_the_caller_and_the_next_call_works():
    model, x = Fork().eval(), torch.randn(4, 16)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2, graph="onnxruntime",
                           scheduler_options={"sync_ms": 0.0})
    lane = fast.backend._pool.workers[0].run.__self__  # the worker lane's LaneWorker
    segments = lane.captured
    worker_op = next(s.op for s in lane.steps if s.kind == "launch")
    kept = segments.bound[worker_op]

    def broken(binding, options):
        raise RuntimeError("segment failed")

    segments.bound[worker_op] = (broken, kept[1])
    with pytest.raises(RuntimeError, match="segment failed"):
        fast(x)
    segments.bound[worker_op] = kept
    with torch.inference_mode():
        assert compare(model(x), fast(x)).ok


def test_workers_stop_on_close_and_when_the_backend_is_collected():
    import gc

    model, x = Fork().eval(), torch.randn(4, 16)
    for closing in (True, False):
        fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2, graph="onnxruntime",
                               scheduler_options={"sync_ms": 0.0})
        threads = [w.thread for w in fast.backend._pool.workers]
        assert threads and all(t.is_alive() for t in threads)
        if closing:
            fast.close()
        else:
            del fast
            gc.collect()
        for t in threads:
            t.join(timeout=60)  # returns as soon as the worker stops
        assert not any(t.is_alive() for t in threads), "a worker thread still ran 60 s after the backend went"


def test_inputs_with_other_strides_run_op_by_op_with_one_warning():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, graph="onnxruntime")
    strided = inputs[0].to(memory_format=torch.channels_last)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compare(model(strided), fast(strided)).ok
        assert compare(model(strided), fast(strided)).ok
    assert sum("another signature" in str(w.message) for w in caught) == 1
    assert fast.backend.stats["fallbacks"] == 2


@pytest.mark.own_pools
@pytest.mark.parametrize("lanes", [1, 2])
def test_session_budgets_follow_the_plan(lanes):
    """One lane: one session of the whole graph on every core, its pool spinning (ONNX Runtime's own run). Two
    lanes: each session on the smallest budget of its ops (lane_threads), its pool sleeping when it has more than
    one thread."""
    from opweave.backends.segments import segment_groups
    from opweave.cores import cores
    from opweave.pipeline.thread_budgets import lane_threads

    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="sequential" if lanes == 1 else "heft",
                           streams=lanes, graph="onnxruntime",
                           scheduler_options={"sync_ms": 0.0} if lanes == 2 else None)
    assert fast.schedule.streams_used == lanes
    budgets = lane_threads(fast.graph, fast.plan, fast.costs, per_op=True) or {}
    expected = {g[0]: cores() if lanes == 1 else min(budgets.get(op, 1) for op in g)
                for g in segment_groups(fast.plan)}
    for first, session in fast.backend.sessions.items():
        options = session.get_session_options()
        try:
            spinning = options.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # not set: ORT's default, which spins
            spinning = "1"
        assert options.intra_op_num_threads == expected[first]
        assert (spinning != "0") == (lanes == 1 or expected[first] == 1)


def test_a_closed_backend_refuses_calls():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, graph="onnxruntime")
    fast.close()
    with pytest.raises(UsageError, match="closed"):
        fast(*inputs)


def test_ort_graph_costs_are_one_thread_kernel_times_of_every_node():
    model, inputs = _model()
    captured = coarsen(capture(model, inputs))
    built = OrtGraph(captured, inputs, profile_runs=3)
    assert set(built.latency_ms) == set(built.graph.ids) and all(v >= 0 for v in built.latency_ms.values())
    assert sum(built.latency_ms.values()) > 0
    # edges carry the bytes of the value between two nodes
    assert built.graph.edges and all(e.bytes > 0 for e in built.graph.edges)


def test_node_names_say_what_a_node_computes_not_what_onnx_runtime_called_it():
    """ONNX Runtime's names for the nodes it adds come from a counter, and once two of them swapped between two
    builds of one model (a cached choice's latencies then fell on the wrong nodes): the names opweave plans on are
    those of what each node computes, the same whatever ONNX Runtime called them."""
    model, inputs = _model()
    built = OrtGraph(coarsen(capture(model, inputs)), inputs, profile_runs=1)
    names = [n.name for n in built.model.graph.node]
    assert len(set(names)) == len(names) and all(name.startswith(n.op_type + "_") for name, n in
                                                    zip(names, built.model.graph.node, strict=True))
    renamed = type(built.model.graph)()
    renamed.CopyFrom(built.model.graph)
    for i, node in enumerate(reversed(renamed.node)):  # as if ONNX Runtime had numbered them the other way round
        node.name = f"ReorderOutput_token_{i}"
    stable_names(renamed)
    assert [n.name for n in renamed.node] == names


def test_a_cached_choice_rebuilds_the_same_plan_without_profiling(monkeypatch):
    """max-autotune's cache holds the chosen plan's latencies, which name the optimized graph's nodes: building the
    choice again plans on them as given and does not profile again."""
    from opweave.pipeline import resolve
    from opweave.pipeline.search import Candidate
    from opweave.pipeline.targets import CpuTarget

    model, inputs = _model()
    first = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, graph="onnxruntime")
    monkeypatch.setattr(OrtGraph, "_profile", lambda self, runs: pytest.fail("profiled again"))
    candidate = Candidate("heft+onnxruntime-graph", {"graph": "onnxruntime", "scheduler": "heft", "scheduler_options": {
        "sync_ms": first.schedule.options.get("sync_ms")}}, "onnxruntime-graph")
    again = CpuTarget().build_candidate(coarsen(capture(model, inputs)), inputs, resolve("cpu"), candidate,
                                        first.costs.latency_ms, None)
    assert again.costs.latency_ms == first.costs.latency_ms
    assert again.schedule.stream_of == first.schedule.stream_of
    with torch.inference_mode():
        assert compare(model(*inputs), again(*inputs)).ok


def test_whole_module_is_the_model_as_one_graph():
    model, inputs = _model()
    captured = coarsen(capture(model, inputs))
    whole = whole_module(captured, inputs)
    results = whole.gm(*whole.inputs)
    env, leaves = whole.bind(inputs)
    with torch.inference_mode():
        expected = model(*inputs)
        assert compare(expected, whole.output(env, list(results))).ok
    assert leaves[0] is inputs[0]
    assert whole.bind((inputs[0].to(memory_format=torch.channels_last),))[1] is None


def test_ort_graph_runs_on_one_cpu_only():
    model, inputs = _model()
    with pytest.raises(UsageError, match="option 'graph' applies to one device"):
        opweave.compile(model, inputs, device="cpu", graph="onnxruntime", devices=2, scheduler="hios-lp")


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.tanh(self.b(x)), x, self.b.weight * 2


def test_outputs_the_graph_does_not_compute_are_returned():
    """The model's input returned as it is (equal to the call's argument), and a constant output: ONNX Runtime folds
    it into an initializer, which no node of its graph makes (an Identity node is added to make it)."""
    model, x = PassThrough().eval(), torch.randn(2, 8)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2, graph="onnxruntime")
    assert fast.backend.model.model.graph.node[-1].op_type == "Identity"
    with torch.inference_mode():
        out = fast(x)
        assert compare(model(x), out).ok and torch.equal(out[1], x)


def test_max_autotune_builds_ort_graph_once_when_it_fails(tmp_path, monkeypatch):
    """When ONNX Runtime's graph cannot be built, max-autotune tries once: the first of its candidates says why, the
    others say it failed without building it again, and a candidate of another compiler is chosen."""
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    tries = []

    def refuse(self, *args, **kwargs):
        tries.append(1)
        raise RuntimeError("no export today")

    monkeypatch.setattr(OrtGraph, "__init__", refuse)
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", mode="max-autotune", threads=4)  # the wide search
    errors = [why for k, why in fast.choice["left_out"].items() if "onnxruntime-graph" in k]
    assert len(tries) == 1 and len(errors) >= 2
    assert errors[0] == "RuntimeError: no export today"
    assert all(e.startswith("UsageError: building ONNX Runtime's graph failed") for e in errors[1:])
    assert "onnxruntime-graph" not in fast.choice["label"]
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
