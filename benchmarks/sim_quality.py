"""Schedule quality in the simulator: every scheduler on every zoo graph, under both cost models.

    .venv/bin/python benchmarks/sim_quality.py [--quick] [--models a,b] [--schedulers x,y] [--out DIR]

For each cost model (``ideal``, ``gpu``; see ``opweave.costs``) the scheduler gets that model's costs, its plan is
lowered, validated and replayed by ``opweave.backends.simulate`` (through ``opweave.cli.run_one``), and the table shows

* **makespan / lower bound**, where lower bound = max(critical path, total work / k): the critical path is the
  longest chain of op latencies, total work the sum of all op latencies, and k the number of streams the schedule
  may use: the ``--streams`` cap (default 8) times the devices the scheduler was given, or, with ``--streams 0``
  (no cap), the streams the scheduler actually used. No schedule on k FIFO streams beats this bound under either
  model (the ``gpu`` model only slows ops down and adds overheads), so 1.00 is optimal and the ratio is how far a
  schedule is from it at most;
* **speedup** = sequential / makespan, both replayed under the same cost model (sequential = every op on one stream
  in capture order).

Zoo graphs are captured at ``--batch-size`` with the roofline latencies (and utilizations) of ``--preset``. Writes
``DIR/sim_quality.json`` and ``DIR/sim_quality.png`` (speedup over sequential per model and scheduler, ``gpu`` model).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import _common as common

from opweave.cli import graph_costs, run_one
from opweave.costs import COST_MODELS


def replay(graph, costs, name: str, streams: int | None, devices: int) -> dict:
    sched, plan, sim = run_one(graph, costs, name, streams, devices)
    return {"makespan_ms": sim.makespan_ms, "sequential_ms": sim.sequential_ms, "predicted_ms": sched.predicted_ms,
            "streams_used": sched.streams_used, "devices_used": sched.devices_used, "syncs": plan.syncs,
            "scheduling_time_s": sched.scheduling_time_s}


def with_bound(row: dict, critical_path_ms: float, total_work_ms: float, streams: int | None, devices: int) -> dict:
    """Add the lower bound max(critical path, work / k), the makespan's ratio to it, and the speedup."""
    k = streams * devices if streams is not None else row["streams_used"]
    bound_ms = max(critical_path_ms, total_work_ms / k)
    row.update(streams_for_bound=k, lower_bound_ms=bound_ms,
               ratio_to_bound=row["makespan_ms"] / bound_ms if bound_ms > 0 else 1.0,
               speedup=row["sequential_ms"] / row["makespan_ms"] if row["makespan_ms"] > 0 else 1.0)
    return row


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary(results: list[dict], names: list[str]) -> dict:
    """Geometric means over graphs, per cost model and scheduler (only cells that ran)."""
    out: dict = {}
    for model in {r["cost_model"] for r in results}:
        for name in names:
            ok = [r for r in results if r["cost_model"] == model and r["scheduler"] == name and r["status"] == "ok"]
            out.setdefault(model, {})[name] = {
                "graphs": len(ok), "geomean_speedup": geomean([r["speedup"] for r in ok]),
                "geomean_ratio_to_bound": geomean([r["ratio_to_bound"] for r in ok])}
    return out


def print_table(model: str, graphs: list[dict], results: list[dict], names: list[str], means: dict,
                streams: int | None) -> None:
    def cell(r: dict) -> str:
        return f"{r['ratio_to_bound']:.3f} {r['speedup']:.2f}x" if r["status"] == "ok" else r["status"]

    rows = []
    for g in graphs:
        mine = {r["scheduler"]: r for r in results if r["cost_model"] == model and r["graph"] == g["name"]}
        seq = next((r["sequential_ms"] for r in mine.values() if r["status"] == "ok"), float("nan"))
        rows.append([g["name"], str(g["ops"]), f"{seq:.3f}", f"{g['critical_path_ms'][model]:.3f}",
                     f"{g['total_work_ms'][model]:.3f}"] + [cell(mine[n]) for n in names])
    rows.append(["geomean", "", "", "", ""] + [f"{means[model][n]['geomean_ratio_to_bound']:.3f} "
                                               f"{means[model][n]['geomean_speedup']:.2f}x" for n in names])
    k = "the streams each scheduler used" if streams is None else f"{streams} streams"
    common.console.print(common.table(
        f"cost model {model}: makespan / lower bound, speedup over sequential",
        ["graph", "ops", "seq ms", "crit ms", "work ms", *names], rows,
        caption=f"lower bound = max(critical path, work / k), k = {k}; 1.000 is optimal"))


