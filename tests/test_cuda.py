"""The CUDA backend on a real GPU (skipped without one).

Every (scheduler, mode) pair on every zoo model matches eager on a fresh input after the static outputs were filled
with NaN; a race stress test (an op that sleeps on its lane before writing); fp16 at batch 8; a caller under
``torch.inference_mode``; replays with new inputs; several graphs alive; in-place ops; static outputs; one graph
per input signature; a sync found by the checked run (named, or run without a graph with ``fallback="eager"``),
also with ``warmup=1``; failures *inside* the capture (a Python error, and a sync that invalidates the capture):
named, never run eagerly, the caller's stream restored and the process usable; threads sharing one compiled model;
the default lane cap and distinct streams (pooled, given back on close); the profiler's GPU time on a real trace; and
``torch.compile(backend="opweave")`` on CUDA, swapped weights included.

Outputs are compared as the GPU benchmark compares them (:func:`opweave.outputs.compare`: fp32 within 1e-3 of the
output's scale, fp16 within 1e-2 or, where BatchNorm folded into fp16 weights rounds differently, against float64),
on inputs drawn by its ``fresh_inputs``; TF32 is off (``cuda_precision.fp32_math``).
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
from opweave import schedulers, zoo
from opweave.api import compile_captured, plan_for
from opweave.backends.cuda import CudaBackend, GraphCaptureError, default_streams
from opweave.capture import capture
from opweave.costs.profile import profile_model
from opweave.costs.profile.kineto import range_runs, trace_ops
from opweave.costs.profile.measure import full_env
from opweave.costs.roofline import estimate
from opweave.errors import DeviceError
from opweave.outputs import compare, exact_outputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = {"bert_base": {"num_layers": 2}}
MODES = ("graph", "streams")
SLEEP_CYCLES = 5_000_000  # torch.cuda._sleep: a few milliseconds at GPU clock rates


def fresh(inputs: tuple, seed: int) -> tuple:
    return gpu_latency().fresh_inputs(inputs, seed)


def check(reference, got, what: str, exact=None) -> None:
    result = compare(reference, got, exact=exact)
    assert result.ok, f"{what}: {result.reason}"


@functools.cache
def cuda_model(name: str, batch: int = 1, half: bool = False):
    model, inputs = zoo.create(name, batch_size=batch, **SMALL.get(name, {}))
    dtype = torch.float16 if half else torch.float32
    model = model.cuda().to(dtype)
    inputs = tuple(x.cuda().to(dtype) if x.is_floating_point() else x.cuda() for x in inputs)
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
    """A long spin on the current stream, then the result: readers on other lanes must wait for it."""
    if x.is_cuda:
        torch.cuda._sleep(SLEEP_CYCLES)
    return x * 2


def refuse_in_graph(x):
    """Fails only while recorded into a CUDA graph, and only for batch 2 (the example is batch 1)."""
    if x.is_cuda and x.shape[0] == 2 and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("this op refuses to be recorded")
    return x + 1


def sync_in_graph(x):
    """Synchronizes the host only while recorded (so the checked run cannot see it), for batch 2."""
    if x.is_cuda and x.shape[0] == 2 and torch.cuda.is_current_stream_capturing():
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


# ---- every scheduler, both modes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheduler", schedulers.names())
def test_scheduler_matches_eager_on_new_inputs_in_mode(scheduler, mode):
    """For every zoo model: built on the example, the static outputs filled with NaN (graph mode), then called with
    a fresh input and with the example again; every model is tried and the failures are listed together."""
    failures = []
    for name in zoo.names():
        try:
            model, inputs, reference, cap = cuda_model(name)
            backend = CudaBackend(cap, plan_of(name, scheduler), inputs, mode=mode)
            if mode == "graph":
                (entry,) = backend._entries.values()
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheduler", ["wavefront", "opara", "lios", "nimble"])
def test_race_stress_a_sleeping_lane_during_capture_then_replays(scheduler, mode):
    """The slow op spins for milliseconds before writing; a missing wait (or a buffer released too early and reused
    by another lane) would let its reader see the previous call's value, which differs with every new input."""
    torch.manual_seed(0)
    model, x = Racy().cuda().eval(), torch.randn(2, 8, 32, 32, device="cuda")
    fast = opweave.compile(model, (x,), scheduler=scheduler, device="cuda", streams=4, mode=mode)
    lane_of = {i.op: (i.device, i.stream) for i in fast.plan.instrs if i.kind == "launch"}
    slow = [op for op in fast.graph.ids if "slow_double" in (fast.graph.op[op].target or "")]
    assert len(slow) == 2 and any(lane_of[r] != lane_of[s] for s in slow for r in fast.graph.succs[s])
    for seed in range(5):
        new = fresh((x,), seed=10 + seed)
        with torch.no_grad():
            expected = model(*new)
        check(expected, fast(*new), f"replay {seed}")


