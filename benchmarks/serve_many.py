"""Many models in one server: what memory, start-up and latency cost as the repository grows.

    .venv/bin/python benchmarks/serve_many.py [--counts 1,4,8,16,32] [--model squeezenet] [--requests 200]
                                              [--mixed-s 10] [--server-args "..."] [--stem serve_many] [--out DIR]
    .venv/bin/python benchmarks/serve_many.py --quick      # counts 1,2; fewer requests

One ``opweave export MODEL`` (random weights), copied N times into a repository (``m00``, ``m01``, ...), served by
``opweave serve --model-repository REPO --device cpu --model-control-mode explicit`` with the defaults otherwise
(plus ``--server-args``), a child process on 127.0.0.1, for each N of ``--counts``:

* ``ready_s``: from the server's start to the line saying it listens (every model loaded and built);
* ``rss_mb``: its resident memory (``VmRSS``) once ready, and ``per_extra_model_mb`` over N = the first count;
* ``first_ms``: each model's first request (one 1-sample request each, over HTTP, the input as binary data), and
  whether every answer equals the exported program run eagerly (:func:`opweave.outputs.compare`);
* ``steady``: ``--requests`` sequential requests to the first model, the median and 10th-90th percentiles;
* ``mixed`` (N > 1): four client threads sending requests round robin over every model for ``--mixed-s`` seconds;
  per model the requests answered and the median and 99th percentile: no model may be starved;
* ``unload`` (N > 1): RSS after unloading half of the models (the lowest seen over the next 3 s), and the share of
  what loading them added that it gave back.

Writes ``DIR/STEM.json`` and ``DIR/STEM.md`` (one table). The figures depend on the machine and on what else runs
on it (``machine.load_average_1_5_15m``); every N's server is started fresh.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--requests", type=int, default=200, help="sequential requests for the steady latency")
    p.add_argument("--mixed-s", type=float, default=10.0, help="seconds of mixed load over every model")
    p.add_argument("--server-args", default="", help="more arguments for opweave serve (space separated)")
    p.add_argument("--stem", default="serve_many", help="file name without suffix (default %(default)s)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="counts 1,2, 20 requests, 2 s of mixed load")
    args = p.parse_args(argv)
    if args.quick:
        args.counts, args.requests, args.mixed_s = "1,2", 20, 2.0
    return args


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def export(model: str, into: Path) -> Path:
    """``opweave export MODEL`` into ``into``; the entry's folder."""
    subprocess.run([sys.executable, "-m", "opweave", "export", model, str(into)], check=True, capture_output=True)
    return into / model


def repository(entry: Path, n: int, root: Path) -> list[str]:
    """``n`` copies of the exported ``entry`` under ``root``; their names."""
    names = [f"m{i:02d}" for i in range(n)]
    for name in names:
        shutil.copytree(entry, root / name)
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{entry.name}"', f'name: "{name}"', 1))
    return names


def start(root: Path, extra: list[str]) -> tuple[subprocess.Popen, str, float]:
    """The server on the repository; its URL once it listens, and how long that took."""
    begin = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root),
                             "--device", "cpu", "--port", "0", "--model-control-mode", "explicit", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[1], time.perf_counter() - begin


