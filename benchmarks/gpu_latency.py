"""Inference latency on a real GPU: eager, a sequential CUDA Graph, torch.compile and opweave with every scheduler.

    .venv/bin/python benchmarks/gpu_latency.py [--quick] [--models a,b] [--schedulers x,y] [--batch-sizes 1,8]
                                               [--dtypes fp32,fp16] [--replays 200] [--streams 8]
                                               [--fuse-schedulers x,y] [--out DIR]

For each model (the zoo, plus torchvision's googlenet and inception_v3 where torchvision is installed), batch size
and dtype, every mode below is built, checked against eager and timed the same way:

* ``eager`` — ``model(*inputs)``;
* ``cuda-graph`` — the whole model captured into one ``torch.cuda.CUDAGraph`` on one stream (static inputs copied
  in, outputs cloned): the sequential CUDA Graph every speedup is measured against;
* ``torch.compile`` — ``torch.compile(model, mode="reduce-overhead")`` (inductor + CUDA graphs), outputs cloned
  like every other mode's (its CUDA graphs' outputs are overwritten by the next replay);
* ``opweave <scheduler>`` — the model captured once, profiled on this GPU (:func:`opweave.costs.profile.profile_model`;
  if profiling fails, the roofline estimate, recorded as the row's ``costs``), each scheduler run on those costs with
  at most ``--streams`` streams (default 8, the GPU's hardware queues), the plan lowered, validated and recorded by
  the CUDA backend into a CUDA graph (static inputs copied in, outputs cloned);
* ``opweave <scheduler>+inductor-graph`` — ``graph="inductor"``: the captured graph regrouped into the kernels
  Inductor fuses in the whole model (:mod:`opweave.backends.inductorgraph`), costed by the fitted device, scheduled,
  every segment compiled by Inductor (``--inductor-graph``, default on, off with ``--quick``), for the schedulers of
  ``--fuse-schedulers``;
* ``opweave <scheduler>+inductor`` — the captured graph coarsened (:func:`opweave.capture.coarsen`), profiled (or
  estimated) on its own, scheduled, lowered and validated the same way, every stream segment compiled by
  TorchInductor (:mod:`opweave.backends.segments`) and the whole plan recorded by the CUDA backend into a CUDA graph,
  for the schedulers of ``--fuse-schedulers`` (default: every one measured; ``--quick``: lios and opara, since each
  scheduler cuts its own segments and every segment is compiled anew).

**Checked** on two inputs: the example (which the warm-ups computed) and a second, fresh random input of the same
shapes and dtypes (:func:`fresh_inputs`: floats drawn with the example's mean and spread, integers — token ids,
embedding indices — drawn within the example's range, so they stay valid), each against eager on that input; a
mode passes when both outputs are right (:func:`opweave.outputs.compare`: fp32 within 1e-3 of the output's scale,
fp16 within 1e-2, scale = max(1, max |eager output|); or no more than 3 times as far from the model run in float64
(:func:`opweave.outputs.exact_outputs`) as eager is: folded BatchNorm, TF32 convolutions and fused kernels round
differently from eager).

**Timing** (the device METHOD): CUDA events around the whole call — input copy and output clone included — on the
current stream, a synchronize after each call, ``--warmup`` calls first, the median (and 10th/90th percentiles) of
``--replays`` calls. Peak memory: ``torch.cuda.max_memory_allocated`` from building the mode to the end of its
timing, minus what was allocated before (weights and inputs); beside it ``held_memory_mb`` (allocated once built),
``run_peak_memory_mb`` (the peak of the checks and timed calls alone, what serving holds) and ``left_memory_mb``
(still allocated once the mode was dropped and collected: a mode that leaks makes the next one's figures wrong);
and for opweave's modes ``weight_copies_mb``, the parameters and buffers the built mode holds that the model does not
(:func:`weight_copies_mb`: coarsening folds each BatchNorm into a copy of its convolution's weights), which the
held and peak figures include and the CUDA Graph's and torch.compile's do not (they read the model's own).
Each mode is freed before the next. Beside the
latency, ``kernels/call``: the CUDA kernels one call runs (a CUDA graph replay's included), counted in a
``torch.profiler`` trace of a few calls after the timing.

Writes ``DIR/<device>-<date>.json`` (device name, torch version, date, settings, every figure, and per model, batch
and dtype a summary: the best unfused scheduler and the best ``+inductor`` one, their speed-ups over the sequential
CUDA Graph and over torch.compile, their peak memory against the CUDA Graph's) and prints a table per configuration.
The JSON is written again after every mode, so a run stopped by a time limit keeps every mode it measured.
Without CUDA it exits with status 2 and one line on stderr. ``--quick`` (squeezenet and googlenet, batch 1, fp32)
is meant to fit within 10 minutes on an H100. The parts that need no GPU (fresh inputs, the summary, the table, the
JSON) are tested on the CPU (tests/test_cuda_cpu_paths.py; the check in tests/test_outputs.py).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import re
import statistics
import sys
import time
from pathlib import Path

from opweave.errors import first_line

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_MODELS = ("squeezenet", "googlenet")
QUICK_FUSE_SCHEDULERS = ("lios", "opara")
TORCHVISION = ("torchvision:googlenet", "torchvision:inception_v3")
DTYPES = {"fp32": "float32", "fp16": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}, batch 1, fp32")
    p.add_argument("--models", help="comma list of zoo names (torchvision:<name> too); default: zoo + torchvision")
    p.add_argument("--schedulers", help="comma list of schedulers (default: all)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8; --quick: 1)")
    p.add_argument("--dtypes", default=None, help="comma list of fp32, fp16 (default both; --quick: fp32)")
    p.add_argument("--configs", help="comma list of model:batch:dtype to measure instead of every model at every "
                                      "batch size and dtype")
    p.add_argument("--replays", type=int, default=200, help="timed calls per mode (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls before timing (default %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="stream cap for every scheduler; 0 = none "
                                                          "(default %(default)s, the GPU's hardware queues)")
    p.add_argument("--profile-repeats", type=int, default=20, help="runs per op when profiling (default %(default)s)")
    p.add_argument("--sched-timeout-s", type=float, default=120.0, help="give up on one schedule after this long")
    p.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile modes")
    p.add_argument("--torch-compile-modes", default="reduce-overhead",
                   help="comma list of torch.compile modes measured as peers (default %(default)s; e.g. "
                        "reduce-overhead,max-autotune)")
    p.add_argument("--opweave-modes", default="default,max-autotune",
                   help="comma list of what opweave.compile picks by itself: default (the calibrated simulator's "
                        "plan), max-autotune (candidates timed on the device); none: neither (default %(default)s)")
    p.add_argument("--fuse-schedulers", help="comma list of schedulers with a +inductor mode (default: those of "
                                             f"--schedulers; --quick: {','.join(QUICK_FUSE_SCHEDULERS)}); none: no "
                                             "+inductor mode")
    p.add_argument("--inductor-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="also an S+inductor-graph mode (graph='inductor') per fuse scheduler (default: on, off with "
                        "--quick)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON (default %(default)s)")
    args = p.parse_args(argv)
    if args.inductor_graph is None:
        args.inductor_graph = not args.quick
    if args.replays < 200 and not args.quick:
        p.error("--replays must be at least 200 (the median of fewer is not reported)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configurations(args, [], [], [])  # a malformed --configs is refused here too, before any GPU is needed
    import torch

    if not torch.cuda.is_available():
        reason = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"gpu_latency: CUDA is not available ({reason}, torch {torch.__version__}); this benchmark needs a GPU",
              file=sys.stderr)
        return 2

    import _common as common

    from opweave import schedulers
    from opweave.outputs import EXACT_FACTOR, TOLERANCE

    models = _split(args.models) or (list(QUICK_MODELS) if args.quick else _default_models())
    scheds = _split(args.schedulers) or schedulers.names()
    fuse_scheds = fuse_schedulers(args, scheds)
    unknown = [s for s in scheds + fuse_scheds if s not in schedulers.names()]
    if unknown:
        print(f"gpu_latency: unknown scheduler(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    batches = [int(b) for b in (_split(args.batch_sizes) or (["1"] if args.quick else ["1", "8"]))]
    dtypes = _split(args.dtypes) or (["fp32"] if args.quick else ["fp32", "fp16"])
    if any(d not in DTYPES for d in dtypes):
        print(f"gpu_latency: dtypes must be among {', '.join(DTYPES)}", file=sys.stderr)
        return 2

    configs = configurations(args, models, batches, dtypes)
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc)
    settings = {"models": list(dict.fromkeys(c[0] for c in configs)), "configs": [list(c) for c in configs],
                "schedulers": scheds, "fuse_schedulers": fuse_scheds, "batch_sizes": batches,
                "dtypes": dtypes,
                "replays": args.replays, "warmup": args.warmup, "streams": args.streams or None,
                "profile_repeats": args.profile_repeats,
                "torch_compile_modes": [] if args.no_torch_compile else _split(args.torch_compile_modes),
                "opweave_modes": [m for m in _split(args.opweave_modes) if m != "none"],
                "tolerance": {d: TOLERANCE[getattr(torch, t)] for d, t in DTYPES.items()},
                "timing": "CUDA events around the whole call, synchronize after each, median",
                "check": "every mode against eager on the example and on a fresh random input; right when within "
                         "tolerance of eager or at most exact_multiplier times eager's distance from float64",
                "exact_multiplier": EXACT_FACTOR}
    data = results_document(device, torch.__version__, torch.version.cuda, date, common.machine_info(), settings)
    path = result_path(args.out, device, date)
    for name, batch, dtype in configs:
        def partial(rows: list[dict]) -> None:  # after every mode: a time limit keeps what was measured
            common.write_json(path, {**data, "results": data["results"] + rows}, quiet=True)

        rows = bench_config(name, batch, dtype, scheds, fuse_scheds, args, common, partial, data["profiles"])
        add_configuration(data, rows)
        common.console.print(speedup_table(name, batch, dtype, rows, common))
        common.write_json(path, data)
    return 0


def configurations(args, models: list[str], batches: list[int], dtypes: list[str]) -> list[tuple[str, int, str]]:
    """The (model, batch, dtype) to measure, in order: ``--configs`` when given (``model:batch:dtype``, comma
    separated: the configurations a shorter run left out), else every model at every batch size and dtype."""
    if not args.configs:
        return [(m, b, d) for m in models for b in batches for d in dtypes]
    out = []
    for item in _split(args.configs):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in DTYPES:
            raise SystemExit(f"gpu_latency: --configs takes model:batch:dtype (dtype one of {', '.join(DTYPES)}), "
                             f"got {item!r}")
        out.append((parts[0], int(parts[1]), parts[2]))
    return out


def fuse_schedulers(args, scheds: list[str]) -> list[str]:
    """The schedulers that get a ``+inductor`` mode: ``--fuse-schedulers`` (``none``: no such mode), else those of
    ``scheds``, only lios and opara with ``--quick``."""
    if args.fuse_schedulers == "none":
        return []
    return _split(args.fuse_schedulers) or [s for s in scheds if s in QUICK_FUSE_SCHEDULERS or not args.quick]


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


def bench_config(name: str, batch: int, dtype: str, scheds: list[str], fuse_scheds: list[str], args, common,
                 partial=lambda rows: None, profiles: list | None = None) -> list[dict]:
    """Every mode of one model, batch size and dtype: one row each (figures or the error); ``partial(rows)`` after
    each mode. The per-op profile the schedulers planned on is appended to ``profiles`` (the results file carries
    it, so every row can be planned and simulated again on the costs it was planned with)."""
    import torch

    from opweave.capture import load
    from opweave.outputs import exact_outputs

    base = {"model": name, "batch_size": batch, "dtype": dtype}
    try:  # captured once, one op per fx node: every unfused scheduler plans this graph
        model, inputs, captured = load(name, batch_size=batch, device="cuda", dtype=getattr(torch, DTYPES[dtype]),
                                       coarsen=False)
    except Exception as exc:  # noqa: BLE001 - a missing optional package or a failed capture skips the model, recorded
        return [{**base, "mode": "build", "error": first_line(exc)}]
    fresh = fresh_inputs(inputs, seed=1)
    with torch.no_grad():
        reference, fresh_reference = model(*inputs), model(*fresh)
    exact, fresh_exact = exact_outputs(model, inputs, fresh)
    checks = ((inputs, reference, exact), (fresh, fresh_reference, fresh_exact))
    torch.cuda.synchronize()
    rows = []

    def measure(mode: str, build, extra: dict | None = None) -> None:
        """``build`` may add to ``extra`` (e.g. the plan's syncs) while it runs."""
        extra = {} if extra is None else extra
        start = time.perf_counter()
        timing = time_mode(build, inputs, checks, args)
        rows.append({**base, "mode": mode, **extra, **timing, "mode_s": round(time.perf_counter() - start, 1)})
        partial(rows)

    measure("eager", lambda: model)
    measure("cuda-graph", lambda: plain_cuda_graph(model, inputs))
    for mode in [] if args.no_torch_compile else _split(args.torch_compile_modes):
        measure("torch.compile" + ("" if mode == "reduce-overhead" else f" {mode}"),
                lambda m=mode: _compiled(model, inputs, m))
        torch._dynamo.reset()  # frees its CUDA graphs before the next modes are measured
    for mode in [m for m in _split(args.opweave_modes) if m != "none"]:
        chosen: dict = {"scheduler": None, "costs": "the fitted device (compile's default)"}
        measure(f"opweave {mode}", lambda m=mode, e=chosen: _chosen(model, inputs, m, e), chosen)
        torch._dynamo.reset()
    costs, source, profile = _costs(captured, inputs, args)
    if profiles is not None and profile is not None:
        profiles.append({**base, "granularity": "fx nodes", **profile.to_dict()})
    for sched_name in scheds:  # a probe, under a time limit: the pipeline then schedules again (deterministic)
        status, sched = common.run_limited(_schedule, (sched_name, captured.graph, costs, args.streams or None),
                                           args.sched_timeout_s)
        if status != "ok":
            rows.append({**base, "mode": f"opweave {sched_name}", "scheduler": sched_name, "costs": source,
                         "error": "scheduling timed out" if status == "timeout" else sched})
            continue
        extra = {"scheduler": sched_name, "costs": source, "ops": len(captured.graph)}
        measure(f"opweave {sched_name}", lambda s=sched_name, e=extra: _opweave(captured, inputs, costs, s, args, e),
                extra)
    if fuse_scheds:
        rows.extend(_fused_rows(captured, fuse_scheds, inputs, args, common, measure, base))
    return rows


def _costs(captured, inputs, args):
    """The costs the schedulers see and where they come from: measured on this GPU
    (:func:`opweave.costs.profile.profile_model`), else, if profiling fails, the roofline estimate of its preset."""
    import torch

    from opweave.costs.profile import profile_model
    from opweave.costs.roofline import estimate, preset_for_gpu

    try:
        profile = profile_model(captured, inputs, device="cuda", repeats=args.profile_repeats, warmup=3)
        return profile.costs(captured.graph), "profile", profile
    except Exception as exc:  # noqa: BLE001 - recorded; the schedulers still run, on estimated costs
        preset = preset_for_gpu(torch.cuda.get_device_name()) or "h100"
        return estimate(captured.graph, preset), f"roofline {preset} (profile failed: {first_line(exc)})", None


def _fused_rows(captured, scheds, inputs, args, common, measure, base) -> list[dict]:
    """The ``opweave <scheduler>+inductor`` modes (measured through ``measure``); rows only for what failed."""
    from opweave.capture import coarsen

    try:
        coarse = coarsen(captured)
    except Exception as exc:  # noqa: BLE001 - recorded, the other modes stand
        return [{**base, "mode": "opweave +inductor", "error": f"coarsening failed: {first_line(exc)}"}]
    costs, source, _ = _costs(coarse, inputs, args)
    failed = []
    for sched_name in scheds:
        mode = f"opweave {sched_name}+inductor"
        status, sched = common.run_limited(_schedule, (sched_name, coarse.graph, costs, args.streams or None),
                                           args.sched_timeout_s)
        if status != "ok":
            failed.append({**base, "mode": mode, "scheduler": sched_name, "costs": source, "fuse": "inductor",
                           "error": "scheduling timed out" if status == "timeout" else sched})
            continue
        extra = {"scheduler": sched_name, "costs": source, "ops": len(coarse.graph), "fuse": "inductor"}
        measure(mode, lambda s=sched_name, e=extra: _opweave(coarse, inputs, costs, s, args, e, compiler="inductor"),
                extra)
    for sched_name in scheds if args.inductor_graph else ():
        extra = {"scheduler": sched_name, "costs": "calibrated", "fuse": "inductor-graph"}
        measure(f"opweave {sched_name}+inductor-graph",
                lambda s=sched_name, e=extra: _inductor_graph(captured, inputs, s, args, e), extra)
    return failed


def _inductor_graph(captured, inputs, scheduler: str, args, extra: dict):
    """``graph="inductor"``: ``captured`` regrouped into Inductor's kernels of the whole model, planned by
    ``scheduler`` on the fitted device's costs, every segment compiled by Inductor; ``extra`` gets what was
    decided."""
    from opweave.pipeline import build, resolve

    options = resolve("cuda", scheduler=scheduler, streams=args.streams or None, graph="inductor")
    start = time.perf_counter()
    fast = build(captured, inputs, options)
    extra.update(ops=len(fast.graph), streams=fast.schedule.streams_used, predicted_ms=fast.schedule.predicted_ms,
                 syncs=fast.plan.syncs, build_s=time.perf_counter() - start,
                 **{f"fuse_{k}": v for k, v in fast.fused.stats.items()})
    return fast


def _chosen(model, inputs, mode: str, extra: dict):
    """``opweave.compile(model, inputs, device="cuda", mode=mode)``: what a user gets with no option (``default``:
    the coarsened graph, the plan the calibrated simulator picks, recorded into a CUDA Graph) or with
    ``max-autotune`` (candidates timed on this GPU); ``extra`` gets what it picked and why, and for
    ``max-autotune`` every candidate's median as it timed them (torch.compile, the plans, the first with its
    segments compiled by Inductor, and over Inductor's kernels: what the simulator's predictions over Inductor's
    kernels are checked against), and whether
    the choice came from its cache (``autotune_cached``: then the medians are those of the run that made it)."""
    import opweave

    fast = opweave.compile(model, inputs, device="cuda", mode=mode)
    extra.update(chosen_figures(fast), weight_copies_mb=weight_copies_mb(fast, model))
    return fast


def weight_copies_mb(fast, model) -> float | None:
    """MB of the parameters and buffers the compiled ``fast`` holds that ``model`` does not hold itself (each storage
    once): the copies it made of weights, such as the convolutions that coarsening folded a BatchNorm into. None
    where ``fast`` runs no captured module of its own (a search that kept torch.compile)."""
    from opweave.capture.runtime import module_tensors

    gm = getattr(getattr(getattr(fast, "backend", None), "captured", None), "gm", None)
    if gm is None:
        return None
    own = {t.untyped_storage().data_ptr() for t in module_tensors(model)}
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module_tensors(gm)}
    return sum(n for ptr, n in held.items() if ptr not in own) / 2**20


