"""Commands on graphs, no device needed: ``schedule``, ``simulate``, ``synth``, ``models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from opweave.cli.app import (
    BatchOpt,
    CoarsenOpt,
    CostOpt,
    DevicesOpt,
    DtypeOpt,
    GraphArg,
    JsonOpt,
    LinkOpt,
    ModelFileOpt,
    ModelOpt,
    PresetOpt,
    ProfileOpt,
    StreamsOpt,
    app,
    device_costs,
    err,
    fitted_gpu,
    graph_or_model,
    guard,
    inductor_kernels,
    linked,
    load_graph,
    out,
    run_one,
    schedule_json,
    scheduler_names,
)
from opweave.errors import UsageError


@app.command()
@guard
def schedule(graph: GraphArg = None, scheduler: Annotated[str, typer.Option(
                 "--scheduler", "-s", help="one scheduler, a comma list or all (opweave.schedulers.names())")] = "lios",
             streams: StreamsOpt = None, devices: DevicesOpt = 1, cost_model: CostOpt = "ideal",
             model: ModelOpt = None, model_file: ModelFileOpt = None, batch_size: BatchOpt = 1,
             preset: PresetOpt = "h100", profile: ProfileOpt = None, coarsen: CoarsenOpt = True,
             link: LinkOpt = None, dtype: DtypeOpt = "fp32", as_json: JsonOpt = False):
    """Schedule a graph and show where each op runs (a model's coarsened graph, as compile plans it, unless
    --no-coarsen); -s takes one scheduler, a comma list or all (one table each)."""
    graph, model = graph_or_model(graph, model)
    g = linked(load_graph(graph, model, batch_size=batch_size, preset=preset, profile=profile, coarsen=coarsen,
                          model_file=model_file), link)
    names = scheduler_names(scheduler)
    g, costs, replay = device_costs(g, cost_model, preset, dtype, measured=graph is not None or profile is not None)
    results = []
    for name in names:
        sched, plan, sim = run_one(g, costs, name, streams, devices, replay)
        results.append(schedule_json(sched, plan, sim))
        if as_json:
            continue
        table = Table(title=f"{name} on {g.name}: makespan {sim.makespan_ms:.3f} ms "
                            f"(sequential {sim.sequential_ms:.3f})")
        for col in ("op", "device", "stream", "stage", "start ms", "finish ms"):
            table.add_column(col, justify="left" if col == "op" else "right")
        for row in results[-1]["ops"]:
            stage = "" if row["stage"] is None else str(row["stage"])
            table.add_row(row["id"], str(row["device"]), str(row["stream"]), stage, f"{row['start_ms']:.3f}",
                          f"{row['finish_ms']:.3f}")
        out.print(table)
        out.print(f"streams {sched.streams_used}, devices {sched.devices_used}, syncs {plan.syncs}, "
                  f"scheduling time {sched.scheduling_time_s * 1e3:.2f} ms")
    if as_json:  # one scheduler: its object, as before; several: a list of them
        print(json.dumps(results[0] if len(results) == 1 else results))


@app.command()
@guard
def simulate(graph: GraphArg = None, scheduler: Annotated[str, typer.Option(
                 "--scheduler", "-s", help="one scheduler, a comma list or all (opweave.schedulers.names())")] = "all",
             streams: StreamsOpt = None, devices: DevicesOpt = 1, cost_model: CostOpt = "ideal",
             model: ModelOpt = None, model_file: ModelFileOpt = None, batch_size: BatchOpt = 1,
             preset: PresetOpt = "h100", profile: ProfileOpt = None, coarsen: CoarsenOpt = True,
             link: LinkOpt = None, dtype: DtypeOpt = "fp32",
             inductor: Annotated[bool, typer.Option(
                 "--inductor", help="plan over Inductor's kernels, as opweave.compile(graph=\"inductor\") does on "
                                    "CUDA (the model lowered here as CUDA lowers it; not coarsened); needs "
                                    "--cost-model gpu and a fitted preset")] = False,
             gantt: Annotated[Path | None, typer.Option(help="write a Gantt chart PNG (one scheduler)")] = None,
             trace: Annotated[Path | None, typer.Option(help="write a Chrome trace JSON (one scheduler)")] = None,
             as_json: JsonOpt = False):
    """Compare schedulers on one graph: makespan, speedup over sequential, syncs, scheduling time (a model's coarsened
    graph, as compile plans it, unless --no-coarsen). With --cost-model gpu and a fitted preset (h200, h100) the
    makespan is one CUDA Graph call on the fitted device, what benchmarks/gpu_latency.py measures."""
    from opweave.backends import render

    graph, model = graph_or_model(graph, model)
    launches, grouping = None, None
    if inductor:
        if profile is not None or graph is not None:
            raise UsageError("--inductor goes with --model or --model-file, without --profile: Inductor lowers the "
                             "model itself and its kernels are priced on the fitted device")
        fitted_gpu(cost_model, preset, dtype, inductor=True)  # refused before the lowering, not after
        g, launches, grouping = inductor_kernels(model, model_file, batch_size)
        g = linked(g, link)
    else:
        g = linked(load_graph(graph, model, batch_size=batch_size, preset=preset, profile=profile, coarsen=coarsen,
                              model_file=model_file), link)
    names = scheduler_names(scheduler)
    if (gantt or trace) and len(names) != 1:
        raise UsageError("--gantt and --trace need a single --scheduler")
    g, costs, replay = device_costs(g, cost_model, preset, dtype, measured=graph is not None or profile is not None,
                                    launches=launches)
    rows = []
    for name in names:
        sched, plan, sim = run_one(g, costs, name, streams, devices, replay)
        rows.append({"scheduler": name, "makespan_ms": sim.makespan_ms, "sequential_ms": sim.sequential_ms,
                     "speedup": sim.sequential_ms / sim.makespan_ms if sim.makespan_ms else 1.0,
                     "streams_used": sched.streams_used, "devices_used": sched.devices_used, "syncs": plan.syncs,
                     "scheduling_time_s": sched.scheduling_time_s})
        if gantt:
            render.gantt(sim, gantt)
        if trace:
            render.chrome_trace(sim, trace)
    if as_json:
        print(json.dumps({"graph": g.name, "ops": len(g), "edges": len(g.edges), "cost_model": cost_model,
                          "costs": replay.source, "dtype": dtype, "critical_path_ms": g.critical_path_ms(),
                          "kernels_per_call": round(sum(replay.kernel_count(o) for o in g.ids), 1),
                          "inductor": grouping, "results": rows}))
        return
    table = Table(title=f"{g.name}: {len(g)} ops, {len(g.edges)} edges, cost model {cost_model}, "
                        f"critical path {g.critical_path_ms():.3f} ms")
    for col in ("scheduler", "makespan ms", "speedup", "streams", "devices", "syncs", "sched time ms"):
        table.add_column(col, justify="left" if col == "scheduler" else "right")
    for r in rows:
        table.add_row(r["scheduler"], f"{r['makespan_ms']:.3f}", f"{r['speedup']:.2f}x", str(r["streams_used"]),
                      str(r["devices_used"]), str(r["syncs"]), f"{r['scheduling_time_s'] * 1e3:.2f}")
    out.print(table)


@app.command()
@guard
def synth(ops: Annotated[int, typer.Option(min=1, help="operators")] = 200,
          layers: Annotated[int, typer.Option(min=1, help="layers the operators are spread over")] = 14,
          edges: Annotated[int | None, typer.Option(help="edges (default 2 x ops)")] = None,
          seed: Annotated[int, typer.Option(help="random seed: the same seed writes the same graph")] = 0,
          comm_ratio: Annotated[float, typer.Option(help="transfer = max(0.1 ms, p x producer latency)")] = 0.8,
          output: Annotated[Path | None, typer.Option("-o", "--output", help="write here (default stdout)")] = None):
    """Write a HIOS-style random layered DAG (HIOS §V-A) as graph JSON."""
    from opweave.ir.synth import random_dag

    g = random_dag(ops, layers, edges, seed, comm_ratio=comm_ratio)
    if output is None:
        print(json.dumps(g.to_dict()))
    else:
        g.save(output)
        err.print(f"wrote {output}: {len(g)} ops, {len(g.edges)} edges")


@app.command()
@guard
def models(as_json: JsonOpt = False):
    """List the built-in model zoo."""
    from opweave import zoo

    if as_json:
        print(json.dumps(zoo.names()))
        return
    table = Table(title="opweave zoo (random weights, no downloads)")
    table.add_column("model")
    table.add_column("opweave ops / edges")
    table.add_column("papers' ops / edges")
    for name in zoo.names():
        ops, edges = zoo.COUNTS[name]
        paper = zoo.PAPER_COUNTS.get(name)
        papers = "" if paper is None else f"{paper['ops']} / {paper.get('edges') or '?'}"
        table.add_row(name, f"{ops} / {edges}", papers)
    out.print(table)
    out.print("also: torchvision:<name>, timm:<name>, hf:<model-id> or hf:<ModelClass> (e.g. hf:T5EncoderModel) "
              "where those packages are installed")




@app.command()
@guard
def calibrate(results: Annotated[list[Path], typer.Argument(help="result JSON files of benchmarks/gpu_latency.py")],
              trace: Annotated[Path | None, typer.Option(help="a profiler trace of one model's ops alone "
                                                                "(scripts/dump_trace.py, .json or .json.gz): "
                                                                "refits the op classes")] = None,
              output: Annotated[Path | None, typer.Option(
                  "--out", help="device file to write (default: this user's, ~/.config/opweave/devices/h200.json "
                                "or $OPWEAVE_CONFIG_DIR, which the h200 preset then reads before the one shipped in "
                                "the package)")] = None,
              base: Annotated[Path | None, typer.Option(help="device file to start from (default: the one the h200 "
                                                             "preset reads now)")] = None,
              iterations: Annotated[int, typer.Option(min=1, help="Nelder-Mead steps per fit")] = 60,
              leave_one_out: Annotated[bool, typer.Option("--leave-one-out/--no-leave-one-out",
                                                          help="also fit with each model left out")] = True,
              rank_weight: Annotated[float | None, typer.Option(
                  min=0.0, help="weight of the term that keeps the measured orderings of each configuration's "
                                "plans (0: fit the errors alone; default 1)")] = None,
              report: Annotated[Path | None, typer.Option(help="write every row's prediction here (JSON)")] = None,
              as_json: JsonOpt = False):
    """Refit the GPU device model on measured results (and a trace): the op classes on the trace, the call on the
    rows; print the error fitted on all rows and with each model left out, and write the device file."""
    import gzip

    from opweave.costs import calibrate as fit
    from opweave.costs import calibrated
    from opweave.pipeline.choose import benchmark_graph, replay

    rows = fit.read_rows(results)
    start = calibrated.Device.load(base or calibrated.device_path("h200"))
    traced = None
    if trace is not None:
        opener = gzip.open if trace.suffix == ".gz" else open
        try:
            with opener(trace, "rt") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read trace {str(trace)!r}: {exc}") from None
        name = (data.get("opweave") or {}).get("model")
        if not name:
            raise UsageError(f"{trace}: no 'opweave' entry naming the model (write it with scripts/dump_trace.py)")
        traced = (benchmark_graph(name, 1), data, name)
    log = (lambda text: None) if as_json else (lambda text: err.print(text, markup=False, highlight=False))
    weight = fit.RANK_WEIGHT if rank_weight is None else rank_weight
    dev, rep = fit.calibrate(rows, start, replay(), traced, iterations, leave_one_out, log, weight)
    target = output or calibrated.user_path("h200")
    target.parent.mkdir(parents=True, exist_ok=True)
    dev.save(target)
    if report is not None:
        report.write_text(json.dumps(rep, indent=1) + "\n")
    if as_json:
        print(json.dumps({"device": dev.to_dict(), "out": str(target), **rep}))
        return
    table = Table(title=f"{dev.name} fitted on {len(rows)} rows: mean |predicted / measured - 1| "
                        f"{rep['fitted']['mean_error']:.1%} (worst {rep['fitted']['max_error']:.1%})")
    for col in ("model", "batch", "dtype", "scheduler", "measured ms", "predicted ms", "error", "left out ms"):
        table.add_column(col, justify="left" if col in ("model", "dtype", "scheduler") else "right")
    for r in rep["rows"]:
        held = r.get("left_out_ms")
        table.add_row(r["model"], str(r["batch"]), r["dtype"], r["scheduler"], f"{r['measured_ms']:.3f}",
                      f"{r['predicted_ms']:.3f}", f"{r['predicted_ms'] / r['measured_ms'] - 1:+.1%}",
                      "" if held is None else f"{held:.3f}")
    out.print(table)
    params = ", ".join(f"{p} {getattr(dev, p):g}" for p in fit.CALL_PARAMS)
    out.print(f"call: {params}; memory efficiency {dev.mem_efficiency:g}")
    if "leave_one_model_out" in rep:
        out.print(f"leave-one-model-out: mean {rep['leave_one_model_out']['mean_error']:.1%}, worst "
                               f"{rep['leave_one_model_out']['max_error']:.1%}")
    out.print(f"wrote {target}")
