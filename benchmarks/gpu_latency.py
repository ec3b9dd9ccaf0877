"""Inference latency on a real GPU: eager, a sequential CUDA Graph, torch.compile and opweave with every scheduler.

    .venv/bin/python benchmarks/gpu_latency.py [--quick] [--models a,b] [--schedulers x,y] [--batch-sizes 1,8]
                                               [--dtypes fp32,fp16] [--replays 200] [--out DIR]

For each model (the zoo, plus torchvision's googlenet and inception_v3 where torchvision is installed), batch size
and dtype, every mode below is built, checked against eager (max |difference| of the outputs; fp32 within 1e-3 of
the output's scale, fp16 within 1e-2) and timed the same way:

* ``eager`` — ``model(*inputs)``;
* ``cuda-graph`` — the whole model captured into one ``torch.cuda.CUDAGraph`` on one stream (static inputs copied
  in, outputs cloned): the sequential CUDA Graph every speedup is measured against;
* ``torch.compile`` — ``torch.compile(model, mode="reduce-overhead")`` (inductor + CUDA graphs);
* ``opweave <scheduler>`` — the model captured once, profiled on this GPU (:func:`opweave.costs.profile.profile_model`),
  each scheduler run on the measured costs, the plan lowered, validated and recorded by the CUDA backend in graph
  mode (static inputs copied in, outputs cloned);
* ``opweave <scheduler>+inductor`` — the captured graph coarsened (:func:`opweave.capture.coarsen`), profiled,
  scheduled, lowered and validated the same way, every stream segment compiled by TorchInductor
  (:mod:`opweave.backends.segments`) and the whole plan recorded by the CUDA backend in graph mode.

Beside the latency, ``kernels/call``: the CUDA kernels one call runs (a CUDA graph replay's included), counted in a
``torch.profiler`` trace of a few calls after the timing.

Timing (benchmarks/README and the device METHOD): CUDA events around the whole call — input copy and output clone
included — on the current stream, a synchronize after each call, ``--warmup`` calls first, the median (and 10th/90th
percentiles) of ``--replays`` calls. Peak memory: ``torch.cuda.max_memory_allocated`` from building the mode to the
end of its timing, minus what was allocated before (weights and inputs). Each mode is freed before the next.

Writes ``DIR/<device>-<date>.json`` (device name, torch version, date, settings, every figure) and prints, per
model, batch and dtype, a table of latencies with speedups over the sequential CUDA Graph and over torch.compile.
Without CUDA it exits with status 2 and one line on stderr. ``--quick`` (squeezenet and googlenet, batch 1, fp32)
fits well within 10 minutes on an H100.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import re
import statistics
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_MODELS = ("squeezenet", "googlenet")
TORCHVISION = ("torchvision:googlenet", "torchvision:inception_v3")
DTYPES = {"fp32": "float32", "fp16": "float16"}
TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}, batch 1, fp32")
    p.add_argument("--models", help="comma list of zoo names (torchvision:<name> too); default: zoo + torchvision")
    p.add_argument("--schedulers", help="comma list of schedulers (default: all)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8; --quick: 1)")
    p.add_argument("--dtypes", default=None, help="comma list of fp32, fp16 (default both; --quick: fp32)")
    p.add_argument("--replays", type=int, default=200, help="timed calls per mode (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls before timing (default %(default)s)")
    p.add_argument("--streams", type=int, default=0, help="stream cap for every scheduler; 0 = none (default)")
    p.add_argument("--profile-repeats", type=int, default=20, help="runs per op when profiling (default %(default)s)")
    p.add_argument("--sched-timeout-s", type=float, default=120.0, help="give up on one schedule after this long")
    p.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile mode")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON (default %(default)s)")
    args = p.parse_args(argv)
    if args.replays < 200 and not args.quick:
        p.error("--replays must be at least 200 (the median of fewer is not reported)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        reason = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"gpu_latency: CUDA is not available ({reason}, torch {torch.__version__}); this benchmark needs a GPU",
              file=sys.stderr)
        return 2

    import _common as common

    from opweave import schedulers

    models = _split(args.models) or (list(QUICK_MODELS) if args.quick else _default_models())
    scheds = _split(args.schedulers) or schedulers.names()
    unknown = [s for s in scheds if s not in schedulers.names()]
    if unknown:
        print(f"gpu_latency: unknown scheduler(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    batches = [int(b) for b in (_split(args.batch_sizes) or (["1"] if args.quick else ["1", "8"]))]
    dtypes = _split(args.dtypes) or (["fp32"] if args.quick else ["fp32", "fp16"])
    if any(d not in DTYPES for d in dtypes):
        print(f"gpu_latency: dtypes must be among {', '.join(DTYPES)}", file=sys.stderr)
        return 2

    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc)
    results: list[dict] = []
    data = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": date.isoformat(timespec="seconds"), "machine": common.machine_info(),
            "settings": {"models": models, "schedulers": scheds, "batch_sizes": batches, "dtypes": dtypes,
                         "replays": args.replays, "warmup": args.warmup, "streams": args.streams or None,
                         "profile_repeats": args.profile_repeats, "timing": "CUDA events around the whole call, "
                         "synchronize after each, median"},
            "results": results}
    path = args.out / f"{_slug(device)}-{date.strftime('%Y-%m-%d')}.json"
    for name in models:
        for batch in batches:
            for dtype in dtypes:
                rows = bench_config(name, batch, dtype, scheds, args, common)
                results.extend(rows)
                common.console.print(speedup_table(name, batch, dtype, rows, common))
                common.write_json(path, data)  # after every configuration: a crash keeps what was measured
    return 0


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _default_models() -> list[str]:
    from opweave import zoo

    names = zoo.names()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return names
    return names + list(TORCHVISION)


# ---- one configuration ----------------------------------------------------------------------------------------------


def bench_config(name: str, batch: int, dtype: str, scheds: list[str], args, common) -> list[dict]:
    import torch

    from opweave import zoo
    from opweave.capture import capture
    from opweave.costs.profile import profile_model

    base = {"model": name, "batch_size": batch, "dtype": dtype}
    try:
        model, inputs = zoo.create(name, batch_size=batch)
    except Exception as exc:  # noqa: BLE001 - a missing optional package skips the model, recorded
        return [{**base, "mode": "build", "error": _line(exc)}]
    torch_dtype = getattr(torch, DTYPES[dtype])
    model = model.cuda().to(torch_dtype).eval()
    inputs = tuple(x.cuda().to(torch_dtype) if x.is_floating_point() else x.cuda() for x in inputs)
    with torch.no_grad():
        reference = model(*inputs)
    torch.cuda.synchronize()
    rows = []

    def measure(mode: str, build, extra: dict | None = None) -> None:
        """``build`` may add to ``extra`` (e.g. the plan's syncs) while it runs."""
        extra = {} if extra is None else extra
        timing = time_mode(build, inputs, reference, dtype, args)
        rows.append({**base, "mode": mode, **extra, **timing})

    measure("eager", lambda: model)
    measure("cuda-graph", lambda: plain_cuda_graph(model, inputs))
    if not args.no_torch_compile:
        measure("torch.compile", lambda: _compiled(model, inputs))
        torch._dynamo.reset()  # frees its CUDA graphs before the next modes are measured
    try:
        captured = capture(model, inputs, name=name)
        profile = profile_model(captured, inputs, device="cuda", repeats=args.profile_repeats, warmup=3)
    except Exception as exc:  # noqa: BLE001 - recorded, the other modes stand
        rows.append({**base, "mode": "opweave", "error": f"capture/profile failed: {_line(exc)}"})
        return rows
    costs = profile.costs(captured.graph)
    for sched_name in scheds:
        status, sched = common.run_limited(_schedule, (sched_name, captured.graph, costs, args.streams or None),
                                           args.sched_timeout_s)
        if status != "ok":
            rows.append({**base, "mode": f"opweave {sched_name}", "scheduler": sched_name,
                         "error": "scheduling timed out" if status == "timeout" else sched})
            continue
        extra = {"scheduler": sched_name, "streams": sched.streams_used, "scheduling_time_s": sched.scheduling_time_s,
                 "predicted_ms": sched.predicted_ms, "ops": len(captured.graph)}
        measure(f"opweave {sched_name}", lambda s=sched, e=extra: _opweave(captured, s, inputs, e), extra)
    rows.extend(_fused_rows(captured, scheds, inputs, args, common, measure, base))
    return rows


def _fused_rows(captured, scheds, inputs, args, common, measure, base) -> list[dict]:
    """The ``opweave <scheduler>+inductor`` modes (measured through ``measure``); rows only for what failed."""
    from opweave.capture import coarsen
    from opweave.costs.profile import profile_model

    try:
        coarse = coarsen(captured)
        costs = profile_model(coarse, inputs, device="cuda", repeats=args.profile_repeats, warmup=3).costs(coarse.graph)
    except Exception as exc:  # noqa: BLE001 - recorded, the other modes stand
        return [{**base, "mode": "opweave +inductor", "error": f"coarsen/profile failed: {_line(exc)}"}]
    failed = []
    for sched_name in scheds:
        mode = f"opweave {sched_name}+inductor"
        status, sched = common.run_limited(_schedule, (sched_name, coarse.graph, costs, args.streams or None),
                                           args.sched_timeout_s)
        if status != "ok":
            failed.append({**base, "mode": mode, "scheduler": sched_name,
                           "error": "scheduling timed out" if status == "timeout" else sched})
            continue
        extra = {"scheduler": sched_name, "streams": sched.streams_used, "scheduling_time_s": sched.scheduling_time_s,
                 "predicted_ms": sched.predicted_ms, "ops": len(coarse.graph), "fuse": "inductor"}
        measure(mode, lambda s=sched, e=extra: _opweave(coarse, s, inputs, e, fuse="inductor"), extra)
    return failed


def _schedule(name, graph, costs, streams):
    from opweave import schedulers

    return schedulers.run(name, graph, costs, streams=streams)


def _opweave(captured, sched, inputs, extra: dict, fuse: str | None = None):
    import time

    from opweave.backends.cuda import CudaBackend
    from opweave.plan.lower import lower
    from opweave.plan.validate import validate

    plan = lower(captured.graph, sched)
    validate(captured.graph, plan, sched)
    extra["syncs"] = plan.syncs
    if fuse is None:
        return CudaBackend(captured, plan, inputs, mode="graph")
    from opweave.backends.segments import fuse_segments

    start = time.perf_counter()
    segmented, segment_plan = fuse_segments(captured, plan, fuse)
    backend = CudaBackend(segmented, segment_plan, inputs, mode="graph")  # its warm-up runs compile the segments
    extra.update(build_s=time.perf_counter() - start, **{f"fuse_{k}": v for k, v in segmented.stats.items()})
    return backend


def _compiled(model, inputs):
    import torch

    torch._dynamo.reset()
    fn = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # compile and record its CUDA graphs before timing
            fn(*inputs)
    return fn


def plain_cuda_graph(model, inputs, warmup: int = 3):
    """The whole model recorded into one CUDA graph on one stream: static inputs copied in, outputs cloned."""
    import torch
    from torch.utils import _pytree as pytree

    static_inputs = tuple(x.clone() for x in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warmup):
            model(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_output = model(*static_inputs)

    def run(*args):
        for static, x in zip(static_inputs, args, strict=True):
            static.copy_(x)
        graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, static_output)

    return run


# ---- timing ----------------------------------------------------------------------------------------------------------


def time_mode(build, inputs, reference, dtype: str, args) -> dict:
    """Build a mode, check its output against eager, time it; every figure or the error."""
    import torch

    from opweave.bench import max_abs_diff
    from opweave.costs import timing

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn = None
    try:
        fn = build()
        with torch.no_grad():
            out = fn(*inputs)
            torch.cuda.synchronize()
            diff = max_abs_diff(reference, out)
            scale = max(1.0, _max_abs(reference))
            times = timing.times_ms(functools.partial(fn, *inputs), runs=args.replays, warmup=args.warmup,
                                    device="cuda")
        peak = torch.cuda.max_memory_allocated()
        try:
            kernels = kernels_per_call(fn, inputs)
        except Exception:  # noqa: BLE001 - the count is extra information; the latency stands without it
            kernels = None
    except Exception as exc:  # noqa: BLE001 - one failing mode must not stop the benchmark
        return {"error": _line(exc)}
    finally:
        del fn
    quantiles = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p10_ms": quantiles[0], "p90_ms": quantiles[-1],
            "kernels_per_call": kernels,
            "replays": len(times), "max_abs_diff": diff, "ok": diff <= TOLERANCE[dtype] * scale,
            "peak_memory_mb": (peak - baseline) / 2**20, "baseline_memory_mb": baseline / 2**20}