def bar_chart(path: Path, graphs: list[dict], results: list[dict], names: list[str], model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.4 * len(graphs) + 2), 4.5))
    for i, name in enumerate(names):
        speedups = [next((r["speedup"] for r in results if r["cost_model"] == model and r["graph"] == g["name"]
                          and r["scheduler"] == name and r["status"] == "ok"), 0.0) for g in graphs]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(graphs))], speedups, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(graphs)), [g["name"] for g in graphs], rotation=20, ha="right")
    ax.set_ylabel("speedup over sequential (simulated)")
    ax.set_title(f"simulated speedup over sequential, {model} cost model")
    ax.legend(ncol=min(4, len(names)), fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    common.console.print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--cost-models", default=",".join(COST_MODELS), help="comma list (default %(default)s)")
    p.add_argument("--devices", type=int, default=1, help="devices for the multi-device schedulers")
    args = p.parse_args(argv)
    names = common.scheduler_names(args)
    cost_models = common.split_names(args.cost_models, COST_MODELS, "cost model")
    streams = common.stream_cap(args)
    clock = common.Stopwatch()

    models = common.model_names(args)
    graphs, loaded, results = [], [], []
    with common.progress() as bar:
        task = bar.add_task("capturing", total=len(models))
        for model in models:
            bar.update(task, description=f"capturing {model}")
            loaded.append(common.load(model, args))
            bar.advance(task)
        task = bar.add_task("simulating", total=len(models) * len(cost_models) * len(names))
        for model, graph in zip(models, loaded, strict=True):
            info = {"name": model, "ops": len(graph), "edges": len(graph.edges), "critical_path_ms": {},
                    "total_work_ms": {}}
            graphs.append(info)
            for cost_model in cost_models:
                costs = graph_costs(graph, cost_model)
                critical_ms = info["critical_path_ms"][cost_model] = graph.critical_path_ms(costs.latency_ms)
                work_ms = info["total_work_ms"][cost_model] = graph.total_work_ms(costs.latency_ms)
                for name in names:
                    bar.update(task, description=f"{cost_model}: {name} on {model}")
                    devices = common.devices_for(name, args.devices)
                    status, value = common.run_limited(replay, (graph, costs, name, streams, devices), args.timeout_s)
                    row = {"cost_model": cost_model, "graph": model, "scheduler": name, "status": status}
                    if status == "ok":
                        row = with_bound({**row, **value}, critical_ms, work_ms, streams, devices)
                    elif status == "error":
                        row["error"] = value
                    results.append(row)
                    bar.advance(task)

    means = summary(results, names)
    for cost_model in cost_models:
        print_table(cost_model, graphs, results, names, means, streams)
    errors = [r for r in results if r["status"] == "error"]
    for r in errors:
        common.console.print(f"[red]error[/red] {r['scheduler']} on {r['graph']} ({r['cost_model']}): {r['error']}")

    if "gpu" in cost_models:
        bar_chart(args.out / "sim_quality.png", graphs, results, names, "gpu")
    common.write_json(args.out / "sim_quality.json", {
        "benchmark": "sim_quality",
        "machine": common.machine_info(),
        "settings": {"quick": args.quick, "cost_models": cost_models, "streams": streams, "devices": args.devices,
                     "preset": args.preset, "batch_size": args.batch_size, "timeout_s": args.timeout_s},
        "definitions": {
            "lower_bound_ms": "max(critical_path_ms, total_work_ms / streams_for_bound); streams_for_bound = the "
                              "--streams cap x the devices the scheduler was given, or the scheduler's own "
                              "streams_used when uncapped (--streams 0)",
            "ratio_to_bound": "makespan_ms / lower_bound_ms (>= 1; 1 is optimal)",
            "speedup": "sequential_ms / makespan_ms, both simulated under the same cost model",
        },
        "schedulers": names,
        "graphs": graphs,
        "results": results,
        "summary": means,
        "wall_s": clock.elapsed_s,
    })
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
