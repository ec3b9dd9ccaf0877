"""Import ``benchmarks/gpu_latency.py`` in tests (the benchmarks are scripts, not a package): its input generator
and output check are the ones the CUDA tests use, and its GPU-free parts are tested on the CPU. Imports nothing
beyond the project and torch, so that the CUDA tests run on a GPU machine without the dev extras.
``benchmarks/cpu_latency.py`` the same way, for the README's CPU tables (rendered from its results); and
``benchmarks/serve_many.py``, whose engine run is tested on the simulator."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@functools.cache
def benchmark(name: str):
    """The module of ``benchmarks/NAME.py``."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # for its ``import _common``
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_latency():
    return benchmark("gpu_latency")


def cpu_latency():
    return benchmark("cpu_latency")


def serve_many():
    return benchmark("serve_many")


@functools.cache
def render_docs():
    """``scripts/render_docs.py``: the figures of README.md and docs/*.md rendered from their results files."""
    path = BENCHMARKS.parent / "scripts" / "render_docs.py"
    spec = importlib.util.spec_from_file_location("render_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
