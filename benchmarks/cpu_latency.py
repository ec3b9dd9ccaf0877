"""Latency on the CPU: opweave's modes beside what a CPU user already runs, every zoo model, batch 1 and 8.

    .venv/bin/python benchmarks/cpu_latency.py [--quick] [--models a,b|all|multi-branch] [--batch-sizes 1,8]
                                               [--modes m1;m2] [--runs 40] [--rounds 8] [--check-only] [--out DIR]

Modes (``--modes``, separated by ``;``; default :data:`DEFAULT_MODES`):

* ``eager`` — ``model(*inputs)`` under ``torch.inference_mode``;
* ``torch.compile`` — TorchInductor's C++ backend, default mode; ``torch.compile freezing`` — the same with
  ``torch._inductor.config.freezing`` (parameters folded in as constants, weights prepacked);
* ``onnxruntime`` — the model exported once with ``torch.onnx`` (TorchScript exporter) and run by one
  ``InferenceSession``, sequential executor, intra-op threads = the cores (ORT's default);
  ``onnxruntime parallel`` — ORT's own inter-operator executor (``ORT_PARALLEL``; one intra-op thread, inter-op
  threads = the cores);
* ``opweave SCHEDULER[+COMPILER]`` — ``opweave.compile(model, inputs, scheduler=SCHEDULER, compiler=COMPILER)`` on the
  CPU. ``sequential`` is one lane on the caller's thread (its own thread count); the other schedulers plan one lane
  per core, and each op (or segment) gets the threads its lane may use while it runs (``opweave.backends.threads``).
  COMPILER: none (the coarsened ops, each lane one generated Python function), ``inductor`` (each segment compiled
  and frozen by TorchInductor), ``onnxruntime`` (each segment one ORT session) or ``onnxruntime-graph`` (option
  ``graph="onnxruntime"``: ORT optimizes the whole model, opweave schedules the nodes of its optimized graph, each
  segment a session of those nodes over bound buffers: ``opweave.backends.ortgraph``);
* ``opweave max-autotune`` — ``opweave.compile(..., mode="max-autotune")``: opweave's own search over those plans
  (its choice is cached per model and machine: the latency phase reads it back);
* ``opweave default`` — ``opweave.compile(model, inputs)`` with no option: its first tier answers when it returns
  (``first_s``), its later tiers are built in a process of their own (``opweave.pipeline.tiers``) and the latency
  phase times it once they have landed (calls are made while a tier is raced, as a caller's would decide it;
  ``landed_s``: when the tier in use at the end took the calls, ``first_s`` where the first tier kept them;
  ``compile_s`` counts until every build ended and every race was decided, ``tier``: the tier in use);
  ``opweave first tier`` — the same with ``tiers=False``; ``opweave first tier fixed`` — and ``dynamic=False``
  (its ONNX Runtime session exported at the example's sizes, not with every dimension free).

Every mode is built and checked against eager first, each in its own spawned child with an empty Inductor cache
(``compile_s``: the cold build, model capture and exports included; ``rss_mb``: the child's resident memory once
built and called, beside eager's), then again in a second child on that cache (``warm_s``; modes that compile with
Inductor; ``--no-warm`` skips it). An output is ``ok`` when it equals eager's within 1e-4 of each
tensor's scale (:func:`opweave.outputs.compare`). Then one child per model and batch builds every mode that
passed (on the merged caches) and times them **interleaved**: round-robin warm-up calls for ``--warmup-s``
seconds, then ``--rounds`` rounds in which every mode runs its share of ``--runs`` calls (``perf_counter`` around
the whole call), each round starting at the next mode (with a fixed order, sub-millisecond models measured a
bias: the default, which on DeepFM runs the model itself, measured 0.93x eager), each mode's share of a round after
two untimed calls of its own and 20 ms of them at least (``settle``: a call timed right after another engine's pays
for the thread pools that engine left spinning, ONNX Runtime's and Inductor's, and they spin for a time: at a tenth
of a millisecond a call, two calls were not enough); per mode the median and the minimum. On a shared machine
whose load moves timings tenfold within minutes, only modes exposed to the same load are comparable; ratios of
medians are what the summary reports.

Writes ``DIR/cpu_latency.json`` (machine, settings, the command, rows, summary), ``DIR/cpu_latency.png`` and
``DIR/cpu_latency.md`` (:func:`document`: the date and command that produced the figures, then :func:`markdown`'s
tables, which the README shows). ``--check-only``: builds and checks only (``cpu_latency_check.json``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _common as common

from opweave.errors import first_line

MULTI_BRANCH_MODELS = ("inception_v3", "googlenet", "nasnet_a_mobile", "randwire")
# The third-party models the default is checked on (tests/test_third_party.py), at their coverage configuration.
THIRD_PARTY = ("torchvision:mobilenet_v3_small", "timm:test_vit", "hf:BertModel", "hf:GPT2Model")
PEERS = ("eager", "torch.compile", "torch.compile freezing", "onnxruntime", "onnxruntime parallel")
OPWEAVE = ("opweave sequential", "opweave heft", "opweave sequential+onnxruntime", "opweave heft+onnxruntime",
           "opweave sequential+onnxruntime-graph", "opweave heft+onnxruntime-graph",
           "opweave sequential+inductor", "opweave heft+inductor", "opweave max-autotune", "opweave default")
DEFAULT_MODES = PEERS + OPWEAVE
QUICK_MODES = ("eager", "onnxruntime", "opweave sequential", "opweave heft", "opweave heft+onnxruntime",
               "opweave default")
TOLERANCE = 1e-4
SETTLE = 2  # untimed calls of a mode right before its timed ones in each round
SETTLE_MS = 20.0  # and until this long has passed: the pools another engine left spinning spin for a time
INDUCTOR_MODES = ("torch.compile", "torch.compile freezing")
# Modes renamed since a results file was written: its tables show today's name (the JSON keeps the one it ran under).
RENAMED_MODES = {"opweave max-speed": "opweave max-autotune"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="deepfm and squeezenet at batch 1, a few modes, few runs")
    p.add_argument("--models", help="comma list of zoo models (torchvision:, timm:, hf: names too), 'all', "
                                    "'third-party' (THIRD_PARTY) or 'multi-branch' (Inception-v3, GoogLeNet, NASNet "
                                    "and RandWire; default all)")
    p.add_argument("--batch-sizes", default="1,8", help="comma list (default %(default)s)")
    p.add_argument("--modes", help="modes separated by ';' (default: every mode in the module docstring)")
    p.add_argument("--bert-layers", type=int, default=2, help="layers of bert_base (default %(default)s)")
    p.add_argument("--runs", type=int, default=40, help="timed calls per mode (default %(default)s)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="round-robin warm-up (default %(default)s s)")
    p.add_argument("--check-only", action="store_true", help="build and check every mode, no latency phase")
    p.add_argument("--limits", action="store_true", help="also measure why the lanes gain or lose against ONNX "
                                                         "Runtime (see limits())")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on one child after this long")
    p.add_argument("--no-warm", action="store_true", help="no second build on the warm cache")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory for the results")
    p.add_argument("--stem", default="cpu_latency", help="file name of the results, without suffix (default "
                                                         "%(default)s)")
    args = p.parse_args(argv)
    if args.quick:
        args.models = args.models or "deepfm,squeezenet"
        args.batch_sizes, args.runs, args.rounds, args.warmup_s = "1", 6, 2, 0.5
        args.modes = args.modes or ";".join(QUICK_MODES)
    args.modes = [m.strip() for m in args.modes.split(";")] if args.modes else list(DEFAULT_MODES)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.rounds = max(1, min(args.rounds, args.runs))
    return args


def model_names(args: argparse.Namespace) -> list[str]:
    from opweave import zoo

    if args.models in (None, "all"):
        return zoo.names()
    if args.models == "multi-branch":
        return list(MULTI_BRANCH_MODELS)
    if args.models == "third-party":
        return list(THIRD_PARTY)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in zoo.names() and ":" not in n]  # torchvision:, timm:, hf: checked built
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; zoo: {', '.join(zoo.names())}")
    return names


# ---- building one mode (in a child) ---------------------------------------------------------------------------
def create(name: str, batch: int, args: argparse.Namespace):
    from opweave import zoo
    from opweave.evaluate import coverage

    if name in coverage.MODELS:  # a third-party model at the configuration the coverage run checks
        return zoo.create(name, batch_size=batch, **coverage.MODELS[name])
    return zoo.create(name, batch_size=batch, **({"num_layers": args.bert_layers} if name == "bert_base" else {}))


def onnxruntime_session(model, inputs, parallel: bool, threads: int | None = None) -> Callable:
    """The whole model exported with torch.onnx and one ORT session; called like the model (outputs as tensors).
    ``threads``: the intra-op pool (default ORT's, one thread per core; ``torch.set_num_threads`` does not reach
    ORT)."""
    import torch
    from torch.utils import _pytree as pytree

    from opweave.backends.compilers import export_onnx, import_onnxruntime
    from opweave.backends.threads import cores

    ort = import_onnxruntime()
    with torch.no_grad():
        leaves, spec = pytree.tree_flatten(model(*inputs))  # the exporter returns the output's leaves in this order
    count = len(leaves)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if parallel:
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.intra_op_num_threads, options.inter_op_num_threads = 1, cores()
    elif threads is not None:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(export_onnx(model, list(inputs), count), options,
                                   providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*xs):
        out = [torch.from_numpy(a) for a in session.run(None, {n: x.numpy() for n, x in zip(names, xs, strict=True)})]
        return pytree.tree_unflatten(out, spec)  # the model's structure (a Hugging Face model's output class)

    return run


def build(model, inputs, mode: str) -> tuple[Callable, dict]:
    """The callable of ``mode`` and what building it recorded; the first call is made here (compilers compile in
    it)."""
    import torch

    import opweave

    info: dict = {}
    if mode == "eager":
        return model, info
    if mode in INDUCTOR_MODES:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(freezing=mode.endswith("freezing")), torch.inference_mode():
            fn = torch.compile(model)
            fn(*inputs)
        return fn, info
    if mode.startswith("onnxruntime"):
        return onnxruntime_session(model, inputs, parallel=mode.endswith("parallel")), info
    if mode in ("opweave default", "opweave first tier", "opweave first tier fixed"):
        start = time.perf_counter()
        options = {} if mode == "opweave default" else {"tiers": False}
        fast = opweave.compile(model, inputs, **options, **({"dynamic": False} if mode.endswith("fixed") else {}))
        info["first_s"] = round(time.perf_counter() - start, 2)
        if hasattr(fast.backend, "wait"):  # its later tiers, built off the caller's path: timed once they landed
            with torch.inference_mode():
                while fast.backend.building or fast.backend.racing:  # calls decide each race once its tier is built
                    if fast.backend.racing:
                        fast(*inputs)
                    else:
                        time.sleep(0.05)
            landed = fast.backend.stats.get("landed_at")  # when the tier in use at the end took the calls
            info.update(tier=fast.backend.label, tiers=fast.backend.tiers,
                        landed_s=round(landed - start, 2) if landed is not None else info["first_s"])
    elif mode == "opweave max-autotune":
        fast = opweave.compile(model, inputs, device="cpu", mode="max-autotune")
    else:
        scheduler, _, compiler = mode.removeprefix("opweave ").partition("+")
        how = {"graph": "onnxruntime"} if compiler == "onnxruntime-graph" else {"compiler": compiler or None}
        fast = opweave.compile(model, inputs, scheduler=scheduler, device="cpu",
                               streams=1 if scheduler == "sequential" else None, **how)
    info.update(scheduler=fast.schedule.scheduler, ops=len(fast.graph), lanes=fast.schedule.streams_used,
                syncs=fast.plan.syncs)
    if fast.fused is not None:
        info.update(compiler=fast.fused.compiler, segments=fast.fused.stats["segments"],
                    in_compiler_s=round(fast.fused.stats["compile_s"], 2), fallbacks=fast.fused.stats["fallbacks"])
    if getattr(fast, "choice", None):
        info["choice"] = fast.choice
    return fast, info


def build_and_check(name: str, batch: int, mode: str, args: argparse.Namespace) -> dict:
    """Phase 1 (in a child): build ``mode`` and compare its output with eager's."""
    import torch

    from opweave.outputs import compare

    model, inputs = create(name, batch, args)
    with torch.inference_mode():
        reference = model(*inputs)
    start = time.perf_counter()
    fn, info = build(model, inputs, mode)
    build_s = time.perf_counter() - start
    with torch.inference_mode():
        check = compare(reference, fn(*inputs), tolerance=TOLERANCE)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"model": name, "batch": batch, "mode": mode, "compile_s": round(build_s, 2), **info,
            "rss_mb": resident_mb(), "weights_mb": round(weights / 2**20, 1),
            "max_abs_diff": check.max_diff, "ok": check.ok, **({"wrong": check.reason} if not check.ok else {})}


