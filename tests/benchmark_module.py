"""Import ``benchmarks/gpu_latency.py`` in tests (the benchmarks are scripts, not a package): its input generator
and output check are the ones the CUDA tests use, and its GPU-free parts are tested on the CPU; and
``benchmarks/serve_many.py``, whose engine run is tested on the simulator. Imports nothing
beyond the project and torch, so that the CUDA tests run on a GPU machine without the dev extras."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@functools.cache
def gpu_latency():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # for its ``import _common``
    spec = importlib.util.spec_from_file_location("gpu_latency", BENCHMARKS / "gpu_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def serve_many():
    """``benchmarks/serve_many.py`` as a module (its engine run is tested without a server)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # for its ``import _common``
    spec = importlib.util.spec_from_file_location("serve_many", BENCHMARKS / "serve_many.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