def chosen_figures(fast) -> dict:
    """What a mode that chose its own plan decided: scheduler, streams, syncs, ops, the choice's label and
    prediction, every candidate's median (``candidates_ms``) and its whole record (``candidates``: build seconds,
    median, and why a candidate was left out: the error that stopped its build or how its output differed), and
    whether the choice came from the cache."""
    choice = fast.choice or {}
    found = choice.get("candidates", {})
    return {"scheduler": fast.schedule.scheduler, "streams": fast.schedule.streams_used, "syncs": fast.plan.syncs,
            "ops": len(fast.graph), "choice": choice.get("label"), "predicted_ms": choice.get("predicted_ms"),
            "candidates_ms": {k: c["median_ms"] for k, c in found.items() if "median_ms" in c} or None,
            "candidates": found or None, "autotune_cached": choice.get("cached")}


def _schedule(name, graph, costs, streams):
    from opweave import schedulers

    return schedulers.run(name, graph, costs, streams=streams)


def _opweave(captured, inputs, costs, scheduler: str, args, extra: dict, compiler: str | None = None):
    """``captured`` built by opweave's pipeline (:func:`opweave.pipeline.build`, what ``opweave.compile`` runs) with
    ``scheduler`` on ``costs``, at the granularity it was captured at; ``extra`` gets what was decided, and the
    weights its build copied (a ``+inductor`` mode's coarsening folded its copies before the build: they are in its
    baseline, not in its figures)."""
    from opweave.pipeline import build, resolve

    options = resolve("cuda", scheduler=scheduler, streams=args.streams or None, costs=costs, coarsen=False,
                      compiler=compiler)
    start = time.perf_counter()
    fast = build(captured, inputs, options)
    extra.update(streams=fast.schedule.streams_used, scheduling_time_s=fast.schedule.scheduling_time_s,
                 predicted_ms=fast.schedule.predicted_ms, syncs=fast.plan.syncs,
                 weight_copies_mb=weight_copies_mb(fast, captured.gm))
    if fast.fused is not None:  # the backend's warm-up runs compiled the segments
        extra.update(build_s=time.perf_counter() - start, **{f"fuse_{k}": v for k, v in fast.fused.stats.items()})
    return fast


