"""Segment compilers (opweave.backends.compilers): ONNX Runtime segments, frozen Inductor segments, and
``mode="max-autotune"``, which picks among them by measuring."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx, nn

import opweave
from opweave import zoo
from opweave.backends.compilers import OnnxRuntime, get
from opweave.backends.segments import op_latencies
from opweave.capture import capture
from opweave.errors import UsageError
from opweave.outputs import compare
from opweave.pipeline import targets


class Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.a(x)) + self.c(torch.tanh(self.b(x)))


@pytest.mark.parametrize("name", ["deepfm", "squeezenet", "bert_base"])
@pytest.mark.parametrize("scheduler", ["sequential", "heft"])
def test_onnxruntime_segments_equal_eager(name, scheduler):
    options = {"num_layers": 2} if name == "bert_base" else {"image_size": 64} if name == "squeezenet" else {}
    model, inputs = zoo.create(name, batch_size=1, **options)
    fast = opweave.compile(model, inputs, device="cpu", scheduler=scheduler, compiler="onnxruntime",
                           streams=1 if scheduler == "sequential" else 2)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs), tolerance=1e-4).ok
    assert fast.fused.stats["compiles"] == fast.fused.stats["segments"] and fast.fused.stats["fallbacks"] == 0
    fast.close()


def test_onnxruntime_refuses_a_segment_with_a_non_tensor_output():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.relu, (x,)), graph.call_method("size", (x, 0))))
    with pytest.raises(UsageError, match="not a tensor"):
        OnnxRuntime()(fx.GraphModule(nn.Module(), graph), [torch.randn(2, 3)], 1)


@pytest.mark.own_pools
@pytest.mark.parametrize(("threads", "alone", "spins"), [(2, True, True), (1, False, True), (2, False, False),
                                                        (4, True, True)])
def test_an_onnxruntime_segment_pool_spins_only_when_it_runs_alone(threads, alone, spins):
    """A pool that runs alone spins between parallel sections as ORT's default does (sleeping, a one-lane plan lost
    to plain ONNX Runtime: GoogLeNet 13.2 against 11.3 ms); one that another lane may overlap sleeps when idle, even
    with every core (spinning, Inception-v3's two HEFT lanes took 123 ms against 36 ms for one lane)."""
    gm = fx.symbolic_trace(Fork())
    segment = OnnxRuntime()(gm, [torch.randn(2, 16)], threads, alone=alone)
    options = segment.session.get_session_options()
    assert options.intra_op_num_threads == threads
    try:
        spinning = options.get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # not set: ORT's default, which spins
        spinning = "1"
    assert (spinning != "0") == spins


@pytest.mark.own_pools
@pytest.mark.parametrize("lanes", [1, 2])
def test_only_a_one_lane_plans_onnxruntime_segments_spin(lanes):
    """The plan's lane count, not the replay's thread budget, decides: a two-lane plan's segment that the replay
    gives every core still sleeps (its other lane may overlap it in fact)."""
    model, x = Fork().eval(), torch.randn(4, 16)
    compiled = opweave.compile(model, (x,), device="cpu", scheduler="sequential" if lanes == 1 else "wavefront",
                               streams=lanes, compiler="onnxruntime")
    assert compiled.schedule.streams_used == lanes
    with torch.inference_mode():
        assert compare(model(x), compiled(x)).ok
    sessions = [c.fn.session for seg in compiled.fused._segments.values() for c in seg.compiled.values() if c]
    assert sessions
    for session in sessions:
        try:
            spinning = session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:
            spinning = "1"
        assert (spinning != "0") == (lanes == 1 or session.get_session_options().intra_op_num_threads == 1)


def test_inductor_segments_on_the_cpu_are_frozen_and_eager_segments_are_not():
    model, x = Fork().eval(), torch.randn(4, 16)
    frozen = opweave.compile(model, (x,), device="cpu", scheduler="sequential", compiler="inductor")
    live = opweave.compile(model, (x,), device="cpu", scheduler="sequential", compiler="eager")
    with torch.inference_mode():
        before = model(x)
        assert compare(before, frozen(x)).ok and compare(before, live(x)).ok
        with torch.no_grad():
            model.a.weight.zero_()  # the graphs share the model's parameters
        assert compare(before, frozen(x)).ok  # constants folded in at compile time (torch.compile's freezing)
        assert compare(model(x), live(x)).ok and not compare(before, live(x)).ok


def test_a_convolution_and_its_batchnorm_compile_as_one_frozen_segment():
    """Inductor's freezing folds the BatchNorm into the convolution itself; inside the segment's tracing context it
    made a real bias among fake parameters and the segment ran op by op. The segment compiler folds it first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = opweave.compile(model, (x,), device="cpu", scheduler="sequential", coarsen=False, compiler="inductor")
    assert not [w for w in caught if "could not be compiled" in str(w.message)]
    assert fast.fused.stats["fallbacks"] == 0 and fast.fused.stats["compiles"] == 1
    with torch.inference_mode():
        assert compare(model(x), fast(x)).ok
    assert isinstance(model[1], nn.BatchNorm2d) and model[0].bias is None  # the model is left as it was


def test_an_unknown_compiler_is_refused_with_the_choices():
    with pytest.raises(UsageError, match="inductor, onnxruntime, eager"):
        get("tvm")
    with pytest.raises(UsageError, match="option 'compiler' must be one of inductor, onnxruntime, eager"):
        opweave.compile(Fork(), (torch.randn(2, 16),), device="cpu", compiler="tvm")


def test_op_latencies_times_every_op_compiled_alone():
    model, x = Fork().eval(), torch.randn(4, 16)
    captured = capture(model, (x,))
    latency = op_latencies(captured, (x,), "onnxruntime", repeats=2)
    assert set(latency) == set(captured.graph.ids) and all(v > 0 for v in latency.values())


def test_max_autotune_measures_the_candidates_keeps_one_that_equals_eager_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    model, inputs = zoo.create("deepfm", batch_size=1)
    fast = opweave.compile(model, inputs, device="cpu", mode="max-autotune", threads=targets.LANE_CORES)
    choice = fast.choice
    assert not choice["cached"] and choice["label"] in choice["candidates"]
    timed = {k: v["median_ms"] for k, v in choice["candidates"].items() if "median_ms" in v}
    assert len(timed) >= 4 and timed[choice["label"]] == min(timed.values())
    assert {"sequential", "heft+onnxruntime sync"} & {k.partition(" 0")[0] for k in timed}
    assert {"sequential+onnxruntime-graph", "heft+onnxruntime-graph sync"} <= {k.partition(" 0")[0] for k in timed}
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
    again = opweave.compile(model, inputs, device="cpu", mode="max-autotune", threads=targets.LANE_CORES)
    assert again.choice["cached"] and again.choice["label"] == choice["label"]
    assert (tmp_path / "autotune.json").exists()
    with torch.inference_mode():
        assert compare(model(*inputs), again(*inputs)).ok


def test_max_autotune_chooses_the_plan_itself():
    with pytest.raises(UsageError, match="chooses the plan itself: give no 'scheduler'"):
        opweave.compile(Fork(), (torch.randn(2, 16),), device="cpu", mode="max-autotune", scheduler="lios")
    with pytest.raises(UsageError, match="mode must be one of default, reduce-overhead, max-autotune"):
        opweave.compile(Fork(), (torch.randn(2, 16),), device="cpu", mode="fast")
    with pytest.raises(UsageError, match="now 'max-autotune'"):
        opweave.compile(Fork(), (torch.randn(2, 16),), device="cpu", mode="max-speed")


def test_max_autotune_on_fewer_cores_than_lanes_need_searches_onnxruntime_in_one_lane(tmp_path, monkeypatch):
    """On 2 cores the lanes of ONNX Runtime segments it picked ran slower than one segment once timed apart, and
    timing every op alone made its build longer than torch.compile's: below LANE_CORES threads it tries the model in
    one session and ONNX Runtime's graph in one lane."""
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    assert [c.label for c in targets.cpu_candidates(0.05, ["onnxruntime", "inductor"], threads=2)] == [
        "sequential+onnxruntime", "sequential+onnxruntime-graph"]
    assert len(targets.cpu_candidates(0.05, ["onnxruntime", "inductor"], threads=targets.LANE_CORES)) == 11
    assert "sequential+inductor" in {c.label for c in targets.cpu_candidates(0.05, ["inductor"], threads=2)}
    model, inputs = zoo.create("deepfm", batch_size=1)
    fast = opweave.compile(model, inputs, device="cpu", mode="max-autotune", threads=2)
    assert set(fast.choice["candidates"]) == {"sequential+onnxruntime", "sequential+onnxruntime-graph"}
    assert fast.schedule.streams_used == 1
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 4)
        self.norm = nn.BatchNorm1d(4).eval()

    def forward(self, ids):
        return (self.norm(self.fc(self.embed(ids).mean(1))),)


