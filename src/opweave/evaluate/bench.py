"""Real-run latency measurement shared by ``opweave bench`` and the benchmark scripts.

Every mode is timed the same way: the whole call (input copy included) after ``warmup`` calls, median over ``runs``.
On CUDA the time comes from CUDA events around the call (and a synchronize per run), on CPU from perf_counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from opweave.costs import timing
from opweave.errors import DeviceError, UsageError
from opweave.outputs import compare


def median_ms(fn: Callable, args: Sequence, *, runs: int = 20, warmup: int = 3, device: str = "cpu") -> float:
    """Median wall time of ``fn(*args)`` in milliseconds (:mod:`opweave.costs.timing`), under inference mode."""
    with torch.inference_mode():
        return timing.median_ms(lambda: fn(*args), runs=runs, warmup=warmup, device=device)


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("CUDA is not available on this machine; use --device cpu (or auto)")
    return device


def device_name(device: str) -> str:
    from opweave.costs.profile import device_name as measured_on

    return measured_on(device) + ("" if device == "cuda" else f" ({torch.get_num_threads()} threads)")


def bench_model(source: str | Path, *, device: str = "cpu", batch_size: int = 1,
                scheduler_names: Sequence[str] = (), streams: int | None = None, runs: int = 20, warmup: int = 3,
                progress: bool = True, profile: str | None = None, coarsen: bool = True,
                mode: str = "default", options: dict | None = None) -> dict:
    """Eager vs ``opweave.compile`` with each scheduler on one zoo model or ``.pt2`` file (``source``, as
    :func:`opweave.capture.load` takes it), with ``options`` (any other option of ``opweave.compile``) for every
    scheduler; returns a JSON-ready dict."""
    from rich.progress import Progress

    from opweave.api import compile_captured
    from opweave.capture import load

    if device == "cuda":
        from opweave.backends.cuda import require_cuda

        require_cuda()
    # captured once: every scheduler plans the same graph
    options = dict(options or {})
    model, inputs, captured = load(source, batch_size=batch_size, device=device, coarsen=coarsen,
                                   fold_bn=options.pop("fold_bn", False))
    model_name = captured.graph.name
    with torch.inference_mode():
        reference = model(*inputs)
    rows = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"{model_name}: eager", total=1 + len(scheduler_names))
        eager_ms = median_ms(model, inputs, runs=runs, warmup=warmup, device=device)
        rows.append({"mode": "eager", "median_ms": eager_ms, "speedup_vs_eager": 1.0})
        bar.advance(task)
        for name in scheduler_names:
            bar.update(task, description=f"{model_name}: opweave {name}")
            fast = compile_captured(captured, inputs, scheduler=name, device=device, streams=streams, profile=profile,
                                    coarsen=False, mode=mode, options=options)
            with torch.inference_mode():
                check = compare(reference, fast(*inputs))
            ms = median_ms(fast, inputs, runs=runs, warmup=warmup, device=device)
            rows.append({"mode": f"opweave {name}", "scheduler": name, "median_ms": ms,
                         "speedup_vs_eager": eager_ms / ms, "streams": fast.schedule.streams_used,
                         "syncs": fast.plan.syncs, "max_abs_diff": check.max_diff, "ok": check.ok,
                         "ops": len(fast.graph)})
            bar.advance(task)
    return {"model": model_name, "batch_size": batch_size, "device": device, "device_name": device_name(device),
            "costs": "profile " + str(profile) if profile else "roofline estimate", "coarsen": coarsen,
            "torch": torch.__version__, "runs": runs, "warmup": warmup, "rows": rows}
