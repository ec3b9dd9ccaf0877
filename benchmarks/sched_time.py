"""Scheduling time of every scheduler on every zoo graph and on HIOS-style random DAGs.

    .venv/bin/python benchmarks/sched_time.py [--quick] [--models a,b] [--schedulers x,y] [--out DIR]

Each cell is the median of ``Schedule.scheduling_time_s`` (the wall time of the scheduler function alone, measured
by ``opweave.schedulers.run``) over ``--reps`` runs in CPython, each cell in a forked child of this process (the
graph's cached topological order and reachability bitsets are built beforehand: every scheduler shares them). The
first run goes through ``opweave.cli.run_one``, so every timed schedule has also been lowered, validated and replayed
once. A scheduler whose runs add up to more than ``--rep-budget-s`` stops repeating early (its cell records how many
runs it had), and one that does not finish within ``--timeout-s`` is killed and shown as ``timeout``. Timings are
only as clean as the machine is idle: the JSON records the load average.

Zoo graphs are captured at ``--batch-size`` with the roofline latencies of ``--preset``; schedulers get ``ideal``
costs (``--cost-model``) and at most ``--streams`` streams. Synthetic graphs follow the HIOS preset (200 ops, 14
layers, 400 edges, seeds 0, 1, …).

The target: every polynomial scheduler (all but IOS, whose dynamic program is exponential in the graph's width)
schedules the largest zoo graph (nasnet_a_mobile, 906 ops) in under 100 ms (it once took 1 s). Writes
``DIR/sched_time.json`` with the machine, the settings, every run's time, the verdict on the target (key
``acceptance``) and, for context, the scheduling times the LIOS and Opara papers report.
"""

from __future__ import annotations

import statistics
import sys

import _common as common

from opweave import schedulers, zoo
from opweave.cli import graph_costs, run_one
from opweave.ir.synth import random_dag

EXPONENTIAL = ("ios",)
LIMIT_S = 0.1

# The papers' own scheduling times, as printed (numbers only), for context: different machines, graphs and code.
PAPER_REFERENCE = {
    "lios_table_v": {
        "paper": "LIOS (IEEE TSC 2023), Table V",
        "unit": "s",
        "measured": "scheduling time of IOS (dynamic programming) and LIOS (Alg. 1) per CNN of the IOS benchmark; "
                    "'speedup' is IOS time / LIOS time. Host: two Intel Xeon Gold 6226R @ 2.90 GHz, GPU RTX 3080 "
                    "(Sec. V-A). The CNNs are the IOS benchmark graphs (NASNet-A and RandWire large variants), "
                    "coarser and larger than opweave's captured zoo graphs.",
        "values": {
            "SqueezeNet": {"IOS": 0.34, "LIOS": 0.05, "speedup": 7},
            "InceptionNet-V3": {"IOS": 38.28, "LIOS": 0.27, "speedup": 142},
            "RandWire": {"IOS": 3775.94, "LIOS": 0.41, "speedup": 9210},
            "NASNet-A": {"IOS": 2782.66, "LIOS": 1.79, "speedup": 1554},
        },
    },
    "opara_table_i": {
        "paper": "Opara (IEEE TC 2024), Table I",
        "unit": "ms",
        "measured": "computation time of the stream allocation algorithm alone: Opara's Alg. 1 vs Nimble's "
                    "(minimum equivalent graph + bipartite matching), per model; host CPU not stated "
                    "(GPUs A100 and RTX 2080 SUPER, PyTorch 2.0).",
        "values": {
            "BERT": {"Opara": 0.58, "Nimble": 20.8},
            "GoogLeNet": {"Opara": 0.27, "Nimble": 5.80},
            "NASNet": {"Opara": 1.75, "Nimble": 257.83},
            "Inception-v3": {"Opara": 0.50, "Nimble": 14.40},
            "T5": {"Opara": 2.8, "Nimble": 161.4},
        },
    },
}


def measure(graph, costs, name: str, streams: int | None, devices: int, reps: int, budget_s: float) -> dict:
    """Scheduling times of ``reps`` runs (fewer once they add up to ``budget_s``)."""
    sched, plan, _ = run_one(graph, costs, name, streams, devices)
    times = [sched.scheduling_time_s]
    while len(times) < reps and sum(times) < budget_s:
        times.append(schedulers.run(name, graph, costs, streams=streams, devices=devices).scheduling_time_s)
    return {"times_s": times, "median_s": statistics.median(times), "reps": len(times),
            "streams_used": sched.streams_used, "devices_used": sched.devices_used, "syncs": plan.syncs}


def warm_structure(graph) -> None:
    """Build the graph's cached structure (topological order, reachability bitsets, adjacency) before forking.

    Every scheduler shares it and it is cached on the graph; built in a forked child it would be thrown away and
    charged to the first run of every scheduler.
    """
    for attr in ("op", "index", "preds", "succs", "edge", "topo_order", "descendants"):
        getattr(graph, attr)


def cell(result: dict, reps: int) -> str:
    if result["status"] != "ok":
        return result["status"]
    ms = result["median_s"] * 1e3
    text = f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"
    return text if result["reps"] >= reps else f"{text} ({result['reps']}x)"


