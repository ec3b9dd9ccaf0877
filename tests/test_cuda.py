"""The CUDA backend on a real GPU (skipped without one): every scheduler and zoo model in both modes matches eager,
replays with new inputs, several graphs alive, in-place ops, static outputs, one graph per input signature, the
capture error and its eager fallback, and ``torch.compile(backend="opweave")`` on CUDA."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import opweave
import opweave.dynamo
from opweave import schedulers, zoo
from opweave.api import plan_for
from opweave.backends.cuda import CudaBackend, GraphCaptureError
from opweave.bench import max_abs_diff
from opweave.capture import capture
from opweave.costs.roofline import estimate

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = {"bert_base": {"num_layers": 2}}
MODES = ("graph", "streams")


@functools.cache
def cuda_model(name: str):
    model, inputs = zoo.create(name, batch_size=1, **SMALL.get(name, {}))
    model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    with torch.no_grad():
        reference = model(*inputs)
    return model, inputs, reference, capture(model, inputs, name=name)


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


@pytest.mark.parametrize("name", zoo.names())
def test_every_scheduler_matches_eager_in_both_modes(name):
    _, inputs, reference, cap = cuda_model(name)
    costs = estimate(cap.graph, "h100")
    for scheduler in schedulers.names():
        devices = 2 if scheduler in schedulers.MULTI_DEVICE else 1
        _, plan = plan_for(cap.graph, costs, scheduler, streams=4, devices=devices)
        for mode in MODES:
            backend = CudaBackend(cap, plan, inputs, mode=mode)
            got = backend(*inputs)
            torch.cuda.synchronize()
            assert max_abs_diff(reference, got) < 1e-3, (scheduler, mode)


@pytest.mark.parametrize("mode", MODES)
def test_replay_with_new_inputs(mode):
    model, inputs, _, _ = cuda_model("googlenet")
    fast = opweave.compile(model, inputs, scheduler="nimble", device="cuda", mode=mode)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn_like(inputs[0])
        with torch.no_grad():
            assert max_abs_diff(model(x), fast(x)) < 1e-3


def test_cpu_inputs_are_copied_to_the_gpu_and_the_callers_model_stays_put():
    model, inputs = zoo.create("squeezenet")
    fast = opweave.compile(model, inputs, scheduler="lios", device="cuda")
    assert next(model.parameters()).device.type == "cpu"
    got = fast(*inputs)
    assert got.is_cuda
    with torch.no_grad():
        assert max_abs_diff(model(*inputs), got.cpu()) < 1e-3


def test_two_captured_models_alive_at_once():
    a_model, a_inputs, a_ref, _ = cuda_model("googlenet")
    b_model, b_inputs, b_ref, _ = cuda_model("squeezenet")
    a = opweave.compile(a_model, a_inputs, scheduler="opara", device="cuda")
    b = opweave.compile(b_model, b_inputs, scheduler="lios", device="cuda")
    for _ in range(3):
        got_a, got_b = a(*a_inputs), b(*b_inputs)
        assert max_abs_diff(a_ref, got_a) < 1e-3 and max_abs_diff(b_ref, got_b) < 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scheduler", ["sequential", "opara", "lios", "wavefront"])
def test_in_place_ops(mode, scheduler):
    torch.manual_seed(0)
    model, x = InPlace().cuda().eval(), torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        expected = model(x.clone())
    fast = opweave.compile(model, (x,), scheduler=scheduler, device="cuda", streams=3, mode=mode)
    for _ in range(2):
        assert max_abs_diff(expected, fast(x)) < 1e-4


def test_static_outputs_are_overwritten_by_the_next_call():
    model, inputs, _, _ = cuda_model("squeezenet")
    x1, x2 = inputs[0], torch.randn_like(inputs[0])
    with torch.no_grad():
        r1, r2 = model(x1), model(x2)
    static = opweave.compile(model, inputs, scheduler="lios", device="cuda", static_outputs=True)
    out1 = static(x1)
    out2 = static(x2)
    assert out1.data_ptr() == out2.data_ptr()
    assert max_abs_diff(r2, out1) < 1e-3  # the first result now holds the second call's values
    cloned = opweave.compile(model, inputs, scheduler="lios", device="cuda")
    out1 = cloned(x1)
    out2 = cloned(x2)
    assert out1.data_ptr() != out2.data_ptr()
    assert max_abs_diff(r1, out1) < 1e-3 and max_abs_diff(r2, out2) < 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_one_entry_per_signature_in_a_bounded_lru_cache(mode):
    model, inputs, _, _ = cuda_model("googlenet")
    fast = opweave.compile(model, inputs, scheduler="opara", device="cuda", mode=mode, cache_size=2)
    batches = [torch.randn(n, *inputs[0].shape[1:], device="cuda") for n in (1, 2, 3)]
    for x in [*batches, batches[0]]:
        with torch.no_grad():
            assert max_abs_diff(model(x), fast(x)) < 1e-3
    backend = fast.backend
    assert len(backend.signatures) == 2
    if mode == "graph":
        assert backend.stats["captures"] == 4 and backend.stats["evictions"] == 2
    with pytest.raises(TypeError, match="expected 1 inputs"):
        fast(batches[0], batches[1])


def test_a_sync_inside_forward_is_named_or_falls_back_to_eager():
    torch.manual_seed(0)
    model, x = Syncs().cuda().eval(), torch.randn(4, 16, device="cuda")
    with pytest.raises(GraphCaptureError, match=r"op '.*'.*item.*synchronizes the CPU with the GPU"):
        opweave.compile(model, (x,), scheduler="lios", device="cuda")
    with pytest.warns(UserWarning, match="without a CUDA graph"):
        fast = opweave.compile(model, (x,), scheduler="lios", device="cuda", fallback="eager")
    with torch.no_grad():
        assert max_abs_diff(model(x), fast(x)) < 1e-4
    assert fast.backend.stats["eager_fallbacks"] == 1
    streams = opweave.compile(model, (x,), scheduler="lios", device="cuda", mode="streams")
    with torch.no_grad():
        assert max_abs_diff(model(x), streams(x)) < 1e-4


def test_calls_from_another_stream_are_ordered_after_the_previous_call():
    model, inputs, reference, _ = cuda_model("squeezenet")
    fast = opweave.compile(model, inputs, scheduler="opara", device="cuda", mode="streams")
    other = torch.cuda.Stream()
    first = fast(*inputs)
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        second = fast(*inputs)
    torch.cuda.synchronize()
    assert max_abs_diff(reference, first) < 1e-3 and max_abs_diff(reference, second) < 1e-3


def test_streams_mode_frees_buffers_before_the_end_of_a_sequential_run():
    model, inputs, _, cap = cuda_model("resnet50")
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "sequential")
    backend = CudaBackend(cap, plan, inputs, mode="streams")
    (entry,) = backend._entries.values()
    released = sum(len(keys) for keys in entry.releases.values())
    assert released >= len(cap.graph) - 2


def test_torch_compile_backend_on_cuda_reads_the_parameters_in_place():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = InPlace().cuda().eval(), torch.randn(2, 3, 16, 16, device="cuda")
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 2})
    with torch.no_grad():
        expected, got = model(x.clone()), fast(x)
        assert max_abs_diff(expected, got) < 1e-4
        x2 = torch.randn_like(x)
        assert max_abs_diff(model(x2.clone()), fast(x2)) < 1e-4
    compiled = opweave.dynamo.last_compiled()
    assert compiled.device == "cuda" and compiled.schedule.scheduler == "lios"
    (entry,) = compiled.backend._entries.values()
    assert len(torch.utils._pytree.tree_leaves(entry.static_inputs)) == 1  # only x is copied per call
    params = {p.data_ptr() for p in model.parameters()}
    assert params <= {p.data_ptr() for p in compiled.backend.captured.gm.parameters()}
    torch._dynamo.reset()
