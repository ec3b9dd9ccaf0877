"""For the CUDA tests: the runtime they run against, as the fixture ``rt`` (import it into a test module).

Where a GPU is present, ``torch.cuda`` itself (:data:`opweave.backends.runtime.CUDA`); elsewhere a fake CUDA runtime
on the CPU (:class:`opweave.testing.fakecuda.FakeCuda`), a new one per test with a new seed, printed with the test's
output so that a failure can be replayed (``OPWEAVE_FAKECUDA_SEED=<seed> pytest ...``). The parameter names the
runtime in the test's id (``[cuda]`` or ``[fake]``). ``ON_GPU`` says which; ``DEVICE`` is where the tests put models
and inputs; ``needs_gpu(reason)`` skips a test that measures the device itself. Imports nothing from the test suite
(the GPU machine runs the CUDA tests with ``--noconftest``)."""

from __future__ import annotations

import pytest
import torch

from opweave.backends.runtime import CUDA
from opweave.testing.fakecuda import SEED_ENV, FakeCuda

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else FakeCuda.device  # (no index: importing this initializes no GPU)


def needs_gpu(reason: str):
    """Skip on the fake runtime: the test measures the device itself (``reason`` says what)."""
    return pytest.mark.skipif(not ON_GPU, reason=f"measures the real device: {reason}")


@pytest.fixture(params=["cuda" if ON_GPU else "fake"])
def rt(request):
    if request.param == "cuda":
        yield CUDA
        return
    fake = FakeCuda()
    print(f"fake CUDA runtime, seed {fake.seed} (replay with {SEED_ENV}={fake.seed})")
    yield fake
