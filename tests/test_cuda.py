"""The CUDA backend, on a real GPU where one is present and on the fake CUDA runtime elsewhere (the ``rt`` fixture,
``tests/cuda_runtime.py``; the fake runs every stream's work in a random order that the events allow, so a missing
wait or a buffer freed too early gives a wrong output there too).

Every (scheduler, graphs or not) pair matches eager on a fresh input after the static outputs were filled with NaN
(every zoo model on a GPU; squeezenet on the fake); a race stress test (an op that sleeps on its lane before writing;
on the fake, the random order stresses it); fp16 (at batch 8 on a GPU; at batch 1 on the fake, whose CPU fp16
convolutions are slow); a caller under ``torch.inference_mode``; replays with new inputs; several graphs alive;
in-place ops; static outputs; one graph per input signature; a sync found by the checked run (named, or run without
a graph with ``capture_fallback="eager"``), also with ``warmup=1``; failures *inside* the capture (a Python error,
and a sync that invalidates the capture): named, never run eagerly, the caller's stream restored and the process
usable; threads sharing one compiled model; the default lane cap and distinct streams (pooled, given back on
close); and, on a GPU only, the profiler's GPU time on a real trace and ``torch.compile(backend="opweave")`` on
CUDA, swapped weights included.

Every model is built by :func:`compile_cuda` (or a :class:`CudaBackend` on a plan), on the test's runtime.
Outputs are compared as the GPU benchmark compares them (:func:`opweave.outputs.compare`: fp32 within 1e-3 of the
output's scale, fp16 within 1e-2 or, where BatchNorm folded into fp16 weights rounds differently, against float64),
on inputs drawn by its ``fresh_inputs``, after synchronizing; TF32 is off (``cuda_precision.fp32_math``).
"""

from __future__ import annotations

import functools
import gc
import math
import threading

import pytest
import torch
from torch import nn

import opweave
import opweave.dynamo
from benchmark_module import gpu_latency
from cuda_precision import fp32_math  # noqa: F401 - autouse: no TF32 in the CUDA tests
from cuda_runtime import DEVICE, ON_GPU, needs_gpu, rt  # noqa: F401 - rt: the runtime fixture
from opweave import schedulers, zoo
from opweave.backends import cuda as cuda_backend
from opweave.backends.cuda import CudaBackend, GraphCaptureError, default_streams
from opweave.backends.streams import stream_pool
from opweave.capture import Captured, capture
from opweave.costs.profile import profile_model
from opweave.costs.profile.kineto import range_runs, trace_ops
from opweave.costs.profile.measure import full_env
from opweave.costs.roofline import estimate
from opweave.errors import DeviceError
from opweave.outputs import compare, exact_outputs
from opweave.pipeline import Compiled, plan_for

pytestmark = pytest.mark.cuda

SMALL = {"bert_base": {"num_layers": 2}}
GRAPHS = pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "streams"])
MODELS = zoo.names() if ON_GPU else ["squeezenet"]  # every scheduler on each; the fake runs on 2 CPU cores
SLEEP_CYCLES = 5_000_000  # torch.cuda._sleep: a few milliseconds at GPU clock rates
RT = None  # the runtime of the running test, which the test ops below ask whether a capture is under way


@pytest.fixture(autouse=True)
def _runtime_of_the_test_ops(rt):  # noqa: F811 - the fixture
    global RT
    RT = rt
    yield
    RT = None


def compile_cuda(model, inputs, *, runtime, scheduler: str = "opara", streams: int | None = None,
                 cudagraphs: bool = True, **options) -> Compiled:
    """``opweave.compile_captured(..., device="cuda", runtime=runtime)`` of ``model`` (or of its capture): the model
    captured and coarsened, planned on the fitted device's op times with at most ``streams`` (default
    :func:`default_streams`), run by a :class:`CudaBackend`; ``options`` are opweave.compile's. The one place these
    tests build a compiled CUDA model."""
    captured = model if isinstance(model, Captured) else capture(model, inputs)
    return opweave.compile_captured(captured, inputs, device="cuda", scheduler=scheduler, streams=streams,
                                    cudagraphs=cudagraphs, runtime=runtime, **options)


def fresh(inputs: tuple, seed: int) -> tuple:
    return gpu_latency().fresh_inputs(inputs, seed)


