"""Many models in one server: what memory, start-up and latency cost as the repository grows, and where the memory is.

    .venv/bin/python benchmarks/serve_many.py [--counts 1,4,8,16,32] [--model squeezenet | --mix a,b,c]
                                              [--requests 200] [--mixed-s 10] [--server-args "..."]
                                              [--breakdown-counts 1,4] [--engine-models 32] [--stem serve_many]
    .venv/bin/python benchmarks/serve_many.py --quick      # counts 1,2; fewer requests; a short engine run

One ``opweave export MODEL`` (random weights) or, with ``--mix``, one of each model listed, copied N times into a
repository (``m00``, ``m01``, ...: copy i is of the (i mod k)-th model), served by ``opweave serve --model-repository
REPO --device cpu --model-control-mode explicit`` with the defaults otherwise (plus ``--server-args``), a child
process on 127.0.0.1, for each N of ``--counts``:

* ``ready_s``: from the server's start to the line saying it listens (every model loaded and built);
* ``rss_mb``: its resident memory (``VmRSS``) once ready, and ``per_extra_model_mb`` over N = the first count;
  ``device_mb`` (``--device cuda``): the GPU memory ``nvidia-smi`` counts for the server's process;
* ``first_ms``: each model's first request (one 1-sample request each, over HTTP, the inputs as binary data), and
  whether every answer equals the exported program run eagerly (:func:`opweave.outputs.compare`);
* ``steady``: ``--requests`` sequential requests to the first model, the median and 10th-90th percentiles;
* ``mixed`` (N > 1): four client threads sending requests round robin over every model for ``--mixed-s`` seconds;
  per model the requests answered and the median and 99th percentile: no model may be starved; and the engine's
  decision time per step over that load (``opweave_decision_seconds`` from ``/metrics``: its mean, and the bucket
  bounds its median and 99th percentile fall in);
* ``unload`` (N > 1): RSS after unloading half of the models (the lowest seen over the next 3 s), and the share of
  what loading them added that it gave back.

``steady_versus_baseline`` (``--baseline-src``, another checkout's ``src/``): one model served by both codes at once,
``--requests`` sequential requests split into rounds that alternate between the two servers, so that both see the
same load; the medians and spreads, and whether both answer equal to eager.

``breakdown`` (``--breakdown-counts``, each in a child process of its own, no server): where the memory of N models
is, read as the resident size after each step with freed memory given back first (``gc.collect`` and
``malloc_trim``): the models loaded (weights, graphs, the blocks' example inputs; ``weights_mb`` counts their
parameters alone), the engine built (every compiled variant: ``variants``, ``threads``), then every model served once
at batch 1 and once at its max batch (what the runs keep: arenas, caches). Per extra model: the difference between
the last two counts over the models between them.

``engine`` (``--engine-models``, no server): the engine itself at that many models, each a copy of the first model's
blocks, on the simulated H100 (:class:`opweave.serve.engine.simulation.SimExecutor`) under each policy of
``--engine-policies`` (``top`` with untrained actors: the time its agents take to decide does not depend on their
weights), Poisson arrivals at ``--engine-rate`` requests per second per model for ``--engine-s`` simulated seconds:
the decision time of every step (wall clock: observing the engine and asking the policy; its median, 99th percentile
and maximum) and every model's answered requests and 99th percentile.

Writes ``DIR/STEM.json`` and ``DIR/STEM.md`` (tables). The figures depend on the machine and on what else runs on
it (each row's ``load_average`` when it started, ``machine.load_average_1_5_15m`` at the end); every N's server is
started fresh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common as common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1,4,8,16,32", help="comma list of model counts (default %(default)s)")
    p.add_argument("--model", default="squeezenet", help="zoo model to export and copy (default %(default)s)")
    p.add_argument("--mix", help="comma list of zoo models: the copies cycle through them (instead of --model)")
    p.add_argument("--requests", type=int, default=200, help="sequential requests for the steady latency")
    p.add_argument("--mixed-s", type=float, default=10.0, help="seconds of mixed load over every model")
    p.add_argument("--server-args", default="", help="more arguments for opweave serve (space separated)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the server's device")
    p.add_argument("--breakdown-counts", default="1,4", help="model counts of the memory breakdown ('' for none)")
    p.add_argument("--engine-models", type=int, default=32, help="models of the engine run (0: none)")
    p.add_argument("--engine-policies", default="static,batch,heuristic,top", help="policies of the engine run")
    p.add_argument("--engine-rate", type=float, default=30.0, help="requests/s per model in the engine run")
    p.add_argument("--engine-s", type=float, default=2.0, help="simulated seconds of the engine run")
    p.add_argument("--baseline-src", type=Path, help="another opweave's src/ (the code before a change): its server "
                   "beside this one's at one model, steady requests interleaved between the two")
    p.add_argument("--stem", default="serve_many", help="file name without suffix (default %(default)s)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="counts 1,2, 20 requests, 2 s of mixed load, 0.5 s engine")
    p.add_argument("--child-breakdown", nargs=3, metavar=("ROOT", "NAMES", "MAX_BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.counts, args.requests, args.mixed_s, args.breakdown_counts = "1,2", 20, 2.0, "1,2"
        args.engine_models, args.engine_s = min(args.engine_models, 4), 0.5
    return args


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def device_mb(pid: int) -> float | None:
    """GPU memory of process ``pid`` as ``nvidia-smi`` counts it (None without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [float(mb) for line in out.splitlines() if line.strip()
            for p, mb in [line.split(",")[:2]] if int(p) == pid]
    return sum(used) if used else 0.0


def export(model: str, into: Path) -> Path:
    """``opweave export MODEL`` into ``into``; the entry's folder."""
    subprocess.run([sys.executable, "-m", "opweave", "export", model, str(into)], check=True, capture_output=True)
    return into / next(p.name for p in into.iterdir() if p.is_dir() and not p.name.startswith("."))


def repository(entries: list[Path], n: int, root: Path) -> list[str]:
    """``n`` copies of the exported ``entries`` (copy i of entry i mod k) under ``root``; their names."""
    names = [f"m{i:02d}" for i in range(n)]
    for i, name in enumerate(names):
        entry = entries[i % len(entries)]
        shutil.copytree(entry, root / name)
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{entry.name}"', f'name: "{name}"', 1))
    return names


class Reference:
    """One exported model: a request for it (its inputs at batch 1 as binary data, the outputs in JSON) and what
    the program run eagerly answers."""

    def __init__(self, entry: Path):
        import torch
        from google.protobuf import text_format
        from torch.utils import _pytree as pytree
        from tritonclient.grpc import model_config_pb2

        from opweave.serve.models import DTYPES

        config = text_format.Parse((entry / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        program = torch.export.load(str(next(entry.rglob("model.pt2"))))
        examples = list(program.example_inputs[0]) if program.example_inputs else []
        generator = torch.Generator().manual_seed(0)
        self.inputs = []
        for spec, example in zip(config.input, examples, strict=True):
            datatype = model_config_pb2.DataType.Name(spec.data_type).removeprefix("TYPE_")
            dtype = DTYPES[datatype]
            x = torch.randn(example.shape, generator=generator).to(dtype) if dtype.is_floating_point else example
            self.inputs.append((spec.name, datatype, x[:1].contiguous()))
        self.module = program.module()  # the program run eagerly: what every answer is held against
        with torch.no_grad():
            self.expected = pytree.tree_leaves(self.module(*[x for _, _, x in self.inputs]))
        self.payload = self.body()

    def body(self) -> tuple[bytes, dict]:
        from opweave.serve.protocol import HEADER, encode_tensor

        head, blobs = {"inputs": []}, []
        for name, datatype, x in self.inputs:
            blob = encode_tensor(x)
            head["inputs"].append({"name": name, "shape": list(x.shape), "datatype": datatype,
                                   "parameters": {"binary_data_size": len(blob)}})
            blobs.append(blob)
        text = json.dumps(head).encode()
        return text + b"".join(blobs), {HEADER: str(len(text)), "Content-Type": "application/octet-stream"}

    def equal(self, outputs: list) -> bool:
        from opweave.outputs import compare

        return len(outputs) == len(self.expected) and all(
            compare(e, got.to(e.dtype)).ok for e, got in zip(self.expected, outputs, strict=True))


def start(root: Path, extra: list[str], device: str, src: Path | None = None) -> tuple[subprocess.Popen, str, float]:
    """The server on the repository (``src``: the opweave sources it runs, default this one's); its URL once it
    listens, and how long that took."""
    begin = time.perf_counter()
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root),
                             "--device", device, "--port", "0", "--model-control-mode", "explicit", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[1], time.perf_counter() - begin


def stop(proc: subprocess.Popen) -> None:
    """End a server started by :func:`start`: asked to drain and stop, killed if it has not within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def infer(client, url: str, name: str, payload: tuple[bytes, dict]):
    """One request; its latency (ms) and output tensors."""
    import torch

    begin = time.perf_counter()
    reply = client.post(f"{url}/v2/models/{name}/infer", content=payload[0], headers=payload[1])
    ms = (time.perf_counter() - begin) * 1e3
    reply.raise_for_status()
    return ms, [torch.tensor(o["data"]).reshape(o["shape"]) for o in reply.json()["outputs"]]


def percentiles(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=100) if len(times) > 1 else [times[0]] * 99
    return {"median_ms": statistics.median(times), "p10_ms": q[9], "p90_ms": q[89], "p99_ms": q[98], "n": len(times)}


def mixed(url: str, names: list[str], payloads: dict, seconds: float, clients: int = 4) -> dict:
    """``clients`` threads sending requests round robin over ``names`` for ``seconds``: per model its latencies."""
    import httpx

    times: dict[str, list[float]] = {name: [] for name in names}
    lock, end = threading.Lock(), time.perf_counter() + seconds

    def client(offset: int) -> None:
        with httpx.Client(timeout=60) as c:
            i = offset
            while time.perf_counter() < end:
                name = names[i % len(names)]
                ms, _ = infer(c, url, name, payloads[name])
                with lock:
                    times[name].append(ms)
                i += 1

    threads = [threading.Thread(target=client, args=(k * len(names) // clients,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per = {name: percentiles(ts) if ts else {"n": 0} for name, ts in times.items()}
    answered = [p["n"] for p in per.values()]
    return {"per_model": per, "min_answered": min(answered), "max_answered": max(answered),
            "worst_p99_ms": max((p["p99_ms"] for p in per.values() if p["n"]), default=None)}


def decision_metric(url: str) -> dict | None:
    """The engine's decision time per step from ``/metrics`` (``opweave_decision_seconds``): how many steps, the
    mean, and the upper bounds of the buckets that hold the median and the 99th percentile (None: not reported)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=60).text
    buckets, total, count = [], None, None
    for line in text.splitlines():
        if line.startswith("opweave_decision_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("opweave_decision_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("opweave_decision_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    if not count:
        return None

    def bound(q: float) -> float:
        return next(le for le, cumulative in sorted(buckets) if cumulative >= q * count) * 1e3

    return {"steps": int(count), "mean_ms": total / count * 1e3, "p50_at_most_ms": bound(0.5),
            "p99_at_most_ms": bound(0.99)}


def unload_half(proc, url: str, names: list[str], loaded_mb: float, baseline_mb: float) -> dict:
    import httpx

    half = names[len(names) // 2:]
    with httpx.Client(timeout=120) as c:
        for name in half:
            c.post(f"{url}/v2/repository/models/{name}/unload").raise_for_status()
    lowest, end = resident_mb(proc.pid), time.perf_counter() + 3
    while time.perf_counter() < end:
        time.sleep(0.2)
        lowest = min(lowest, resident_mb(proc.pid))
    # what the unloaded half added, at the mean of what each model past the first added (baseline: one model's RSS;
    # none when the first count has more than one model)
    added = (loaded_mb - baseline_mb) * len(half) / (len(names) - 1) if baseline_mb else 0.0
    return {"unloaded": len(half), "rss_mb": lowest, "given_back_mb": loaded_mb - lowest,
            "share_of_added": (loaded_mb - lowest) / added if added > 0 else None}


def one_count(n: int, entries: list[Path], args, references: list[Reference]) -> dict:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        names = repository(entries, n, Path(tmp))
        refs = {name: references[i % len(references)] for i, name in enumerate(names)}
        payloads = {name: ref.payload for name, ref in refs.items()}
        load_average = os.getloadavg()
        proc, url, ready_s = start(Path(tmp), args.server_args.split(), args.device)
        try:
            rss = resident_mb(proc.pid)
            first, right = {}, True
            with httpx.Client(timeout=120) as c:
                for name in names:
                    ms, out = infer(c, url, name, payloads[name])
                    first[name] = ms
                    right = right and refs[name].equal(out)
                steady = [infer(c, url, names[0], payloads[names[0]])[0] for _ in range(args.requests)]
            row = {"models": n, "load_average": load_average, "ready_s": ready_s, "rss_mb": rss,
                   "first_ms": first, "first_median_ms": statistics.median(first.values()), "all_equal_eager": right,
                   "steady": percentiles(steady)}
            if args.device == "cuda":
                row["device_mb"] = device_mb(proc.pid)
            if n > 1:
                row["mixed"] = mixed(url, names, payloads, args.mixed_s)
                row["decision"] = decision_metric(url)
                row["unload"] = unload_half(proc, url, names, rss, args.baseline_mb)
            return row
        finally:
            stop(proc)


def steady_versus(entries: list[Path], args, reference: Reference, rounds: int = 10) -> dict:
    """One model served by this code and by ``--baseline-src``'s at once; ``rounds`` rounds of ``--requests`` /
    ``rounds`` sequential requests to each in turn (both see the same load), the medians and spreads."""
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        repository(entries[:1], 1, Path(tmp))
        servers = {"this": start(Path(tmp), args.server_args.split(), args.device),
                   "baseline": start(Path(tmp), args.server_args.split(), args.device, args.baseline_src)}
        times: dict[str, list[float]] = {k: [] for k in servers}
        try:
            with httpx.Client(timeout=120) as c:
                for k, (_, url, _) in servers.items():
                    for _ in range(5):
                        _, out = infer(c, url, "m00", reference.payload)
                    times[k + "_equal_eager"] = reference.equal(out)  # type: ignore[assignment]
                for _ in range(rounds):
                    for k, (_, url, _) in servers.items():
                        times[k] += [infer(c, url, "m00", reference.payload)[0]
                                     for _ in range(max(1, args.requests // rounds))]
        finally:
            for proc, _, _ in servers.values():
                stop(proc)
    return {k: percentiles(v) if isinstance(v, list) else v for k, v in times.items()} | {
        "baseline_src": str(args.baseline_src), "rounds": rounds}


# ---- where the memory is ------------------------------------------------------------------------------------------
def child_breakdown(root: Path, names: list[str], max_batch: int) -> dict:
    """In this process: the models loaded, the engine built, every model served (module docstring)."""
    import ctypes
    import gc

    import torch

    from opweave.serve.assemble import make_engine
    from opweave.serve.engine.combined import Part
    from opweave.serve.models import load

    libc = ctypes.CDLL(None)

    def settled() -> float:
        gc.collect()
        libc.malloc_trim(0)
        return resident_mb(os.getpid())

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    out: dict = {"models": len(names), "start_mb": settled()}
    models = {name: load(name, path=next((root / name).rglob("model.pt2")), max_batch=max_batch) for name in names}
    out["loaded_mb"] = settled()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for m in models.values() for p in m.blocked.captured.gm.parameters()}
    out["weights_mb"] = sum(storages.values()) / 2**20
    engine = make_engine(models, device="cpu", max_batch=max_batch)
    out["built_mb"] = settled()
    ex = engine.executor
    out["variants"] = sum(len(b.compiled) for b in getattr(ex, "_blocks", {}).values())
    out["threads"] = threads()
    for name, served in models.items():
        blocked = served.blocked
        for batch in (1, served.max_batch):
            state = ex.prepare(name, [blocked.flat_inputs(tuple(x.repeat(batch, *[1] * (x.dim() - 1))
                                                                for x in blocked.example_inputs))])
            for b in range(len(blocked.blocks)):
                part = Part(name, b, batch, state)
                with torch.no_grad():
                    ex.run([part])
                state = part.state
    out["served_mb"] = settled()
    out["threads_served"] = threads()
    out["signatures"] = len(ex._cache)
    return out


def breakdown(entries: list[Path], n: int, max_batch: int = 8) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        names = repository(entries, n, Path(tmp))
        text = subprocess.run([sys.executable, __file__, "--child-breakdown", tmp, ",".join(names), str(max_batch)],
                              check=True, capture_output=True, text=True).stdout
    return json.loads(text.strip().splitlines()[-1])


def per_extra(rows: list[dict]) -> dict | None:
    """What each model past the first count's added, step by step (module docstring)."""
    if len(rows) < 2:
        return None
    a, b = rows[0], rows[-1]
    k = b["models"] - a["models"]
    step = {"load_mb": ("loaded_mb", "start_mb"), "build_mb": ("built_mb", "loaded_mb"),
            "serve_mb": ("served_mb", "built_mb")}
    out = {key: ((b[hi] - b[lo]) - (a[hi] - a[lo])) / k for key, (hi, lo) in step.items()}
    out["weights_mb"] = (b["weights_mb"] - a["weights_mb"]) / k
    out["total_mb"] = (b["served_mb"] - b["start_mb"] - a["served_mb"] + a["start_mb"]) / k
    out["variants"] = (b["variants"] - a["variants"]) / k
    out["threads"] = (b["threads_served"] - a["threads_served"]) / k
    return out


# ---- the engine at scale ------------------------------------------------------------------------------------------
def engine_scale(entry: Path, n: int, policies: list[str], rate: float, seconds: float) -> list[dict]:
    """The simulated engine at ``n`` models (module docstring)."""
    from opweave.serve.assemble import serving_options
    from opweave.serve.engine import Engine, Observer, top
    from opweave.serve.engine import policies as registry
    from opweave.serve.engine.simulation import SimClock, SimExecutor
    from opweave.serve.loadgen import run_simulated
    from opweave.serve.models import load

    class Decisions(Observer):
        def __init__(self):
            self.seconds: list[float] = []

        def on_decision(self, seconds: float) -> None:
            self.seconds.append(seconds)

    blocked = load("m", path=next(entry.rglob("model.pt2")), max_batch=8).blocked
    rows = []
    for policy_name in policies:
        models = {f"m{i:02d}": blocked for i in range(n)}  # the simulator reads only their graphs
        policy = top.TopPolicy(shipped=False) if policy_name == "top" else registry.create(policy_name)
        decided = Decisions()  # every step's (the engine keeps only its latest for decision_times())
        engine = Engine(SimExecutor(models, serving_options("sim"), preset="h100"), policy, SimClock(), max_batch=8,
                        max_sub_blocks=4, observers=[decided])
        if policy_name == "top":  # untrained: the time to decide, not its quality, is measured
            policy.agents = top.Actors(policy.state_dim, policy.action_dims)
        begin = time.perf_counter()
        rep, _ = run_simulated(engine, dict.fromkeys(models, rate), seconds)
        wall_s = time.perf_counter() - begin
        decisions = sorted(decided.seconds)
        q = statistics.quantiles(decisions, n=100)
        per = {m: {"answered": r["answered"], "sent": r["sent"], "p99_ms": r["p99_ms"]} for m, r in
               rep["models"].items()}
        rows.append({"policy": policy_name, "models": n, "rate_per_model": rate, "simulated_s": seconds,
                     "wall_s": wall_s, "steps": engine.stats["steps"], "decision_steps": len(decisions),
                     "decision_p50_ms": q[49] * 1e3, "decision_p99_ms": q[98] * 1e3,
                     "decision_max_ms": decisions[-1] * 1e3, "per_model": per,
                     "min_answered": min(p["answered"] for p in per.values()),
                     "unanswered": sum(p["sent"] - p["answered"] for p in per.values()),
                     "worst_p99_ms": max(p["p99_ms"] for p in per.values()),
                     "median_p99_ms": statistics.median(p["p99_ms"] for p in per.values()),
                     "describe": engine.policy.describe()})
    return rows


# ---- tables -------------------------------------------------------------------------------------------------------
def markdown(data: dict) -> str:
    rows = data["rows"]
    out = ["| models | load avg | ready s | RSS MB | per extra model MB | all equal eager | first request ms (median) "
           "| steady ms (p10-p90) | mixed: fewest / most answered, worst p99 ms | decision ms: mean, p99 at most "
           "| unloading half gives back |",
           "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- | --- |"]
    for r in rows:
        mix, unload, s, d = r.get("mixed"), r.get("unload"), r["steady"], r.get("decision")
        out.append(f"| {r['models']} | {r['load_average'][0]:.1f} | {r['ready_s']:.1f} | {r['rss_mb']:.0f} | "
                   f"{r['per_extra_model_mb']:.0f} | {'yes' if r['all_equal_eager'] else 'NO'} | "
                   f"{r['first_median_ms']:.1f} | {s['median_ms']:.1f} ({s['p10_ms']:.1f}-{s['p90_ms']:.1f}) | "
                   + (f"{mix['min_answered']} / {mix['max_answered']}, {mix['worst_p99_ms']:.0f}" if mix else "-")
                   + " | " + (f"{d['mean_ms']:.3f}, {d['p99_at_most_ms']:.2f}" if d else "-")
                   + " | " + (f"{unload['given_back_mb']:.0f} MB ({unload['share_of_added']:.0%} of what the half "
                              f"added)" if unload and unload["share_of_added"] is not None else "-") + " |")
    text = "\n".join(out) + "\n"
    parts = data.get("breakdown") or []
    if parts:
        text += ("\nWhere the memory is (MB; resident size after each step, freed memory given back first):\n\n"
                 "| models | start | + load (weights) | + build (variants, threads) | + serve | total |\n"
                 "| ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for b in parts:
            text += (f"| {b['models']} | {b['start_mb']:.0f} | {b['loaded_mb'] - b['start_mb']:.0f} "
                     f"({b['weights_mb']:.0f}) | {b['built_mb'] - b['loaded_mb']:.0f} ({b['variants']}, "
                     f"{b['threads']}) | {b['served_mb'] - b['built_mb']:.0f} | "
                     f"{b['served_mb'] - b['start_mb']:.0f} |\n")
        extra = data.get("breakdown_per_extra_model")
        if extra:
            text += (f"| per extra model | | {extra['load_mb']:.1f} ({extra['weights_mb']:.1f}) | "
                     f"{extra['build_mb']:.1f} ({extra['variants']:.1f}, {extra['threads']:.1f}) | "
                     f"{extra['serve_mb']:.1f} | {extra['total_mb']:.1f} |\n")
    versus = data.get("steady_versus_baseline")
    if versus:
        a, b = versus["this"], versus["baseline"]
        text += (f"\nOne model, steady requests interleaved in {versus['rounds']} rounds between this code's server "
                 f"and the baseline's: median {a['median_ms']:.1f} ms (p10-p90 {a['p10_ms']:.1f}-{a['p90_ms']:.1f}) "
                 f"against {b['median_ms']:.1f} ms ({b['p10_ms']:.1f}-{b['p90_ms']:.1f}).\n")
    engine = data.get("engine") or []
    if engine:
        text += ("\nThe engine at scale (simulated H100, decision time in wall-clock ms per step that ran a block):\n\n"
                 "| policy | models | steps | decision p50 / p99 / max ms | fewest answered | unanswered | "
                 "p99 ms: median model / worst model |\n| --- | ---: | ---: | --- | ---: | ---: | --- |\n")
        for e in engine:
            text += (f"| {e['policy']} | {e['models']} | {e['steps']} | {e['decision_p50_ms']:.3f} / "
                     f"{e['decision_p99_ms']:.3f} / {e['decision_max_ms']:.3f} | {e['min_answered']} | "
                     f"{e['unanswered']} | {e['median_p99_ms']:.2f} / {e['worst_p99_ms']:.2f} |\n")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_breakdown:
        root, names, max_batch = args.child_breakdown
        print(json.dumps(child_breakdown(Path(root), names.split(","), int(max_batch))))
        return 0
    import torch  # noqa: F401 - loaded once here, before the children

    counts = [int(c) for c in args.counts.split(",") if c]
    sources = [m for m in (args.mix or args.model).split(",") if m]
    data: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        entries = [export(m, Path(tmp) / f"exported{i}") for i, m in enumerate(sources)]
        references = [Reference(e) for e in entries]
        rows = []
        for n in counts:
            common.console.print(f"{n} model(s) ...")
            args.baseline_mb = rows[0]["rss_mb"] if rows and rows[0]["models"] == 1 else 0.0
            rows.append(one_count(n, entries, args, references))
        if args.baseline_src is not None:
            common.console.print("one model, this code against the baseline, interleaved ...")
            data["steady_versus_baseline"] = steady_versus(entries, args, references[0])
        data["breakdown"] = []
        for n in [int(c) for c in args.breakdown_counts.split(",") if c]:
            common.console.print(f"breakdown, {n} model(s) ...")
            data["breakdown"].append(breakdown(entries, n))
        data["breakdown_per_extra_model"] = per_extra(data["breakdown"])
        if args.engine_models:
            common.console.print(f"the engine at {args.engine_models} models ...")
            data["engine"] = engine_scale(entries[0], args.engine_models, args.engine_policies.split(","),
                                          args.engine_rate, args.engine_s)
    first = rows[0]
    for r in rows:
        extra = r["models"] - first["models"]
        r["per_extra_model_mb"] = (r["rss_mb"] - first["rss_mb"]) / extra if extra else 0.0
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                if k not in ("out", "baseline_mb", "child_breakdown")}
    data = {"machine": common.machine_info(), "settings": settings, "rows": rows, **data}
    common.write_json(args.out / f"{args.stem}.json", data)
    text = markdown(data)
    (args.out / f"{args.stem}.md").write_text(f"# {' + '.join(sources)} copies in one server\n\n{text}")
    common.console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
