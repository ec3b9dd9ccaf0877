"""The ``opweave`` command line (DESIGN.md §3). Bad input exits with status 2 and one line on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from opweave import schedulers
from opweave.costs import COST_MODELS, Costs, from_graph
from opweave.ir import GraphError, OpGraph

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Inter-operator parallel DNN inference: schedule, simulate and run models on many streams.")
out = Console()
err = Console(stderr=True)


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


def _fail(message: str) -> None:
    err.print(f"opweave: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _guard(fn):
    """Turn the library's input errors into the CLI contract: one line on stderr, exit 2."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UsageError, GraphError, ValueError, KeyError, ImportError, FileNotFoundError) as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            _fail(str(message).splitlines()[0] if str(message) else type(exc).__name__)

    return wrapper


# ---- shared options -----------------------------------------------------------------------------------------------
GraphArg = Annotated[str | None, typer.Argument(help="graph JSON file or example name (e.g. lios-fig3)")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="zoo model name instead of a graph")]
StreamsOpt = Annotated[int | None, typer.Option("--streams", min=1, help="max streams per device")]
DevicesOpt = Annotated[int, typer.Option("--devices", min=1, help="number of devices")]
CostOpt = Annotated[str, typer.Option("--cost-model", help="ideal | gpu")]
PresetOpt = Annotated[str, typer.Option("--preset", help="device preset for zoo models' estimated latencies")]
BatchOpt = Annotated[int, typer.Option("--batch-size", min=1)]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="measured profile (opweave profile) for --model")]


def load_graph(graph: str | None, model: str | None, *, batch_size: int = 1, preset: str = "h100",
               profile: Path | None = None) -> OpGraph:
    """A graph from a JSON file, a shipped example, or a captured zoo model with roofline latencies (measured ones
    from ``profile``)."""
    from opweave import examples

    if (graph is None) == (model is None):
        raise UsageError("give a GRAPH (file or example name) or --model NAME, not both")
    if profile is not None and model is None:
        raise UsageError("--profile goes with --model (a graph file carries its own latencies)")
    if model is not None:
        from opweave import zoo
        from opweave.capture import capture
        from opweave.roofline import with_estimates

        module, inputs = zoo.create(model, batch_size=batch_size)
        estimated = with_estimates(capture(module, inputs, name=model).graph, preset)
        if profile is None:
            return estimated
        from opweave.profile import Profile

        measured = Profile.load(profile)
        if measured.key.get("model") != model:
            raise UsageError(f"{profile} was measured for model {measured.key.get('model')!r}, not {model!r}")
        return measured.apply(estimated)
    if graph in examples.names():
        return examples.load(graph)
    if not Path(graph).exists():
        raise UsageError(f"no graph file {graph!r} (examples: {', '.join(examples.names())})")
    return OpGraph.load(graph)


def graph_costs(graph: OpGraph, cost_model: str) -> Costs:
    if cost_model not in COST_MODELS:
        raise UsageError(f"unknown cost model {cost_model!r}; choose one of {', '.join(COST_MODELS)}")
    return from_graph(graph, model=cost_model)


def _scheduler_names(name: str) -> list[str]:
    if name == "all":
        return schedulers.names()
    if name not in schedulers.names():
        raise UsageError(f"unknown scheduler {name!r}; choose one of {', '.join(schedulers.names())} or all")
    return [name]


def run_one(graph: OpGraph, costs: Costs, name: str, streams: int | None, devices: int):
    """Schedule, lower, validate and replay one scheduler: (schedule, plan, simulation result)."""
    from opweave.api import plan_for
    from opweave.simulate import simulate

    sched, plan = plan_for(graph, costs, name, streams=streams,
                           devices=devices if name in schedulers.MULTI_DEVICE else 1)
    return sched, plan, simulate(graph, plan, costs)


