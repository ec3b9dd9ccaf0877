"""A compiled model called with inputs of another shape (opweave.pipeline.signatures, opweave.pipeline.sizes): other
sizes run the plan built, checked once against the model, on the CPU and on the fake CUDA runtime, under every
scheduler; a capture that baked a size in is built for each size, within ``cache_size``, past which the model runs;
refused with ``dynamic=False``; served once when two threads ask for it at once; the same through
``torch.compile(backend="opweave")`` and from a ``.pt2`` exported with a dynamic batch; batches padded to
buckets."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import opweave
import opweave.dynamo
from opweave import schedulers, zoo
from opweave.errors import CaptureError, UsageError
from opweave.outputs import compare
from opweave.testing.fakecuda import FakeCuda

NEW = [(2, 3, 64, 64), (3, 3, 64, 64), (8, 3, 64, 64), (1, 3, 160, 160)]


def squeezenet():
    model, (x,) = zoo.create("squeezenet", image_size=64)
    return model.eval(), x


def check(model, fast, shape, runtime=None, seed: int = 0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = fast(x)
        if runtime is not None:
            runtime.synchronize()
        result = compare(model(x), got)
    assert result.ok, (shape, result.reason)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("scheduler", schedulers.names())
def test_squeezenet_compiled_at_batch_1_equals_eager_at_other_batches_and_sizes(scheduler, device):
    model, x = squeezenet()
    runtime = FakeCuda(seed=3) if device == "cuda" else None
    extra = {"runtime": runtime} if runtime is not None else {}
    streams = 1 if scheduler == "sequential" else 3
    fast = opweave.compile(model, (x,), device=device, scheduler=scheduler, streams=streams, **extra)
    for shape in NEW:
        check(model, fast, shape, runtime)
    check(model, fast, tuple(x.shape), runtime)  # the example's own signature still runs its own build
    assert fast.wait(120)  # each new size's check, made beside the calls (which ran on the model meanwhile)
    assert [tuple(key[1][0]) for key in fast.signatures] == [tuple(x.shape), *NEW]
    assert fast.variants.stats["builds"] == 0 and fast.variants.stats["resized"] == len(NEW)  # no new capture
    assert fast.variants.stats["checks"] == 2  # the first new batch, the first new image size: once per dimension
    assert all(plan.schedule.scheduler == scheduler for plan in fast.variants._plans.values())


def test_a_bert_encoder_compiled_at_32_tokens_equals_eager_at_17_and_64():
    model, (ids,) = zoo.create("bert_base", num_layers=2, seq_len=32)
    model.eval()
    fast = opweave.compile(model, (ids,), scheduler="lios")
    for length in (17, 64):
        other = torch.randint(0, model.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            result = compare(model(other), fast(other))
        assert result.ok, (length, result.reason)


class Baked(torch.nn.Module):
    """Python control flow on a size: symbolic_trace cannot follow it, and torch.export bakes the batch into the
    reshape it traces."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(48, 4)

    def forward(self, x):
        if x.shape[0] > 0:
            x = x.reshape(x.shape[0], -1)
        return self.fc(x)


def baked():
    torch.manual_seed(0)
    return Baked().eval(), torch.randn(1, 3, 4, 4)


def test_a_size_the_plan_cannot_take_runs_on_the_model_itself_with_one_log_line_and_no_build(caplog):
    """A graph whose reshape holds the example's batch fails at every other batch: the first new size runs on the model
    itself while the plan is tried there (beside the calls), which fails once and says so in one line; that size and
    every later one run on the model itself, no size is built (each was captured and built on its own, seconds a
    size)."""
    model, x = baked()
    fast = opweave.compile(model, (x,), scheduler="sequential", cache_size=2)
    with caplog.at_level(logging.INFO, logger="opweave.pipeline.signatures"):
        check(model, fast, (2, 3, 4, 4))
        assert fast.wait(60)
        for batch in (3, 4, 5, 2, 3, 4, 5, 1):
            check(model, fast, (batch, 3, 4, 4))
    assert fast.variants.stats["builds"] == 0 and not fast.variants.sizes.generic
    assert sum("runs on the model itself" in r.message for r in caplog.records) == 1