def target_verdict(graphs: list[dict], results: list[dict], names: list[str]) -> dict:
    """Every polynomial scheduler under LIMIT_S on the zoo graph with the most ops."""
    zoo_graphs = [g for g in graphs if g["source"] == "zoo"] or graphs
    largest = max(zoo_graphs, key=lambda g: g["ops"])
    checked = [n for n in names if n not in EXPONENTIAL]
    by_name = {r["scheduler"]: r for r in results if r["graph"] == largest["name"]}
    failures = [{"scheduler": n, "status": by_name[n]["status"], "median_s": by_name[n].get("median_s")}
                for n in checked if by_name[n]["status"] != "ok" or by_name[n]["median_s"] >= LIMIT_S]
    return {"graph": largest["name"], "ops": largest["ops"], "limit_s": LIMIT_S, "schedulers": checked,
            "pass": not failures, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, help="runs per cell (default 5, quick 3)")
    p.add_argument("--rep-budget-s", type=float, default=10.0,
                   help="stop repeating once a cell's runs add up to this (default %(default)s)")
    p.add_argument("--synth", type=int, help="number of random DAGs (default 2, quick 1)")
    p.add_argument("--synth-ops", type=int, help="ops per random DAG (default 200, quick 50)")
    p.add_argument("--cost-model", default="ideal", choices=("ideal", "gpu"))
    p.add_argument("--devices", type=int, default=1, help="devices for the multi-device schedulers")
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    synth_count = args.synth if args.synth is not None else (1 if args.quick else 2)
    synth_ops = args.synth_ops or (50 if args.quick else 200)
    names = common.scheduler_names(args)
    streams = common.stream_cap(args)
    clock = common.Stopwatch()

    graphs, loaded = [], []
    models = common.model_names(args)
    with common.progress() as bar:
        task = bar.add_task("capturing", total=len(models))
        for model in models:
            bar.update(task, description=f"capturing {model}")
            graph = common.load(model, args)
            loaded.append(graph)
            graphs.append({"name": model, "source": "zoo" if model in zoo.names() else "file",
                           "ops": len(graph), "edges": len(graph.edges)})
            bar.advance(task)
    for seed in range(synth_count):
        graph = random_dag(synth_ops, min(14, synth_ops), 2 * synth_ops, seed)
        loaded.append(graph)
        graphs.append({"name": graph.name, "source": "synth", "ops": len(graph), "edges": len(graph.edges)})

    results = []
    with common.progress() as bar:
        task = bar.add_task("scheduling", total=len(loaded) * len(names))
        for info, graph in zip(graphs, loaded, strict=True):
            costs = graph_costs(graph, args.cost_model)
            warm_structure(graph)
            for name in names:
                bar.update(task, description=f"{name} on {info['name']}")
                status, value = common.run_limited(
                    measure, (graph, costs, name, streams, common.devices_for(name, args.devices), reps,
                              args.rep_budget_s), args.timeout_s)
                row = {"graph": info["name"], "scheduler": name, "status": status}
                row.update(value if status == "ok" else {"error": value} if status == "error" else {})
                results.append(row)
                bar.advance(task)

    title = (f"median scheduling time (ms) over {reps} runs, {args.cost_model} costs, "
             f"streams {'uncapped' if streams is None else f'<= {streams}'}")
    rows = [[g["name"], str(g["ops"]), str(g["edges"])]
            + [cell(next(r for r in results if r["graph"] == g["name"] and r["scheduler"] == n), reps) for n in names]
            for g in graphs]
    common.console.print(common.table(title, ["graph", "ops", "edges", *names], rows,
                                      caption=f"(Nx) = only N runs fitted in {args.rep_budget_s:g} s"))
    errors = [r for r in results if r["status"] == "error"]
    for r in errors:
        common.console.print(f"[red]error[/red] {r['scheduler']} on {r['graph']}: {r['error']}", markup=True)

    verdict = target_verdict(graphs, results, names)
    worst = max((r["median_s"] for r in results if r["graph"] == verdict["graph"] and r["status"] == "ok"
                 and r["scheduler"] in verdict["schedulers"]), default=float("nan"))
    failing = ", ".join(f["scheduler"] for f in verdict["failures"])
    common.console.print(f"{'PASS' if verdict['pass'] else 'FAIL'}: every polynomial scheduler "
                         f"({', '.join(verdict['schedulers'])}) under {LIMIT_S * 1e3:g} ms on the largest zoo graph "
                         f"{verdict['graph']} ({verdict['ops']} ops); slowest {worst * 1e3:.1f} ms"
                         + (f"; failing: {failing}" if failing else ""), soft_wrap=True)

    common.write_json(args.out / "sched_time.json", {
        "benchmark": "sched_time",
        "machine": common.machine_info(),
        "settings": {"quick": args.quick, "reps": reps, "rep_budget_s": args.rep_budget_s,
                     "timeout_s": args.timeout_s, "cost_model": args.cost_model, "streams": streams,
                     "devices": args.devices, "preset": args.preset, "batch_size": args.batch_size,
                     "synth": {"count": synth_count, "ops": synth_ops, "layers": min(14, synth_ops),
                               "edges": 2 * synth_ops}},
        "definition": "median over runs of Schedule.scheduling_time_s (wall time of the scheduler function in "
                      "CPython, lowering and validation excluded), seconds",
        "schedulers": names,
        "graphs": graphs,
        "results": results,
        "acceptance": verdict,
        "paper_reference": PAPER_REFERENCE,
        "wall_s": clock.elapsed_s,
    })
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
