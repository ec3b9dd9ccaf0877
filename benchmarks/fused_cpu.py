"""Compile time and latency on the CPU: eager, torch.compile, and opweave with and without ``fuse="inductor"``.

    .venv/bin/python benchmarks/fused_cpu.py [--quick] [--models a,b|all] [--schedulers x,y] [--streams 2]
                                             [--runs 30] [--rounds 6] [--warm-cache] [--check-only] [--out DIR]

For each zoo model (batch 1, the zoo's default input size; ``bert_base`` at ``--bert-layers`` layers), the modes:

* ``eager`` — ``model(*inputs)``;
* ``torch.compile`` — ``torch.compile(model)`` (TorchInductor's C++ backend, default mode); its compile time is
  the first call's wall time minus one eager call;
* ``opweave <scheduler>`` — ``opweave.compile(..., coarsen=True)``: the coarsened graph, one op at a time on the
  CPU backend's lane threads (compile time = capture + coarsening + scheduling + lowering + validation);
* ``opweave <scheduler>+inductor`` — the same plan with every stream segment compiled by TorchInductor
  (``fuse="inductor"``; compile time = all of ``opweave.compile``, of which ``inductor_s`` inside Inductor).

Two phases, each in spawned child processes (nothing compiled in one helps another):

1. **Build and check**, one process per mode with its own empty TorchInductor cache directory, so compile times are
   cold-cache times (the first compile on a machine; ``--warm-cache``: every mode of a model shares one directory,
   filled by one untimed build of each mode first). The output is checked against eager
   (:func:`opweave.outputs.compare`): max |difference|, ``ok`` when within :data:`TOLERANCE` (1e-4, issue 14's
   acceptance: stricter than float32's 1e-3) of the output's scale, max(1, max |eager output|).
2. **Latency**, one process per model that builds every mode again (untimed) and times them **interleaved**: calls
   round-robin over the modes for ``--warmup-s`` seconds (at least ``--warmup`` calls each), then ``--rounds``
   rounds in which each mode runs ``--runs / --rounds`` timed calls (perf_counter around the whole call under
   ``torch.inference_mode``, :func:`opweave.costs.timing.times_ms`); per mode the median and the minimum of its
   calls. Why interleaved and not one process per mode: on the shared 2-core machine this was written on, other
   work moved a process's timings by 10-fold and more for tens of seconds (a squeezenet eager median of 323 ms in one
   process, 50 ms in another a few minutes later), so modes timed in separate processes at separate times were not
   comparable; interleaving exposes every mode to the same load. The minimum is the figure least moved by it.

``--check-only`` runs phase 1 alone, with one Inductor cache shared by the modes of a model (compile times are then
not cold-cache times), and writes ``DIR/fused_cpu_check.json``: the equality check of issue 14's acceptance for
models whose segments take too long to compile three times over for the latency phase (nasnet_a_mobile, randwire,
googlenet, inception_v3 on a 2-core machine).

Writes ``DIR/fused_cpu.json`` (machine, settings, one row per model and mode, the load average when each row was
written) and prints one table per model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _common as common

DEFAULT_MODELS = ("squeezenet", "resnet50", "bert_base")
QUICK_MODELS = ("deepfm",)
DEFAULT_SCHEDULERS = ("sequential", "lios", "opara")
TOLERANCE = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}, few runs")
    p.add_argument("--models", help=f"comma list of zoo models or all (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--schedulers", help=f"comma list (default {','.join(DEFAULT_SCHEDULERS)})")
    p.add_argument("--streams", type=int, default=2, help="stream (lane) cap per scheduler (default %(default)s)")
    p.add_argument("--bert-layers", type=int, default=2, help="layers of bert_base (default %(default)s)")
    p.add_argument("--runs", type=int, default=30, help="timed calls per mode (default %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds the runs are split into "
                                                        "(default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per mode first, at least (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="untimed round-robin calls for at least this long first (default %(default)s)")
    p.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile mode")
    p.add_argument("--warm-cache", action="store_true", help="one shared, pre-filled Inductor cache for every mode")
    p.add_argument("--check-only", action="store_true",
                   help="build and check every mode, no latency phase; writes fused_cpu_check.json")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on one child process after this long")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the JSON (default %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.rounds, args.warmup, args.warmup_s = min(args.runs, 4), 2, min(args.warmup, 1), 0.0
    args.rounds = max(1, min(args.rounds, args.runs))
    return args


def model_kwargs(name: str, args: argparse.Namespace) -> dict:
    return {"num_layers": args.bert_layers} if name == "bert_base" else {}


def build(model, inputs, mode: str, args: argparse.Namespace) -> tuple[Callable, dict]:
    """The callable of ``mode`` and what building it recorded (compile time, ops, streams, segments)."""
    import torch

    import opweave
    from opweave.evaluate.bench import median_ms

    info: dict = {}
    start = time.perf_counter()
    if mode == "eager":
        return model, info
    if mode == "torch.compile":
        compiled = torch.compile(model)
        eager_ms = median_ms(model, inputs, runs=3, warmup=1)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*inputs)
        info["compile_s"] = time.perf_counter() - start - eager_ms / 1e3
        return compiled, info
    scheduler, _, fuse = mode.removeprefix("opweave ").partition("+")
    fast = opweave.compile(model, inputs, scheduler=scheduler, streams=args.streams, fuse=fuse or None)
    info.update(compile_s=time.perf_counter() - start, ops=len(fast.graph), streams=fast.schedule.streams_used,
                syncs=fast.plan.syncs)
    if fast.fused is not None:
        stats = fast.fused.stats
        info.update(segments=stats["segments"], inductor_s=stats["compile_s"], fallbacks=stats["fallbacks"])
    return fast, info


def build_and_check(name: str, mode: str, args: argparse.Namespace) -> dict:
    """Phase 1 (in a child process): build ``mode`` for model ``name`` and check its output against eager."""
    import torch

    from opweave import zoo
    from opweave.outputs import compare

    model, inputs = zoo.create(name, **model_kwargs(name, args))
    with torch.inference_mode():
        reference = model(*inputs)
    fn, info = build(model, inputs, mode, args)
    with torch.inference_mode():
        check = compare(reference, fn(*inputs), tolerance=TOLERANCE)
    return {"model": name, "mode": mode, "threads": torch.get_num_threads(), **info, "max_abs_diff": check.max_diff,
            "ok": check.ok}


def interleaved_latency(name: str, modes: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Phase 2 (in a child process): every mode of model ``name`` built, then timed interleaved (module docstring).
    Per mode: ``median_ms``, ``min_ms``, ``warmup_calls``."""
    import statistics

    import torch

    from opweave import zoo
    from opweave.costs import timing

    model, inputs = zoo.create(name, **model_kwargs(name, args))
    fns = {mode: build(model, inputs, mode, args)[0] for mode in modes}
    calls = dict.fromkeys(modes, 0)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    per_round = [args.runs // args.rounds + (i < args.runs % args.rounds) for i in range(args.rounds)]
    with torch.inference_mode():
        deadline = time.perf_counter() + args.warmup_s
        while min(calls.values()) < args.warmup or time.perf_counter() < deadline:
            for mode, fn in fns.items():
                fn(*inputs)
                calls[mode] += 1
        for runs in per_round:
            for mode, fn in fns.items():
                times[mode] += timing.times_ms(lambda fn=fn: fn(*inputs), runs=runs, warmup=0)
    return {mode: {"median_ms": statistics.median(ts), "min_ms": min(ts), "warmup_calls": calls[mode]}
            for mode, ts in times.items()}


def _child(conn, fn: Callable, fn_args: tuple, cache_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read when torch._inductor's config is imported
    try:
        conn.send(("ok", fn(*fn_args)))
    except BaseException as exc:  # reported as an error, the other modes stand
        conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
    finally:
        conn.close()


def in_child(fn: Callable, fn_args: tuple, cache_dir: str, timeout_s: float) -> tuple[str, object]:
    """``fn(*fn_args)`` in a spawned child with ``cache_dir`` as its Inductor cache: ``("ok", result)`` or
    ``("error", message)``."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, fn_args, cache_dir), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            return "error", f"timed out after {timeout_s:.0f} s"
        return receive.recv()
    except EOFError:
        return "error", f"child died with exit code {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()


def measure_model(name: str, modes: list[str], args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Both phases for one model: one row per mode."""
    shared = str(tmp / f"{name}-shared")
    if args.warm_cache:  # fill the shared cache once with every compiling mode, untimed
        for mode in modes[1:]:
            in_child(build_and_check, (name, mode, args), shared, args.timeout_s)
    rows = []
    for i, mode in enumerate(modes):
        common.console.print(f"{name}: build and check {mode}", style="dim")
        cache = shared if args.warm_cache or args.check_only else str(tmp / f"{name}-{i}")
        status, result = in_child(build_and_check, (name, mode, args), cache, args.timeout_s)
        rows.append(result if status == "ok" else {"model": name, "mode": mode, "error": result})
    if args.check_only:
        return [{**row, "load_average_1m": round(os.getloadavg()[0], 2)} for row in rows]
    built = [r["mode"] for r in rows if "error" not in r]
    common.console.print(f"{name}: latency of {len(built)} modes, interleaved", style="dim")
    status, latency = in_child(interleaved_latency, (name, built, args), str(tmp / f"{name}-latency"),
                               args.timeout_s)
    eager = latency.get("eager", {}).get("median_ms") if status == "ok" else None
    for row in rows:
        if row["mode"] not in built:
            continue
        if status != "ok":
            row["error"] = f"latency: {latency}"
            continue
        row.update(latency[row["mode"]])
        if eager:
            row["speedup_vs_eager"] = eager / row["median_ms"]
    load = round(os.getloadavg()[0], 2)
    return [{**row, "load_average_1m": load} for row in rows]


def inductor_cache(args: argparse.Namespace) -> str:
    """How the modes of a model share Inductor's cache (module docstring)."""
    return "shared per model" if args.check_only else "warm" if args.warm_cache else "cold"


def table(name: str, rows: list[dict], args: argparse.Namespace):
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["mode"], "", "", "", "", "", "", r["error"][:60]])
            continue
        timed = "median_ms" in r
        cells.append([r["mode"], f"{r['compile_s']:.1f}" if "compile_s" in r else "",
                      f"{r['inductor_s']:.1f}" if "inductor_s" in r else "", str(r.get("segments", "")),
                      f"{r['median_ms']:.2f}" if timed else "", f"{r['min_ms']:.2f}" if timed else "",
                      f"{r.get('speedup_vs_eager', 0):.2f}x" if timed else "",
                      f"{r['max_abs_diff']:.1e}" + ("" if r["ok"] else " WRONG")])
    cache = inductor_cache(args)
    timing = ("no latency phase (--check-only)" if args.check_only else
              f"{args.runs} calls per mode in {args.rounds} interleaved rounds; vs eager: of the medians")
    return common.table(
        f"{name} batch 1 on the CPU ({cache} Inductor cache; {timing})",
        ["mode", "compile s", "in Inductor s", "segments", "median ms", "min ms", "vs eager", "max |diff|"], cells)


