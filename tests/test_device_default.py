"""``opweave.compile`` without ``device`` runs where the inputs and the model are, as ``torch.compile`` does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave
from opweave.api import device_of
from opweave.backends.cpu import CpuBackend
from opweave.backends.cuda import CudaBackend
from opweave.testing.fakecuda import FakeCuda


class Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_cpu_inputs_compile_for_the_cpu_and_a_runtime_means_cuda():
    model, x = Fork().eval(), torch.randn(2, 8)
    assert isinstance(opweave.compile(model, (x,), scheduler="lios").backend, CpuBackend)
    fast = opweave.compile(model, (x,), scheduler="lios", runtime=FakeCuda(seed=0))  # the fake CUDA runtime
    assert isinstance(fast.backend, CudaBackend) and fast.device == "cuda"


def test_a_device_given_wins():
    model, x = Fork().eval(), torch.randn(2, 8)
    with pytest.raises(opweave.errors.UsageError, match="option 'runtime' applies to device='cuda' only"):
        opweave.compile(model, (x,), device="cpu", runtime=FakeCuda(seed=0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_inputs_compile_for_the_gpu():
    model, x = Fork().eval().cuda(), torch.randn(2, 8, device="cuda")
    assert device_of(model, (x,), None, {}) == "cuda"
    with opweave.compile(model, (x,), scheduler="lios") as fast:
        assert isinstance(fast.backend, CudaBackend)
        torch.testing.assert_close(fast(x), model(x))


def test_where_the_tensors_are_decides():
    model = Fork().eval()
    assert device_of(model, (torch.randn(2, 8),), None, {}) == "cpu"
    assert device_of(model, (), None, {"runtime": object()}) == "cuda"
    meta = torch.randn(2, 8, device="meta")
    assert device_of(model, (meta,), None, {}) == "cpu"  # only a GPU tensor means cuda