def resident_mb() -> float:
    """This process's resident memory (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def interleaved(name: str, batch: int, modes: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Phase 2 (in a child): every mode built (untimed), then timed interleaved (module docstring)."""
    import torch

    from opweave.evaluate.bench import interleaved_times_ms

    model, inputs = create(name, batch, args)
    built = {mode: build(model, inputs, mode) for mode in modes}
    fns = {mode: fn for mode, (fn, _) in built.items()}
    # a measured choice (max-autotune, the default's guard) is made again in this process: record this one's
    chosen = {mode: info["choice"]["label"] for mode, (_, info) in built.items() if "choice" in info}
    with torch.inference_mode():
        deadline = time.perf_counter() + args.warmup_s
        while True:
            for fn in fns.values():
                fn(*inputs)
            if time.perf_counter() >= deadline:
                break
        # each round starts at the next mode: no mode always goes first
        times = interleaved_times_ms({mode: (lambda fn=fn: fn(*inputs)) for mode, fn in fns.items()},
                                     runs=args.runs, warmup=0, rounds=args.rounds, settle=SETTLE,
                                     settle_ms=SETTLE_MS)
    return {mode: {"median_ms": statistics.median(ts), "min_ms": min(ts), "p10_ms": _decile(ts, 0),
                   "p90_ms": _decile(ts, -1), **({"timed_choice": chosen[mode]} if mode in chosen else {})}
            for mode, ts in times.items()}


