"""Serving policies on TOP's task arrival patterns (TOP §VI-B, Table II): static, batch and heuristic, and (cpu
mode) the same models on Ray Serve as a peer.

    .venv/bin/python benchmarks/serving.py [--mode sim|cpu|gpu] [--quick] [--duration S] [--policies ...]

Patterns (TOP Table II): one model alone at 240 FPS (Inception-v3, ResNet-50, SqueezeNet, each its own pattern)
and the three models together at 30 + 60 + 120 FPS; each also at double rate, as TOP runs its server. For every
pattern and policy: throughput, p50/p99 latency, queue-length variance over time (per model, averaged over the
models; and TOP's sigma, the variance across the queues) at scale 1 and 2, and the **highest sustainable rate**:
the largest scale of the pattern at which the 99th percentile of every sent request's latency, a rejected (429) or
timed-out request counting as infinitely late, stays under the bound (``--slo-ms``). Found by doubling from scale 1
until it fails, then bisecting to within ``--tolerance`` (3 %); the rate found is then run ``--repeats`` times in
all (3), and it stands only if every repeat keeps the bound (otherwise the search goes on below it); the repeats'
spread (throughput and p99, min and max) is reported. Every probe lasts long enough to send at least
``--min-requests`` (300) requests at its rate. Arrivals are Poisson (seeded, another seed per repeat), every run
starts with empty queues.
Patterns run one after another, every policy of a pattern before the next (``--patterns`` picks them and their
order), so the policies of a pattern are measured close together in time; the runs at scale 1 and 2 are the search's
first two probes (made once). The JSON is rewritten after every pattern-policy entry (``complete`` false until the
end): a run cut short keeps what it measured.

Modes:

* ``sim`` (default) — the engine on the simulated executor: H100 roofline preset, ``gpu`` contention cost model,
  lios inside each combined block, 0.03 ms per step of overhead (an assumption; see SimExecutor); the zoo models at
  their published input sizes; ``--duration`` seconds of virtual time per run. Writes ``serving_sim.json``/``.png``.
* ``cpu`` — ``opweave serve --device cpu`` in a subprocess on 127.0.0.1 (one per policy; its default executor:
  every block compiled whole by ONNX Runtime, parts of a combined block side by side on one lane per core), loaded
  by the HTTP load generator (``opweave.serve.loadgen.run_http``) of this process; the patterns' rates divided by
  ``--cpu-divisor`` (default 40) as the search's starting point, the models at their published input sizes
  (Inception-v3 299, the others 224; ``--image-size`` to change). The peer ``ray``: the same models on Ray Serve
  (``benchmarks/ray_peer.py``: one deployment per model running eager PyTorch, ``@serve.batch`` with max batch 16),
  its batch wait (``batch_wait_timeout_s``) tuned over ``--ray-waits`` (the best sustainable rate is kept). Writes
  ``serving_cpu.json``/``.png``. The machine is shared: timings are noisy.
* ``gpu`` — the same against ``opweave serve --device cuda`` at TOP's own rates (needs a GPU; not run here).

Every server and engine uses max batch 16, queues of 64, H = 4 sub-blocks per combined block.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import _common as common

from opweave.serve import loadgen
from opweave.testing.loads import model_latency_ms, sustainable

SINGLE_RATE = 240.0
MULTI = {"inception_v3": 30.0, "resnet50": 60.0, "squeezenet": 120.0}
MODELS = ("inception_v3", "resnet50", "squeezenet")
POLICIES = ("static", "batch", "heuristic")
PEERS = ("ray",)
SLO_MS = 100.0  # TOP serves on a GPU; on 2 CPU cores one Inception-v3 request alone takes ~150 ms
CPU_SLO_MS = 1000.0
MAX_BATCH, MAX_QUEUE, H = 16, 64, 4


def patterns(models: list[str]) -> dict[str, dict[str, float]]:
    out = {f"{m}:{SINGLE_RATE:g}": {m: SINGLE_RATE} for m in models}
    if set(MULTI) <= set(models):
        out["multi:30+60+120"] = dict(MULTI)
    return out


def row(rep: dict, slo_ms: float) -> dict:
    """The table's numbers of one report; sustainable when p99 of all sent stays under ``slo_ms``."""
    t = rep["total"]
    return {"throughput_rps": round(t["throughput_rps"], 2), "p50_ms": round(t["p50_ms"], 3),
            "p99_ms": round(t["p99_ms"], 3), "p99_all_ms": t["p99_all_ms"] if math.isfinite(t["p99_all_ms"])
            else None, "sent": t["sent"], "answered": t["answered"], "rejected": t["rejected"],
            "timeouts": t["timeouts"], "errors": t["errors"],
            "queue_var_time": round(sum(m["queue_var"] for m in rep["models"].values()) / len(rep["models"]), 3),
            "queue_var_across": round(rep["queue_variance"], 3), "sustainable": sustainable(rep, slo_ms)}