def test_dynamic_false_refuses_a_new_signature_naming_the_one_compiled():
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios", dynamic=False)
    with pytest.raises(UsageError, match=r"\(2, 3, 64, 64\) float32 differ from those it was compiled for "
                                         r"\(\(1, 3, 64, 64\) float32\)"):
        fast(torch.randn(2, 3, 64, 64))
    check(model, fast, tuple(x.shape))


def test_two_threads_asking_for_a_new_signature_at_once_serve_it_once():
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios")
    real, started, release = fast.variants._serve, threading.Event(), threading.Event()
    calls = []

    def slow_serve(args, key):
        calls.append(key)
        started.set()
        assert release.wait(60)
        return real(args, key)

    fast.variants._serve = slow_serve
    errors: list[BaseException] = []

    def call(seed: int) -> None:
        try:
            check(model, fast, NEW[0], seed=seed)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    first = threading.Thread(target=call, args=(1,))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=call, args=(2,))
    second.start()
    second.join(0.5)  # it waits for the first to serve it
    release.set()
    first.join(120)
    second.join(120)
    assert not errors and not first.is_alive() and not second.is_alive() and fast.wait(60)
    assert len(calls) == 1 and fast.variants.stats["resized"] == 1


def test_the_torch_compile_backend_compiles_a_graph_with_symbolic_sizes_once():
    """After a size changed once, dynamo hands over a graph with a symbolic batch: compiled at batch 2, every later
    batch runs that plan."""
    model, x = squeezenet()
    torch._dynamo.reset()
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios"})
    for batch in (1, 2, 3, 8):
        check(model, fast, (batch, 3, 64, 64))
    last = opweave.dynamo.last_compiled()
    assert last is not None and last.variants.stats["builds"] == 0 and last.variants.stats["resized"] == 2
    torch._dynamo.reset()


def test_a_program_exported_with_a_dynamic_batch_runs_batches_1_to_8(tmp_path):
    model, x = squeezenet()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(model, (torch.randn(2, 3, 64, 64),), dynamic_shapes=({0: batch},))
    path = tmp_path / "squeezenet.pt2"
    torch.export.save(program, path)
    fast = opweave.compile(str(path), (torch.randn(1, 3, 64, 64),), scheduler="lios")
    for size in range(1, 9):
        check(model, fast, (size, 3, 64, 64), seed=size)
    assert fast.variants.stats["builds"] == 0  # its dimension is free: the plan built serves every batch
    with pytest.raises(CaptureError, match=r"Guard failed: x.size\(\)\[0\] <= 8"):  # beyond the program's range
        fast(torch.randn(9, 3, 64, 64))


def test_inputs_of_the_examples_shapes_on_another_device_are_its_signature_for_the_backend_to_move():
    """A model compiled for CUDA from CPU example inputs and called with CUDA tensors of the same shapes (or the
    reverse) runs on the backend built for the example, which moves inputs to its device: on an H200 such a call
    was taken for a new signature and captured again, running the CPU model on the GPU inputs. Here "meta" stands
    for the other device. A new shape is built once whatever device its inputs come on."""
    from opweave.pipeline.signatures import Signatures, key_of

    built = []
    example = (torch.randn(4, 8),)
    variants = Signatures("m", key_of(example), lambda args: built.append(args) or len(built), bound=2)
    assert variants.for_inputs((torch.empty(4, 8, device="meta"),)) is None and not built
    assert variants.for_inputs((torch.empty(2, 8, device="meta"),)) == 1
    assert variants.for_inputs((torch.randn(2, 8),)) == 1 and len(built) == 1
    assert variants.for_inputs((torch.randn(4, 8, dtype=torch.float64),)) == 2  # another dtype is another one