def check(reference, got, what: str, exact=None) -> None:
    RT.synchronize()  # the fake runs queued work only when something must observe it
    result = compare(reference, got, exact=exact)
    assert result.ok, f"{what}: {result.reason}"


@functools.cache
def cuda_model(name: str, batch: int = 1, half: bool = False):
    model, inputs = zoo.create(name, batch_size=batch, **SMALL.get(name, {}))
    dtype = torch.float16 if half else torch.float32
    model = model.to(DEVICE).to(dtype)
    inputs = tuple(x.to(DEVICE).to(dtype) if x.is_floating_point() else x.to(DEVICE) for x in inputs)
    with torch.no_grad():
        reference = model(*inputs)
    return model, inputs, reference, capture(model, inputs, name=name)


@functools.cache
def plan_of(name: str, scheduler: str):
    cap = cuda_model(name)[3]
    devices = 2 if scheduler in schedulers.MULTI_DEVICE else 1
    return plan_for(cap.graph, estimate(cap.graph, "h100"), scheduler, streams=4, devices=devices)[1]


# ---- test ops: symbolic_trace keeps these wrapped functions as single calls, run by the backend as ops ---------------


def slow_double(x):
    """A long spin on the current stream, then the result: readers on other lanes must wait for it. (On the fake,
    which has no time, its random order is the stress.)"""
    if x.is_cuda:
        torch.cuda._sleep(SLEEP_CYCLES)
    return x * 2


def capturing() -> bool:
    return RT is not None and RT.is_current_stream_capturing()


def refuse_in_graph(x):
    """Fails only while recorded into a CUDA graph, and only for batch 2 (the example is batch 1)."""
    if x.shape[0] == 2 and capturing():
        raise RuntimeError("this op refuses to be recorded")
    return x + 1


def sync_in_graph(x):
    """Synchronizes the host only while recorded (so the checked run cannot see it), for batch 2."""
    if x.shape[0] == 2 and capturing():
        return x * float(x.sum())  # .item(): a device-to-host copy and a sync, illegal in a capture
    return x * 1.0


for _fn in ("slow_double", "refuse_in_graph", "sync_in_graph"):
    torch.fx.wrap(_fn)


class Racy(nn.Module):
    """Two slow branches in parallel, read by ops that at most one of them can share a lane with."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        slow1, slow2 = slow_double(self.a(x)), slow_double(self.b(x))
        fast = self.c(x).relu()
        return torch.cat([slow1 + slow2, fast], 1), (slow1 * fast).sum()


class Refuses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)

    def forward(self, x):
        return refuse_in_graph(self.a(x)) * self.b(x)


class SyncsInCapture(Refuses):
    def forward(self, x):
        return sync_in_graph(self.a(x)) * self.b(x)


class InPlace(nn.Module):
    """Branches, an in-place ReLU module, and an in-place add that stays in place (a view of it is read later)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        a, b = self.act(self.a(x)), self.b(x)
        flat = b.flatten(1)
        b.add_(a)
        return torch.cat([a, b], 1), flat.sum(1)


class Syncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        scale = x.abs().max().item()  # a CPU-GPU sync: cannot be recorded into a CUDA graph
        return self.a(x) * scale + self.b(x)


class Wide(nn.Module):
    def __init__(self, branches: int = 40) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(branches))

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


def nan_fill(value) -> None:
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(math.nan)


# ---- every scheduler, with and without graphs ------------------------------------------------------------------------


@GRAPHS
@pytest.mark.parametrize("scheduler", schedulers.names())
def test_scheduler_matches_eager_on_new_inputs(rt, scheduler, cudagraphs):  # noqa: F811 - rt: the fixture
    """For every model of ``MODELS``: built on the example, the static outputs filled with NaN (with graphs), then
    called with a fresh input and with the example again; every model is tried and the failures are listed
    together."""
    failures = []
    for name in MODELS:
        try:
            model, inputs, reference, cap = cuda_model(name)
            backend = CudaBackend(cap, plan_of(name, scheduler), inputs, cudagraphs=cudagraphs, runtime=rt)
            if cudagraphs:
                (entry,) = backend._entries.values()
                rt.synchronize()
                nan_fill(entry.static_output)
            new = fresh(inputs, seed=1)
            with torch.no_grad():
                expected = model(*new)
            check(expected, backend(*new), f"{name}, fresh input")
            check(reference, backend(*inputs), f"{name}, example input")
            del backend
        except Exception as exc:  # noqa: BLE001 - every model is tried; all failures are reported below
            failures.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    assert not failures, "\n".join(failures)