def schedule_json(sched, plan, sim) -> dict:
    return {
        "scheduler": sched.scheduler, "makespan_ms": sim.makespan_ms, "sequential_ms": sim.sequential_ms,
        "scheduling_time_s": sched.scheduling_time_s, "streams_used": sched.streams_used,
        "devices_used": sched.devices_used, "syncs": plan.syncs,
        "ops": [{"id": o, "device": sched.device(o), "stream": sched.stream_of[o],
                 "stage": None if sched.stage_of is None else sched.stage_of[o],
                 "start_ms": sim.start_ms[o], "finish_ms": sim.finish_ms[o]} for o in sched.order],
        "plan": plan.to_list(),
    }


# ---- commands -----------------------------------------------------------------------------------------------------
@app.command()
@_guard
def schedule(graph: GraphArg = None, scheduler: Annotated[str, typer.Option("--scheduler", "-s")] = "lios",
             streams: StreamsOpt = None, devices: DevicesOpt = 1, cost_model: CostOpt = "ideal",
             model: ModelOpt = None, batch_size: BatchOpt = 1, preset: PresetOpt = "h100",
             profile: ProfileOpt = None, as_json: JsonOpt = False):
    """Schedule a graph with one scheduler and show where each op runs."""
    g = load_graph(graph, model, batch_size=batch_size, preset=preset, profile=profile)
    (name,) = _scheduler_names(scheduler)
    sched, plan, sim = run_one(g, graph_costs(g, cost_model), name, streams, devices)
    result = schedule_json(sched, plan, sim)
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"{name} on {g.name}: makespan {sim.makespan_ms:.3f} ms (sequential {sim.sequential_ms:.3f})")
    for col in ("op", "device", "stream", "stage", "start ms", "finish ms"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for row in result["ops"]:
        stage = "" if row["stage"] is None else str(row["stage"])
        table.add_row(row["id"], str(row["device"]), str(row["stream"]), stage, f"{row['start_ms']:.3f}",
                      f"{row['finish_ms']:.3f}")
    out.print(table)
    out.print(f"streams {sched.streams_used}, devices {sched.devices_used}, syncs {plan.syncs}, "
              f"scheduling time {sched.scheduling_time_s * 1e3:.2f} ms")


@app.command()
@_guard
def simulate(graph: GraphArg = None, scheduler: Annotated[str, typer.Option("--scheduler", "-s")] = "all",
             streams: StreamsOpt = None, devices: DevicesOpt = 1, cost_model: CostOpt = "ideal",
             model: ModelOpt = None, batch_size: BatchOpt = 1, preset: PresetOpt = "h100",
             profile: ProfileOpt = None,
             gantt: Annotated[Path | None, typer.Option(help="write a Gantt chart PNG (one scheduler)")] = None,
             trace: Annotated[Path | None, typer.Option(help="write a Chrome trace JSON (one scheduler)")] = None,
             as_json: JsonOpt = False):
    """Compare schedulers on one graph: makespan, speedup over sequential, syncs, scheduling time."""
    from opweave import simulate as sim_mod

    g = load_graph(graph, model, batch_size=batch_size, preset=preset, profile=profile)
    names = _scheduler_names(scheduler)
    if (gantt or trace) and len(names) != 1:
        raise UsageError("--gantt and --trace need a single --scheduler")
    costs = graph_costs(g, cost_model)
    rows = []
    for name in names:
        sched, plan, sim = run_one(g, costs, name, streams, devices)
        rows.append({"scheduler": name, "makespan_ms": sim.makespan_ms, "sequential_ms": sim.sequential_ms,
                     "speedup": sim.sequential_ms / sim.makespan_ms if sim.makespan_ms else 1.0,
                     "streams_used": sched.streams_used, "devices_used": sched.devices_used, "syncs": plan.syncs,
                     "scheduling_time_s": sched.scheduling_time_s})
        if gantt:
            sim_mod.gantt(sim, gantt)
        if trace:
            sim_mod.chrome_trace(sim, trace)
    if as_json:
        print(json.dumps({"graph": g.name, "ops": len(g), "edges": len(g.edges), "cost_model": cost_model,
                          "critical_path_ms": g.critical_path_ms(), "results": rows}))
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
@_guard
def synth(ops: Annotated[int, typer.Option(min=1)] = 200, layers: Annotated[int, typer.Option(min=1)] = 14,
          edges: Annotated[int | None, typer.Option(help="default 2 x ops")] = None, seed: int = 0,
          comm_ratio: Annotated[float, typer.Option(help="transfer = max(0.1 ms, p x producer latency)")] = 0.8,
          output: Annotated[Path | None, typer.Option("-o", "--output", help="write here (default stdout)")] = None):
    """Write a HIOS-style random layered DAG (HIOS §V-A) as graph JSON."""
    from opweave.synth import random_dag

    g = random_dag(ops, layers, edges, seed, comm_ratio=comm_ratio)
    if output is None:
        print(json.dumps(g.to_dict()))
    else:
        g.save(output)
        err.print(f"wrote {output}: {len(g)} ops, {len(g.edges)} edges")


@app.command()
@_guard
def models(as_json: JsonOpt = False):
    """List the built-in model zoo."""
    from opweave import zoo

    if as_json:
        print(json.dumps(zoo.names()))
        return
    table = Table(title="opweave zoo (random weights, no downloads)")
    table.add_column("model")
    table.add_column("paper op/edge counts")
    for name in zoo.names():
        counts = zoo.PAPER_COUNTS.get(name)
        table.add_row(name, "" if counts is None else f"{counts[0]} / {counts[1]}")
    out.print(table)
    out.print("also: torchvision:<name>, timm:<name>, hf:<model-id> where those packages are installed")


@app.command()
@_guard
def bench(model: Annotated[str, typer.Option("--model")] = "inception_v3",
          device: Annotated[str, typer.Option(help="cpu | cuda | auto (cuda when present)")] = "cpu",
          batch_size: BatchOpt = 1,
          schedulers_: Annotated[str, typer.Option("--schedulers", help="comma list or all")] = "sequential,lios,opara",
          streams: StreamsOpt = None, runs: Annotated[int, typer.Option(min=1)] = 20,
          warmup: Annotated[int, typer.Option(min=0)] = 3,
          profile: Annotated[Path | None, typer.Option(help="schedule on this measured profile")] = None,
          as_json: JsonOpt = False):
    """Real runs: eager vs opweave with each scheduler, median latency after warm-up."""
    from opweave.bench import bench_model, resolve_device

    device = resolve_device(device)
    names = schedulers.names() if schedulers_ == "all" else [s.strip() for s in schedulers_.split(",") if s.strip()]
    for name in names:
        _scheduler_names(name)
    result = bench_model(model, device=device, batch_size=batch_size, scheduler_names=names, streams=streams,
                         runs=runs, warmup=warmup, progress=not as_json, profile=profile)
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"{model} batch {batch_size} on {result['device_name']} (median of {runs} runs, "
                        f"torch {result['torch']})")
    for col in ("mode", "median ms", "vs eager", "streams", "syncs", "max |diff|"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in result["rows"]:
        table.add_row(r["mode"], f"{r['median_ms']:.3f}", f"{r['speedup_vs_eager']:.2f}x",
                      "" if r.get("streams") is None else str(r["streams"]),
                      "" if r.get("syncs") is None else str(r["syncs"]),
                      "" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.1e}")
    out.print(table)


@app.command()
@_guard
def profile(model: Annotated[str, typer.Option("--model")] = "inception_v3",
            device: Annotated[str, typer.Option(help="cuda | cpu | auto")] = "cuda", batch_size: BatchOpt = 1,
            output: Annotated[Path | None, typer.Option("-o", "--output")] = None):
    """Measure each op's latency (and kernel resources on CUDA) and save a profile the cost model loads."""
    from opweave import zoo
    from opweave.bench import resolve_device
    from opweave.capture import capture
    from opweave.profile import profile_model

    device = resolve_device(device)
    module, inputs = zoo.create(model, batch_size=batch_size)
    module, inputs = module.to(device), tuple(x.to(device) for x in inputs)
    prof = profile_model(capture(module, inputs, name=model), inputs, device=device)
    path = output or Path(f"{model}-b{batch_size}-{device}.profile.json")
    prof.save(path)
    err.print(f"wrote {path}")


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
