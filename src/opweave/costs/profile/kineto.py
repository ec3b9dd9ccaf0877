"""GPU work of a profiler trace, by the op (and the run of the op) that launched it.

Each op runs inside a ``record_function("opweave::<op>")`` range under ``torch.profiler``; the exported Kineto
(chrome-trace) JSON then ties every GPU activity to its op: a kernel, memcpy or memset and the host-side runtime or
driver call that launched it share a ``correlation`` id, and the launch lies inside the op's range on the launching
thread. Never guessed from kernel or source names, nor from where the work lands on the GPU's timeline.

The format is what ``torch.profiler.profile.export_chrome_trace`` writes (Kineto's ``output_json``): complete
events (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, a ``cat`` (``user_annotation`` for
``record_function`` ranges, ``cuda_runtime``/``cuda_driver`` for launches, ``kernel``/``gpu_memcpy``/``gpu_memset``
for GPU work, and others that are ignored here: ``cpu_op``, ``gpu_user_annotation``, ``ac2g`` flows, ...), and
``args`` holding ``correlation`` and, for kernels, ``grid``, ``block``, ``registers per thread`` and ``shared
memory``. Categories are compared case-insensitively, and the short names older Kineto versions wrote
(``Runtime``, ``Driver``, ``Memcpy``, ``Memset``) are accepted.

Where a launch's thread has no op range at all (a trace whose runtime events carry another thread numbering than
its CPU events), the ranges of every thread are searched: opweave runs the profiled ops from one thread.
"""

from __future__ import annotations

import json
import math
import tempfile
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

RANGE_PREFIX = "opweave::"
_CATEGORY = {"user_annotation": "range", "cuda_runtime": "launch", "cuda_driver": "launch", "runtime": "launch",
             "driver": "launch", "kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy",
             "gpu_memset": "memset", "memset": "memset"}
GPU_WORK = ("kernel", "memcpy", "memset")


@dataclass
class RangeRun:
    """One run of one op: its ``opweave::<op>`` range and the GPU work launched inside it."""

    op: str
    ts: float
    work: list[dict] = field(default_factory=list)

    @property
    def duration_us(self) -> float:
        """GPU time of the run: the durations of its kernels, memcpys and memsets, summed."""
        return sum(w["duration_us"] for w in self.work)

    @property
    def kernels(self) -> list[dict]:
        return [w for w in self.work if w["kind"] == "kernel"]


def trace_ops(captured, env: dict, ops: Sequence[str], repeats: int, device: str) -> dict:
    """Run each op of ``ops`` ``repeats`` times under ``torch.profiler``, every run inside its own
    ``record_function("opweave::<op>")`` range; the exported trace as a dict."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for op in ops:
            name = RANGE_PREFIX + op
            for _ in range(repeats):
                with record_function(name):
                    captured.run_op(op, env)
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def range_runs(trace: dict) -> list[RangeRun]:
    """Every ``opweave::<op>`` range of a Kineto trace, in start order, with the GPU work launched inside it.

    A host-side launch (``cuda_runtime``/``cuda_driver`` event) belongs to the innermost-started op range on its
    thread that contains it; its ``correlation`` id names the GPU work it launched.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    runs: list[RangeRun] = []
    by_thread: dict[object, list[tuple[float, float, int]]] = {}
    for e in events:
        if _kind(e) == "range" and str(e.get("name", "")).startswith(RANGE_PREFIX):
            ts = float(e["ts"])
            runs.append(RangeRun(e["name"][len(RANGE_PREFIX):], ts))
            by_thread.setdefault(e.get("tid"), []).append((ts, ts + float(e.get("dur", 0)), len(runs) - 1))
    every_thread = sorted(span for spans in by_thread.values() for span in spans)
    for spans in by_thread.values():
        spans.sort()
    run_of_launch: dict[object, int] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if corr is None or _kind(e) != "launch":
            continue
        spans = by_thread.get(e.get("tid")) or every_thread
        ts = float(e["ts"])
        i = bisect_right(spans, (ts, math.inf, math.inf)) - 1
        if i >= 0 and spans[i][0] <= ts <= spans[i][1]:
            run_of_launch[corr] = spans[i][2]
    for e in events:
        kind = _kind(e)
        args = e.get("args") or {}
        run = run_of_launch.get(args.get("correlation"))
        if kind not in GPU_WORK or run is None:
            continue
        work = {"kind": kind, "name": e.get("name", ""), "duration_us": float(e.get("dur", 0.0))}
        if kind == "kernel":
            work |= {"grid": _dims(args.get("grid")), "block": _dims(args.get("block")),
                     "registers_per_thread": int(args.get("registers per thread", 0)),
                     "shared_memory_bytes": int(args.get("shared memory", 0))}
        runs[run].work.append(work)
    runs.sort(key=lambda r: r.ts)
    return runs


def kernels_by_op(trace: dict, ops: Sequence[str]) -> dict[str, list[dict]]:
    """The kernels of every run of each op in ``ops`` (ops without a range get an empty list)."""
    by_op: dict[str, list[dict]] = {op: [] for op in ops}
    for run in range_runs(trace):
        if run.op in by_op:
            by_op[run.op].extend(run.kernels)
    return by_op


def _kind(event: dict) -> str | None:
    return _CATEGORY.get(str(event.get("cat", "")).lower())


def _dims(value) -> list[int]:
    """A launch dimension as Kineto writes it (a list, or its string form "[x, y, z]")."""
    if isinstance(value, str):
        value = [v for v in value.strip("[]() ").split(",") if v.strip()]
    return [int(v) for v in value] if value else [1, 1, 1]