def test_a_new_signature_is_captured_on_the_devices_of_the_example():
    """The inputs of a new signature are moved where the example's were before the model is captured for them
    (where its parameters are); the built model moves each call's inputs itself."""
    from opweave.pipeline.sizes import on_devices_of

    example = (torch.empty(4, 8, device="meta"), 3)
    moved = on_devices_of((torch.randn(2, 8), 5), example)
    assert moved[0].device.type == "meta" and tuple(moved[0].shape) == (2, 8) and moved[1] == 5
    assert on_devices_of((torch.randn(2, 8),), example)[0].device.type == "cpu"  # another structure: left alone


def test_every_capture_shares_one_folded_copy_of_the_weights():
    """Coarsening folds each BatchNorm into a copy of its convolution; every capture of the model (one per compile,
    and one per signature built on its own) made its own copy (a compiled model that had met four input shapes held
    four copies of its folded weights). One copy now serves them all, made again only when the model's weights
    change."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU()).eval()
    builds = [opweave.compile(model, (torch.randn(batch, 3, 8, 8),), device="cpu", scheduler="sequential")
              for batch in (1, 2, 3)]
    for fast in builds:
        check(model, fast, (5, 3, 8, 8))
    weights = {b.captured.gm.get_submodule("0").weight.data_ptr() for b in builds}
    assert len(weights) == 1
    assert model[0].weight.data_ptr() not in weights  # folded: a copy, the model's own weights left as they are
    with torch.no_grad():
        model[1].running_var.mul_(4)  # the model changed in place: a new capture folds it again
    newest = opweave.compile(model, (torch.randn(4, 3, 8, 8),), device="cpu", scheduler="sequential")
    assert newest.captured.gm.get_submodule("0").weight.data_ptr() not in weights


# ---- one plan for every size ----------------------------------------------------------------------------------------
def test_a_sweep_of_batches_runs_the_cpu_default_plan_and_never_builds_a_size():
    """The CPU default compiled at batch 1 (ONNX Runtime's session of the whole model, lanes or the model) serves
    batches 2-13, twice over, with a cache of 2: no capture, no plan, each size checked once; ONNX Runtime exports
    the model once more, at the second batch, with its batch free, and that session serves every later one."""
    pytest.importorskip("onnxruntime")
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), cache_size=2)
    for batch in [*range(2, 14), *range(2, 14)]:
        check(model, fast, (batch, 3, 64, 64), seed=batch)
    assert fast.wait(60)
    stats = fast.variants.stats
    assert stats["builds"] == 0 and stats["replans"] == 0 and stats["eager"] == 0 and stats["resized"] == 12
    assert stats["checks"] == (0 if fast.choice["label"] == "eager" else 1)  # the batch, checked at its first value
    assert len(fast.signatures) == 13
    if fast.fused is not None:  # ONNX Runtime's segment won the race: exported once, every dimension free
        assert fast.fused.stats["compiles"] == 1 and fast.fused.stats["dynamic_compiles"] == 1


def test_dynamic_true_leaves_every_size_free_from_the_first_build():
    """``dynamic=True``: ONNX Runtime's session of the whole model takes any size from the start, so no size
    exports it again."""
    pytest.importorskip("onnxruntime")
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="sequential", compiler="onnxruntime", dynamic=True)
    assert fast.fused.stats == {**fast.fused.stats, "compiles": 1, "dynamic_compiles": 1}
    for shape in NEW:
        check(model, fast, shape)
    assert fast.wait(60)
    assert fast.fused.stats["compiles"] == 1 and fast.variants.stats["resized"] == len(NEW)


def test_onnx_runtime_takes_free_sizes_of_strided_inputs():
    """DeepFM's segment reads each column of its ids (``x[:, i]``: strided from batch 2 on): a session exported with
    a free batch takes them as well, so batch 3 and 5 export nothing (they exported one session each)."""
    pytest.importorskip("onnxruntime")
    model, inputs = zoo.create("deepfm")
    model.eval()
    fast = opweave.compile(model, inputs, scheduler="sequential", compiler="onnxruntime")
    for batch in (2, 3, 5):
        other = tuple(torch.cat([x] * batch) for x in inputs)
        with torch.no_grad():
            result = compare(model(*other), fast(*other))
        assert result.ok, (batch, result.reason)
    assert fast.wait(60)
    assert fast.fused.stats["compiles"] == 2 and fast.fused.stats["dynamic_compiles"] == 1


def test_a_bert_encoder_under_the_cpu_default_serves_every_length_with_one_plan():
    model, (ids,) = zoo.create("bert_base", num_layers=2, seq_len=32)
    model.eval()
    fast = opweave.compile(model, (ids,))
    for length in (8, 17, 24, 31, 33, 40, 48, 64, 80, 96, 100, 128):
        other = torch.randint(0, model.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            result = compare(model(other), fast(other))
        assert result.ok, (length, result.reason)
    assert fast.wait(60)
    assert fast.variants.stats["builds"] == 0 and fast.variants.stats["resized"] == 12


def test_on_the_fake_cuda_runtime_a_new_size_records_a_graph_and_reuses_the_schedule(monkeypatch):
    """Each new batch is one more CUDA graph recorded by the backend built at the example's: nothing is captured
    or scheduled again (batches 5-7 lie in the example's power-of-two range, so no prediction runs either)."""
    model, _ = squeezenet()
    runtime = FakeCuda(seed=5)
    fast = opweave.compile(model, (torch.randn(4, 3, 64, 64),), device="cuda", scheduler="opara", streams=3,
                           runtime=runtime)
    schedules = []
    real = schedulers.run
    monkeypatch.setattr(schedulers, "run", lambda *a, **k: schedules.append(a[0]) or real(*a, **k))
    for batch in (5, 6, 7, 5):
        check(model, fast, (batch, 3, 64, 64), runtime, seed=batch)
    assert fast.backend.stats["captures"] == 4  # the example's, then one per new batch
    assert not schedules and fast.variants.stats["builds"] == 0 and fast.variants.stats["resized"] == 3


def test_a_range_of_sizes_is_planned_again_when_predicted_faster(monkeypatch):
    """The first size of a new power-of-two range asks the costs at that size; a new schedule predicted 10% faster
    plans the range again (from the same capture, at that size), which then serves the rest of the range."""
    from opweave.pipeline import sizes

    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="lios", streams=3)
    gain = sizes.replan_gain(fast, (torch.randn(8, 3, 64, 64),))
    assert gain is not None and gain < 1  # a prediction, made on the roofline costs at batch 8
    asked = []
    monkeypatch.setattr(sizes, "replan_gain", lambda compiled, args: asked.append(args[0].shape[0]) or 0.5)
    for batch in (2, 3, 8, 9, 15):
        check(model, fast, (batch, 3, 64, 64), seed=batch)
    assert asked == [2, 8]  # once per range: 2-3, 8-15
    assert fast.variants.stats["replans"] == 2 and fast.variants.stats["builds"] == 0
    plans = list(fast.variants._plans.values())
    assert len(plans) == 2 and all(p is not fast and p.schedule.scheduler == "lios" for p in plans)
    assert plans[1].captured.example_inputs[0].shape[0] == 8  # planned at the first size of its range


def test_a_plan_in_the_models_order_is_never_planned_again():
    from opweave.pipeline.sizes import replan_gain

    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="sequential")
    assert replan_gain(fast, (torch.randn(8, 3, 64, 64),)) is None


