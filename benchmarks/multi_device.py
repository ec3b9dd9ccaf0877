"""HIOS on several devices for real: 1, 2 and 4 CPU rank processes (gloo) beside the simulator's prediction.

    .venv/bin/python benchmarks/multi_device.py [--quick] [--ranks 1,2,4] [--sizes inception_v3=512,...]
                                                [--runs N] [--scheduler hios-lp] [--out DIR]

For each model (default Inception-v3 at 512x512 and NASNet-A mobile at 448x448, batch 1; HIOS §VI goes up to
1280x1280, which takes minutes per forward pass on the 2-core machine this was written on, so smaller "large"
inputs are used) and each rank count M:

1. per-op latencies are measured on this machine with ``cores // M`` intra-op threads (the threads each rank gets;
   ``opweave.costs.profile.profile_model``), and the link between ranks is measured once (``profile-links``'s
   ping-pong, fitted to latency + bytes / bandwidth);
2. ``hios-lp`` schedules the graph on M devices with those costs; the simulator replays the plan (``ideal`` model:
   each device runs its ops at their measured latency, transfers cost the fitted link);
3. the plan runs on M rank processes (``opweave.pipeline.targets.RanksTarget``, what ``opweave.compile(...,
   devices=M)`` builds; ``threads = cores // M``): median latency of ``--runs`` calls after a warm-up.

Speedups are against 1 rank (measured/measured, simulated/simulated) and measured against single-process eager
(all cores). For comparison, the same graphs are also scheduled and simulated as they would run on 1, 2 and 4
H100 GPUs joined by NVLink 4 (roofline H100 latencies, the ``gpu`` contention model, the ``nvlink4`` link): what
this script cannot measure here. Writes ``DIR/multi_device.json``. Timings on a shared machine are noisy: the JSON
records the load average; compare numbers of one run only.

``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads (unless already set): on the shared, oversubscribed 2-core
machine, OpenMP's spinning waits made a forward pass run from the main thread (eager, the per-op profiler) 4-8x
slower than the same pass run from another thread (where the ranks run their ops), which would have compared
unlike things; with passive waits both take the same time.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see the docstring)

import statistics  # noqa: E402

import _common as common  # noqa: E402
import torch  # noqa: E402

from opweave.backends.distributed import profile_link  # noqa: E402
from opweave.backends.simulate import simulate  # noqa: E402
from opweave.capture import load  # noqa: E402
from opweave.cores import cores as usable_cores  # noqa: E402
from opweave.costs.links import fit  # noqa: E402
from opweave.costs.profile import profile_model  # noqa: E402
from opweave.costs.roofline import estimate  # noqa: E402
from opweave.evaluate.bench import median_ms  # noqa: E402
from opweave.outputs import compare  # noqa: E402
from opweave.pipeline import Options  # noqa: E402
from opweave.pipeline.targets import RanksTarget  # noqa: E402

DEFAULT_SIZES = "inception_v3=512,nasnet_a_mobile=448"
QUICK_SIZES = "squeezenet=64"


def measure_model(name: str, size: int, ranks: list[int], args, link) -> dict:
    cores = usable_cores()
    model, inputs, captured = load(name, image_size=size, coarsen=False)  # the captured ops, as measured so far
    torch.set_num_threads(cores)
    with torch.inference_mode():
        reference = model(*inputs)
    eager_ms = median_ms(model, inputs, runs=args.runs, warmup=1)
    rows = []
    for m in ranks:
        threads = max(1, cores // m)
        torch.set_num_threads(threads)
        profile = profile_model(captured, inputs, device="cpu", repeats=args.repeats, warmup=1)
        costs = profile.costs(captured.graph)
        options = Options(scheduler=args.scheduler, devices=m, costs=costs, link=link, threads=threads,
                          timeout_s=1800, coarsen=False)  # one rank too: the baseline the others are held against
        costs, sched, plan = RanksTarget().plan(captured, inputs, options)
        sim = simulate(captured.graph, plan, costs)
        with RanksTarget().build(captured, inputs, options) as fast:
            if fast.plan.instrs != plan.instrs:
                raise SystemExit(f"{name}: the plan run differs from the plan simulated")
            diff = compare(reference, fast(*inputs)).max_diff
            times = [median_ms(fast, inputs, runs=1, warmup=0) for _ in range(args.runs)]
            info = fast.backend.info
        rows.append({"ranks": m, "threads_per_rank": threads, "devices_used": sched.devices_used,
                     "measured_ms": statistics.median(times), "times_ms": times, "simulated_ms": sim.makespan_ms,
                     "sum_of_op_latencies_ms": sim.sequential_ms, "max_abs_diff": diff,
                     "messages": sum(i["messages"] for i in info), "ops_per_rank": [i["ops"] for i in info],
                     "param_mb_per_rank": [round(i["param_bytes"] / 1e6, 2) for i in info]})
    for row in rows:  # the same graph on H100 GPUs with NVLink 4, simulated
        h100, _, h100_plan = RanksTarget().plan(captured, inputs, Options(  # planned here, H100's costs
            scheduler=args.scheduler, devices=row["ranks"], link="nvlink4",
            costs=estimate(captured.graph, "h100", model="gpu")))
        row["simulated_h100_nvlink4_ms"] = simulate(captured.graph, h100_plan, h100).makespan_ms
    base = rows[0]
    for row in rows:
        row["measured_speedup_vs_1_rank"] = base["measured_ms"] / row["measured_ms"]
        row["simulated_speedup_vs_1_rank"] = base["simulated_ms"] / row["simulated_ms"]
        row["measured_speedup_vs_eager"] = eager_ms / row["measured_ms"]
        row["simulated_h100_speedup_vs_1_gpu"] = base["simulated_h100_nvlink4_ms"] / row["simulated_h100_nvlink4_ms"]
    return {"model": name, "image_size": size, "ops": len(captured.graph), "eager_ms": eager_ms,
            "eager_threads": cores, "rows": rows}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4", help="rank counts, the first is the base (default %(default)s)")
    p.add_argument("--sizes", help=f"model=image size, comma separated (default {DEFAULT_SIZES})")
    p.add_argument("--runs", type=int, default=3, help="timed calls per configuration (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="profiler repeats per op (default %(default)s)")
    p.add_argument("--scheduler", default="hios-lp", choices=["hios-lp", "hios-mr"])
    args = p.parse_args()
    clock = common.Stopwatch()
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [(n, int(s)) for n, s in (item.split("=") for item in (args.sizes or (QUICK_SIZES if args.quick
                                                                                   else DEFAULT_SIZES)).split(","))]
    if args.quick:
        ranks, args.runs, args.repeats = ranks[:2], 1, 1
    samples = profile_link("cpu", [2 ** k for k in range(4, 25, 2)], repeats=5 if args.quick else 20)
    link = fit(samples, name="measured-loopback", source="benchmarks/multi_device.py")
    common.console.print(f"link: {link.latency_ms:.3f} ms + bytes / {link.bandwidth_gbs:.2f} GB/s (gloo, loopback)")
    results = []
    for name, size in sizes:
        result = measure_model(name, size, ranks, args, link)
        results.append(result)
        common.console.print(common.table(
            f"{name} {size}x{size}, {result['ops']} ops, {args.scheduler}: eager {result['eager_ms']:.0f} ms "
            f"({result['eager_threads']} threads)",
            ["ranks", "threads/rank", "devices used", "messages", "measured ms", "simulated ms", "measured speedup",
             "simulated speedup", "vs eager", "max |diff|", "H100 sim speedup"],
            [[str(r["ranks"]), str(r["threads_per_rank"]), str(r["devices_used"]), str(r["messages"]),
              f"{r['measured_ms']:.0f}", f"{r['simulated_ms']:.0f}", f"{r['measured_speedup_vs_1_rank']:.2f}x",
              f"{r['simulated_speedup_vs_1_rank']:.2f}x", f"{r['measured_speedup_vs_eager']:.2f}x",
              f"{r['max_abs_diff']:.1e}", f"{r['simulated_h100_speedup_vs_1_gpu']:.2f}x"] for r in result["rows"]]))
    common.write_json(args.out / ("multi_device_quick.json" if args.quick else "multi_device.json"), {
        "benchmark": "multi_device", "machine": common.machine_info(), "wall_s": clock.elapsed_s,
        "settings": {"scheduler": args.scheduler, "ranks": ranks, "runs": args.runs, "profile_repeats": args.repeats,
                     "cost_model": "ideal", "backend": "gloo rank processes on one machine",
                     "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
        "link": {"latency_ms": link.latency_ms, "bandwidth_gbs": link.bandwidth_gbs, "samples": link.samples},
        "results": results})


if __name__ == "__main__":
    main()