def _compiled(model, inputs, mode: str = "reduce-overhead"):
    import torch

    torch._dynamo.reset()
    fn = torch.compile(model, mode=mode)
    with torch.no_grad():
        for _ in range(3):  # compile and record its CUDA graphs before timing
            fn(*inputs)
    return lambda *args: _clone(fn(*args))  # its CUDA graphs' outputs are overwritten by the next replay


def plain_cuda_graph(model, inputs, warmup: int = 3):
    """The whole model recorded into one CUDA graph on one stream: static inputs copied in, outputs cloned."""
    import torch

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
        return _clone(static_output)

    return run


# ---- timing ----------------------------------------------------------------------------------------------------------


def time_mode(build, inputs, checks, args) -> dict:
    """Build a mode, check its output (:func:`opweave.outputs.compare`) on each ``(inputs, eager output, float64
    output)`` of ``checks``, time it on ``inputs``; every figure or the error."""
    import torch

    from opweave.costs import timing
    from opweave.outputs import compare

    gc.collect()
    clear_library_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn = None
    try:
        fn = build()
        torch.cuda.synchronize()
        held, build_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            results = [compare(reference, fn(*check_inputs), exact=exact) for check_inputs, reference, exact in checks]
            times = timing.times_ms(functools.partial(fn, *inputs), runs=args.replays, warmup=args.warmup,
                                    device="cuda")
        run_peak = torch.cuda.max_memory_allocated()
        try:
            kernels = kernels_per_call(fn, inputs)
        except Exception:  # noqa: BLE001 - the count is extra information; the latency stands without it
            kernels = None
    except Exception as exc:  # noqa: BLE001 - one failing mode must not stop the benchmark
        return {"error": first_line(exc)}
    finally:
        del fn
    gc.collect()
    torch.cuda.synchronize()
    clear_library_workspaces()
    left = torch.cuda.memory_allocated()
    quantiles = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p10_ms": quantiles[0], "p90_ms": quantiles[-1],
            "kernels_per_call": kernels,
            "replays": len(times), "max_abs_diff": max(r.max_diff for r in results),
            "fresh_input_max_abs_diff": results[-1].max_diff, "ok": all(r.ok for r in results),
            "peak_memory_mb": (max(build_peak, run_peak) - baseline) / 2**20,
            "held_memory_mb": (held - baseline) / 2**20, "run_peak_memory_mb": (run_peak - baseline) / 2**20,
            "left_memory_mb": (left - baseline) / 2**20, "baseline_memory_mb": baseline / 2**20}


