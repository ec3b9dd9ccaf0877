"""GPG against IOS's DP on combined blocks of 1-6 sub-blocks (TOP §VI-C, Fig. 13): scheduling time and makespan.

    .venv/bin/python benchmarks/top_gpg.py [--quick] [--graphs N] [--models ...]

For each k = 1..6: ``--graphs`` combined blocks of k distinct random ``(model, block)`` sub-blocks of the zoo
models (each at a random batch of 1-16), side by side as the serving engine combines them, with the simulated
executor's roofline costs (H100 preset, ``gpu`` contention model). Both schedulers search the same space (IOS's
chunks, r = 3, s = 8); ``top-gpg`` uses the shipped weights, loaded once before timing. Scheduling time is the
median of ``--repeats`` calls of ``schedulers.run`` (one intra-op torch thread for GPG, as it runs); the makespan is
the schedule's predicted latency under the cost model (sum of its stages). A schedule also passes the validator and
GPG's makespan is never below the DP's (it searches the same space): ``ok`` says so. The machine is shared and
timings are noisy. Writes ``top_gpg.json`` and ``top_gpg.png``.
"""

from __future__ import annotations

import statistics

import _common as common

from opweave import schedulers
from opweave.api import plan_for
from opweave.learn.gpg import GpgGraphs
from opweave.schedulers import top_gpg

MODELS = ("inception_v3", "resnet50", "squeezenet")


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--graphs", type=int, default=None, help="graphs per sub-block count (default 5; quick 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    graphs_per_k = args.graphs or (2 if args.quick else 5)
    models = common.split_names(args.models, MODELS, "model") or (["squeezenet"] if args.quick else list(MODELS))
    clock = common.Stopwatch()
    source = GpgGraphs.from_zoo(models, preset=args.preset, seed=args.seed)
    top_gpg.load()  # the weights, once
    rows = []
    for k in range(1, 7):
        for _ in range(graphs_per_k):
            graph, costs = source.random_combined(k)
            entry = {"sub_blocks": k, "graph": graph.name, "ops": len(graph)}
            for name in ("ios", "top-gpg"):
                times, sched = [], None
                for _ in range(args.repeats):
                    sched = schedulers.run(name, graph, costs)
                    times.append(sched.scheduling_time_s)
                plan_for(graph, costs, name)  # lowers and validates
                entry[name] = {"time_ms": round(statistics.median(times) * 1e3, 3),
                               "makespan_ms": round(sched.predicted_ms, 5), "stages": len(set(sched.stage_of.values()))}
            entry["gpg_over_dp"] = round(entry["top-gpg"]["makespan_ms"] / entry["ios"]["makespan_ms"], 4)
            entry["speedup"] = round(entry["ios"]["time_ms"] / entry["top-gpg"]["time_ms"], 2)
            entry["ok"] = entry["top-gpg"]["makespan_ms"] >= entry["ios"]["makespan_ms"] - 1e-6
            rows.append(entry)
            common.console.print(f"k={k} {graph.name}: {len(graph)} ops, DP {entry['ios']['time_ms']:.1f} ms "
                                 f"-> {entry['ios']['makespan_ms']:.4f}, GPG {entry['top-gpg']['time_ms']:.1f} ms "
                                 f"-> {entry['top-gpg']['makespan_ms']:.4f}")
    summary = []
    for k in range(1, 7):
        mine = [r for r in rows if r["sub_blocks"] == k]
        summary.append({"sub_blocks": k, "graphs": len(mine), "ops": round(statistics.mean(r["ops"] for r in mine), 1),
                        "dp_time_ms": round(statistics.median(r["ios"]["time_ms"] for r in mine), 2),
                        "gpg_time_ms": round(statistics.median(r["top-gpg"]["time_ms"] for r in mine), 2),
                        "speedup": round(statistics.median(r["speedup"] for r in mine), 2),
                        "gpg_over_dp": round(statistics.mean(r["gpg_over_dp"] for r in mine), 4),
                        "worst_gpg_over_dp": max(r["gpg_over_dp"] for r in mine)})
    out = {"settings": {"models": models, "preset": args.preset, "cost_model": "gpu", "graphs_per_k": graphs_per_k,
                        "repeats": args.repeats, "seed": args.seed, "max_group_ops": 3, "max_groups": 8,
                        "weights": str(top_gpg.DEFAULT_WEIGHTS.name)},
           "machine": common.machine_info(), "elapsed_s": clock.elapsed_s, "summary": summary, "results": rows,
           "paper_reference": "TOP Fig. 13 (A100 server): DP's optimization time grows exponentially with the "
                              "number of sub-blocks; trained GPG's is about an order of magnitude lower at the "
                              "larger sizes, its performance slightly lower than DP's."}
    cols = ["sub-blocks", "graphs", "ops", "DP time ms", "GPG time ms", "speed-up", "GPG / DP makespan", "worst"]
    common.console.print(common.table("GPG vs IOS-DP on combined blocks (TOP Fig. 13)", cols, [
        [str(s["sub_blocks"]), str(s["graphs"]), f"{s['ops']:.0f}", f"{s['dp_time_ms']:.1f}", f"{s['gpg_time_ms']:.1f}",
         f"{s['speedup']:.1f}x", f"{s['gpg_over_dp']:.3f}", f"{s['worst_gpg_over_dp']:.3f}"] for s in summary]))
    common.write_json(args.out / "top_gpg.json", out)
    plot(out, args.out / "top_gpg.png")


def plot(out: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [s["sub_blocks"] for s in out["summary"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(ks, [s["dp_time_ms"] for s in out["summary"]], marker="o", label="IOS DP")
    left.plot(ks, [s["gpg_time_ms"] for s in out["summary"]], marker="o", label="GPG (top-gpg)")
    left.set(xlabel="sub-blocks in the combined block", ylabel="scheduling time (ms, median)", yscale="log",
             title="optimization time")
    right.bar(ks, [s["gpg_over_dp"] for s in out["summary"]], color="tab:orange")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(xlabel="sub-blocks in the combined block", ylabel="GPG makespan / DP makespan",
              ylim=(0.95, max(1.1, max(s["worst_gpg_over_dp"] for s in out["summary"]) + 0.02)),
              title="effectiveness")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("GPG vs IOS-DP (TOP Fig. 13), simulated H100 costs")
    common.save_figure(fig, path)


if __name__ == "__main__":
    main()