@GRAPHS
@pytest.mark.parametrize("scheduler", ["wavefront", "opara", "lios", "nimble"])
def test_race_stress_a_sleeping_lane_during_capture_then_replays(rt, scheduler, cudagraphs):  # noqa: F811
    """The slow op spins for milliseconds before writing; a missing wait (or a buffer released too early and reused
    by another lane) would let its reader see the previous call's value, which differs with every new input."""
    torch.manual_seed(0)
    model, x = Racy().to(DEVICE).eval(), torch.randn(2, 8, 32, 32, device=DEVICE)
    fast = compile_cuda(model, (x,), scheduler=scheduler, streams=4, cudagraphs=cudagraphs, runtime=rt)
    lane_of = {i.op: (i.device, i.stream) for i in fast.plan.instrs if i.kind == "launch"}
    slow = [op for op in fast.graph.ids if "slow_double" in (fast.graph.op[op].target or "")]
    assert len(slow) == 2 and any(lane_of[r] != lane_of[s] for s in slow for r in fast.graph.succs[s])
    for seed in range(5):
        new = fresh((x,), seed=10 + seed)
        with torch.no_grad():
            expected = model(*new)
        check(expected, fast(*new), f"replay {seed}")


# ---- dtypes, batch sizes, callers ------------------------------------------------------------------------------------


@GRAPHS
@pytest.mark.parametrize("name", ["googlenet", "squeezenet"] if ON_GPU else ["squeezenet"])
def test_fp16(rt, name, cudagraphs):  # noqa: F811
    """At batch 8 on a GPU (batch 1 on the fake: fp16 convolutions are slow on a CPU). fp16 rounds BatchNorm folded
    into the weights (coarsening) differently from eager: checked against float64 as the benchmark checks (within
    1e-2 of eager, or no farther from float64 than 3 times eager)."""
    model, inputs, reference, cap = cuda_model(name, batch=8 if ON_GPU else 1, half=True)
    fast = compile_cuda(cap, inputs, scheduler="opara", cudagraphs=cudagraphs, runtime=rt)
    new = fresh(inputs, seed=3)
    exact, new_exact = exact_outputs(model, inputs, new)
    check(reference, fast(*inputs), "example", exact)
    with torch.no_grad():
        expected = model(*new)
    check(expected, fast(*new), "fresh input", new_exact)


@GRAPHS
def test_a_caller_under_inference_mode(rt, cudagraphs):  # noqa: F811
    model, inputs, _, cap = cuda_model("googlenet")
    fast = compile_cuda(cap, inputs, scheduler="lios", cudagraphs=cudagraphs, runtime=rt)
    with torch.inference_mode():
        x = fresh(inputs, seed=4)
        check(model(*x), fast(*x), "inference mode")
        batch2 = fresh((torch.randn(2, *inputs[0].shape[1:], device=DEVICE),), seed=5)  # a new signature in there
        check(model(*batch2), fast(*batch2), "new signature under inference mode")
    with torch.no_grad():  # and outside it again, on the entries made inside
        x = fresh(inputs, seed=6)
        check(model(*x), fast(*x), "after inference mode")
        check(model(*batch2), fast(*batch2), "batch 2 after inference mode")


@GRAPHS
def test_replay_with_new_inputs(rt, cudagraphs):  # noqa: F811
    model, inputs, _, _ = cuda_model("googlenet")
    fast = compile_cuda(model, inputs, scheduler="nimble", cudagraphs=cudagraphs, runtime=rt)
    for seed in range(3):
        x = fresh(inputs, seed)
        with torch.no_grad():
            check(model(*x), fast(*x), f"seed {seed}")


def test_cpu_inputs_are_copied_to_the_gpu_and_the_callers_model_stays_put(rt):  # noqa: F811
    """(On the fake, whose device is the CPU, nothing is copied: the model must still stay put.)"""
    model, inputs = zoo.create("squeezenet")
    fast = compile_cuda(model, inputs, scheduler="lios", runtime=rt)
    assert next(model.parameters()).device.type == "cpu"
    got = fast(*inputs)
    assert got.device == rt.device
    host = fresh(inputs, seed=7)
    pinned = tuple(x.pin_memory() for x in host) if ON_GPU else host  # copied with non_blocking=True
    out = fast(*pinned)
    rt.synchronize()
    with torch.no_grad():
        check(model(*inputs), got.cpu(), "pageable")
        check(model(*pinned), out.cpu(), "pinned")