def search(measure, *, max_scale: float = 512.0, tolerance: float = 1.03,
           repeats: int = 1) -> tuple[float, list[tuple[float, dict]]]:
    """Largest sustainable scale (0 if even 1/64 is not), and every probe (scale, row). A scale is sustainable when
    ``repeats`` runs at it (``measure(scale, repeat)``) all keep the bound: the first run steers the search, the
    others are made at the scale the search ends on, and if one fails the search goes on below that scale."""
    probes: list[tuple[float, dict]] = []

    def run(scale: float, repeat: int = 0) -> bool:
        r = measure(scale, repeat)
        probes.append((scale, r))
        return r["sustainable"]

    best = largest(run, tolerance, max_scale)
    while best > 0 and not all(run(best, k) for k in range(1, repeats)):
        best = largest(run, tolerance, max_scale, fails=best)
    return best, probes


def largest(ok, tolerance: float, max_scale: float, fails: float | None = None) -> float:
    """The largest scale ``ok`` accepts, to within ``tolerance``: doubling from 1 (halving when 1 fails, or from
    ``fails``, a scale known to fail) to a bracket, then bisecting it geometrically."""
    lo, hi = 0.0, fails
    scale = 1.0 if fails is None else fails / 2
    while True:
        if ok(scale):
            lo = scale
            if hi is not None:
                break
            if scale >= max_scale:
                return lo
            scale *= 2
        else:
            hi = scale
            if lo:
                break
            if scale <= 1 / 64:
                return 0.0
            scale /= 2
    while hi / lo > tolerance:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---- simulation -------------------------------------------------------------------------------------------------