# ---- dtypes, batch sizes, callers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["googlenet", "squeezenet"])
def test_fp16_at_batch_8(name, mode):
    model, inputs, reference, cap = cuda_model(name, batch=8, half=True)
    """fp16 rounds BatchNorm folded into the weights (coarsening) differently from eager: checked against float64
    as the benchmark checks (within 1e-2 of eager, or no farther from float64 than 3 times eager)."""
    fast = compile_captured(cap, inputs, scheduler="opara", device="cuda", mode=mode)
    new = fresh(inputs, seed=3)
    exact, new_exact = exact_outputs(model, inputs, new)
    check(reference, fast(*inputs), "example", exact)
    with torch.no_grad():
        expected = model(*new)
    check(expected, fast(*new), "fresh input", new_exact)


@pytest.mark.parametrize("mode", MODES)
def test_a_caller_under_inference_mode(mode):
    model, inputs, _, cap = cuda_model("googlenet")
    fast = compile_captured(cap, inputs, scheduler="lios", device="cuda", mode=mode)
    with torch.inference_mode():
        x = fresh(inputs, seed=4)
        check(model(*x), fast(*x), "inference mode")
        batch2 = fresh((torch.randn(2, *inputs[0].shape[1:], device="cuda"),), seed=5)  # a new signature in there
        check(model(*batch2), fast(*batch2), "new signature under inference mode")
    with torch.no_grad():  # and outside it again, on the entries made inside
        x = fresh(inputs, seed=6)
        check(model(*x), fast(*x), "after inference mode")
        check(model(*batch2), fast(*batch2), "batch 2 after inference mode")


@pytest.mark.parametrize("mode", MODES)
def test_replay_with_new_inputs(mode):
    model, inputs, _, _ = cuda_model("googlenet")
    fast = opweave.compile(model, inputs, scheduler="nimble", device="cuda", mode=mode)
    for seed in range(3):
        x = fresh(inputs, seed)
        with torch.no_grad():
            check(model(*x), fast(*x), f"seed {seed}")


def test_cpu_inputs_are_copied_to_the_gpu_and_the_callers_model_stays_put():
    model, inputs = zoo.create("squeezenet")
    fast = opweave.compile(model, inputs, scheduler="lios", device="cuda")
    assert next(model.parameters()).device.type == "cpu"
    got = fast(*inputs)
    assert got.is_cuda
    pinned = tuple(x.pin_memory() for x in fresh(inputs, seed=7))  # copied with non_blocking=True
    out = fast(*pinned)
    with torch.no_grad():
        check(model(*inputs), got.cpu(), "pageable")
        check(model(*pinned), out.cpu(), "pinned")


def test_two_captured_models_alive_at_once():
    a_model, a_inputs, a_ref, _ = cuda_model("googlenet")
    b_model, b_inputs, b_ref, _ = cuda_model("squeezenet")
    a = opweave.compile(a_model, a_inputs, scheduler="opara", device="cuda")
    b = opweave.compile(b_model, b_inputs, scheduler="lios", device="cuda")
    for _ in range(3):
        got_a, got_b = a(*a_inputs), b(*b_inputs)
        check(a_ref, got_a, "googlenet")
        check(b_ref, got_b, "squeezenet")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheduler", ["sequential", "opara", "lios", "wavefront"])
def test_in_place_ops(mode, scheduler):
    torch.manual_seed(0)
    model, x = InPlace().cuda().eval(), torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        expected = model(x.clone())
    fast = opweave.compile(model, (x,), scheduler=scheduler, device="cuda", streams=3, mode=mode)
    for _ in range(2):
        check(expected, fast(x), "in place")