def test_two_captured_models_alive_at_once(rt):  # noqa: F811
    a_model, a_inputs, a_ref, _ = cuda_model("googlenet")
    b_model, b_inputs, b_ref, _ = cuda_model("squeezenet")
    a = compile_cuda(a_model, a_inputs, scheduler="opara", runtime=rt)
    b = compile_cuda(b_model, b_inputs, scheduler="lios", runtime=rt)
    for _ in range(3):
        got_a, got_b = a(*a_inputs), b(*b_inputs)
        check(a_ref, got_a, "googlenet")
        check(b_ref, got_b, "squeezenet")


@GRAPHS
@pytest.mark.parametrize("scheduler", ["sequential", "opara", "lios", "wavefront"])
def test_in_place_ops(rt, cudagraphs, scheduler):  # noqa: F811
    torch.manual_seed(0)
    model, x = InPlace().to(DEVICE).eval(), torch.randn(2, 3, 16, 16, device=DEVICE)
    with torch.no_grad():
        expected = model(x.clone())
    fast = compile_cuda(model, (x,), scheduler=scheduler, streams=3, cudagraphs=cudagraphs, runtime=rt)
    for _ in range(2):
        check(expected, fast(x), "in place")


def test_static_outputs_are_overwritten_by_the_next_call(rt):  # noqa: F811
    model, inputs, _, _ = cuda_model("squeezenet")
    x1, x2 = inputs[0], fresh(inputs, seed=8)[0]
    with torch.no_grad():
        r1, r2 = model(x1), model(x2)
    static = compile_cuda(model, inputs, scheduler="lios", static_outputs=True, runtime=rt)
    out1 = static(x1)
    out2 = static(x2)
    assert out1.data_ptr() == out2.data_ptr()
    check(r2, out1, "the first result now holds the second call's values")
    cloned = compile_cuda(model, inputs, scheduler="lios", runtime=rt)
    out1 = cloned(x1)
    out2 = cloned(x2)
    assert out1.data_ptr() != out2.data_ptr()
    check(r1, out1, "first")
    check(r2, out2, "second")


@GRAPHS
def test_another_batch_runs_the_plan_built_in_a_bounded_cache_of_recordings(rt, cudagraphs):  # noqa: F811
    """Another batch size runs the plan built for the example's, checked once against the model: nothing is
    captured or scheduled again; the backend records it (without graphs: plans its buffers) once per signature and
    keeps ``cache_size`` of them, the least recently used dropped and recorded again if it comes back."""
    model, inputs, _, _ = cuda_model("googlenet")
    fast = compile_cuda(model, inputs, scheduler="opara", cudagraphs=cudagraphs, cache_size=2, runtime=rt)
    batches = [torch.randn(n, *inputs[0].shape[1:], device=DEVICE) for n in (1, 2, 3)]
    for x in [*batches, batches[0]]:
        with torch.no_grad():
            check(model(x), fast(x), f"batch {x.shape[0]}")
    assert [key[1][0][0] for key in fast.signatures] == [1, 2, 3]
    assert fast.variants.stats["builds"] == 0 and fast.variants.stats["resized"] == 2
    assert len(fast.backend.signatures) == 2 and fast.backend.stats["evictions"] == 2  # 1 for 3, then 2 for 1
    if cudagraphs:
        assert fast.backend.stats["captures"] == 4
    with pytest.raises(TypeError, match="expected 1 inputs"):
        fast(batches[0], batches[1])


def test_calls_from_another_stream_are_ordered_after_the_previous_call(rt):  # noqa: F811
    """Calls alternate between the current stream and another one, with no wait between them but the backend's:
    each call's input copy must not overwrite the static inputs (nor its replay the static outputs) before the
    previous call, on the other stream, has read them."""
    model, inputs, _, _ = cuda_model("squeezenet")
    xs = [fresh(inputs, seed) for seed in range(6)]
    with torch.no_grad():
        refs = [model(*x) for x in xs]
    for cudagraphs in (True, False):
        fast = compile_cuda(model, inputs, scheduler="opara", cudagraphs=cudagraphs, runtime=rt)
        other = rt.Stream()
        outs = []
        for i, x in enumerate(xs):
            with rt.stream(other if i % 2 else None):
                outs.append(fast(*x))
        rt.synchronize()
        for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
            check(ref, out, f"cudagraphs={cudagraphs}: call {i}, {'another' if i % 2 else 'the current'} stream")