def _decile(times: list[float], which: int) -> float:
    """The 10th (``which=0``) or 90th (``-1``) percentile of ``times``: the spread beside the median."""
    return statistics.quantiles(times, n=10)[which] if len(times) > 1 else times[0]


def limits(name: str, batch: int, args: argparse.Namespace) -> dict:
    """Why the lanes gain or lose against ONNX Runtime here (in a child, one thread per run): ORT's whole model at
    one thread and at every core; each op compiled alone by ORT (:func:`opweave.backends.segments.op_latencies`),
    their sum and the critical path through them (the speed-up any number of one-thread lanes could reach);
    HEFT's plan on the cores' lanes with those costs (its predicted makespan, its segments) and the same segments
    run one after another on one thread (what cutting the model into segments costs ORT)."""

    import torch

    import opweave
    from opweave.backends.segments import op_latencies
    from opweave.backends.threads import cores
    from opweave.capture import capture, coarsen
    from opweave.costs import timing
    from opweave.costs.roofline import estimate

    model, inputs = create(name, batch, args)
    whole_fast = onnxruntime_session(model, inputs, parallel=False)
    captured = coarsen(capture(model, inputs, name=name))
    latency = op_latencies(captured, inputs, "onnxruntime", repeats=5)
    graph = captured.graph
    finish: dict[str, float] = {}
    for op in graph.topo_order:
        finish[op] = latency[op] + max((finish[p] for p in graph.preds[op]), default=0.0)
    from dataclasses import replace

    costs = replace(estimate(graph, "cpu", model="ideal"), latency_ms=latency)
    fast = opweave.compile(model, inputs, scheduler="heft", device="cpu", compiler="onnxruntime", costs=costs)
    segmented, order = fast.fused, [i.op for i in fast.plan.instrs if i.kind == "launch"]
    caller = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole_one = onnxruntime_session(model, inputs, parallel=False, threads=1)

        def segments_in_a_row():
            env = segmented.bind(inputs)
            for seg in [i.op for i in fast.backend.program.plan.instrs if i.kind == "launch"]:
                segmented.run_op(seg, env)

        with torch.inference_mode():
            one = timing.median_ms(lambda: whole_one(*inputs), runs=20, warmup=3)
            in_a_row = timing.median_ms(segments_in_a_row, runs=20, warmup=3)
    finally:
        torch.set_num_threads(caller)
    with torch.inference_mode():
        every = timing.median_ms(lambda: whole_fast(*inputs), runs=20, warmup=3)
    fast.close()
    total, critical = sum(latency.values()), max(finish.values())
    return {"model": name, "batch": batch, "cores": cores(), "ort_whole_1_thread_ms": round(one, 3),
            "ort_whole_all_cores_ms": round(every, 3), "ort_intra_op_speedup": round(one / every, 3),
            "ops": len(graph), "ort_ops_alone_sum_ms": round(total, 3), "critical_path_ms": round(critical, 3),
            "lanes_bound_speedup": round(total / critical, 3), "heft_lanes": fast.schedule.streams_used,
            "heft_predicted_ms": round(fast.schedule.predicted_ms, 3), "heft_segments": len(order),
            "heft_segments_in_a_row_1_thread_ms": round(in_a_row, 3),
            "segmenting_costs_ort": round(in_a_row / one, 3),
            "note": "statistics of 20 runs each; one child per model, after the latency phase"}