def test_static_outputs_are_overwritten_by_the_next_call():
    model, inputs, _, _ = cuda_model("squeezenet")
    x1, x2 = inputs[0], fresh(inputs, seed=8)[0]
    with torch.no_grad():
        r1, r2 = model(x1), model(x2)
    static = opweave.compile(model, inputs, scheduler="lios", device="cuda", static_outputs=True)
    out1 = static(x1)
    out2 = static(x2)
    assert out1.data_ptr() == out2.data_ptr()
    check(r2, out1, "the first result now holds the second call's values")
    cloned = opweave.compile(model, inputs, scheduler="lios", device="cuda")
    out1 = cloned(x1)
    out2 = cloned(x2)
    assert out1.data_ptr() != out2.data_ptr()
    check(r1, out1, "first")
    check(r2, out2, "second")


@pytest.mark.parametrize("mode", MODES)
def test_one_entry_per_signature_in_a_bounded_lru_cache(mode):
    model, inputs, _, _ = cuda_model("googlenet")
    fast = opweave.compile(model, inputs, scheduler="opara", device="cuda", mode=mode, cache_size=2)
    batches = [torch.randn(n, *inputs[0].shape[1:], device="cuda") for n in (1, 2, 3)]
    for x in [*batches, batches[0]]:
        with torch.no_grad():
            check(model(x), fast(x), f"batch {x.shape[0]}")
    backend = fast.backend
    assert len(backend.signatures) == 2
    if mode == "graph":
        assert backend.stats["captures"] == 4 and backend.stats["evictions"] == 2
    with pytest.raises(TypeError, match="expected 1 inputs"):
        fast(batches[0], batches[1])


def test_calls_from_another_stream_are_ordered_after_the_previous_call():
    model, inputs, reference, _ = cuda_model("squeezenet")
    for mode in MODES:
        fast = opweave.compile(model, inputs, scheduler="opara", device="cuda", mode=mode)
        other = torch.cuda.Stream()
        first = fast(*inputs)
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            second = fast(*inputs)
        torch.cuda.synchronize()
        check(reference, first, f"{mode}: first")
        check(reference, second, f"{mode}: second, from another stream")


@pytest.mark.parametrize("mode", MODES)
def test_threads_calling_one_compiled_model(mode):
    """Six threads, half of them on their own streams, call one compiled model with different inputs."""
    model, inputs, _, _ = cuda_model("squeezenet")
    fast = opweave.compile(model, inputs, scheduler="opara", device="cuda", mode=mode)
    xs = [fresh(inputs, seed) for seed in range(6)]
    with torch.no_grad():
        refs = [model(*x) for x in xs]
    torch.cuda.synchronize()
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream() if k % 2 else None):
                for rep in range(5):
                    i = (k + rep) % len(xs)
                    result = compare(refs[i], fast(*xs[i]))  # float(): syncs this stream
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


# ---- what cannot be recorded -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [1, 2])
def test_a_sync_is_found_before_capture_and_named_or_run_without_a_graph(warmup):
    torch.manual_seed(0)
    model, x = Syncs().cuda().eval(), torch.randn(4, 16, device="cuda")
    with pytest.raises(GraphCaptureError, match=r"op '.*'.*item.*synchronizes the CPU with the GPU"):
        opweave.compile(model, (x,), scheduler="lios", device="cuda", warmup=warmup)
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
    with pytest.warns(UserWarning, match="without a CUDA graph"):
        fast = opweave.compile(model, (x,), scheduler="lios", device="cuda", fallback="eager", warmup=warmup)
    assert fast.backend.stats == {"captures": 0, "evictions": 0, "eager_fallbacks": 1}  # found before capture
    with torch.no_grad():
        check(model(x), fast(x), "fallback")
    streams = opweave.compile(model, (x,), scheduler="lios", device="cuda", mode="streams")
    with torch.no_grad():
        check(model(x), streams(x), "streams mode")