def kernels_per_call(fn, inputs, calls: int = 5) -> float:
    """CUDA kernels per call of ``fn`` (those of a CUDA graph replay included), from a ``torch.profiler`` trace."""
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return sum(isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "kernel" for e in events) / calls


def _max_abs(value) -> float:
    import torch
    from torch.utils import _pytree as pytree

    return max((float(t.detach().abs().max()) for t in pytree.tree_leaves(value)
                if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point()), default=1.0)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def speedup_table(name: str, batch: int, dtype: str, rows: list[dict], common):
    graph_ms = next((r.get("median_ms") for r in rows if r["mode"] == "cuda-graph"), None)
    compile_ms = next((r.get("median_ms") for r in rows if r["mode"] == "torch.compile"), None)

    def ratio(base, ms):
        return f"{base / ms:.2f}x" if base and ms else "-"

    cells = []
    for r in rows:
        ms = r.get("median_ms")
        if ms is None:
            cells.append([r["mode"], "-", "-", "-", "-", "-", "-", "-", r.get("error", "")[:60]])
            continue
        cells.append([r["mode"], f"{ms:.3f}", ratio(graph_ms, ms), ratio(compile_ms, ms),
                      "" if r.get("kernels_per_call") is None else f"{r['kernels_per_call']:.0f}",
                      "" if r.get("streams") is None else str(r["streams"]),
                      "" if r.get("syncs") is None else str(r["syncs"]), f"{r['peak_memory_mb']:.0f}",
                      "ok" if r["ok"] else f"WRONG ({r['max_abs_diff']:.1e})"])
    return common.table(f"{name}, batch {batch}, {dtype}", ["mode", "median ms", "vs CUDA graph", "vs torch.compile",
                                                            "kernels/call", "streams", "syncs", "peak MB", "output"],
                        cells)


if __name__ == "__main__":
    sys.exit(main())