def test_an_onnxruntime_session_reads_in_place_the_weights_that_the_exported_bytes_leave_out():
    """The export leaves the weights out of the bytes (external initializers, each handed to ONNX Runtime): the
    bytes are small, every parameter and buffer the graph reads is there by name, handed over as the graph's own
    tensor (no copy of the weights is made), and the session equals the graph."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from opweave.backends.compilers import export_onnx

    torch.manual_seed(0)
    gm, ids = fx.symbolic_trace(Weighted().eval()), torch.randint(0, 50, (3, 5))
    weights: dict = {}
    raw = export_onnx(gm, [ids], 1, weights=weights)
    model = onnx.load_from_string(raw)
    names = {*dict(gm.named_parameters()), *dict(gm.named_buffers())}
    assert {"embed.weight", "fc.weight", "fc.bias"} <= set(weights) <= names  # (the exporter may fold a norm's)
    own = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    assert all(weights[name].data_ptr() == own[name].data_ptr() for name in weights)
    assert len(raw) < 4 * 50 * 8 and [i.name for i in model.graph.input] == ["in0"]
    assert all(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer
               if init.name in weights)
    with torch.no_grad():
        expected = gm(ids)[0]
        run = get("onnxruntime")(gm, [ids], 1)
        torch.testing.assert_close(run(ids)[0], expected, rtol=1e-5, atol=1e-5)
    shared = get("onnxruntime", share_weights=True)  # the server's sessions read the weights in the bytes, shared
    with torch.no_grad():
        torch.testing.assert_close(shared(gm, [ids], 1)(ids)[0], gm(ids)[0], rtol=1e-5, atol=1e-5)


class NamedLikeAnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("in1", torch.randn(4))

    def forward(self, a, b):
        return (a * self.in1 + b,)


def test_a_weight_named_like_an_input_still_exports():
    pytest.importorskip("onnxruntime")
    gm, a, b = fx.symbolic_trace(NamedLikeAnInput()), torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(get("onnxruntime")(gm, [a, b], 1)(a, b)[0], gm(a, b)[0])