def test_buckets_pad_a_batch_and_cut_its_outputs_back():
    """``buckets="pow2"``: batch 3 runs padded to 4, the size compiled, even with ``dynamic=False``, which refuses
    batch 5 (padded to 8, a new signature); unset, batch 5 and 6 both run the plan at batch 8, checked each once, and
    batch 2, a power of two, runs as it is."""
    model, _ = squeezenet()
    four = torch.randn(4, 3, 64, 64)
    fixed = opweave.compile(model, (four,), scheduler="lios", buckets="pow2", dynamic=False)
    check(model, fixed, (3, 3, 64, 64))
    with pytest.raises(UsageError, match="dynamic=False refuses"):
        fixed(torch.randn(5, 3, 64, 64))
    fast = opweave.compile(model, (four,), scheduler="lios", buckets="pow2")
    for batch in (5, 6, 2, 5):
        check(model, fast, (batch, 3, 64, 64), seed=batch)
    assert fast.variants.stats["padded"] == 2 and fast.variants.stats["resized"] == 2  # 5, 6; the plan at 8, and 2
    assert [key[1][0][0] for key in fast.signatures] == [4, 8, 5, 6, 2]


def test_a_pad_that_more_than_doubles_the_batch_warns_once():
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="sequential", buckets=[8])
    with pytest.warns(UserWarning, match=r"a batch of 3 is padded to 8 \(buckets=\[8\]\), 2.7x the rows"):
        check(model, fast, (3, 3, 64, 64))
    check(model, fast, (2, 3, 64, 64))  # no second warning (filterwarnings=error would raise)
    check(model, fast, (9, 3, 64, 64))  # beyond the largest bucket: its own size