@GRAPHS
def test_threads_calling_one_compiled_model(rt, cudagraphs):  # noqa: F811
    """Six threads, half of them on their own streams, call one compiled model with different inputs."""
    model, inputs, _, _ = cuda_model("squeezenet")
    fast = compile_cuda(model, inputs, scheduler="opara", cudagraphs=cudagraphs, runtime=rt)
    xs = [fresh(inputs, seed) for seed in range(6)]
    with torch.no_grad():
        refs = [model(*x) for x in xs]
    rt.synchronize()
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            with rt.stream(rt.Stream() if k % 2 else None):
                for rep in range(5):
                    i = (k + rep) % len(xs)
                    out = fast(*xs[i])
                    rt.current_stream().synchronize()
                    result = compare(refs[i], out)
                    if not result.ok:
                        errors.append(f"thread {k}, call {rep}: {result.reason}")
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


# ---- memory ----------------------------------------------------------------------------------------------------------


class Ladder(nn.Module):
    """Three branches of four convolutions, summed: twelve intermediates, few of them needed at once."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(4)])
                                      for _ in range(3))

    def forward(self, x):
        a, b, c = (branch(x) for branch in self.branches)
        return a + b + c


@GRAPHS
def test_the_first_run_of_a_signature_already_frees_its_buffers(rt, monkeypatch, cudagraphs):  # noqa: F811
    """Buffers are planned before the first run (on fake tensors): building and the first call allocate far less
    than when a first run keeps every intermediate to learn them (the fallback, forced here). The model is captured
    before the count starts (capturing runs it eagerly and checks its output). The peaks are read before the output
    is checked: the check computes in float64 on the device, 8.25 activations of temporaries at once, which a GPU
    counts and the fake does not (it counts what is launched on its streams): read after the check, an H200
    measured 10.25 and 12.26 activations for the planned build (streams, graphs), 8.25 of them the check's. The first
    build of these shapes in the process is measured apart (what a library allocates on its first use of a shape is
    not the plan's), and the message says which phase, the build or the first call, holds each peak."""
    torch.manual_seed(0)
    model, x = Ladder().to(DEVICE).eval(), torch.randn(1, 8, 64, 64, device=DEVICE)
    with torch.no_grad():
        reference = model(x)
    captured = capture(model, (x,))

    activation = x.numel() * x.element_size()

    def peak() -> tuple[int, dict, tuple]:
        rt.synchronize()
        gc.collect()
        baseline = rt.memory_allocated()
        rt.reset_peak_memory_stats()
        fast = compile_cuda(captured, (x,), scheduler="lios", streams=3, cudagraphs=cudagraphs, runtime=rt)
        rt.synchronize()
        build = rt.max_memory_allocated() - baseline
        with torch.no_grad():
            out = fast(x)
        rt.synchronize()
        total = rt.max_memory_allocated() - baseline
        held = rt.memory_allocated() - baseline  # the phases, in activations, for the message
        check(reference, out, "first call")  # after the count: its float64 temporaries are not the plan's
        return total, dict(fast.backend.stats), (round(build / activation, 2), round(held / activation, 2))

    cold, _, cold_phases = peak()  # the first build of these shapes in the process: libraries' first use counted
    planned, stats, planned_phases = peak()
    assert stats["keep_all_runs"] == 0
    with monkeypatch.context() as patch:
        patch.setattr(cuda_backend, "static_buffers", lambda *args: 1 / 0)  # cannot run on fake tensors
        kept, stats, kept_phases = peak()
    assert stats["keep_all_runs"] == 1
    assert kept >= 12 * activation  # every conv's output at once
    assert planned <= kept - 8 * activation, (  # 5 and 15 on the fake
        f"peaks {planned / activation:.2f} and {kept / activation:.2f} activations (the first build "
        f"{cold / activation:.2f}); (build's peak, held after the first call): planned {planned_phases}, kept "
        f"{kept_phases}, first {cold_phases}")


# ---- what cannot be recorded -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [1, 2])
def test_a_sync_is_found_before_capture_and_named_or_run_without_a_graph(rt, warmup):  # noqa: F811
    torch.manual_seed(0)
    model, x = Syncs().to(DEVICE).eval(), torch.randn(4, 16, device=DEVICE)
    with pytest.raises(GraphCaptureError, match=r"op '.*'.*item.*synchronizes the CPU with the GPU"):
        compile_cuda(model, (x,), scheduler="lios", warmup=warmup, runtime=rt)
    assert rt.get_sync_debug_mode() == 0  # restored
    with pytest.warns(UserWarning, match="without a CUDA graph"):
        fast = compile_cuda(model, (x,), scheduler="lios", capture_fallback="eager", warmup=warmup, runtime=rt)
    # found before capture; .item() cannot run on fake tensors, so a first run kept every buffer to find them
    assert fast.backend.stats == {"captures": 0, "evictions": 0, "eager_fallbacks": 1, "keep_all_runs": 1}
    with torch.no_grad():
        check(model(x), fast(x), "fallback")
    streams = compile_cuda(model, (x,), scheduler="lios", cudagraphs=False, runtime=rt)
    with torch.no_grad():
        check(model(x), streams(x), "without graphs")


@pytest.mark.parametrize(("model_class", "cause"), [
    (Refuses, r"refuse_in_graph.*failed: CaptureError: .*this op refuses to be recorded"),
    (SyncsInCapture, r"sync_in_graph.*synchronizes the CPU with the GPU"),
])
def test_a_failure_inside_capture_is_named_never_run_eagerly_and_leaves_the_process_usable(
        rt, model_class, cause):  # noqa: F811
    """The example (batch 1) captures; batch 2 fails while being recorded: a Python error, or a sync that
    invalidates the capture. Even with capture_fallback="eager" it is raised, the caller's (non-default) stream is
    current again, no stream of the backend is left capturing, and the backend, the process and new compiles work."""
    torch.manual_seed(0)
    model = model_class().to(DEVICE).eval()
    x1, x2 = torch.randn(1, 3, 16, 16, device=DEVICE), torch.randn(2, 3, 16, 16, device=DEVICE)
    caller = rt.Stream()
    caller.wait_stream(rt.current_stream())
    with rt.stream(caller):
        fast = compile_cuda(model, (x1,), scheduler="wavefront", streams=2, capture_fallback="eager", runtime=rt)
        assert fast.schedule.streams_used == 2
        with pytest.raises(GraphCaptureError, match=cause):
            fast(x2)
        assert rt.current_stream() == caller
        assert not rt.is_current_stream_capturing()
        assert fast.backend.capturing_streams() == []
        assert fast.backend.stats["eager_fallbacks"] == 0
        with torch.no_grad():
            check(model(x1), fast(x1), "the captured signature still replays")
    rt.synchronize()
    other, inputs, reference, _ = cuda_model("squeezenet")
    again = compile_cuda(other, inputs, scheduler="lios", runtime=rt)
    check(reference, again(*inputs), "a new compile after the failure")


# ---- streams ---------------------------------------------------------------------------------------------------------


def test_lanes_are_capped_by_default_and_get_distinct_streams(rt):  # noqa: F811
    model, inputs, _, cap = cuda_model("nasnet_a_mobile" if ON_GPU else "googlenet")
    fast = compile_cuda(cap, inputs, scheduler="wavefront", runtime=rt)
    backend = fast.backend
    assert 1 < len(backend.lanes) <= default_streams()  # 8 unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise
    handles = [s.cuda_stream for s in [*backend._lanes.side, backend._capture_stream]]
    assert len(set(handles)) == len(handles) == len(backend.lanes)


def test_backends_alive_together_get_distinct_pooled_streams_and_give_them_back(rt):  # noqa: F811
    model, inputs, reference, cap = cuda_model("squeezenet")
    pool = stream_pool(rt.device, rt)
    sched, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "wavefront", streams=3)
    # wavefront gives each level at most as many streams as it has ops: squeezenet's widest levels are its fire
    # modules' two expand convolutions, so 2 of the 3 streams allowed are used
    assert sched.streams_used == 2
    gc.collect()
    gc.disable()  # no other backend is collected (giving its streams back) while the pool's counts are compared
    try:
        held = sum(pool.users)
        a, b = (CudaBackend(cap, plan, inputs, cudagraphs=graphs, runtime=rt) for graphs in (True, False))
        handles = [s.cuda_stream for backend in (a, b) for s in [*backend._lanes.side, backend._capture_stream]]
        assert len(a.lanes) == len(b.lanes) == 2  # each: 1 side lane and a capture stream
        assert len(set(handles)) == len(handles) == 4
        assert sum(pool.users) == held + 4
        check(reference, a(*inputs), "with graphs")
        check(reference, b(*inputs), "without graphs")
        a.close()
        b.close()
        b.close()  # twice: harmless
        assert sum(pool.users) == held
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="closed"):
        a(*inputs)


