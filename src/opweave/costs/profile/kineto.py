"""Kernels of a profiler trace, by the op that launched them.

Each op runs inside a ``record_function("opweave::<op>")`` range under ``torch.profiler``; the exported Kineto
(chrome-trace) JSON then ties every GPU kernel to its op: a kernel and the host-side runtime call that launched it
share a ``correlation`` id, and the launch lies inside the op's range on the launching thread. Never guessed from
kernel or source names.
"""

from __future__ import annotations

import json
import math
import tempfile
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

import torch

RANGE_PREFIX = "opweave::"
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def trace_kernels(captured, env: dict, device: str) -> dict[str, list[dict]]:
    """Run every op once under ``torch.profiler``, each inside a ``record_function`` range; the kernels by op."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for op in captured.graph.topo_order:
            with record_function(RANGE_PREFIX + op):
                captured.run_op(op, env)
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return kernels_by_op(trace, captured.graph.ids)


def kernels_by_op(trace: dict, ops: Sequence[str]) -> dict[str, list[dict]]:
    """Kernels of a Kineto (chrome-trace) export, grouped by the ``opweave::<op>`` range that launched them.

    A host-side launch (``cuda_runtime``/``cuda_driver`` event) belongs to the innermost-started op range on its
    thread that contains it; its ``correlation`` id names the kernel it launched.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    ranges: dict[object, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(RANGE_PREFIX):
            ts = float(e["ts"])
            ranges.setdefault(e.get("tid"), []).append((ts, ts + float(e.get("dur", 0)), e["name"][len(RANGE_PREFIX):]))
    for spans in ranges.values():
        spans.sort()
    op_of_launch: dict[int, str] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and corr is not None:
            spans = ranges.get(e.get("tid"), [])
            i = bisect_right(spans, (float(e["ts"]), math.inf, "")) - 1
            if i >= 0 and spans[i][0] <= float(e["ts"]) <= spans[i][1]:
                op_of_launch[corr] = spans[i][2]
    by_op: dict[str, list[dict]] = {op: [] for op in ops}
    for e in events:
        args = e.get("args") or {}
        op = op_of_launch.get(args.get("correlation"))
        if e.get("cat") == "kernel" and op in by_op:
            by_op[op].append({
                "name": e.get("name", ""),
                "grid": _dims(args.get("grid")),
                "block": _dims(args.get("block")),
                "registers_per_thread": int(args.get("registers per thread", 0)),
                "shared_memory_bytes": int(args.get("shared memory", 0)),
                "duration_us": float(e.get("dur", 0.0)),
            })
    return by_op


def _dims(value) -> list[int]:
    """A launch dimension as Kineto writes it (a list, or its string form "[x, y, z]")."""
    if isinstance(value, str):
        value = [v for v in value.strip("[]() ").split(",") if v.strip()]
    return [int(v) for v in value] if value else [1, 1, 1]


