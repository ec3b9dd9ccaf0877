"""Load generation and its report: TOP's task arrival patterns (§VI-B, Table II) sent to a server over HTTP, or run
through the engine in simulation, reported the same way.

* :func:`parse_pattern` — ``"inception_v3:30,resnet50:60,squeezenet:120"``: requests per second per model;
* :func:`arrivals` — ``poisson`` (exponential gaps, seeded per model) or ``constant`` (evenly spaced) arrival times;
* :func:`run_http` — an asynchronous client (httpx) that sends each request at its arrival time whatever the
  answers (an open loop, as sensors sample), with the binary tensor data extension, and reads the queue depths from
  ``/metrics`` every ``sample_s``;
* :func:`run_simulated` — the same arrivals through :class:`~opweave.serve.engine.Engine` on a simulated clock;
* :func:`report` — per model: sent, answered, rejected (429), timeouts (504), errors, throughput, p50/p99 latency,
  queue length mean and variance over time; overall: the same, TOP's queue-length variance across models (σ, the
  mean over samples of the population variance of the queue lengths), and ``p99_all_ms``, the 99th percentile of
  every sent request's latency counting a rejected, timed-out or failed request as infinitely late;
* :func:`sustainable` — p99_all_ms under the SLO (100 ms by default): the rule behind "highest sustainable rate".
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, pvariance

import numpy as np

from opweave.errors import UsageError, did_you_mean
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.simulation import Arrival, simulate_arrivals

ARRIVALS = ("poisson", "constant")


def parse_pattern(text: str) -> dict[str, float]:
    """``NAME:RATE,...`` as ``{name: requests per second}``."""
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, rate = item.rpartition(":")
        try:
            value = float(rate)
        except ValueError:
            value = -1.0
        if not sep or not name or not value > 0 or not math.isfinite(value):
            raise UsageError(f"pattern item {item!r} must be MODEL:RATE with a positive rate (requests per second)")
        if name in out:
            raise UsageError(f"pattern names model {name!r} twice")
        out[name] = value
    if not out:
        raise UsageError("empty pattern; give MODEL:RATE[,MODEL:RATE...]")
    return out


def arrivals(pattern: dict[str, float], duration_s: float, kind: str = "poisson", *, seed: int = 0,
             scale: float = 1.0) -> list[Arrival]:
    """Arrival times in [0, duration_s) of every model of ``pattern`` at ``scale`` times its rate, sorted.

    ``poisson``: exponential gaps from a generator seeded with (seed, model position); ``constant``: one request
    every 1/rate seconds, the first at half a gap (models at the same rate then arrive together, as TOP's periodic
    sensors may)."""
    if kind not in ARRIVALS:
        raise UsageError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {kind!r}{did_you_mean(kind, ARRIVALS)}")
    if duration_s <= 0 or scale <= 0:
        raise UsageError(f"duration and scale must be positive, got {duration_s} and {scale}")
    out: list[Arrival] = []
    for i, (model, rate) in enumerate(pattern.items()):
        rate *= scale
        if kind == "constant":
            n = int(duration_s * rate - 0.5) + 1
            out += [Arrival((k + 0.5) / rate, model) for k in range(n) if (k + 0.5) / rate < duration_s]
            continue
        rng = random.Random(seed * 1009 + i)
        t = rng.expovariate(rate)
        while t < duration_s:
            out.append(Arrival(t, model))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: (a.time, a.model))


@dataclass
class Outcome:
    """One sent request: its model, when it was sent (s from the start), what came back and how long it took."""

    model: str
    sent: float
    status: str  # answered | rejected | timeout | error
    latency_s: float = math.inf
    code: int | None = None


# ---- the report ---------------------------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):  # infinite values sort last; np.percentile cannot interpolate with them
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]
    return float(np.percentile(finite, q))


def report(outcomes: list[Outcome], samples: list[tuple[float, dict[str, int]]], *, pattern: dict[str, float],
           duration_s: float, mode: str, **about) -> dict:
    """The load report (module docstring). ``about`` is copied in (policy, url, scale, arrivals, ...). Queue samples
    count the pattern's models only (a server may serve others)."""
    samples = [(t, {m: s.get(m, 0) for m in pattern}) for t, s in samples]
    models: dict[str, dict] = {}
    end = max([duration_s] + [o.sent + o.latency_s for o in outcomes if o.status == "answered"])
    for name in pattern:
        mine = [o for o in outcomes if o.model == name]
        models[name] = _summary(mine, [s.get(name, 0) for _, s in samples], end)
    total = _summary(outcomes, [sum(s.values()) for _, s in samples], end)
    sigma = [pvariance(list(s.values())) for _, s in samples if len(s) > 1]
    return {"mode": mode, **about, "pattern": pattern, "duration_s": duration_s, "elapsed_s": end,
            "models": models, "total": total, "queue_variance": fmean(sigma) if sigma else 0.0,
            "queue_samples": [[t, s] for t, s in samples]}


