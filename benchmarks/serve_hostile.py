"""What refused requests cost ``opweave serve``: its resident memory after 50 refused 60 MB gRPC requests, how
long ``/v2/health/live`` takes to answer while eight large HTTP bodies are being refused, and what hostile clients
(amplification, trickle, unread answers, many unfinished bodies) cost the normal inferences beside them. The server
is a child process on 127.0.0.1 serving SqueezeNet at 64 px (max batch 8, ``--compiler none``).

    .venv/bin/python benchmarks/serve_hostile.py                 # writes results/serve_hostile.json
    .venv/bin/python benchmarks/serve_hostile.py --quick --out /tmp
    .venv/bin/python benchmarks/serve_hostile.py --only refused_body   # one scenario (the others' results kept)
    .venv/bin/python benchmarks/serve_hostile.py --scenarios connections,grpc_oversized   # (--only, another name)

Scenarios (each against a fresh server):

* ``grpc_rss`` (``--max-body-mb 64``): ``--requests`` ModelInfer calls alternating 60 MB (under gRPC's 64 MiB cap:
  parsed, then refused ``INVALID_ARGUMENT``) and 66 MB (refused ``RESOURCE_EXHAUSTED`` by gRPC itself). The server's
  RSS (``/proc/PID/status``) after one answered request, right after the last refusal, and settled (the lowest seen
  over the next ``--settle-s`` seconds), and the server's CPU time per refused request. Pass: settled within 100 MB
  of before.
* ``grpc_rss_default`` (the default limits, derived from the model's inputs): the same requests, all refused by
  gRPC before they are parsed.
* ``live_oversized`` (the default limits): eight 63 MB bodies, over the model's limit, sent at once, while a
  client asks ``/v2/health/live`` every 50 ms; every answer's latency. Pass: the slowest under 1 s.
* ``live_decoded`` (``--max-body-mb 64``): eight JSON bodies of ``--json-mb`` MB within the limit whose values do not
  fit the input's shape: each is parsed in full (on a worker thread), then refused 400.
* ``refused_body`` (the default limits): a client that declares a 100 GiB body and keeps sending it, 1 MiB at a time
  (``--attackers`` of them at once; one cut off connects again ``--reconnect-ms`` later), while one client sends
  normal inferences one after another. Windows of ``--window-s`` seconds without and with the attackers alternate
  (``--rounds`` of each, which goes first rotating), so that both see the same machine. Per attacking connection
  what the server read of it (its socket's bytes received less those queued unread, from ``ss``, looked at once the
  attacker's sends stall) and the bytes the attacker pushed before the server closed the connection (its send
  buffer held to 64 KiB; the kernels' buffers hold the rest), the server's CPU seconds per second of each kind of
  window, and the normal inferences' median latency in each. Pass: the server read at most 1 MiB of any connection,
  and the median under attack is within 10 % of the median without.
* ``refused_body_flood``: the same, the attackers connecting again at once (``--reconnect-ms 0``). No pass line: on
  a machine whose cores the attackers share with the server, their own sending takes the server's CPU.

Attackers beside normal inferences (:func:`beside`: the windows of ``refused_body``, with ``/v2/health/live`` asked
every 50 ms and the server's RSS read every 100 ms in each; pass: the inference median beside the attackers within
1.2x of alone and liveness under a second):

* ``amplification``: ``--attackers`` clients each sending a request that names squeezenet's output ``--copies``
  times (each copy was answered).
* ``trickle`` (``--idle-timeout-s 5``): ``--held`` clients each declaring a 4 MB body, sending 1 MiB of it and then
  a byte a second: how long the server keeps each.
* ``unread_answers`` (``--idle-timeout-s 5``): ``--held`` clients each asking for an 8 MiB answer (a model that
  repeats its input) and not reading it for 12 s: how many answers the server dropped.
* ``unfinished_bodies`` (``--max-held-mb 22 --idle-timeout-s 5``): ``--held`` clients each declaring a 4 MB body and
  sending 3.5 MB of it, then enough to stay above the minimum rate, never finishing it: how many the budget refused.

These three run windows of ``--held-window-s`` (their attacks last seconds).

* ``connections``: the server's open-file limit lowered to ``--nofile`` (512) for the run; ``--attackers`` clients
  open ``--idle`` (612) connections in all at the start of each attacked window, past that limit, say nothing on
  them and hold them to the window's end, while ``/v2/health/live`` is asked on a new connection each time (a client
  that just came). What the server did with the idle connections (closed to make room, refused 503, held). Pass
  also: every connection made.
* ``grpc_oversized`` (``--model-control-mode explicit --max-held-mb 64``, an empty repository beside squeezenet):
  ``--grpc-calls`` clients each sending ModelInfer calls one after another, of ``--grpc-mb`` (60) MB (over the
  message cap) and of just under the cap (over squeezenet's own limit: read, then refused); the codes. Pass also:
  the RSS beside them within the budget (64 MB) of alone, and no call answered.

The numbers depend on the machine and on what else runs on it (``machine.load_average_1_5_15m``).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, console, machine_info, table  # noqa: E402

MODEL = ["--models", "squeezenet", "--image-size", "64", "--compiler", "none", "--max-batch", "8"]
ATTACKS = ("amplification", "trickle", "unread_answers", "unfinished_bodies", "connections", "grpc_oversized")
FAN_FILE = "fan.pt2"


def start(*extra: str, nofile: int | None = None) -> tuple[subprocess.Popen, str, str]:
    """``opweave serve`` with HTTP and gRPC (``nofile``: its open-file limit, soft and hard); its URL and gRPC
    address once it listens."""
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", *MODEL, "--port", "0", "--grpc-port", "0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=limit)
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
        start_s, cpu0 = time.perf_counter(), cpu_s(proc.pid)
        for i in range(args.requests):
            try:
                stub.ModelInfer(big[i % 2], timeout=120)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as exc:
                codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
        elapsed, cpu = time.perf_counter() - start_s, cpu_s(proc.pid) - cpu0
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
            "server_cpu_ms_per_request": round(cpu / args.requests * 1e3, 1),
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


def cpu_s(pid: int) -> float:
    """The process's user and system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_read(server_port: int, client_port: int) -> int | None:
    """What the server has read of a connection: the bytes its kernel received (``ss``'s ``bytes_received``, TCP's
    ``tcpi_bytes_received``) less those still queued unread (``Recv-Q``); None without ``ss``."""
    try:
        out = subprocess.run(["ss", "-tinH", "state", "all", f"( sport = :{server_port} and dport = :{client_port} )"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    received = next((int(w.split(":", 1)[1]) for w in out if w.startswith("bytes_received:")), None)
    return None if received is None or len(out) < 2 else received - int(out[1])


def push(address: tuple[str, int], host: str, cap: int) -> tuple[int, int | None]:
    """One attacking connection: a request declaring 100 GiB, then 1 MiB chunks until the server closes it (or
    ``cap`` bytes were sent, or 30 s passed); the bytes sent, and what the server had read of them when it stopped
    reading (:func:`server_read`, looked at once a send waits half a second: the server reads no more)."""
    chunk = b"\0" * (1 << 20)
    read = None
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.settimeout(60)
        s.connect(address)
        s.sendall(f"POST /v2/models/squeezenet/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {100 << 30}\r\n\r\n".encode())
        s.settimeout(0.5)
        sent, deadline = 0, time.monotonic() + 30
        try:
            while sent < cap and time.monotonic() < deadline:
                try:
                    sent += s.send(chunk)
                except TimeoutError:  # the server reads no more (or is behind): what has it read?
                    if read is None:
                        read = server_read(address[1], s.getsockname()[1])
        except OSError:  # reset or broken pipe: the server closed it
            pass
        else:
            read = server_read(address[1], s.getsockname()[1])
    return sent, read


def beside(args, attack, attackers: int, reconnect_s: float, flags: tuple[str, ...] = (),
           window_s: float | None = None, nofile: int | None = None, fresh: bool = False,
           grpc: bool = False) -> tuple[dict, list]:
    """A server (``flags`` added) that one client sends normal inferences one after another while ``attackers``
    threads each call ``attack(address, host, active)`` over and over (``reconnect_s`` apart) in every other window
    of ``window_s`` (default ``--window-s``; ``--rounds`` of each kind, which goes first rotating, so that both see
    the same machine; an attack that lasts ends once ``active()`` is false, at its window's end); meanwhile
    ``/v2/health/live`` is asked every 50 ms (``fresh``: on a new connection each time, as a client that just came)
    and the server's RSS read every 100 ms. ``nofile``: the server's open-file limit; ``grpc``: the attack gets the
    gRPC address (``host:port``) instead of HTTP's. The windows' figures, and what each attack returned."""
    window_s = window_s or args.window_s
    import httpx

    proc, url, grpc_address = start(*flags, nofile=nofile)
    host = url.removeprefix("http://")
    address = grpc_address if grpc else (host.split(":")[0], int(host.split(":")[1]))
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                   "data": [0.5] * (3 * 64 * 64)}]}).encode()
    attacking = threading.Event()
    stop = threading.Event()
    records: list = []
    phase_now = ["warm-up"]

    def attacker() -> None:
        while not stop.is_set():
            if not attacking.wait(0.05):
                continue
            records.append(attack(address, host, lambda: attacking.is_set() and not stop.is_set()))
            stop.wait(reconnect_s)

    latencies: dict[str, list[float]] = {"idle": [], "attacked": []}
    retried: dict[str, int] = {}  # normal inferences tried again on a new connection, per window kind
    cpu: dict[str, list[float]] = {"idle": [], "attacked": []}
    live: dict[str, list[float]] = {"idle": [], "attacked": [], "warm-up": []}
    rss: dict[str, list[float]] = {"idle": [], "attacked": [], "warm-up": []}

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            k = 0
            while not stop.is_set():
                sent = time.perf_counter()
                try:
                    if fresh:
                        with httpx.Client(base_url=url, timeout=60) as new:
                            ok = new.get("/v2/health/live").status_code == 200
                    else:
                        ok = c.get("/v2/health/live").status_code == 200
                except httpx.HTTPError:
                    ok = False
                live[phase_now[0]].append(time.perf_counter() - sent if ok else float("inf"))
                if k % 2 == 0:
                    rss[phase_now[0]].append(resident_mb(proc.pid))
                k += 1
                stop.wait(0.05)

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(attackers)]
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        for t in threads:
            t.start()
        with httpx.Client(base_url=url, timeout=120) as c:
            def infer() -> int:
                """One normal inference; a kept-alive connection the server closed while idle (to make room for a new
                one, as nginx does at its limit) is tried again on a new one, as browsers do (counted)."""
                for _ in range(3):
                    try:
                        return c.post("/v2/models/squeezenet/infer", content=body,
                                      headers={"Content-Type": "application/json"}).status_code
                    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                        retried[phase_now[0]] = retried.get(phase_now[0], 0) + 1
                return 0

            for _ in range(20):  # warm-up
                assert infer() == 200
            watcher.start()
            order = ["idle", "attacked"]
            for k in range(2 * args.rounds):
                phase = order[(k + k // 2) % 2]  # idle, attacked, attacked, idle, idle, attacked, ...
                if phase == "attacked":
                    attacking.set()
                time.sleep(0.2)  # the attackers connected (or gone)
                phase_now[0] = phase
                seen, cpu0, t0 = [], cpu_s(proc.pid), time.perf_counter()
                while time.perf_counter() - t0 < window_s:
                    sent = time.perf_counter()
                    status = infer()
                    seen.append(time.perf_counter() - sent if status == 200 else float("inf"))
                cpu[phase].append((cpu_s(proc.pid) - cpu0) / (time.perf_counter() - t0))
                latencies[phase] += seen
                attacking.clear()
                phase_now[0] = "warm-up"  # between windows: the attackers leave
                time.sleep(0.2)
        stop.set()
        for t in [*threads, watcher]:
            t.join(timeout=120)
    finally:
        stop.set()
        proc.kill()
        proc.wait(timeout=30)
    idle, attacked = (statistics.median(latencies[p]) * 1e3 for p in ("idle", "attacked"))
    return {"flags": list(flags), "attackers": attackers, "reconnect_ms": reconnect_s * 1e3, "rounds": args.rounds,
            "window_s": window_s, "connections": len(records),
            "inferences": {p: len(v) for p, v in latencies.items()},
            "infer_median_ms": {"idle": round(idle, 2), "attacked": round(attacked, 2)},
            "infer_p90_ms": {p: round(sorted(v)[int(0.9 * (len(v) - 1))] * 1e3, 2) for p, v in latencies.items()},
            "attacked_over_idle": round(attacked / idle, 3), "retried": retried,
            "server_cpu_s_per_s": {p: round(statistics.mean(v), 3) for p, v in cpu.items()},
            "live_median_ms": {p: round(statistics.median(live[p]) * 1e3, 1) for p in ("idle", "attacked")},
            "live_max_ms": {p: round(max(live[p]) * 1e3, 1) for p in ("idle", "attacked")},
            "rss_max_mb": {p: round(max(rss[p])) for p in ("idle", "attacked")}}, records


def refused_body(args, reconnect_s: float) -> dict:
    pushes: list[int] = []
    reads: list[int] = []

    def attack(address, host, _active):
        sent, read = push(address, host, args.cap_mb << 20)
        pushes.append(sent)
        if read is not None:
            reads.append(read)

    common, _ = beside(args, attack, args.attackers, reconnect_s)
    idle, attacked = common["infer_median_ms"]["idle"], common["infer_median_ms"]["attacked"]
    most = max(pushes, default=0)
    return {"attackers": args.attackers, "reconnect_ms": reconnect_s * 1e3, "rounds": args.rounds,
            "window_s": args.window_s, "connections": len(pushes),
            "server_read_max_kib": round(max(reads) / 1024, 1) if reads else None,
            "server_read_median_kib": round(statistics.median(reads) / 1024, 1) if reads else None,
            "server_reads_seen": len(reads),
            "pushed_max_kib": round(most / 1024, 1),
            "pushed_median_kib": round(statistics.median(pushes) / 1024, 1) if pushes else None,
            "pushed_total_mib": round(sum(pushes) / (1 << 20), 1), "capped_connections":
            sum(1 for n in pushes if n >= args.cap_mb << 20),
            **{k: common[k] for k in ("inferences", "infer_median_ms", "infer_p90_ms", "attacked_over_idle",
                                      "server_cpu_s_per_s", "live_median_ms", "live_max_ms", "rss_max_mb")},
            "pass": bool(reads) and max(reads) <= 1 << 20 and attacked <= 1.10 * idle if reconnect_s > 0 else None}


def infer_head(host: str, model: str, length: int, extra: str = "") -> bytes:
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {length}\r\n\r\n").encode()


def status_of(s: socket.socket) -> int | None:
    """The status of an answer already readable on ``s`` (-1: the connection was closed without one); None: nothing
    yet."""
    import select

    if not select.select([s], [], [], 0)[0]:
        return None
    try:
        head = s.recv(64)
    except OSError:
        return -1
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else -1


def amplification(args) -> dict:
    """A request naming squeezenet's output ``--copies`` times (each copy was answered: a 469 KB request made a
    314 MB answer); ``--attackers`` of them one after another, 100 ms apart."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                   "data": [0.5] * (3 * 64 * 64)}],
                       "outputs": [{"name": "output__0"}] * args.copies}).encode()

    def attack(address, host, _active):
        with socket.create_connection(address, timeout=120) as s:
            s.sendall(infer_head(host, "squeezenet", len(body)) + body)
            answer = b""
            while part := s.recv(1 << 20):
                answer += part
                if b"\r\n\r\n" in answer and answer.startswith(b"HTTP/1.1 400"):
                    break
        return {"status": int(answer.split(b" ", 2)[1]) if answer else None, "answer_bytes": len(answer)}

    common, records = beside(args, attack, args.attackers, 0.1)
    return {**common, "request_kib": round(len(body) / 1024, 1),
            "statuses": sorted({r["status"] for r in records}, key=str),
            "answer_bytes_max": max(r["answer_bytes"] for r in records), "pass": passed(common)}


def trickle(args) -> dict:
    """``--held`` connections that each declare a 4 MB body, send 1 MiB of it, then a byte a second, connecting
    again once cut (``--idle-timeout-s 5``, windows of ``--held-window-s``): how long the server keeps each (those
    that their window's end stopped first left out)."""
    def attack(address, host, active):
        started = time.monotonic()
        cut = False
        with socket.create_connection(address, timeout=60) as s:
            try:
                s.sendall(infer_head(host, "squeezenet", 4_000_000) + b" " * (1 << 20))
                while active() and not cut:
                    s.send(b" ")
                    time.sleep(1.0)
                    cut = status_of(s) is not None
            except OSError:
                cut = True
        return {"lived_s": time.monotonic() - started, "cut": cut}

    common, records = beside(args, attack, args.held, 0.1, ("--idle-timeout-s", "5"), args.held_window_s)
    lived = [r["lived_s"] for r in records if r["cut"]]
    return {**common, "cut": len(lived), "lived_s_median": round(statistics.median(lived), 1) if lived else None,
            "lived_s_max": round(max(lived), 1) if lived else None,
            "pass": passed(common) and bool(lived) and max(lived) < 20}


def fan_program(folder: Path) -> Path:
    """A model whose answer is 8 MiB in binary data at batch 8, from a 2 KiB input (each value 4096 times), saved
    by ``torch.export.save`` in ``folder``."""
    import torch

    class Fan(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x).repeat(1, 4096, 1, 1)

    path = folder / FAN_FILE
    torch.export.save(torch.export.export(Fan(), (torch.randn(1, 1, 8, 8),)), str(path))
    return path


def unread_answers(args) -> dict:
    """``--held`` clients that each ask for an 8 MiB answer and do not read it (their receive buffer held at 4 KiB)
    for 12 s, then read what is left of it (``--idle-timeout-s 5``: the server drops an answer read slower than
    16 KiB/s over 5 s; windows of ``--held-window-s``)."""
    import tempfile

    body_values = [0.5] * (8 * 64)
    header = json.dumps({"inputs": [{"name": "x", "shape": [8, 1, 8, 8], "datatype": "FP32", "data": body_values}],
                         "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}).encode()

    def attack(address, host, _active):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(60)
            s.connect(address)
            s.sendall(infer_head(host, "fan", len(header)) + header)
            answer = s.recv(1024)
            time.sleep(12)
            try:
                while part := s.recv(1 << 20):
                    answer += part
            except OSError:
                pass
        head, _, content = answer.partition(b"\r\n\r\n")
        whole = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")), 0)
        return {"read": len(content), "whole": whole}

    with tempfile.TemporaryDirectory() as folder:
        common, records = beside(args, attack, args.held, 0.1,
                                 ("--idle-timeout-s", "5", "--model-file", f"fan={fan_program(Path(folder))}"),
                                 args.held_window_s)
    cut = sum(1 for r in records if r["read"] < r["whole"])
    common["flags"] = [f"fan={FAN_FILE}" if f.startswith("fan=") else f for f in common["flags"]]  # not the tmp dir
    return {**common, "answer_mib": round(max(r["whole"] for r in records) / (1 << 20), 1), "answers_cut": cut,
            "pass": passed(common) and cut == len(records)}


def unfinished_bodies(args) -> dict:
    """``--held`` clients that each declare a 4 MB body, send 3.5 MB of it, then 120 KiB every 4 s (above the
    minimum rate) to their window's end without finishing it (``--max-held-mb 22 --idle-timeout-s 5``, windows of
    ``--held-window-s``): at most five are held, the others refused 503 at once."""
    def attack(address, host, active):
        started = time.monotonic()
        status = None
        with socket.create_connection(address, timeout=60) as s:
            try:
                s.sendall(infer_head(host, "squeezenet", 4_000_000))
                time.sleep(0.05)
                status = status_of(s)
                if status is None:
                    s.sendall(b" " * 3_500_000)
                sent = time.monotonic()
                while status is None and active():
                    time.sleep(0.25)
                    status = status_of(s)
                    if status is None and time.monotonic() - sent >= 4:
                        s.sendall(b" " * (120 << 10))
                        sent = time.monotonic()
            except OSError:
                status = -1
        return {"status": status, "held_s": time.monotonic() - started}

    common, records = beside(args, attack, args.held, 0.1, ("--max-held-mb", "22", "--idle-timeout-s", "5"),
                             args.held_window_s)
    held = [r["held_s"] for r in records if r["status"] is None]
    return {**common, "refused_503": sum(1 for r in records if r["status"] == 503),
            "cut": sum(1 for r in records if r["status"] == -1), "held_to_window_end": len(held),
            "held_s_median": round(statistics.median(held), 1) if held else None, "pass": passed(common)}


def connections(args) -> dict:
    """``--attackers`` clients that each open their share of ``--idle`` connections (past the server's open-file
    limit, ``--nofile``) at the start of every attacked window, say nothing on them and hold them to its end, while
    a fresh client asks ``/v2/health/live`` every 50 ms on a new connection (those clients locked every other one
    out: liveness timed out for as long as they held them). What the server did with them: closed (idle, to make
    room for a new connection), refused 503, or held."""
    share = -(-args.idle // args.attackers)

    def attack(address, _host, active):
        held, failed, started = [], 0, time.perf_counter()
        for _ in range(share):
            try:
                held.append(socket.create_connection(address, timeout=10))
            except OSError:
                failed += 1
        opened_s = time.perf_counter() - started
        while active():
            time.sleep(0.05)
        fates = {"closed": 0, "refused": 0, "held": 0}
        for s in held:
            s.setblocking(False)
            try:
                data = s.recv(64)
            except BlockingIOError:
                fates["held"] += 1
            except OSError:
                fates["closed"] += 1
            else:
                fates["refused" if data.startswith(b"HTTP/1.1 503") else "closed"] += 1
            s.close()
        return {**fates, "failed": failed, "opened_s": opened_s}

    common, records = beside(args, attack, args.attackers, 0.1, nofile=args.nofile, fresh=True)
    fates = {k: sum(r[k] for r in records) for k in ("closed", "refused", "held", "failed")}
    common["flags"] = [f"(open-file limit {args.nofile})"]
    return {**common, "idle_connections": share * args.attackers, "nofile": args.nofile, **fates,
            "opened_s_max": round(max(r["opened_s"] for r in records), 2),
            "pass": passed(common) and fates["failed"] == 0}


def grpc_oversized(args) -> dict:
    """``--grpc-calls`` clients each sending, one after another, ModelInfer calls of ``--grpc-mb`` MB (over gRPC's
    message cap: under explicit control it was 64 MiB, whatever the model took) and of just under the cap (over
    squeezenet's own limit: read whole, then refused), with ``--model-control-mode explicit --max-held-mb 64``:
    the server's RSS beside them against alone (40 calls of 60 MB had raised it by 1.56 GB). The clients run in a
    process of their own (:func:`grpc_attacker`, started once), so that their copies of the messages do not hold
    this process's GIL from the normal inferences."""
    import tempfile

    budget_mb = 64
    child = subprocess.Popen([sys.executable, __file__, "--grpc-attacker", "--grpc-mb", str(args.grpc_mb),
                              "--grpc-calls", str(args.grpc_calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)

    def tell(line: str) -> None:
        child.stdin.write(line + "\n")
        child.stdin.flush()

    def attack(grpc_address, _host, active):
        tell(f"go {grpc_address}")
        while active():
            time.sleep(0.05)
        tell("stop")
        return json.loads(child.stdout.readline())

    try:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("the gRPC clients did not start")
        with tempfile.TemporaryDirectory() as folder:
            common, records = beside(args, attack, 1, 0.0,
                                     ("--model-repository", folder, "--model-control-mode", "explicit",
                                      "--max-held-mb", str(budget_mb)), grpc=True)
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    common["flags"] = ["--model-repository", "(empty)", *common["flags"][2:]]
    codes: dict[str, int] = {}
    for r in records:
        for code, n in r.items():
            codes[code] = codes.get(code, 0) + n
    rise = common["rss_max_mb"]["attacked"] - common["rss_max_mb"]["idle"]
    common["attackers"] = args.grpc_calls
    return {**common, "message_mb": args.grpc_mb, "calls": sum(codes.values()), "codes": codes,
            "rss_rise_mb": rise, "budget_mb": budget_mb,
            "pass": passed(common) and rise <= budget_mb and sum(codes.values()) > 0 and "OK" not in codes}


def grpc_attacker(mb: int, calls: int) -> None:
    """What :func:`grpc_oversized` runs in a process of its own: says ``ready`` once its messages are built; on
    ``go ADDRESS`` (a line on stdin) ``calls`` threads send ModelInfer calls one after another, alternately of ``mb``
    MB and of just under a 2 MiB cap, until ``stop``, which it answers with the codes seen (JSON, one line). It runs
    at the lowest priority, standing in for clients on other machines: on this one they share the server's two cores,
    and their own sending is no cost of the server's."""
    import grpc
    from tritonclient.grpc import service_pb2

    os.nice(19)

    def message(size: int) -> bytes:
        r = service_pb2.ModelInferRequest(model_name="squeezenet")
        r.inputs.add(name="x", datatype="FP32", shape=[1, 3, 64, 64])
        r.raw_input_contents.append(b"\0" * size)
        return r.SerializeToString()

    messages = [message(mb << 20), message((2 << 20) - (64 << 10))]
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.startswith("go "):
            continue
        address, stop, codes, lock = line.split()[1], threading.Event(), {}, threading.Lock()

        def send(address=address, stop=stop, codes=codes, lock=lock) -> None:
            with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
                k = 0
                while not stop.is_set():
                    try:
                        call(messages[k % 2], timeout=60)
                        code = "OK"
                    except grpc.RpcError as exc:
                        code = exc.code().name
                    with lock:
                        codes[code] = codes.get(code, 0) + 1
                    k += 1

        threads = [threading.Thread(target=send) for _ in range(calls)]
        for t in threads:
            t.start()
        sys.stdin.readline()  # stop
        stop.set()
        for t in threads:
            t.join(timeout=120)
        print(json.dumps(codes), flush=True)


def passed(common: dict) -> bool:
    """The normal inferences' median beside the attackers within 1.2x of alone, liveness under a second."""
    return common["attacked_over_idle"] <= 1.2 and common["live_max_ms"]["attacked"] < 1000


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer and smaller requests")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--requests", type=int, default=50, help="refused gRPC requests (default %(default)s)")
    p.add_argument("--bodies", type=int, default=8, help="large HTTP bodies at once (default %(default)s)")
    p.add_argument("--json-mb", type=float, default=24.0, help="size of each decoded JSON body (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=5.0, help="how long RSS is watched after the last request")
    p.add_argument("--attackers", type=int, default=2, help="refused_body: attacking clients (default %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="refused_body: windows of each kind (default %(default)s)")
    p.add_argument("--window-s", type=float, default=4.0, help="refused_body: seconds a window (default %(default)s)")
    p.add_argument("--reconnect-ms", type=float, default=100.0, help="refused_body: an attacker cut off connects "
                                                                    "again this long after (default %(default)s)")
    p.add_argument("--cap-mb", type=int, default=1024, help="refused_body: an attacking connection stops after "
                                                           "this many MiB (default %(default)s)")
    p.add_argument("--copies", type=int, default=20_000, help="amplification: copies of the output asked for "
                                                                   "(default %(default)s)")
    for flag, kind, default, what in (
            ("--held-window-s", float, 15.0, "trickle, unread_answers, unfinished_bodies: seconds a window"),
            ("--held", int, 12, "trickle, unread_answers, unfinished_bodies: attacking clients"),
            ("--idle", int, 612, "connections: idle connections held in all"),
            ("--nofile", int, 512, "connections: the server's open-file limit"),
            ("--grpc-calls", int, 8, "grpc_oversized: calls in flight at once"),
            ("--grpc-mb", int, 60, "grpc_oversized: the oversized messages' MB")):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default %(default)s)")
    p.add_argument("--only", "--scenarios", dest="only", help="comma list of scenarios to run (default: all)")
    p.add_argument("--grpc-attacker", action="store_true", help=argparse.SUPPRESS)  # grpc_oversized's clients
    args = p.parse_args()
    if args.grpc_attacker:
        grpc_attacker(args.grpc_mb, args.grpc_calls)
        return
    if args.quick:
        args.requests, args.bodies, args.json_mb, args.settle_s = 4, 2, 2.0, 2.0
        args.rounds, args.window_s, args.held, args.held_window_s, args.copies = 2, 2.0, 3, 14.0, 2000
        args.grpc_calls, args.grpc_mb = 4, 16
    oversized = b"{" + b" " * ((63 << 20) - 1)
    values = int(args.json_mb * (1 << 20) / 21)
    decoded = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 64, 64], "datatype": "FP32",
                                      "data": [0.123456789012345] * values}]}).encode()
    scenarios = {
        "grpc_rss": lambda: grpc_rss(args, ["--max-body-mb", "64"]),
        "grpc_rss_default": lambda: grpc_rss(args, []),
        "live_oversized": lambda: liveness(args, [], oversized, {"Content-Type": "application/json"}),
        "live_decoded": lambda: liveness(args, ["--max-body-mb", "64"], decoded, {"Content-Type": "application/json"}),
        "refused_body": lambda: refused_body(args, args.reconnect_ms / 1e3),
        "refused_body_flood": lambda: refused_body(args, 0.0),
        "amplification": lambda: amplification(args),
        "trickle": lambda: trickle(args),
        "unread_answers": lambda: unread_answers(args),
        "unfinished_bodies": lambda: unfinished_bodies(args),
        "connections": lambda: connections(args),
        "grpc_oversized": lambda: grpc_oversized(args),
    }
    chosen = [n.strip() for n in (args.only or ",".join(scenarios)).split(",") if n.strip()]
    unknown = [n for n in chosen if n not in scenarios]
    if unknown:
        raise SystemExit(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(scenarios)}")
    results = {"machine": machine_info(), **{name: scenarios[name]() for name in chosen}}
    rows = [[name, " ".join(r["flags"]) or "(defaults)", str(r.get("codes", r.get("statuses"))), str(r["seconds"]),
             f"{r['rss_before_mb']} -> {r['rss_after_mb']} -> {r['rss_settled_mb']}" if "rss_before_mb" in r else "",
             f"{r['live_median_ms']} / {r['live_max_ms']}" if "live_max_ms" in r else "", str(r["pass"])]
            for name, r in results.items() if name in ("grpc_rss", "grpc_rss_default", "live_oversized",
                                                         "live_decoded")]
    if rows:
        console.print(table("refused requests (squeezenet 64 px)", ["scenario", "flags", "answers", "s",
                                                                   "RSS MB before -> after -> settled",
                                                                   "live median / max ms", "pass"], rows))
    attacks = [[name, str(r["attackers"]), f"{r['reconnect_ms']:g}", str(r["connections"]),
                f"{r['server_read_max_kib']} / {r['server_read_median_kib']}",
                f"{r['pushed_max_kib']} / {r['pushed_median_kib']}",
                f"{r['infer_median_ms']['idle']} / {r['infer_median_ms']['attacked']}", str(r["attacked_over_idle"]),
                f"{r['server_cpu_s_per_s']['idle']} / {r['server_cpu_s_per_s']['attacked']}", str(r["pass"])]
               for name, r in results.items() if name.startswith("refused_body")]
    if attacks:
        console.print(table("clients declaring 100 GiB and sending on (squeezenet 64 px)",
                            ["scenario", "attackers", "reconnect ms", "connections", "server read max / median KiB",
                             "pushed max / median KiB",
                             "infer median ms idle / attacked", "x", "server CPU s/s idle / attacked", "pass"],
                            attacks))
    beside_rows = [[name, " ".join(r["flags"]) or "(defaults)", str(r["attackers"]), str(r["connections"]),
                    f"{r['infer_median_ms']['idle']} / {r['infer_median_ms']['attacked']}",
                    str(r["attacked_over_idle"]),
                    f"{r['live_median_ms']['attacked']} / {r['live_max_ms']['attacked']}",
                    f"{r['rss_max_mb']['idle']} / {r['rss_max_mb']['attacked']}", str(r["pass"])]
                   for name, r in results.items() if name in ATTACKS]
    if beside_rows:
        console.print(table("attackers beside normal inferences (squeezenet 64 px)",
                            ["scenario", "flags", "attackers", "connections", "infer median ms idle / attacked", "x",
                             "live median / max ms attacked", "RSS max MB idle / attacked", "pass"], beside_rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "serve_hostile.json"
    if args.only and path.exists():  # the other scenarios' results stay as (and where) they were measured
        machine = results.pop("machine")
        results = {**json.loads(path.read_text()), **{n: {**r, "machine": machine} for n, r in results.items()}}
    path.write_text(json.dumps(results, indent=1) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