@pytest.mark.parametrize(("model_class", "cause"), [
    (Refuses, r"refuse_in_graph.*failed: CaptureError: .*this op refuses to be recorded"),
    (SyncsInCapture, r"sync_in_graph.*synchronizes the CPU with the GPU"),
])
def test_a_failure_inside_capture_is_named_never_run_eagerly_and_leaves_the_process_usable(model_class, cause):
    """The example (batch 1) captures; batch 2 fails while being recorded: a Python error, or a sync that
    invalidates the capture. Even with fallback="eager" it is raised, the caller's (non-default) stream is current
    again, no stream of the backend is left capturing, and the backend, the process and new compiles work."""
    torch.manual_seed(0)
    model = model_class().cuda().eval()
    x1, x2 = torch.randn(1, 3, 16, 16, device="cuda"), torch.randn(2, 3, 16, 16, device="cuda")
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        fast = opweave.compile(model, (x1,), scheduler="wavefront", device="cuda", streams=2, fallback="eager")
        assert fast.schedule.streams_used == 2
        with pytest.raises(GraphCaptureError, match=cause):
            fast(x2)
        assert torch.cuda.current_stream() == caller
        assert not torch.cuda.is_current_stream_capturing()
        assert fast.backend.capturing_streams() == []
        assert fast.backend.stats["eager_fallbacks"] == 0
        with torch.no_grad():
            check(model(x1), fast(x1), "the captured signature still replays")
    torch.cuda.synchronize()
    other, inputs, reference, _ = cuda_model("squeezenet")
    again = opweave.compile(other, inputs, scheduler="lios", device="cuda")
    check(reference, again(*inputs), "a new compile after the failure")


# ---- streams ---------------------------------------------------------------------------------------------------------


def test_lanes_are_capped_by_default_and_get_distinct_streams():
    model, inputs, _, cap = cuda_model("nasnet_a_mobile")
    fast = compile_captured(cap, inputs, scheduler="wavefront", device="cuda")
    backend = fast.backend
    assert 1 < len(backend.lanes) <= default_streams()  # 8 unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise
    handles = [s.cuda_stream for s in [*backend._lanes.side, backend._capture_stream]]
    assert len(set(handles)) == len(handles) == len(backend.lanes)


def test_backends_alive_together_get_distinct_pooled_streams_and_give_them_back():
    from opweave.backends.streams import stream_pool

    model, inputs, reference, cap = cuda_model("squeezenet")
    pool = stream_pool(torch.device("cuda", torch.cuda.current_device()))
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "wavefront", streams=3)
    gc.collect()
    gc.disable()  # no other backend is collected (giving its streams back) while the pool's counts are compared
    try:
        held = sum(pool.users)
        a, b = (CudaBackend(cap, plan, inputs, mode=mode) for mode in MODES)
        handles = [s.cuda_stream for backend in (a, b) for s in [*backend._lanes.side, backend._capture_stream]]
        assert len(a.lanes) == 3 and len(set(handles)) == len(handles) == 6  # 2 side lanes + a capture stream each
        assert sum(pool.users) == held + 6
        check(reference, a(*inputs), "graph mode")
        check(reference, b(*inputs), "streams mode")
        a.close()
        b.close()
        b.close()  # twice: harmless
        assert sum(pool.users) == held
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="closed"):
        a(*inputs)


def test_more_lanes_than_the_stream_pool_are_refused():
    pool = [torch.cuda.Stream() for _ in range(40)]
    assert len({s.cuda_stream for s in pool}) < 40  # PyTorch hands out a pool of 32 streams round robin
    torch.manual_seed(0)
    model, x = Wide(40).cuda().eval(), torch.randn(1, 4, 8, 8, device="cuda")
    with pytest.raises(DeviceError, match="got the same CUDA stream"):
        opweave.compile(model, (x,), scheduler="wavefront", device="cuda", streams=40)


def test_streams_mode_frees_buffers_before_the_end_of_a_sequential_run():
    model, inputs, _, cap = cuda_model("resnet50")
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "sequential")
    backend = CudaBackend(cap, plan, inputs, mode="streams")
    (entry,) = backend._entries.values()
    released = sum(len(keys) for keys in entry.releases.values())
    assert released >= len(cap.graph) - 2


# ---- profiler --------------------------------------------------------------------------------------------------------


def test_profiler_takes_gpu_time_from_a_real_trace():
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


def test_torch_compile_backend_on_cuda_reads_the_parameters_in_place_and_follows_a_swap():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = InPlace().cuda().eval(), torch.randn(2, 3, 16, 16, device="cuda")
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 2})
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
