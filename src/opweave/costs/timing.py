"""One way to time things, used by the profiler, ``opweave bench`` and the GPU benchmark.

``warmup`` calls first (lazy initialization, cuDNN/cuBLAS handles, allocator growth), then ``runs`` timed calls.
On CUDA each call is bracketed by CUDA events; with ``sync_each_run`` (the default, used for whole model calls)
the host waits for every call before issuing the next, so each figure covers one call and nothing queued behind
it; without it (per-op profiling) every call is queued back to back and the events are read at the end. On the CPU
each call is timed with ``perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def times_ms(fn: Callable[[], object], *, runs: int, warmup: int, device: str = "cpu",
             sync_each_run: bool = True) -> list[float]:
    """Milliseconds of each of ``runs`` calls of ``fn()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
        if sync_each_run:
            end.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def median_ms(fn: Callable[[], object], *, runs: int, warmup: int, device: str = "cpu",
              sync_each_run: bool = True) -> float:
    """Median of :func:`times_ms`."""
    return statistics.median(times_ms(fn, runs=runs, warmup=warmup, device=device, sync_each_run=sync_each_run))