def body(x) -> tuple[bytes, dict]:
    """A request for input ``x`` with its values as binary data (the protocol's extension), the output in JSON."""
    import json

    from opweave.serve.protocol import HEADER

    blob = x.contiguous().numpy().tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(blob)}}]}).encode()
    return head + blob, {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def infer(client, url: str, name: str, payload: tuple[bytes, dict]):
    """One request; its latency (ms) and output tensor."""
    import torch

    begin = time.perf_counter()
    reply = client.post(f"{url}/v2/models/{name}/infer", content=payload[0], headers=payload[1])
    ms = (time.perf_counter() - begin) * 1e3
    reply.raise_for_status()
    out = reply.json()["outputs"][0]
    return ms, torch.tensor(out["data"]).reshape(out["shape"])


def percentiles(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=100) if len(times) > 1 else [times[0]] * 99
    return {"median_ms": statistics.median(times), "p10_ms": q[9], "p90_ms": q[89], "p99_ms": q[98], "n": len(times)}


def mixed(url: str, names: list[str], payload: tuple, seconds: float, clients: int = 4) -> dict:
    """``clients`` threads sending requests round robin over ``names`` for ``seconds``: per model its latencies."""
    import httpx

    times: dict[str, list[float]] = {name: [] for name in names}
    lock, end = threading.Lock(), time.perf_counter() + seconds

    def client(offset: int) -> None:
        with httpx.Client(timeout=60) as c:
            i = offset
            while time.perf_counter() < end:
                name = names[i % len(names)]
                ms, _ = infer(c, url, name, payload)
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
    # what the unloaded half added, at the mean of what each model past the first added (baseline: one model)
    added = (loaded_mb - baseline_mb) * len(half) / (len(names) - 1)
    return {"unloaded": len(half), "rss_mb": lowest, "given_back_mb": loaded_mb - lowest,
            "share_of_added": (loaded_mb - lowest) / added if added > 0 else None}


def one_count(n: int, entry: Path, args, reference) -> dict:
    import httpx

    from opweave.outputs import compare

    x, expected = reference
    payload = body(x)
    with tempfile.TemporaryDirectory() as tmp:
        names = repository(entry, n, Path(tmp))
        proc, url, ready_s = start(Path(tmp), args.server_args.split())
        try:
            rss = resident_mb(proc.pid)
            first, right = {}, True
            with httpx.Client(timeout=120) as c:
                for name in names:
                    ms, out = infer(c, url, name, payload)
                    first[name] = ms
                    right = right and compare(expected, out.to(expected.dtype)).ok
                steady = [infer(c, url, names[0], payload)[0] for _ in range(args.requests)]
            row = {"models": n, "ready_s": ready_s, "rss_mb": rss, "first_ms": first,
                   "first_median_ms": statistics.median(first.values()), "all_equal_eager": right,
                   "steady": percentiles(steady)}
            if n > 1:
                row["mixed"] = mixed(url, names, payload, args.mixed_s)
                row["unload"] = unload_half(proc, url, names, rss, args.baseline_mb)
            return row
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def markdown(rows: list[dict]) -> str:
    out = ["| models | ready s | RSS MB | per extra model MB | first request ms (median) | steady ms (p10-p90) | "
           "mixed: fewest / most answered, worst p99 ms | unloading half gives back |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        mix = r.get("mixed")
        unload = r.get("unload")
        s = r["steady"]
        out.append(f"| {r['models']} | {r['ready_s']:.1f} | {r['rss_mb']:.0f} | "
                   f"{r['per_extra_model_mb']:.0f} | {r['first_median_ms']:.1f} | "
                   f"{s['median_ms']:.1f} ({s['p10_ms']:.1f}-{s['p90_ms']:.1f}) | "
                   + (f"{mix['min_answered']} / {mix['max_answered']}, {mix['worst_p99_ms']:.0f}" if mix else "-")
                   + " | " + (f"{unload['given_back_mb']:.0f} MB ({unload['share_of_added']:.0%} of what the half "
                              f"added)" if unload and unload["share_of_added"] is not None else "-") + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        entry = export(args.model, Path(tmp) / "exported")
        program = torch.export.load(str(next(entry.rglob("model.pt2"))))
        shape = program.example_inputs[0][0].shape if program.example_inputs else (1, 3, 224, 224)
        x = torch.randn(1, *shape[1:], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = program.module()(x)
        rows = []
        for n in counts:
            common.console.print(f"{n} model(s) ...")
            args.baseline_mb = rows[0]["rss_mb"] if rows else 0.0
            rows.append(one_count(n, entry, args, (x, expected)))
    first = rows[0]
    for r in rows:
        extra = r["models"] - first["models"]
        r["per_extra_model_mb"] = (r["rss_mb"] - first["rss_mb"]) / extra if extra else 0.0
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "baseline_mb")}
    common.write_json(args.out / f"{args.stem}.json", {"machine": common.machine_info(), "settings": settings,
                                                       "rows": rows})
    text = markdown(rows)
    (args.out / f"{args.stem}.md").write_text(f"# {args.model} copies in one server\n\n{text}")
    common.console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
