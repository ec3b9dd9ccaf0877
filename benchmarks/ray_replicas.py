"""Throughput of the engine on Ray Serve with 2 replicas beside 1 (and beside one plain ``opweave serve`` process on
the same cores), closed loop over HTTP on 127.0.0.1.

    .venv/bin/python benchmarks/ray_replicas.py                      # writes results/ray_replicas.json
    .venv/bin/python benchmarks/ray_replicas.py --quick --out /tmp   # a short run

Each configuration is ``opweave serve`` in a child process: ``--ray --replicas N`` (its own local Ray cluster on
127.0.0.1, each replica one engine pinned to ``--threads`` cores of its own, ``--pin-cores``, and as many CPUs
reserved), or the plain server (one engine over every core: the cores the 2 replicas share out). ``--clients``
concurrent clients each send a request, wait for its answer and send the next, for ``--warmup`` then ``--duration``
seconds; throughput is the answers per second of the measured window; latency percentiles are of those answers.
Before the load, a few answers are checked against eager (``ok``). Any answer other than 200 is counted
(``errors``). The clients, Ray's proxy and the replicas share the machine's cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, console, machine_info, table  # noqa: E402


def start(args, replicas: int | None) -> tuple[subprocess.Popen, str, object]:
    """``opweave serve`` with Ray (``replicas``) or without (None); its URL once it listens."""
    cmd = [sys.executable, "-m", "opweave", "serve", "--models", args.model, "--image-size", str(args.image_size),
           "--port", "0", "--max-batch", str(args.max_batch), "--policy", args.policy]
    if replicas is None:
        cmd += ["--threads", str(args.threads * args.plain_threads_factor)]
    else:
        cmd += ["--ray", "--replicas", str(replicas), "--threads", str(args.threads), "--pin-cores"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].split()[0], log
        if not line and proc.poll() is not None:
            break
    stop(proc, log)
    raise SystemExit(f"{' '.join(cmd)} did not start: {Path(log.name).read_text()[-2000:]}")


def stop(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    log.close()
    os.unlink(log.name)


async def closed_loop(url: str, args, bodies: list[tuple[bytes, dict]]) -> dict:
    import httpx

    path = f"/v2/models/{args.model}/infer"
    measured: list[float] = []
    errors = 0
    begin = time.monotonic()
    start_at, end_at = begin + args.warmup, begin + args.warmup + args.duration
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def client(k: int) -> None:
            nonlocal errors
            i = k
            while time.monotonic() < end_at:
                body, headers = bodies[i % len(bodies)]
                sent = time.monotonic()
                r = await c.post(path, content=body, headers=headers)
                done = time.monotonic()
                if start_at <= sent and done <= end_at:
                    if r.status_code == 200:
                        measured.append(done - sent)
                    else:
                        errors += 1
                i += args.clients

        await asyncio.gather(*(client(k) for k in range(args.clients)))
    measured.sort()

    def pct(q: float) -> float:
        return round(measured[min(len(measured) - 1, int(q * len(measured)))] * 1e3, 2) if measured else None

    return {"answered": len(measured), "errors": errors, "throughput_per_s": round(len(measured) / args.duration, 2),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def check(url: str, args, reference, inputs) -> bool:
    """A few answers equal eager's."""
    import httpx
    import torch

    from opweave.outputs import compare

    with httpx.Client(base_url=url, timeout=120) as c:
        for x, (body, headers) in inputs[:4]:
            r = c.post(f"/v2/models/{args.model}/infer", content=body, headers=headers)
            if r.status_code != 200:
                return False
            size = int(r.headers["Inference-Header-Content-Length"])
            shape = json.loads(r.content[:size])["outputs"][0]["shape"]
            got = torch.frombuffer(bytearray(r.content[size:]), dtype=torch.float32).reshape(shape)
            with torch.no_grad():
                if not compare(reference(x), got).ok:
                    return False
    return True


def main() -> None:
    import argparse

    import torch

    from opweave import zoo
    from opweave.serve.protocol import HEADER, encode_tensor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows (warm-up 1 s, 3 s measured)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--model", default="squeezenet")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--policy", default="batch")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per replica")
    p.add_argument("--plain-threads-factor", type=int, default=2,
                   help="the plain server gets threads x this (the cores 2 replicas use)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--configs", default="ray1,ray2,plain", help="comma list of ray1, ray2, plain")
    args = p.parse_args()
    if args.quick:
        args.warmup, args.duration = 1.0, 3.0
    torch.set_num_threads(1)
    reference = zoo.create(args.model, image_size=args.image_size)[0].eval()
    inputs = []
    for i in range(16):
        x = torch.randn(1, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(i))
        head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.numel() * 4}}],
                           "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}).encode()
        inputs.append((x, (head + encode_tensor(x), {HEADER: str(len(head))})))
    bodies = [b for _, b in inputs]
    configs = {"ray1": 1, "ray2": 2, "plain": None}
    rows = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        replicas = configs[name]
        console.print(f"[dim]{name}: starting[/dim]")
        t0 = time.monotonic()
        proc, url, log = start(args, replicas)
        startup = time.monotonic() - t0
        try:
            ok = check(url, args, reference, inputs)
            result = asyncio.run(closed_loop(url, args, bodies))
        finally:
            stop(proc, log)
        rows.append({"config": name, "ray": replicas is not None, "replicas": replicas or 1,
                     "threads_per_engine": args.threads if replicas else args.threads * args.plain_threads_factor,
                     "startup_s": round(startup, 1), "ok": ok, **result})
    base = next((r for r in rows if r["config"] == "ray1"), None)
    for r in rows:
        r["speedup_vs_ray1"] = round(r["throughput_per_s"] / base["throughput_per_s"], 2) \
            if base and base["throughput_per_s"] else None
    out = {"benchmark": "ray_replicas", "machine": machine_info(), "settings": {
        k: getattr(args, k) for k in ("model", "image_size", "max_batch", "policy", "threads", "clients", "warmup",
                                      "duration", "quick")}, "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_replicas.json").write_text(json.dumps(out, indent=1) + "\n")
    console.print(table(f"{args.model} at {args.image_size} px, {args.clients} closed-loop clients, "
                        f"{args.duration:g} s", ["config", "replicas", "threads/engine", "req/s", "x ray1", "p50 ms",
                                                "p99 ms", "errors", "ok"],
                        [[r["config"], str(r["replicas"]), str(r["threads_per_engine"]), str(r["throughput_per_s"]),
                          str(r["speedup_vs_ray1"]), str(r["p50_ms"]), str(r["p99_ms"]), str(r["errors"]),
                          str(r["ok"])] for r in rows]))


if __name__ == "__main__":
    main()