def clear_library_workspaces() -> None:
    """Free the cuBLAS workspaces PyTorch caches per stream (about 33 MB each on an H200), as torch.compile's CUDA
    graph trees do before they record: without it a mode's memory figures count the workspaces an earlier mode left
    (every graph-recording mode left 66 MB once dropped, freed only when a later one recorded)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


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


# ---- the parts that need no GPU (tested on the CPU) -----------------------------------------------------------------


def fresh_inputs(inputs: tuple, seed: int) -> tuple:
    """Inputs of the same shapes, dtypes and devices as ``inputs`` with new random values: floating tensors drawn
    from a normal with the example's mean and standard deviation, integer tensors uniformly within the example's
    [min, max] (token ids and embedding indices stay valid), booleans at random; anything else as it is."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dtype == torch.bool:
            new = torch.randint(0, 2, x.shape, generator=generator).bool()
        elif x.is_floating_point() or x.is_complex():
            sample = x.detach().float()
            std = float(sample.std()) if sample.numel() > 1 else 1.0
            new = torch.randn(x.shape, generator=generator) * (std or 1.0) + (float(sample.mean()) if x.numel() else 0)
        else:
            low, high = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
            new = torch.randint(low, high + 1, x.shape, generator=generator)
        return new.to(dtype=x.dtype, device=x.device)

    return tuple(fresh(x) for x in inputs)