def write(args: argparse.Namespace, models: list[str], scheds: list[str], rows: list[dict],
          watch: common.Stopwatch) -> None:
    common.write_json(args.out / ("fused_cpu_check.json" if args.check_only else "fused_cpu.json"), {
        "machine": common.machine_info(),
        "settings": {"models": models, "schedulers": scheds, "streams": args.streams, "bert_layers": args.bert_layers,
                     "runs": args.runs, "rounds": args.rounds, "warmup": args.warmup, "warmup_s": args.warmup_s,
                     "inductor_cache": inductor_cache(args),
                     "batch_size": 1, "tolerance": TOLERANCE,
                     "timing": None if args.check_only else "perf_counter per call, modes interleaved in one process"},
        "rows": rows,
        "elapsed_s": watch.elapsed_s,
    })


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from opweave import schedulers, zoo

    models = (zoo.names() if args.models == "all" else args.models.split(",") if args.models
              else list(QUICK_MODELS if args.quick else DEFAULT_MODELS))
    scheds = args.schedulers.split(",") if args.schedulers else list(DEFAULT_SCHEDULERS)
    bad = [m for m in models if m not in zoo.names()] + [s for s in scheds if s not in schedulers.names()]
    if bad:
        raise SystemExit(f"unknown model or scheduler {bad[0]!r}")
    modes = ["eager", *([] if args.no_torch_compile else ["torch.compile"]),
             *(f"opweave {s}{fuse}" for s in scheds for fuse in ("", "+inductor"))]
    watch = common.Stopwatch()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fused_cpu_inductor_") as tmp:
        for name in models:
            model_rows = measure_model(name, modes, args, Path(tmp))
            common.console.print(table(name, model_rows, args))
            rows += model_rows
            write(args, models, scheds, rows, watch)  # after every model: a long run stopped early keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