def test_more_lanes_than_the_stream_pool_are_refused(rt):  # noqa: F811
    pool = [rt.Stream() for _ in range(40)]
    assert len({s.cuda_stream for s in pool}) < 40  # PyTorch hands out a pool of 32 streams round robin
    torch.manual_seed(0)
    model, x = Wide(40).to(DEVICE).eval(), torch.randn(1, 4, 8, 8, device=DEVICE)
    with pytest.raises(DeviceError, match="got the same CUDA stream"):
        compile_cuda(model, (x,), scheduler="wavefront", streams=40, runtime=rt)


def test_running_without_graphs_frees_buffers_before_the_end_of_a_sequential_run(rt):  # noqa: F811
    model, inputs, _, cap = cuda_model("resnet50" if ON_GPU else "squeezenet")
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "sequential")
    backend = CudaBackend(cap, plan, inputs, cudagraphs=False, runtime=rt)
    (entry,) = backend._entries.values()
    released = sum(len(keys) for keys in entry.releases.values())
    assert released >= len(cap.graph) - 2


# ---- profiler --------------------------------------------------------------------------------------------------------


@needs_gpu("the kernels' GPU times in a real profiler trace")
def test_profiler_takes_gpu_time_from_a_real_trace(rt):  # noqa: F811
    """Per-op latency is the kernels' GPU time: at batch 1 their sum is below eager's (host-bound) wall time."""
    from opweave.costs import timing

    model, inputs, _, cap = cuda_model("googlenet")
    with torch.no_grad():
        env = full_env(cap, inputs)
        runs = range_runs(trace_ops(cap, env, cap.graph.topo_order, 2, "cuda"))
    assert [r.op for r in runs] == [op for op in cap.graph.topo_order for _ in range(2)]
    prof = profile_model(cap, inputs, device="cuda", repeats=5, warmup=2)
    flops_ops = [o.id for o in cap.graph.ops if o.flops > 0]
    assert all(prof.latency_ms[op] > 0 and prof.kernels[op] for op in flops_ops)
    assert all(0 < k["occupancy"] <= 1 for op in flops_ops for k in prof.kernels[op])
    with torch.no_grad():
        eager_ms = timing.median_ms(lambda: model(*inputs), runs=20, warmup=5, device="cuda")
    assert sum(prof.latency_ms.values()) < eager_ms