def sim_runner(args, models: list[str]):
    from opweave.serve.assemble import load_models, serving_options
    from opweave.serve.engine import Engine, policies
    from opweave.serve.engine.simulation import SimClock, SimExecutor

    start = time.perf_counter()
    served = load_models(models, device="sim", max_batch=MAX_BATCH)
    common.console.print(f"loaded {', '.join(models)} in {time.perf_counter() - start:.0f} s")
    executor = SimExecutor({n: m.blocked for n, m in served.items()}, serving_options("sim"), preset=args.preset)
    blocks = {n: len(m.blocked.blocks) for n, m in served.items()}

    def measure(policy: str, pattern: dict[str, float], scale: float, repeat: int = 0) -> dict:
        engine = Engine(executor, policies.create(policy), SimClock(), max_queue=MAX_QUEUE, max_batch=MAX_BATCH,
                        max_sub_blocks=H)
        duration = max(args.duration, args.min_requests * 1.1 / (scale * sum(pattern.values())))
        rep, _ = loadgen.run_simulated(engine, pattern, duration, seed=args.seed + repeat, scale=scale)
        return row(rep, args.slo_ms)

    def explain(policy: str, pattern: dict[str, float], scale: float) -> dict:
        """Where a run at ``scale`` spends the simulated device: the share of the time a step runs (busy), the
        share of the device those steps fill (the contention model's utilization, step overhead counted as empty),
        sub-blocks per step and samples per sub-block; ``headroom`` = time / device-filled time, the most any policy
        could raise the rate at the same work per sample."""
        from opweave.serve.engine import Observer

        class Steps(Observer):
            busy = used = steps = parts = samples = 0.0

            def on_step(self, parts, cost):
                self.busy += cost.seconds
                self.used += cost.seconds * (cost.utilization if cost.utilization is not None else 1.0)
                self.steps += 1
                self.parts += len(parts)
                self.samples += sum(p.batch for p in parts)

        engine = Engine(executor, policies.create(policy), SimClock(), max_queue=MAX_QUEUE, max_batch=MAX_BATCH,
                        max_sub_blocks=H)
        seen = Steps()
        engine.observers.append(seen)
        duration = max(args.duration, args.min_requests * 1.1 / (scale * sum(pattern.values())))
        loadgen.run_simulated(engine, pattern, duration, seed=args.seed, scale=scale)
        span = engine.clock.now()
        return {"scale": scale, "busy": round(seen.busy / span, 3), "device_filled": round(seen.used / span, 3),
                "fill_while_busy": round(seen.used / seen.busy, 3) if seen.busy else 0.0,
                "sub_blocks_per_step": round(seen.parts / seen.steps, 2) if seen.steps else 0.0,
                "samples_per_sub_block": round(seen.samples / seen.parts, 2) if seen.parts else 0.0,
                "headroom": round(span / seen.used, 3) if seen.used else None}

    measure.explain = explain
    settings = {"preset": args.preset, "cost_model": "gpu", "scheduler": "lios", "streams": 8,
                "step_overhead_ms": executor.step_overhead_ms, "pad_batches_to_powers_of_two": executor.pad,
                "virtual_duration_s": args.duration, "blocks": blocks,
                "single_request_latency_ms": {n: round(model_latency_ms(executor, n), 3) for n in served}}
    return measure, settings, lambda: dict(executor.stats)


# ---- real servers -----------------------------------------------------------------------------------------------
class Server:
    """``opweave serve`` in a subprocess on 127.0.0.1 with an ephemeral port; stopped with SIGTERM (drains)."""

    def __init__(self, models: list[str], device: str, policy: str, image_size: str | None, timeout_s: float = 900,
                 lanes: int | None = None):
        cmd = [sys.executable, "-m", "opweave", "serve", "--models", ",".join(models), "--device", device,
               "--port", "0", "--policy", policy, "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
               "--max-sub-blocks", str(H)]
        if lanes:
            cmd += ["--streams", str(lanes)]
        if image_size:
            cmd += ["--image-size", image_size]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # every block is compiled before the server listens
        if "listening on" not in line:
            raise SystemExit(f"the server did not start: {line}{self.proc.stderr.read()[-2000:]}")
        self.url = line.strip().rsplit(" ", 1)[1]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def http_runner(args, models: list[str], device: str):
    servers: dict[str, object] = {}

    def server(policy: str):
        if policy not in servers:
            for other in list(servers):
                servers.pop(other).stop()
            start = time.perf_counter()
            if policy.startswith("ray"):
                from ray_peer import RayPeer

                servers[policy] = RayPeer(models, args.image_size, float(policy.partition("@")[2]))
            else:
                servers[policy] = Server(models, device, policy, args.image_size, lanes=args.lanes)
            common.console.print(f"{policy} server up in {time.perf_counter() - start:.0f} s")
        return servers[policy]

    def measure(policy: str, pattern: dict[str, float], scale: float, repeat: int = 0) -> dict:
        rates = {m: r / args.cpu_divisor for m, r in pattern.items()} if device == "cpu" else pattern
        duration = max(args.duration, args.min_requests * 1.1 / (scale * sum(rates.values())))
        rep, _ = loadgen.run_http(server(policy).url, rates, duration, seed=args.seed + repeat, scale=scale)
        time.sleep(0.5)  # let the queues empty before the next run
        return {**row(rep, args.slo_ms), "duration_s": round(duration, 2), "repeat": repeat}

    def close():
        for s in servers.values():
            s.stop()

    settings = {"device": device, "image_size": args.image_size or "published (Inception-v3 299, others 224)",
                "rate_divisor": args.cpu_divisor if device == "cpu" else 1, "min_duration_s": args.duration,
                "executor": "opweave serve's default (cpu: blocks compiled by ONNX Runtime, heft over the parts)",
                "lanes": args.lanes or "opweave serve's default (one per core on a CPU)"}
    measure.close = close
    return measure, settings, lambda: {}


