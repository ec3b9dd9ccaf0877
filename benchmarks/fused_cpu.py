"""Compile time and latency on the CPU: eager, torch.compile, and opweave with and without ``fuse="inductor"``.

    .venv/bin/python benchmarks/fused_cpu.py [--quick] [--models a,b|all] [--schedulers x,y] [--streams 2]
                                             [--runs 30] [--warm-cache] [--out DIR]

For each zoo model (batch 1, the zoo's default input size; ``bert_base`` at ``--bert-layers`` layers) every mode
runs in a fresh child process (spawned, so nothing a mode compiled helps the next), is checked against eager (max
|difference| of the outputs; ``ok`` when within :data:`TOLERANCE` of the output's scale, max(1, max |eager
output|): the fp32 allclose of issue 14's acceptance) and is timed the same way (perf_counter around the whole
call under ``torch.inference_mode``, :func:`opweave.costs.timing.times_ms`; the median and the minimum of ``--runs``
calls, after at least ``--warmup`` calls and ``--warmup-s`` seconds of calls):

* ``eager`` — ``model(*inputs)``;
* ``torch.compile`` — ``torch.compile(model)`` (TorchInductor's C++ backend, default mode); its compile time is
  the first call's wall time minus one eager call;
* ``opweave <scheduler>`` — ``opweave.compile(..., coarsen=True)``: the coarsened graph, one op at a time on the
  CPU backend's lane threads (compile time = capture + coarsening + scheduling + lowering + validation);
* ``opweave <scheduler>+inductor`` — the same plan with every stream segment compiled by TorchInductor
  (``fuse="inductor"``; compile time = all of ``opweave.compile``, of which ``inductor_s`` inside Inductor).

Each child gets its own empty TorchInductor cache directory, so the compile times are cold-cache times (the
first compile on a machine); ``--warm-cache`` gives every child the same directory, compiled once beforehand, for
the times of a machine that compiled the same graphs before. The machine's load is recorded: on a shared 2-core
machine every figure moves with it, so compare rows of one run only. Why a warm-up in seconds: on the shared 2-core
machine this was written on, a fresh process's first calls were sometimes 10 to 30 times slower than later ones for
some 20 seconds (cause not found: not Inductor, not opweave's threads), which a few warm-up calls did not cover and
which favoured the modes that spend that time compiling; the minimum is the figure least moved by other load.

Writes ``DIR/fused_cpu.json`` (machine, settings, one row per model and mode) and prints one table per model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
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
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first, at least (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="untimed calls for at least this long first (default %(default)s)")
    p.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile mode")
    p.add_argument("--warm-cache", action="store_true", help="one shared, pre-filled Inductor cache for every mode")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on one mode after this long")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the JSON (default %(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.warmup, args.warmup_s = min(args.runs, 5), min(args.warmup, 1), 0.0
    return args


def model_kwargs(name: str, args: argparse.Namespace) -> dict:
    return {"num_layers": args.bert_layers} if name == "bert_base" else {}


def measure(name: str, mode: str, args: argparse.Namespace) -> dict:
    """Build ``mode`` for model ``name``, check it against eager and time it (runs in a child process)."""
    import statistics

    import torch
    from torch.utils import _pytree as pytree

    import opweave
    from opweave import zoo
    from opweave.bench import max_abs_diff, median_ms
    from opweave.costs import timing

    model, inputs = zoo.create(name, **model_kwargs(name, args))
    with torch.inference_mode():
        reference = model(*inputs)
    row: dict = {"model": name, "mode": mode, "threads": torch.get_num_threads()}
    start = time.perf_counter()
    if mode == "eager":
        fn = model
    elif mode == "torch.compile":
        compiled = torch.compile(model)
        eager_ms = median_ms(model, inputs, runs=3, warmup=1)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*inputs)
        row["compile_s"] = time.perf_counter() - start - eager_ms / 1e3
        fn = compiled
    else:
        scheduler, _, fuse = mode.removeprefix("opweave ").partition("+")
        fast = opweave.compile(model, inputs, scheduler=scheduler, streams=args.streams, fuse=fuse or None)
        row.update(compile_s=time.perf_counter() - start, ops=len(fast.graph), streams=fast.schedule.streams_used,
                   syncs=fast.plan.syncs)
        if fast.fused is not None:
            stats = fast.fused.stats
            row.update(segments=stats["segments"], inductor_s=stats["compile_s"], fallbacks=stats["fallbacks"])
        fn = fast
    with torch.inference_mode():
        row["max_abs_diff"] = max_abs_diff(reference, fn(*inputs))
    scale = max((t.abs().max().item() for t in pytree.tree_leaves(reference)
                 if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point()), default=1.0)
    row["ok"] = row["max_abs_diff"] <= TOLERANCE * max(1.0, scale)
    with torch.inference_mode():
        deadline, calls = time.perf_counter() + args.warmup_s, 0
        while calls < args.warmup or time.perf_counter() < deadline:
            fn(*inputs)
            calls += 1
        times = timing.times_ms(lambda: fn(*inputs), runs=args.runs, warmup=0)
    row.update(warmup_calls=calls, median_ms=statistics.median(times), min_ms=min(times))
    return row


def _child(conn, name: str, mode: str, args: argparse.Namespace, cache_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read when torch._inductor's config is imported
    try:
        conn.send(("ok", measure(name, mode, args)))
    except BaseException as exc:  # reported as the row's error, the other modes stand
        conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
    finally:
        conn.close()


def run_mode(name: str, mode: str, args: argparse.Namespace, cache_dir: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, name, mode, args, cache_dir), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(args.timeout_s):
            return {"model": name, "mode": mode, "error": f"timed out after {args.timeout_s:.0f} s"}
        status, result = receive.recv()
    except EOFError:
        return {"model": name, "mode": mode, "error": f"child died with exit code {child.exitcode}"}
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    return result if status == "ok" else {"model": name, "mode": mode, "error": result}


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
            shared = str(Path(tmp) / f"{name}-shared")
            if args.warm_cache:  # fill the shared cache once with every compiling mode, untimed
                fill = argparse.Namespace(**{**vars(args), "runs": 1, "warmup": 0, "warmup_s": 0.0})
                for mode in modes[1:]:
                    run_mode(name, mode, fill, shared)
            for i, mode in enumerate(modes):
                common.console.print(f"{name}: {mode}", style="dim")
                cache = shared if args.warm_cache else str(Path(tmp) / f"{name}-{i}")
                rows.append({**run_mode(name, mode, args, cache), "load_average_1m": round(os.getloadavg()[0], 2)})
    for row in rows:
        eager = next((r for r in rows if r["model"] == row["model"] and r["mode"] == "eager" and "median_ms" in r),
                     None)
        if eager and "median_ms" in row:
            row["speedup_vs_eager"] = eager["median_ms"] / row["median_ms"]
    for name in models:
        table_rows = []
        for r in (r for r in rows if r["model"] == name):
            if "error" in r:
                table_rows.append([r["mode"], "", "", "", "", "", "", r["error"][:60]])
                continue
            table_rows.append([r["mode"], f"{r['compile_s']:.1f}" if "compile_s" in r else "",
                               f"{r['inductor_s']:.1f}" if "inductor_s" in r else "", str(r.get("segments", "")),
                               f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r.get('speedup_vs_eager', 0):.2f}x",
                               f"{r['max_abs_diff']:.1e}" + ("" if r["ok"] else " WRONG")])
        common.console.print(common.table(
            f"{name} batch 1 on the CPU ({'warm' if args.warm_cache else 'cold'} Inductor cache, {args.runs} calls; "
            "vs eager: of the medians)", ["mode", "compile s", "in Inductor s", "segments", "median ms", "min ms",
                                          "vs eager", "max |diff|"], table_rows))
    common.write_json(args.out / "fused_cpu.json", {
        "machine": common.machine_info(),
        "settings": {"models": models, "schedulers": scheds, "streams": args.streams, "bert_layers": args.bert_layers,
                     "runs": args.runs, "warmup": args.warmup, "warmup_s": args.warmup_s,
                     "inductor_cache": "warm" if args.warm_cache else "cold", "batch_size": 1},
        "rows": rows,
        "elapsed_s": watch.elapsed_s,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