# ---- torch.compile ---------------------------------------------------------------------------------------------------


def test_torch_compile_backend_on_cuda_reads_the_parameters_in_place_and_follows_a_swap(rt):  # noqa: F811
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = InPlace().to(DEVICE).eval(), torch.randn(2, 3, 16, 16, device=DEVICE)
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 2,
                                                             **({} if ON_GPU else {"runtime": rt})})
    with torch.no_grad():
        check(model(x.clone()), fast(x), "first call")
        x2 = torch.randn_like(x)
        check(model(x2.clone()), fast(x2), "new input")
        compiled = opweave.dynamo.last_compiled()
        assert compiled.device == "cuda" and compiled.schedule.scheduler == "lios"
        (entry,) = compiled.backend._entries.values()
        assert len(torch.utils._pytree.tree_leaves(entry.static_inputs)) == 1  # only x is copied per call
        params = {p.data_ptr() for p in model.parameters()}
        assert params <= {p.data_ptr() for p in compiled.backend.captured.gm.parameters()}
        model.a.weight = nn.Parameter(torch.randn_like(model.a.weight))  # the graph read the old one's address
        check(model(x2.clone()), fast(x2), "after swapping a weight")
        assert opweave.dynamo.last_compiled() is not compiled
    torch._dynamo.reset()