def _summary(outcomes: list[Outcome], queue: list[int], end: float) -> dict:
    answered = [o.latency_s * 1e3 for o in outcomes if o.status == "answered"]
    every = [o.latency_s * 1e3 if o.status == "answered" else math.inf for o in outcomes]
    count = {s: sum(o.status == s for o in outcomes) for s in ("answered", "rejected", "timeout", "error")}
    return {"sent": len(outcomes), "answered": count["answered"], "rejected": count["rejected"],
            "timeouts": count["timeout"], "errors": count["error"],
            "throughput_rps": count["answered"] / end if end > 0 else 0.0,
            "p50_ms": _percentile(answered, 50), "p99_ms": _percentile(answered, 99),
            "mean_ms": fmean(answered) if answered else math.nan, "p99_all_ms": _percentile(every, 99),
            "queue_mean": fmean(queue) if queue else 0.0, "queue_var": pvariance(queue) if len(queue) > 1 else 0.0}


def table(rep: dict, title: str | None = None):
    """The report as a rich table."""
    from rich.table import Table

    t = Table(title=title or f"{rep['mode']} {rep.get('policy', '')}: {rep['duration_s']:g} s of "
                             f"{', '.join(f'{m}:{r:g}/s' for m, r in rep['pattern'].items())}")
    for col in ("model", "sent", "answered", "rejected", "timeouts", "errors", "throughput/s", "p50 ms", "p99 ms",
                "queue mean", "queue var"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name, r in [*rep["models"].items(), ("total", rep["total"])]:
        t.add_row(name, str(r["sent"]), str(r["answered"]), str(r["rejected"]), str(r["timeouts"]), str(r["errors"]),
                  f"{r['throughput_rps']:.1f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['queue_mean']:.2f}",
                  f"{r['queue_var']:.2f}")
    t.caption = (f"queue-length variance across models (TOP sigma, mean over time): {rep['queue_variance']:.3f}; "
                 f"p99 of all sent (rejected = inf): {rep['total']['p99_all_ms']:.2f} ms")
    return t


def plot(rep: dict, outcomes: list[Outcome], path: str | Path) -> None:
    """PNG: queue length of every model over time, and each model's latency distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    times = [t for t, _ in rep["queue_samples"]]
    for name in rep["pattern"]:
        left.plot(times, [s.get(name, 0) for _, s in rep["queue_samples"]], label=name, linewidth=1)
        lat = sorted(o.latency_s * 1e3 for o in outcomes if o.model == name and o.status == "answered")
        if lat:
            right.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=name)
    left.set(xlabel="time (s)", ylabel="queue length", title="queue length over time")
    right.set(xlabel="latency (ms)", ylabel="fraction answered", title="latency CDF", xscale="log")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{rep['mode']} {rep.get('policy', '')}: "
                 + ", ".join(f"{m}:{r:g}/s" for m, r in rep["pattern"].items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- simulation ---------------------------------------------------------------------------------------------------
def run_simulated(engine: Engine, pattern: dict[str, float], duration_s: float, kind: str = "poisson", *,
                  seed: int = 0, scale: float = 1.0, sample_s: float = 0.05) -> tuple[dict, list[Outcome]]:
    """The pattern through ``engine`` (on a SimClock) with no HTTP: the report and every outcome."""
    unknown = sorted(set(pattern) - set(engine.models))
    if unknown:
        raise UsageError(f"pattern names {unknown[0]!r}{did_you_mean(unknown[0], engine.models)}, which the engine "
                         f"does not serve ({', '.join(engine.models)})")
    start = engine.clock.now()
    arr = [Arrival(a.time + start, a.model, a.batch) for a in arrivals(pattern, duration_s, kind, seed=seed,
                                                                          scale=scale)]
    run = simulate_arrivals(engine, arr, sample_s=sample_s)
    status = {"done": "answered", "timeout": "timeout", "error": "error"}
    outcomes = [Outcome(r.model, r.arrival - start, status[r.status], r.latency_s if r.status == "done" else math.inf)
                for r in run.requests]
    outcomes += [Outcome(a.model, a.time - start, "rejected") for a in run.rejected]
    samples = [(t - start, s) for t, s in run.samples]
    rep = report(outcomes, samples, pattern={m: r * scale for m, r in pattern.items()}, duration_s=duration_s,
                 mode="simulate", policy=engine.policy.name, scale=scale, arrivals=kind,
                 engine_stats=run.stats, executor_stats=dict(engine.executor.stats))
    return rep, outcomes


# ---- HTTP ---------------------------------------------------------------------------------------------------------
def request_body(inputs: list[dict], seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """An infer request with random batch-1 data for ``inputs`` (the model metadata's ``inputs``; integers in
    [0, 10)), every input and output in binary (the binary tensor data extension): (body, headers)."""
    import torch

    from opweave.serve.models import DTYPES
    from opweave.serve.protocol import HEADER, encode_tensor

    generator = torch.Generator().manual_seed(seed)
    header: dict = {"inputs": [], "parameters": {"binary_data_output": True}}
    blobs = []
    for spec in inputs:
        shape = [1 if d < 0 else d for d in spec["shape"]]
        dtype = DTYPES[spec["datatype"]]
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=generator).to(dtype)
        else:
            t = torch.randint(0, 2 if dtype == torch.bool else 10, shape, generator=generator).to(dtype)
        blob = encode_tensor(t)
        header["inputs"].append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                                 "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


async def _run_http(url: str, pattern: dict[str, float], duration_s: float, kind: str, seed: int, scale: float,
                    sample_s: float, timeout_s: float) -> tuple[list[Outcome], list[tuple[float, dict[str, int]]]]:
    import httpx

    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        bodies = {}
        for i, model in enumerate(pattern):
            meta = await client.get(f"/v2/models/{model}")
            if meta.status_code != 200:
                raise UsageError(f"{url}: model {model!r} is not served ({meta.status_code})")
            bodies[model] = request_body(meta.json()["inputs"], seed + i)
        outcomes: list[Outcome] = []
        samples: list[tuple[float, dict[str, int]]] = []
        start = time.perf_counter()
        done = asyncio.Event()

        async def fire(a: Arrival) -> None:
            body, headers = bodies[a.model]
            sent = time.perf_counter()
            try:
                r = await client.post(f"/v2/models/{a.model}/infer", content=body, headers=headers)
                code = r.status_code
            except httpx.HTTPError:
                outcomes.append(Outcome(a.model, sent - start, "error"))
                return
            status = {200: "answered", 429: "rejected", 504: "timeout"}.get(code, "error")
            latency = time.perf_counter() - sent if status == "answered" else math.inf
            outcomes.append(Outcome(a.model, sent - start, status, latency, code))

        async def sample() -> None:
            while not done.is_set():
                t = time.perf_counter() - start
                try:
                    text = (await client.get("/metrics")).text
                    samples.append((t, _queue_depths(text, pattern)))
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(done.wait(), sample_s)
                except asyncio.TimeoutError:
                    pass

        sampler = asyncio.create_task(sample())
        tasks = []
        for a in arrivals(pattern, duration_s, kind, seed=seed, scale=scale):
            delay = a.time - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(a)))
        await asyncio.gather(*tasks)
        done.set()
        await sampler
    return outcomes, samples


def _queue_depths(text: str, pattern: dict[str, float]) -> dict[str, int]:
    """``opweave_queue_depth{model="m"}`` of every model of the pattern from a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith("opweave_queue_depth{"):
            labels, _, value = line.rpartition(" ")
            name = labels.split('model="', 1)[1].split('"', 1)[0]
            if name in pattern:
                out[name] = int(float(value))
    return out


def run_http(url: str, pattern: dict[str, float], duration_s: float, kind: str = "poisson", *, seed: int = 0,
             scale: float = 1.0, sample_s: float = 0.1, timeout_s: float = 60.0) -> tuple[dict, list[Outcome]]:
    """The pattern sent to the server at ``url``: the report and every outcome."""
    outcomes, samples = asyncio.run(_run_http(url, pattern, duration_s, kind, seed, scale, sample_s, timeout_s))
    rep = report(outcomes, samples, pattern={m: r * scale for m, r in pattern.items()}, duration_s=duration_s,
                 mode="http", url=url, scale=scale, arrivals=kind)
    return rep, outcomes


__all__ = ["ARRIVALS", "Outcome", "arrivals", "parse_pattern", "plot", "report", "request_body", "run_http",
           "run_simulated", "table"]
