"""What refused requests cost ``opweave serve``: its resident memory after 50 refused 60 MB gRPC requests, and how
long ``/v2/health/live`` takes to answer while eight large HTTP bodies are being refused. The server is a child
process on 127.0.0.1 serving SqueezeNet at 64 px (max batch 8, ``--compiler none``).

    .venv/bin/python benchmarks/serve_hostile.py                 # writes results/serve_hostile.json
    .venv/bin/python benchmarks/serve_hostile.py --quick --out /tmp

Scenarios (each against a fresh server):

* ``grpc_rss`` (``--max-body-mb 64``): ``--requests`` ModelInfer calls alternating 60 MB (under gRPC's 64 MiB cap:
  parsed, then refused ``INVALID_ARGUMENT``) and 66 MB (refused ``RESOURCE_EXHAUSTED`` by gRPC itself). The server's
  RSS (``/proc/PID/status``) after one answered request, right after the last refusal, and settled (the lowest seen
  over the next ``--settle-s`` seconds). Pass: settled within 100 MB of before.
* ``grpc_rss_default`` (the default limits, derived from the model's inputs): the same requests, all refused by
  gRPC before they are parsed.
* ``live_oversized`` (the default limits): eight 63 MB bodies, over the model's limit, sent at once, while a
  client asks ``/v2/health/live`` every 50 ms; every answer's latency. Pass: the slowest under 1 s.
* ``live_decoded`` (``--max-body-mb 64``): eight JSON bodies of ``--json-mb`` MB within the limit whose values do not
  fit the input's shape: each is parsed in full (on a worker thread), then refused 400.

The numbers depend on the machine and on what else runs on it (``machine.load_average_1_5_15m``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, console, machine_info, table  # noqa: E402

MODEL = ["--models", "squeezenet", "--image-size", "64", "--compiler", "none", "--max-batch", "8"]


def start(*extra: str) -> tuple[subprocess.Popen, str, str]:
    """``opweave serve`` with HTTP and gRPC; its URL and gRPC address once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", *MODEL, "--port", "0", "--grpc-port", "0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[1], line.split("gRPC on ", 1)[1].split(";", 1)[0]


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def grpc_rss(args, extra: list[str]) -> dict:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    proc, _, address = start(*extra)
    try:
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def request(size: int):
            r = service_pb2.ModelInferRequest(model_name="squeezenet")
            r.inputs.add(name="x", datatype="FP32", shape=[1, 3, 64, 64])
            r.raw_input_contents.append(b"\0" * size)
            return r

        stub.ModelInfer(request(3 * 64 * 64 * 4), timeout=120)
        time.sleep(1.0)
        before = resident_mb(proc.pid)
        big = [request(60 << 20), request(66 << 20)]
        codes: dict[str, int] = {}
        start_s = time.perf_counter()
        for i in range(args.requests):
            try:
                stub.ModelInfer(big[i % 2], timeout=120)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as exc:
                codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
        elapsed = time.perf_counter() - start_s
        after = resident_mb(proc.pid)
        seen = [after]
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline:
            time.sleep(0.25)
            seen.append(resident_mb(proc.pid))
        answered = bool(stub.ModelInfer(request(3 * 64 * 64 * 4), timeout=120).outputs)
        channel.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    settled = min(seen)
    return {"flags": extra, "requests": args.requests, "codes": codes, "seconds": round(elapsed, 1),
            "rss_before_mb": round(before), "rss_after_mb": round(after), "rss_settled_mb": round(settled),
            "answers_after": answered, "pass": settled - before <= 100 and answered and "OK" not in codes}


def liveness(args, extra: list[str], body: bytes, headers: dict) -> dict:
    import httpx

    proc, url, _ = start(*extra)
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                sent = time.perf_counter()
                status = c.get("/v2/health/live").status_code
                latencies.append(time.perf_counter() - sent if status == 200 else float("inf"))
                stop.wait(0.05)

    async def flood() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            async def one() -> int:
                try:
                    return (await c.post("/v2/models/squeezenet/infer", content=body, headers=headers)).status_code
                except httpx.HTTPError:  # the server answered and closed before the body was all sent
                    return -1
            return await asyncio.gather(*(one() for _ in range(args.bodies)))

    try:
        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.5)
        start_s = time.perf_counter()
        statuses = asyncio.run(flood())
        elapsed = time.perf_counter() - start_s
        stop.set()
        prober.join(timeout=120)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return {"flags": extra, "bodies": args.bodies, "body_mb": round(len(body) / (1 << 20), 1),
            "statuses": sorted(set(statuses)), "seconds": round(elapsed, 1), "probes": len(latencies),
            "live_median_ms": round(statistics.median(latencies) * 1e3, 1),
            "live_max_ms": round(max(latencies) * 1e3, 1),
            "pass": max(latencies) < 1.0 and all(s in (400, -1) for s in statuses)}


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer and smaller requests")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--requests", type=int, default=50, help="refused gRPC requests (default %(default)s)")
    p.add_argument("--bodies", type=int, default=8, help="large HTTP bodies at once (default %(default)s)")
    p.add_argument("--json-mb", type=float, default=24.0, help="size of each decoded JSON body (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=5.0, help="how long RSS is watched after the last request")
    args = p.parse_args()
    if args.quick:
        args.requests, args.bodies, args.json_mb, args.settle_s = 4, 2, 2.0, 2.0
    oversized = b"{" + b" " * ((63 << 20) - 1)
    values = int(args.json_mb * (1 << 20) / 21)
    decoded = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                      "data": [0.123456789012345] * values}]}).encode()
    results = {
        "machine": machine_info(),
        "grpc_rss": grpc_rss(args, ["--max-body-mb", "64"]),
        "grpc_rss_default": grpc_rss(args, []),
        "live_oversized": liveness(args, [], oversized, {"Content-Type": "application/json"}),
        "live_decoded": liveness(args, ["--max-body-mb", "64"], decoded, {"Content-Type": "application/json"}),
    }
    rows = [[name, " ".join(r["flags"]) or "(defaults)", str(r.get("codes", r.get("statuses"))), str(r["seconds"]),
             f"{r['rss_before_mb']} -> {r['rss_after_mb']} -> {r['rss_settled_mb']}" if "rss_before_mb" in r else "",
             f"{r['live_median_ms']} / {r['live_max_ms']}" if "live_max_ms" in r else "", str(r["pass"])]
            for name, r in results.items() if name != "machine"]
    console.print(table("refused requests (squeezenet 64 px)", ["scenario", "flags", "answers", "s",
                                                               "RSS MB before -> after -> settled",
                                                               "live median / max ms", "pass"], rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "serve_hostile.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