# ---- the table ----------------------------------------------------------------------------------------------------
def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("sim", "cpu", "gpu"), default="sim")
    p.add_argument("--duration", type=float, default=None, help="seconds per run (sim: virtual; default 2 sim, "
                                                                "10 cpu/gpu)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list (cpu mode: the Ray peer too, "
                                                                   "unless a list is given without it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", default=None, help="cpu mode: zoo CNN input sizes, e.g. 64,inception_v3=75 "
                                                        "(default: the published sizes)")
    p.add_argument("--tolerance", type=float, default=1.03, help="the search's resolution (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs at the rate found (default %(default)s)")
    p.add_argument("--min-requests", type=int, default=300, help="requests every probe sends at least "
                                                                 "(default %(default)s)")
    p.add_argument("--ray-waits", default="2,10", help="cpu mode: Ray Serve batch waits (ms) to tune over")
    p.add_argument("--cpu-divisor", type=float, default=40.0, help="cpu mode: divide the patterns' rates by this")
    p.add_argument("--no-search", action="store_true", help="skip the sustainable-rate search")
    p.add_argument("--lanes", type=int, default=None, help="cpu/gpu mode: lanes (streams) per combined block given to "
                                                            "opweave serve (default: its own, one per core on a CPU)")
    p.add_argument("--slo-ms", type=float, default=None, help="p99 bound of a sustainable rate (default 100 ms, "
                                                              "1000 ms in cpu mode: one CPU request takes longer)")
    p.add_argument("--patterns", default=None, help="comma list of patterns, in the order run (default: all; e.g. "
                                                    "multi,squeezenet: a name matches the pattern it starts)")
    args = p.parse_args()
    args.duration = args.duration or (0.5 if args.quick else 2.0 if args.mode == "sim" else 10.0)
    args.slo_ms = args.slo_ms or (CPU_SLO_MS if args.mode == "cpu" else SLO_MS)
    models = common.split_names(args.models, MODELS, "model") or (["squeezenet"] if args.quick else list(MODELS))
    known = POLICIES + (PEERS if args.mode == "cpu" else ())
    chosen = common.split_names(args.policies, known, "policy")
    if args.mode == "cpu" and args.policies == p.get_default("policies"):
        chosen.append("ray")
    runs = [f"ray@{w}" for w in args.ray_waits.split(",")] if "ray" in chosen else []
    runs = [c for c in chosen if c != "ray"] + runs
    todo = pick_patterns(patterns(models), args.patterns)
    clock = common.Stopwatch()
    if args.mode == "sim":
        measure, settings, stats = sim_runner(args, models)
    else:
        measure, settings, stats = http_runner(args, models, "cpu" if args.mode == "cpu" else "cuda")
    stem = {"sim": "serving_sim", "cpu": "serving_cpu", "gpu": "serving_gpu"}[args.mode]
    probed: dict[tuple, dict] = {}

    def once(policy: str, name: str, scale: float, repeat: int = 0) -> dict:
        """One probe, made once: the table's runs at scale 1 and 2 are the search's first two probes."""
        key = (policy, name, round(scale, 9), repeat)
        if key not in probed:
            probed[key] = measure(policy, todo[name], scale, repeat)
        return probed[key]

    def report(results: list[dict], complete: bool) -> dict:
        out = {"mode": args.mode, "complete": complete,
               "settings": {**settings, "max_batch": MAX_BATCH, "max_queue": MAX_QUEUE, "max_sub_blocks": H,
                            "slo_ms": args.slo_ms, "arrivals": "poisson", "seed": args.seed,
                            "order": "pattern by pattern, every policy of a pattern one after another"},
               "machine": common.machine_info(), "elapsed_s": clock.elapsed_s, "executor_stats": stats(),
               "results": results, "acceptance": verdicts(results, todo, args.mode, args.min_requests),
               "paper_reference": "TOP Table II: Inception-v3 13 blocks, ResNet-50 5, SqueezeNet 12; single-model "
                                  "240 FPS, multi-model 30+60+120 FPS, doubled on the server; TOP reports +63% "
                                  "throughput over POS on three models and 14-180% over mainstream frameworks "
                                  "(A100)."}
        common.write_json(args.out / f"{stem}.json", out)  # after every entry: a run cut short keeps its figures
        return out

    results = []
    try:
        # Pattern by pattern, so that the policies of one pattern are measured close together in time (the machine
        # is shared) and a run cut short leaves whole patterns, each with every policy.
        for name, pattern in todo.items():
            for policy in runs:  # one server per policy at a time in the cpu and gpu modes
                entry = {"pattern": name, "rates": pattern, "policy": policy, "scales": {}}
                for scale in (1.0, 2.0):
                    entry["scales"][f"{scale:g}"] = once(policy, name, scale)
                if not args.no_search and not args.quick:
                    best, probes = search(lambda s, r, policy=policy, name=name: once(policy, name, s, r),
                                          tolerance=args.tolerance, repeats=args.repeats)
                    entry["sustainable_scale"] = round(best, 4)
                    entry["sustainable_rps"] = round(best * sum(pattern.values()) /
                                                     (args.cpu_divisor if args.mode == "cpu" else 1), 2)
                    probes = list({id(r): (s, r) for s, r in probes}.values())  # a probe made once, listed once
                    entry["probes"] = [[round(s, 4), r] for s, r in probes]
                    entry["at_sustainable"] = spread([r for s, r in probes if s == best])
                results.append(entry)
                common.console.print(f"{name} {policy}: {entry['scales']['1']} sustainable scale "
                                     f"{entry.get('sustainable_scale')}")
                report(results, complete=False)
    finally:
        getattr(measure, "close", lambda: None)()
    if hasattr(measure, "explain"):  # simulation: what bounds heuristic over batch (docs/serving.md)
        for e in results:
            if e["policy"] in ("batch", "heuristic") and e.get("sustainable_scale"):
                e["where_time_goes"] = measure.explain(e["policy"], e["rates"], e["sustainable_scale"])
    out = report(results, complete=True)
    print_tables(out)
    plot(out, args.out / f"{stem}.png")