def _clone(value):
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def result_path(out: Path, device: str, date: datetime.datetime) -> Path:
    return out / f"{_slug(device)}-{date.strftime('%Y-%m-%d')}.json"


def results_document(device: str, torch_version: str, cuda: str | None, date: datetime.datetime, machine: dict,
                     settings: dict) -> dict:
    """The JSON document, before any configuration was measured."""
    return {"device": device, "torch": torch_version, "cuda": cuda, "date": date.isoformat(timespec="seconds"),
            "machine": machine, "settings": settings, "results": [], "summaries": [], "profiles": []}


def add_configuration(data: dict, rows: list[dict]) -> None:
    """Add one configuration's rows, and its summary when any mode was measured."""
    data["results"].extend(rows)
    if rows and any("median_ms" in r for r in rows):
        data["summaries"].append(summarize(rows))


def summarize(rows: list[dict]) -> dict:
    """Per configuration: the fastest unfused opweave scheduler whose output was right (``best_scheduler``,
    ``best_ms``, ``speedup_vs_cuda_graph``, ``speedup_vs_torch_compile``, ``peak_memory_vs_cuda_graph``: its peak
    memory over the CUDA Graph's) and the same figures of the fastest right ``+inductor`` mode, prefixed
    ``inductor_`` (None where a figure is missing). "torch.compile" is the fastest of its modes measured;
    ``best_mode`` the mode of the fastest right opweave row of any kind (its scheduler, default, max-autotune)."""
    first = rows[0]
    by_mode = {r["mode"]: r for r in rows if "median_ms" in r}
    graph = by_mode.get("cuda-graph")
    compiled = min((r for m, r in by_mode.items() if m.startswith("torch.compile") and r["ok"]),
                   key=lambda r: r["median_ms"], default=None)  # the fastest torch.compile mode measured

    def ratio(a, b):
        return a / b if a is not None and b else None

    def best_of(fused: bool) -> dict:
        right = [r for r in by_mode.values() if r["mode"].startswith("opweave ") and r["ok"] and ("fuse" in r) == fused]
        best = min(right, key=lambda r: r["median_ms"], default=None)
        return {"scheduler": best["scheduler"] if best else None, "ms": best["median_ms"] if best else None,
                "speedup_vs_cuda_graph": ratio(graph and graph["median_ms"], best and best["median_ms"]),
                "speedup_vs_torch_compile": ratio(compiled and compiled["median_ms"], best and best["median_ms"]),
                "peak_memory_vs_cuda_graph": ratio(best and best["peak_memory_mb"], graph and graph["peak_memory_mb"])}

    unfused = best_of(False)
    ours = [r for r in by_mode.values() if r["mode"].startswith("opweave ") and r["ok"]]
    best_any = min(ours, key=lambda r: r["median_ms"], default=None)
    return {"model": first["model"], "batch_size": first["batch_size"], "dtype": first["dtype"],
            "best_mode": best_any["mode"] if best_any else None,
            "best_mode_vs_torch_compile": ratio(compiled and compiled["median_ms"], best_any and best_any["median_ms"]),
            "best_scheduler": unfused.pop("scheduler"), "best_ms": unfused.pop("ms"), **unfused,
            **{f"inductor_{k}": v for k, v in best_of(True).items()},
            "cuda_graph_ms": graph["median_ms"] if graph else None,
            "torch_compile_ms": compiled["median_ms"] if compiled else None,
            "all_outputs_ok": all(r["ok"] for r in by_mode.values()),
            "failed_modes": sorted(r["mode"] for r in rows if "median_ms" not in r)}


