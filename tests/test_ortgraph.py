"""Lanes over ONNX Runtime's optimized graph of the whole model (``fuse="onnxruntime-graph"``,
opweave.backends.ortgraph)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import opweave
from opweave import zoo
from opweave.backends.ortgraph import OrtGraph, OrtLanes
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
    fast = opweave.compile(model, inputs, device="cpu", scheduler=scheduler, fuse="onnxruntime-graph",
                           streams=1 if scheduler == "sequential" else 2)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs), tolerance=1e-4).ok
    if scheduler == "sequential":
        assert fast.fused.stats["segments"] == 1
    else:
        assert fast.schedule.streams_used <= 2 and fast.fused.stats["segments"] >= fast.schedule.streams_used
    assert fast.fused.stats["fallbacks"] == 0
    fast.close()


def test_the_plan_is_over_ort_nodes_validated_and_each_segment_is_one_session():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph",
                           scheduler_options={"sync_ms": 0.0})
    backend = fast.backend
    assert isinstance(backend, OrtLanes) and fast.fused is backend
    ort_model = backend.model
    assert set(fast.graph.ids) == {n.name for n in ort_model.model.graph.node}  # the optimized nodes
    validate(fast.graph, fast.plan, fast.schedule)
    launched = [i.op for i in fast.plan.instrs if i.kind == "launch"]
    assert sorted(launched) == sorted(fast.graph.ids)
    assert fast.schedule.streams_used == 2 and len(backend.sessions) == backend.stats["segments"] > 2
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_buffers_are_made_once_and_outputs_are_copied_out():
    """No allocation per call: every boundary value's buffer keeps its address; each call's outputs are its own
    (the next call does not overwrite them)."""
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph",
                           scheduler_options={"sync_ms": 0.0})
    addresses = {k: v.data_ptr() for k, v in fast.backend.buffers.items()}
    other = torch.randn_like(inputs[0])
    with torch.inference_mode():
        first, second = fast(*inputs), fast(other)
        assert compare(model(*inputs), first).ok and compare(model(other), second).ok
    assert {k: v.data_ptr() for k, v in fast.backend.buffers.items()} == addresses
    assert not torch.equal(first["sum"], second["sum"])


def test_inputs_with_other_strides_run_op_by_op_with_one_warning():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph")
    strided = inputs[0].to(memory_format=torch.channels_last)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compare(model(strided), fast(strided)).ok
        assert compare(model(strided), fast(strided)).ok
    assert sum("another signature" in str(w.message) for w in caught) == 1
    assert fast.fused.stats["fallbacks"] == 2


@pytest.mark.parametrize("lanes", [1, 2])
def test_session_budgets_follow_the_plan(lanes):
    """One lane: one session of the whole graph on every core, its pool spinning (ONNX Runtime's own run). Two
    lanes: each session on its ops' budget (lane_threads), the pool sleeping when it has more than one thread."""
    from opweave.backends.threads import cores

    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="sequential" if lanes == 1 else "heft",
                           streams=lanes, fuse="onnxruntime-graph")
    for session in fast.backend.sessions.values():
        options = session.get_session_options()
        try:
            spinning = options.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # not set: ORT's default, which spins
            spinning = "1"
        if lanes == 1:
            assert options.intra_op_num_threads == cores() and spinning != "0"
        else:
            assert options.intra_op_num_threads >= 1
            assert spinning == ("0" if options.intra_op_num_threads > 1 else spinning)


def test_a_closed_backend_refuses_calls():
    model, inputs = _model()
    fast = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph")
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


def test_a_cached_choices_latencies_plan_the_same_schedule():
    """costs naming exactly the optimized graph's nodes are planned on as given (max-speed's cache)."""
    model, inputs = _model()
    first = opweave.compile(model, inputs, device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph")
    again = opweave.api.compile_ort_graph(coarsen(capture(model, inputs)), inputs,
                                          streams=2, costs=first.costs)
    assert again.costs.latency_ms == first.costs.latency_ms
    assert again.schedule.stream_of == first.schedule.stream_of


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
    with pytest.raises(UsageError, match="runs on one CPU"):
        opweave.compile(model, inputs, device="cpu", fuse="onnxruntime-graph", devices=2, scheduler="hios-lp")


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.tanh(self.b(x)), x, self.b.weight * 2


def test_outputs_the_graph_does_not_compute_are_returned():
    """The model's input returned as it is (the call's own argument), and a constant output: ONNX Runtime folds
    it into an initializer, which no node of its graph makes (an Identity node is added to make it)."""
    model, x = PassThrough().eval(), torch.randn(2, 8)
    fast = opweave.compile(model, (x,), device="cpu", scheduler="heft", streams=2, fuse="onnxruntime-graph")
    assert fast.backend.model.model.graph.node[-1].op_type == "Identity"
    with torch.inference_mode():
        out = fast(x)
        assert compare(model(x), out).ok and torch.equal(out[1], x)