def pick_patterns(known: dict[str, dict[str, float]], names: str | None) -> dict[str, dict[str, float]]:
    """The patterns named (a name matches the pattern it starts, ``multi`` for ``multi:30+60+120``), in that
    order; all of them when none is named."""
    if not names:
        return known
    out = {}
    for n in (n.strip() for n in names.split(",") if n.strip()):
        match = [k for k in known if k == n or k.split(":")[0] == n]
        if not match:
            raise SystemExit(f"unknown pattern {n!r}; known: {', '.join(known)}")
        out[match[0]] = known[match[0]]
    return out


def spread(rows: list[dict]) -> dict:
    """The repeats at one scale: how many, and the least and most of throughput, p99 and answered requests."""
    def span(key: str) -> list:
        values = [r[key] for r in rows if r.get(key) is not None]
        return [min(values), max(values)] if values else []

    return {"runs": len(rows), "throughput_rps": span("throughput_rps"), "p99_ms": span("p99_ms"),
            "answered": span("answered")}


def verdicts(results: list[dict], names, mode: str, min_requests: int) -> dict:
    """Per pattern: heuristic's sustainable rate over the better of static and batch, over batch, and (cpu) over
    the Ray Serve peer (its best batch wait); the goals: >= 1.2x and >= 1.3x on the CPU, >= 1.3x over batch
    in simulation; and whether every run at each reported rate answered ``min_requests``."""
    out = {}
    for name in names:
        rate = {}
        for e in results:
            if e["pattern"] == name and e.get("sustainable_scale") is not None:
                key = "ray" if e["policy"].startswith("ray@") else e["policy"]
                rate[key] = max(rate.get(key, 0.0), e["sustainable_scale"])
        if not rate.get("heuristic"):
            continue
        entry: dict = {}
        if rate.get("batch"):
            entry["heuristic_over_batch"] = round(rate["heuristic"] / rate["batch"], 3)
        baseline = max(rate.get("static", 0.0), rate.get("batch", 0.0))
        if baseline:
            entry["heuristic_over_best_baseline"] = round(rate["heuristic"] / baseline, 3)
        if rate.get("ray"):
            entry["heuristic_over_ray"] = round(rate["heuristic"] / rate["ray"], 3)
        answered = [a for e in results if e["pattern"] == name and "at_sustainable" in e
                    for a in e["at_sustainable"]["answered"]]
        entry["every_reported_run_answered_enough"] = bool(answered) and min(answered) >= min_requests
        if mode == "cpu":
            entry["pass"] = (entry.get("heuristic_over_best_baseline", 0) >= 1.2
                             and entry.get("heuristic_over_ray", 0) >= 1.3
                             and entry["every_reported_run_answered_enough"])
        elif mode == "sim":
            entry["pass"] = entry.get("heuristic_over_batch", 0) >= 1.3
        out[name] = entry
    return out