def speedup_table(name: str, batch: int, dtype: str, rows: list[dict], common):
    graph_ms = next((r.get("median_ms") for r in rows if r["mode"] == "cuda-graph"), None)
    compile_ms = min((r["median_ms"] for r in rows if r["mode"].startswith("torch.compile") and r.get("ok")),
                     default=None)

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
    sources = sorted({r["costs"] for r in rows if r.get("costs")})
    return common.table(f"{name}, batch {batch}, {dtype}", ["mode", "median ms", "vs CUDA graph", "vs torch.compile",
                                                            "kernels/call", "streams", "syncs", "peak MB", "output"],
                        cells, caption=f"opweave schedules on costs from: {'; '.join(sources)}" if sources else None)


def markdown(data: dict) -> str:
    """The results of one run as Markdown, one table per configuration (every mode's median with its 10th-90th
    percentile spread, its speed-ups over the sequential CUDA Graph and torch.compile, kernels per call, streams,
    syncs, peak memory, whether its output was right): what docs/gpu.md shows, kept equal to the committed JSON by a
    test."""
    out = []
    configs = sorted({(r["model"], r["batch_size"], r["dtype"]) for r in data["results"]},
                     key=lambda c: (c[1], c[2], c[0]))
    for model, batch, dtype in configs:
        rows = [r for r in data["results"] if (r["model"], r["batch_size"], r["dtype"]) == (model, batch, dtype)]
        by_mode = {r["mode"]: r.get("median_ms") for r in rows}
        graph_ms, compile_ms = by_mode.get("cuda-graph"), by_mode.get("torch.compile")
        copies = any(r.get("weight_copies_mb") is not None for r in rows)  # results from before it was measured: none
        out += [f"**{model}**, batch {batch}, {dtype}", "",
                "| mode | median ms (p10-p90) | vs CUDA Graph | vs torch.compile | kernels/call | streams | syncs | "
                "peak MB | " + ("of it weight copies MB | " if copies else "") + "output |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + ("---: | " if copies else "") + "--- |"]
        for r in rows:
            if r.get("median_ms") is None:
                out.append(f"| {r['mode']} | - | - | - | - | - | - | - | " + ("- | " if copies else "")
                           + f"{r.get('error', '')[:80]} |")
                continue
            ms = r["median_ms"]
            cells = [r["mode"], f"{ms:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f})",
                     f"{graph_ms / ms:.2f}x" if graph_ms else "-", f"{compile_ms / ms:.2f}x" if compile_ms else "-",
                     "" if r.get("kernels_per_call") is None else f"{r['kernels_per_call']:.0f}",
                     "" if r.get("streams") is None else str(r["streams"]),
                     "" if r.get("syncs") is None else str(r["syncs"]), f"{r['peak_memory_mb']:.1f}",
                     *([] if not copies else [""] if r.get("weight_copies_mb") is None else
                       [f"{r['weight_copies_mb']:.1f}"]),
                     "ok" if r["ok"] else "WRONG"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def summary_markdown(data: dict) -> str:
    """The summaries of one run as one Markdown table: per configuration the best unfused plan, its median and its
    speed-ups over the sequential CUDA Graph and torch.compile, and its peak memory over the CUDA Graph's: what the
    README and docs/gpu.md show, kept equal to the committed JSON by a test."""
    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    out = ["| model | batch, dtype | best plan | median ms | vs CUDA Graph | vs torch.compile | "
           "peak memory vs CUDA Graph |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for s in data["summaries"]:
        if s.get("best_ms") is None:
            continue
        out.append(f"| {s['model']} | {s['batch_size']}, {s['dtype']} | {s['best_scheduler']} | {s['best_ms']:.3f} | "
                   f"{times(s['speedup_vs_cuda_graph'])} | {times(s['speedup_vs_torch_compile'])} | "
                   f"{times(s['peak_memory_vs_cuda_graph'])} |")
    return "\n".join(out) + "\n"


def chosen_markdown(datas: list[dict]) -> str:
    """What a user gets, as one Markdown table over the runs ``datas``: per configuration and mode where opweave chose
    its own plan (``opweave default``, ``opweave max-autotune``), the plan, its median and its speed-ups over the
    sequential CUDA Graph and torch.compile of the same run, and its peak memory over the CUDA Graph's (from the
    start of its build: a build that times candidates holds them while it does). Rows come from the results, so a
    configuration a time limit cut short still shows the modes it measured."""
    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    out = ["| model | batch, dtype | mode | plan | median ms (p10-p90) | vs CUDA Graph | vs torch.compile | "
           "peak memory vs CUDA Graph |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for data in datas:
        configs = list(dict.fromkeys((r["model"], r["batch_size"], r["dtype"]) for r in data["results"]))
        for model, batch, dtype in configs:
            rows = {r["mode"]: r for r in data["results"] if (r["model"], r["batch_size"], r["dtype"]) == (
                model, batch, dtype) and r.get("median_ms") is not None}
            graph, compiled = rows.get("cuda-graph"), rows.get("torch.compile")
            for mode in ("opweave default", "opweave max-autotune"):
                r = rows.get(mode)
                if r is None:
                    continue
                ms, memory = r["median_ms"], graph and graph["peak_memory_mb"]
                out.append(f"| {model} | {batch}, {dtype} | {mode.removeprefix('opweave ')} | "
                           f"{r.get('choice') or '-'} | {ms:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f}) | "
                           f"{times(graph and graph['median_ms'] / ms)} | "
                           f"{times(compiled and compiled['median_ms'] / ms)} | "
                           f"{times(memory and r['peak_memory_mb'] / memory)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
