"""For the CUDA tests: ``fp32_math``, an autouse fixture (import it into a test module), and ``no_tf32``, the same
as a context manager: TF32 off in cuDNN and cuBLAS, restored after.

Why: cuDNN convolutions run in TF32 by default on Ampere and later, and coarsening folds BatchNorm into the
convolution weights, so eager rounds ``w`` to TF32 where opweave rounds ``w * s``. On the zoo's random weights tens
of layers can amplify that beyond the fp32 tolerance of 1e-3 of the output's scale; in full fp32 the two differ by
float32 rounding only. The GPU benchmark keeps the defaults and checks against a float64 run instead
(``opweave.outputs.compare``'s ``exact``). Imports nothing beyond pytest and torch (the GPU machine runs these tests
with ``--noconftest``)."""

from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def no_tf32():
    """TF32 off in cuDNN and cuBLAS inside the block, restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(autouse=True)
def fp32_math():
    with no_tf32():
        yield