# ---- children ------------------------------------------------------------------------------------------------
def _child(conn, fn: Callable, fn_args: tuple, env: dict) -> None:
    os.environ.update(env)  # read when torch._inductor's config and opweave's cache are first used
    try:
        conn.send(("ok", fn(*fn_args)))
    except BaseException as exc:  # reported as an error row, the other modes stand
        conn.send(("error", first_line(exc)))
    finally:
        conn.close()


def in_child(fn: Callable, fn_args: tuple, env: dict, timeout_s: float) -> tuple[str, object]:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, fn_args, env), daemon=True)
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


def measure(name: str, batch: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Both phases for one model and batch: one row per mode."""
    rows, caches = [], []
    for i, mode in enumerate(args.modes):
        cache = tmp / f"{name}-b{batch}-{i}"
        caches.append(cache)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "OPWEAVE_CACHE_DIR": str(cache / "opweave")}
        common.console.print(f"{name} batch {batch}: build and check {mode}", style="dim")
        status, row = in_child(build_and_check, (name, batch, mode, args), env, args.timeout_s)
        if status != "ok":
            rows.append({"model": name, "batch": batch, "mode": mode, "error": row})
            continue
        if not args.no_warm and (mode in INDUCTOR_MODES or mode.endswith("+inductor")
                                 or mode == "opweave max-autotune"):
            status, warm = in_child(build_and_check, (name, batch, mode, args), env, args.timeout_s)
            if status == "ok":
                row["warm_s"] = warm["compile_s"]
        rows.append(row)
    if args.check_only:
        return rows
    built = [r["mode"] for r in rows if r.get("ok")]
    merged = tmp / f"{name}-b{batch}-latency"
    for cache in caches:  # one cache holding every mode's compiled artefacts
        if cache.exists():
            shutil.copytree(cache, merged, dirs_exist_ok=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(merged / "inductor"), "OPWEAVE_CACHE_DIR": str(merged / "opweave")}
    common.console.print(f"{name} batch {batch}: latency of {len(built)} modes, interleaved", style="dim")
    status, latency = in_child(interleaved, (name, batch, built, args), env, args.timeout_s)
    eager = latency.get("eager", {}).get("median_ms") if status == "ok" else None
    for row in rows:
        if row["mode"] not in built:
            continue
        if status != "ok":
            row["error"] = f"latency: {latency}"
            continue
        row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in latency[row["mode"]].items()})
        if eager:
            row["speedup_vs_eager"] = round(eager / latency[row["mode"]]["median_ms"], 3)
    from opweave.evaluate.bench import load_average

    load = (load_average() or [None])[0]
    return [{**row, "load_average_1m": load} for row in rows]


# ---- summary, table, plot ------------------------------------------------------------------------------------
def single_lane(mode: str) -> bool:
    return mode.startswith("opweave sequential")


def compiler_of(mode: str) -> str:
    return mode.partition("+")[2] or "none"


def summarize(rows: list[dict]) -> list[dict]:
    """Per model and batch: opweave's best mode against torch.compile (freezing) and ORT sequential, and the best
    multi-lane plan against the best single-lane one with the same compiler; max-autotune counts as the plan it
    chose, timed in this process."""
    out = []
    for key in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        timed = {r["mode"]: r["median_ms"] for r in rows if (r["model"], r["batch"]) == key and "median_ms" in r}
        ours = {m: t for m, t in timed.items() if m.startswith("opweave")}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        entry = {"model": key[0], "batch": key[1], "best_opweave": best, "best_ms": ours[best]}
        for peer in ("torch.compile freezing", "onnxruntime", "eager"):
            if peer in timed:
                entry[f"vs {peer}"] = round(timed[peer] / ours[best], 3)
        # each plan as "opweave SCHEDULER[+COMPILER]"; max-autotune counts as the plan it chose (its label's scheduler
        # and compiler; the sync cost it searched is not a mode of its own)
        plans = {m: t for m, t in ours.items() if m.count(" ") == 1
                 and m not in ("opweave max-autotune", "opweave default")}
        choice = next((r.get("timed_choice") for r in rows if (r["model"], r["batch"], r["mode"])
                       == (*key, "opweave max-autotune")), None)
        if "opweave max-autotune" in ours and choice:
            plans[f"opweave {choice.partition(' ')[0]}"] = min(ours["opweave max-autotune"],
                                                              plans.get(f"opweave {choice.partition(' ')[0]}",
                                                                        float("inf")))
        lanes = {}
        for compiler in dict.fromkeys(compiler_of(m) for m in plans):
            one = [t for m, t in plans.items() if single_lane(m) and compiler_of(m) == compiler]
            many = [t for m, t in plans.items() if not single_lane(m) and compiler_of(m) == compiler]
            if one and many:
                lanes[compiler] = round(min(one) / min(many), 3)
        entry["multi_over_single_lane"] = lanes
        if "opweave default" in timed and "eager" in timed:
            entry["default_vs_eager"] = round(timed["eager"] / timed["opweave default"], 3)
            # "eager": the default runs the model itself (api._guarded), so the ratio is the machine's noise
            entry["default_choice"] = next((r.get("timed_choice") for r in rows if (r["model"], r["batch"], r["mode"])
                                            == (*key, "opweave default")), None)
        entry.update(against_torch_compile([r for r in rows if (r["model"], r["batch"]) == key]))
        entry.update(against_tuned_peers([r for r in rows if (r["model"], r["batch"]) == key]))
        out.append(entry)
    return out


def against_torch_compile(rows: list[dict]) -> dict:
    """The default's and max-autotune's medians and cold builds against ``torch.compile``'s (default mode), from one
    model's and batch's rows: ``default_vs_torch_compile`` (a ratio of medians, above 1 when the default is faster),
    ``spreads_overlap`` (whether their p10-p90 spreads overlap: then the ratio is no difference), the builds as a
    share of torch.compile's cold compile, and what the default picked with which compiler."""
    timed = {r["mode"]: r for r in rows if "median_ms" in r}
    peer = timed.get("torch.compile")
    out: dict = {}
    if peer is None:
        return out
    for mode, name in (("opweave default", "default"), ("opweave max-autotune", "max_autotune")):
        if mode not in timed:
            continue
        row = timed[mode]
        out[f"{name}_vs_torch_compile"] = round(peer["median_ms"] / row["median_ms"], 3)
        out[f"{name}_spreads_overlap"] = row["p10_ms"] <= peer["p90_ms"] and peer["p10_ms"] <= row["p90_ms"]
        out[f"{name}_build_vs_torch_compile"] = round(row["compile_s"] / peer["compile_s"], 3)
    if "opweave default" in timed:
        out["default_compiler"] = (timed["opweave default"].get("choice") or {}).get("compiler")
    return out


PEERS_TUNED = ("torch.compile freezing", "onnxruntime")  # what CPU users tune: the better of the two is the bar


def against_tuned_peers(rows: list[dict]) -> dict:
    """The default (once its tiers have landed) and max-autotune against the better of the peers CPU users tune
    (:data:`PEERS_TUNED`), from one model's and batch's rows: ratios of medians (above 1 faster), whether the p10-p90
    spreads overlap; the default's first output and last tier against the cold compiles (torch.compile's default
    mode, and with freezing), max-autotune's build against freezing's; resident memory beside eager's."""
    timed = {r["mode"]: r for r in rows if "median_ms" in r}
    built = {r["mode"]: r for r in rows if "compile_s" in r and "error" not in r}
    peers = [timed[p] for p in PEERS_TUNED if p in timed]
    out: dict = {}
    if peers:
        best = min(peers, key=lambda r: r["median_ms"])
        out["best_peer"] = best["mode"]
        for mode, name in (("opweave default", "default"), ("opweave max-autotune", "max_autotune")):
            if mode in timed:
                row = timed[mode]
                out[f"{name}_vs_best_peer"] = round(best["median_ms"] / row["median_ms"], 3)
                out[f"{name}_vs_best_peer_overlap"] = (row["p10_ms"] <= best["p90_ms"]
                                                       and best["p10_ms"] <= row["p90_ms"])
    default, freezing, plain = (built.get(m) for m in ("opweave default", "torch.compile freezing",
                                                        "torch.compile"))
    if default is not None and plain is not None and "first_s" in default:
        out["default_first_vs_torch_compile"] = round(default["first_s"] / plain["compile_s"], 3)
    if default is not None and freezing is not None:
        out["default_last_tier_vs_freezing"] = round(default.get("landed_s", default["compile_s"])
                                                     / freezing["compile_s"], 3)
        out["default_builds_vs_freezing"] = round(default["compile_s"] / freezing["compile_s"], 3)
        out["default_tier"] = default.get("tier")
    autotune = built.get("opweave max-autotune")
    if autotune is not None and freezing is not None:
        out["max_autotune_build_vs_freezing"] = round(autotune["compile_s"] / freezing["compile_s"], 3)
    eager = built.get("eager")
    if eager is not None and default is not None and "rss_mb" in default:
        out["default_rss_mb"], out["eager_rss_mb"] = default["rss_mb"], eager["rss_mb"]
        out["weights_mb"] = default.get("weights_mb")
    return out


def tuned_verdict(summary: list[dict]) -> str:
    """The default and max-autotune against the better of torch.compile (freezing) and ONNX Runtime per model and
    batch (``~``: the p10-p90 spreads overlap), the default's first output and last tier against the cold compiles,
    and resident memory beside eager's."""
    shown = [s for s in summary if "default_vs_best_peer" in s]
    if not shown:
        return ""

    def ratio(s: dict, name: str) -> str:
        if f"{name}_vs_best_peer" not in s:
            return ""
        return ("~" if s[f"{name}_vs_best_peer_overlap"] else "") + f"{s[f'{name}_vs_best_peer']:.2f}x"

    def share(s: dict, key: str) -> str:
        return f"{s[key]:.2f}x" if key in s else ""

    lines = ["**against the better of torch.compile (freezing) and ONNX Runtime** (ratio of medians, above 1 faster; "
             "~: the p10-p90 spreads overlap); the default's first output against torch.compile's cold compile, its "
             "last tier and max-autotune's build against torch.compile (freezing)'s; resident MiB once built", "",
             "| model | batch | better peer | default | its tier | max-autotune | first output | last tier | "
             "max-autotune build | RSS default / eager | weights |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in shown:
        rss = (f"{s['default_rss_mb']:.0f} / {s['eager_rss_mb']:.0f}" if "default_rss_mb" in s else "")
        weights = f"{s['weights_mb']:.0f}" if s.get("weights_mb") is not None else ""
        lines.append(f"| {s['model']} | {s['batch']} | {s.get('best_peer', '')} | {ratio(s, 'default')} | "
                     f"{s.get('default_tier') or ''} | {ratio(s, 'max_autotune')} | "
                     f"{share(s, 'default_first_vs_torch_compile')} | {share(s, 'default_last_tier_vs_freezing')} | "
                     f"{share(s, 'max_autotune_build_vs_freezing')} | {rss} | {weights} |")
    return "\n".join(lines) + "\n"


def verdict(summary: list[dict], rows: list[dict]) -> str:
    """The default and max-autotune against ``torch.compile`` per model and batch: the ratio of medians (``~`` where
    the p10-p90 spreads overlap: no difference), each mode's cold build in seconds, and what the default kept."""
    shown = [s for s in summary if "default_vs_torch_compile" in s]
    if not shown:
        return ""

    def build_s(s: dict, mode: str) -> str:
        row = next((r for r in rows if (r["model"], r["batch"], r["mode"]) == (s["model"], s["batch"], mode)), {})
        if "compile_s" not in row:
            return ""
        if "first_s" not in row:
            return f"{row['compile_s']:.1f}"
        return f"{row['first_s']:.1f} / {row.get('landed_s', row['compile_s']):.1f} / {row['compile_s']:.1f}"

    def ratio(s: dict, name: str) -> str:
        if f"{name}_vs_torch_compile" not in s:
            return ""
        return ("~" if s[f"{name}_spreads_overlap"] else "") + f"{s[f'{name}_vs_torch_compile']:.2f}x"

    tiered = any("first_s" in r for r in rows if r["mode"] == "opweave default")
    lines = ["**against torch.compile** (ratio of medians, above 1 faster; ~: the p10-p90 spreads overlap; cold "
             "builds in s" + ("; the default's: its first output / its last tier landed / its builds ended)" if tiered
                              else ")"), "",
             "| model | batch | default | max-autotune | default's pick | build: torch.compile | default | "
             "max-autotune |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for s in shown:
        lines.append(f"| {s['model']} | {s['batch']} | {ratio(s, 'default')} | {ratio(s, 'max_autotune')} | "
                     f"{s.get('default_choice') or ''} | {build_s(s, 'torch.compile')} | "
                     f"{build_s(s, 'opweave default')} | {build_s(s, 'opweave max-autotune')} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], summary: list[dict], modes: list[str]) -> str:
    """The README's table: median ms per mode (batch 1, then 8), the best opweave mode in bold; a renamed mode under
    today's name (:data:`RENAMED_MODES`)."""
    lines = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        shown = [m for m in modes if any(r["mode"] == m and r["batch"] == batch and "median_ms" in r for r in rows)]
        lines += [f"**batch {batch}** (median ms; lower is better)", "",
                  "| model | " + " | ".join(RENAMED_MODES.get(m, m) for m in shown) + " |",
                  "| --- |" + " ---: |" * len(shown)]
        for entry in (s for s in summary if s["batch"] == batch):
            cells = []
            for mode in shown:
                row = next((r for r in rows if (r["model"], r["batch"], r["mode"]) == (entry["model"], batch, mode)
                            and "median_ms" in r), None)
                text = "" if row is None else f"{row['median_ms']:.1f}"
                cells.append(f"**{text}**" if mode == entry["best_opweave"] else text)
            lines.append(f"| {entry['model']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def advice(data: dict) -> str:
    """What the README says of the default and max-autotune against ``torch.compile`` on the CPU, every figure from
    ``data``'s summary and rows (a results file with :func:`against_torch_compile`'s figures): the ratios of medians
    per batch, how many lie within the spread, the default's picks, and the cold builds against torch.compile's."""
    summary = [s for s in data["summary"] if "default_vs_torch_compile" in s]
    rows = data["rows"]

    def span(values: list[float], unit: str = "×") -> str:
        lo, hi = min(values), max(values)
        digits = 2 if unit == "×" else (0 if lo >= 10 else 1)
        text = f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}–{hi:.{digits}f}"
        return f"{text}{unit}" if unit == "×" else f"{text} {unit}"

    def builds(mode: str) -> list[float]:
        return [r["compile_s"] for r in rows if r["mode"] == mode and "compile_s" in r and "error" not in r]

    batches = list(dict.fromkeys(s["batch"] for s in summary))
    per_batch = " and ".join(f"{span([s['default_vs_torch_compile'] for s in summary if s['batch'] == b])}"
                             f"{' `torch.compile`' if i == 0 else ''} at batch {b}" for i, b in enumerate(batches))
    overlap = sum(s["default_spreads_overlap"] for s in summary)
    slower = [s for s in summary if s["default_vs_torch_compile"] < 1 and not s["default_spreads_overlap"]]
    within = [s for s in summary if s["default_vs_torch_compile"] < 0.95 and s["default_spreads_overlap"]]
    picks: dict[str, int] = {}
    for s in summary:
        picks[s.get("default_choice") or "?"] = picks.get(s.get("default_choice") or "?", 0) + 1
    picked = ", ".join(f"{label} {n}" for label, n in sorted(picks.items(), key=lambda kv: -kv[1]))
    eager = [s["default_vs_eager"] for s in summary if "default_vs_eager" in s]
    text = (f"The default is {per_batch} ({overlap} of {len(summary)} within the p10–p90 spread) and "
            f"{span(eager)} eager; it kept {picked} of {len(summary)} (model and batch).")
    if slower:
        text += (" It is slower than `torch.compile` on " + ", ".join(
            f"{s['model']} at batch {s['batch']} ({s['default_vs_torch_compile']:.2f}×)" for s in slower) + "")
        text += (", and below 0.95× within the spread on " + ", ".join(
            f"{s['model']} at batch {s['batch']} ({s['default_vs_torch_compile']:.2f}×)" for s in within)
            if within else "") + "."
    firsts = [r["first_s"] for r in rows if r["mode"] == "opweave default" and "first_s" in r and "error" not in r]
    landed = [r.get("landed_s", r["compile_s"]) for r in rows
              if r["mode"] == "opweave default" and "first_s" in r and "error" not in r]
    if firsts:  # tiered: its first tier answers, its last lands later
        text += (f" It answers its first call {span(firsts, 's')} after it is asked to compile, "
                 f"{span([s['default_first_vs_torch_compile'] for s in summary])} the time of `torch.compile`'s "
                 f"first compile ({span(builds('torch.compile'), 's')}); the tier it ends on takes the calls after "
                 f"{span(landed, 's')}, and its tier builds (the ones that lose their race too) end after "
                 f"{span(builds('opweave default'), 's')}.")
    else:
        text += (" It builds in "
                 f"{span(builds('opweave default'), 's')}, "
                 f"{span([s['default_build_vs_torch_compile'] for s in summary])} "
                 f"the time of `torch.compile`'s first compile ({span(builds('torch.compile'), 's')}).")
    autotuned = [s for s in summary if "max_autotune_vs_torch_compile" in s]
    if autotuned:
        text += (f" `mode=\"max-autotune\"` is {span([s['max_autotune_vs_torch_compile'] for s in autotuned])} "
                 f"`torch.compile`, for {span(builds('opweave max-autotune'), 's')} of building the first time, "
                 f"{span([s['max_autotune_build_vs_torch_compile'] for s in autotuned])} `torch.compile`'s.")
    tuned = [s for s in data["summary"] if "default_vs_best_peer" in s]
    if tuned:
        ahead = sum(s["default_vs_best_peer"] >= 1 for s in tuned)
        close = sum(s["default_vs_best_peer_overlap"] for s in tuned)
        text += (f" Against the better of `torch.compile` with freezing and ONNX Runtime on the whole model, the peers "
                 f"CPU users tune, the default once its tiers have landed is "
                 f"{span([s['default_vs_best_peer'] for s in tuned])} ({ahead} of {len(tuned)} at 1.00× or above, "
                 f"{close} within the spread)")
        lasts = [s["default_last_tier_vs_freezing"] for s in tuned if "default_last_tier_vs_freezing" in s]
        if lasts:
            text += f", the tier it ends on taking the calls after {span(lasts)} the time of the freezing compile"
        text += "."
    return text


def command_line(data: dict, stem: str = "cpu_latency") -> str:
    """The command that wrote ``data`` (a results JSON named ``stem``): as recorded, or, in a file written before
    the command was recorded, the options its settings differ from the defaults in, spelled as today's flags."""
    if "command" in data:
        return data["command"]
    settings, defaults = data["settings"], parse_args([])
    args = []
    if settings["models"] == list(MULTI_BRANCH_MODELS):
        args += ["--models", "multi-branch"]
    elif settings["models"] != model_names(defaults):
        args += ["--models", ",".join(settings["models"])]
    if settings["batch_sizes"] != defaults.batch_sizes:
        args += ["--batch-sizes", ",".join(map(str, settings["batch_sizes"]))]
    modes = [RENAMED_MODES.get(m, m) for m in settings["modes"]]
    if modes != defaults.modes:
        args += ["--modes", f'"{";".join(modes)}"']
    for flag, key in (("--bert-layers", "bert_layers"), ("--runs", "runs"), ("--rounds", "rounds"),
                      ("--warmup-s", "warmup_s")):
        if settings[key] != getattr(defaults, key):
            args += [flag, f"{settings[key]:g}"]
    if data.get("limits"):
        args.append("--limits")
    if stem != "cpu_latency":
        args += ["--stem", stem]
    return " ".join(["python benchmarks/cpu_latency.py", *args])


def document(data: dict, stem: str = "cpu_latency") -> str:
    """``STEM.md``: when, how and where the figures were measured, then :func:`markdown`'s tables."""
    machine = data["machine"]
    renamed = [f"`{RENAMED_MODES[m]}` ran as `{m}`" for m in data["settings"]["modes"] if m in RENAMED_MODES]
    how = "" if "command" in data else "the equivalent of "
    head = (f"Measured {machine['date'][:10]} by {how}`{command_line(data, stem)}` on {machine['machine']} "
            f"{machine['platform'].split('-')[0]} with {machine['cpus_usable']} usable cores, torch "
            f"{machine['torch']}, Python {machine['python']}"
            + (f" (modes renamed since: {'; '.join(renamed)})" if renamed else "") + ".")
    against = verdict(data["summary"], data["rows"])
    tuned = tuned_verdict(data["summary"])
    return head + "\n\n" + markdown(data["rows"], data["summary"], data["settings"]["modes"]) + (
        "\n" + against if against else "") + ("\n" + tuned if tuned else "")


def plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(dict.fromkeys(s["batch"] for s in summary))
    fig, axes = plt.subplots(len(batches), 1, figsize=(11, 3.6 * len(batches)), squeeze=False)
    shown = ("torch.compile freezing", "onnxruntime", "onnxruntime parallel", "best opweave")
    for ax, batch in zip(axes[:, 0], batches, strict=True):
        entries = [s for s in summary if s["batch"] == batch]
        width = 0.8 / len(shown)
        for i, label in enumerate(shown):
            values = []
            for s in entries:
                eager = next((r["median_ms"] for r in rows if (r["model"], r["batch"], r["mode"]) ==
                              (s["model"], batch, "eager") and "median_ms" in r), None)
                ms = s["best_ms"] if label == "best opweave" else next(
                    (r["median_ms"] for r in rows if (r["model"], r["batch"], r["mode"]) == (s["model"], batch, label)
                     and "median_ms" in r), None)
                values.append(eager / ms if eager and ms else 0.0)
            ax.bar([j + i * width for j in range(len(entries))], values, width, label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(entries))], [s["model"] for s in entries])
        ax.set_ylabel("speed-up over eager")
        ax.set_title(f"CPU latency, batch {batch} (medians, modes interleaved)")
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def table(rows: list[dict]):
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([f"{r['model']} b{r['batch']}", r["mode"], "", "", "", "", "", r["error"][:70]])
            continue
        cells.append([f"{r['model']} b{r['batch']}", r["mode"], f"{r['compile_s']:.1f}",
                      f"{r['warm_s']:.1f}" if "warm_s" in r else "",
                      f"{r['median_ms']:.2f}" if "median_ms" in r else "",
                      f"{r['min_ms']:.2f}" if "min_ms" in r else "",
                      f"{r['speedup_vs_eager']:.2f}x" if "speedup_vs_eager" in r else "",
                      f"{r['max_abs_diff']:.1e}" + ("" if r["ok"] else " WRONG")])
    return common.table("CPU latency (modes interleaved per model; vs eager: ratio of medians)",
                        ["model", "mode", "build s", "warm s", "median ms", "min ms", "vs eager", "max |diff|"],
                        cells)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(given) if a != "--out" and (i == 0 or given[i - 1] != "--out")
             and not a.startswith("--out=")]  # where the files go is no setting of the run
    command = " ".join(["python benchmarks/cpu_latency.py", *(f'"{a}"' if " " in a or ";" in a else a for a in shown)])
    names = model_names(args)
    watch = common.Stopwatch()
    rows: list[dict] = []
    bounds: list[dict] = []
    stem = f"{args.stem}_check" if args.check_only else args.stem
    with tempfile.TemporaryDirectory(prefix="cpu_latency_") as tmp:
        for batch in args.batch_sizes:
            for name in names:
                rows += measure(name, batch, args, Path(tmp))
                if args.limits:
                    status, found = in_child(limits, (name, batch, args), {}, args.timeout_s)
                    bounds.append(found if status == "ok" else {"model": name, "batch": batch, "error": found})
                summary = [] if args.check_only else summarize(rows)
                data = {
                    "machine": common.machine_info(),
                    "settings": {"models": names, "batch_sizes": args.batch_sizes, "modes": args.modes,
                                 "bert_layers": args.bert_layers, "runs": args.runs, "rounds": args.rounds,
                                 "warmup_s": args.warmup_s, "tolerance": TOLERANCE},
                    "command": command, "rows": rows, "summary": summary, "limits": bounds,
                    "elapsed_s": watch.elapsed_s}
                common.write_json(args.out / f"{stem}.json", data, quiet=True)
    common.console.print(table(rows))
    if not args.check_only:
        summary = summarize(rows)
        (args.out / f"{stem}.md").write_text(document(data, stem))
        plot(rows, summary, args.out / f"{stem}.png")
        for s in summary + bounds:
            common.console.print(s)
    common.console.print(f"wrote {args.out / (stem + '.json')}")
    wrong = [r for r in rows if "error" not in r and not r["ok"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