class BatchMean(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_pad_that_changes_the_answer_turns_buckets_off():
    model = BatchMean()
    fast = opweave.compile(model, (torch.randn(4, 5),), scheduler="sequential", buckets="pow2")
    x = torch.randn(3, 5)
    with pytest.warns(UserWarning, match="rows are not independent; buckets are ignored"):
        got = fast(x)
    assert torch.allclose(got, model(x)) and fast.variants.sizes.buckets is None


def test_a_captured_graph_binds_other_sizes_only_in_the_dimensions_freed():
    from opweave.capture import capture

    model, x = squeezenet()
    captured = capture(model, (x,))
    with pytest.raises(UsageError, match="it was captured with"):
        captured.bind((torch.randn(2, 3, 64, 64),))
    assert captured.free((torch.randn(2, 3, 64, 64),))
    captured.bind((torch.randn(5, 3, 64, 64),))  # the batch is free now
    with pytest.raises(UsageError, match="it was captured with"):
        captured.bind((torch.randn(2, 3, 32, 32),))  # the image is not
    assert not captured.free((torch.randn(2, 3, 64),))  # another rank: never
    assert captured.free((torch.randn(2, 3, 32, 32),))
    captured.bind((torch.randn(7, 3, 32, 48),))


def test_options_buckets_take_pow2_or_sizes():
    from opweave.pipeline import resolve

    assert resolve("cpu", buckets="pow2").buckets == "pow2"
    assert resolve("cpu", buckets=[16, 4, 8]).buckets == (4, 8, 16)
    assert resolve("cpu", buckets="8,2").buckets == (2, 8)  # as the command line gives it
    for bad in ("powers", [0, 4], [], 2.5):
        with pytest.raises(UsageError, match="option 'buckets' must be 'pow2' or a list of sizes"):
            resolve("cpu", buckets=bad)


class ReadsItsBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(48, 4)

    def forward(self, x):
        return self.fc(x.view(x.size(0), -1)).relu()


def test_a_dynamo_graph_with_symbolic_sizes_is_compiled_once_and_its_segment_exported_once():
    """``torch.compile(dynamic=True)`` hands over a graph that takes its batch as an input of its own
    (``view(s0, -1)``): read from the tensor instead, no segment takes it as a value to bake, so ONNX Runtime's
    session, free in every size from its first build, serves every batch."""
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = ReadsItsBatch().eval()
    torch._dynamo.reset()
    fast = torch.compile(model, backend="opweave", dynamic=True,
                         options={"scheduler": "sequential", "compiler": "onnxruntime"})
    for batch in (2, 3, 5, 9):
        check(model, fast, (batch, 3, 4, 4), seed=batch)
    last = opweave.dynamo.last_compiled()
    assert len(opweave.dynamo.compiled_graphs()) >= 1 and last.variants.stats["builds"] == 0
    assert last.fused.stats["compiles"] == 1 and last.fused.stats["dynamic_compiles"] == 1
    torch._dynamo.reset()


def test_one_onnx_runtime_session_with_a_free_batch_takes_every_batch():
    """``dynamic=True`` where the whole model is one ONNX Runtime session: exported with its batch dimension free,
    checked at another batch, and then no other batch size is built (a server's blocks are built this way); a model
    that bakes its batch in fails the check and is built per batch as with dynamic unset."""
    pytest.importorskip("onnxruntime")

    class Baked(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x).reshape(2, -1).sum(1)

    torch.manual_seed(0)
    free = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    options = {"scheduler": "sequential", "streams": 1, "compiler": "onnxruntime", "dynamic": True}
    with opweave.compile(free, (torch.randn(2, 8),), **options) as fast, torch.no_grad():
        assert fast.any_batch
        for n in (1, 3, 7):
            x = torch.randn(n, 8)
            assert compare(free(x), fast(x), tolerance=1e-4).ok
        assert len(fast.signatures) == 1 and fast.variants.stats["builds"] == 0
    with opweave.compile(Baked(), (torch.randn(2, 5),), **options) as fast, torch.no_grad():
        assert not fast.any_batch
        x = torch.randn(4, 5)
        assert compare(Baked()(x[:2]), fast(x[:2])).ok and len(fast.signatures) == 1


# ---- a new size never waits ------------------------------------------------------------------------------------------
def test_a_new_size_is_answered_at_once_on_the_model_while_its_check_is_held_back(held):
    """The first call of a new size did the plan's first run there and a run of the model to check it before it
    returned; now the model itself answers it, the check waits for the builder, and once the plan agrees the size's
    later calls go to the plan."""
    model, x = squeezenet()
    fast = opweave.compile(model, (x,), scheduler="sequential")
    runs = []
    real = fast.backend.__call__
    fast.backend.__call__ = lambda *args: runs.append(args) or real(*args)
    check(model, fast, NEW[0])  # answered by the model: the plan has not run at this size
    assert fast.variants.stats["resized"] == 0 and fast.variants.stats["checks"] == 0
    held.run()  # the check: the plan at that size, against the model
    assert fast.variants.stats["checks"] == 1 and fast.variants.stats["resized"] == 1
    check(model, fast, NEW[0], seed=3)
    assert fast.variants.for_inputs((torch.randn(NEW[0]),)) is None  # the example's own backend runs it now


def test_dynamic_true_frees_every_dimension_and_never_builds_per_size():
    """A 2-layer BERT compiled at 32 tokens with ``dynamic=True`` failed at 8 (its session was exported with the
    batch free, every other dimension fixed) and was then captured and built for every length, seconds each; every
    dimension is free now: no length builds."""
    pytest.importorskip("onnxruntime")
    model, (ids,) = zoo.create("bert_base", num_layers=2, seq_len=32)
    model.eval()
    fast = opweave.compile(model, (ids,), dynamic=True)
    for length in (8, 12, 17, 40):
        other = torch.randint(0, model.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert compare(model(other), fast(other)).ok, length
    assert fast.wait(60)
    assert fast.variants.stats["builds"] == 0 and fast.variants.stats["resized"] == 4
    if fast.fused is not None:
        assert fast.fused.stats["compiles"] == 1


def test_a_new_signature_runs_on_the_model_while_it_is_built_beside_and_then_takes_the_build(held, monkeypatch):
    """Inputs of another rank are another signature, which needs a capture and a build of its own: its first call
    waited for both; now the model answers it while they are made beside, and the build takes the signature's calls
    once a short race finds it no slower."""
    from opweave.pipeline import search

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    fast = opweave.compile(model, (torch.randn(4, 8),), scheduler="sequential")
    other = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert compare(model(other), fast(other)).ok and fast.variants.stats["builds"] == 0
    monkeypatch.setattr(search, "TIMER", lambda label, fn: (fn(), 1.0 if label == "built" else 2.0)[1])
    held.run()
    assert fast.variants.stats["builds"] == 1
    runner = fast.variants.for_inputs((other,))
    assert getattr(runner, "schedule", None) is not None  # the build, not the model
    with torch.no_grad():
        assert compare(model(other), fast(other)).ok