def print_tables(out: dict) -> None:
    cols = ["pattern", "policy", "scale", "throughput/s", "p50 ms", "p99 ms", "rejected", "queue var (time)",
            "queue var (across)", "sustainable scale", "sustainable req/s"]
    rows = []
    for e in out["results"]:
        for scale, r in e["scales"].items():
            rows.append([e["pattern"], e["policy"], scale, f"{r['throughput_rps']:.1f}", f"{r['p50_ms']:.2f}",
                         f"{r['p99_ms']:.2f}", str(r["rejected"]), f"{r['queue_var_time']:.2f}",
                         f"{r['queue_var_across']:.2f}", str(e.get("sustainable_scale", "-")),
                         str(e.get("sustainable_rps", "-"))])
    common.console.print(common.table(f"serving ({out['mode']})", cols, rows))
    for name, a in out["acceptance"].items():
        verdict = ("PASS: " if a["pass"] else "FAIL: ") if "pass" in a else ""
        ratios = ", ".join(f"{k.removeprefix('heuristic_over_').replace('_', ' ')} {v:.2f}x" for k, v in a.items()
                           if k.startswith("heuristic_over_"))
        common.console.print(f"{verdict}{name}: heuristic sustains {ratios}")


def plot(out: dict, path, title: str | None = None) -> None:
    """p99 of all sent against offered load, one panel per pattern, a line per policy (its search probes)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(e["pattern"] for e in out["results"]))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for e in (e for e in out["results"] if e["pattern"] == name):
            total = sum(e["rates"].values()) / out["settings"].get("rate_divisor", 1)
            points = sorted((s * total, r["p99_all_ms"] or 1e4) for s, r in e.get("probes", []))
            if not points:
                points = sorted((float(s) * total, r["p99_all_ms"] or 1e4) for s, r in e["scales"].items())
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=e["policy"])
        ax.axhline(out["settings"]["slo_ms"], color="grey", linestyle="--", linewidth=1)
        ax.set(xscale="log", yscale="log", xlabel="offered load (req/s)", ylabel="p99 of all sent (ms)", title=name)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"serving policies ({out['mode']}): p99 vs load, rejections as infinite (plotted at 10 s)")
    common.save_figure(fig, path)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
