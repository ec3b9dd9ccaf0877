"""One rank: its :class:`~.split.RankPart` run on its own worker threads (CPU) or streams (CUDA), its messages
exchanged with ``torch.distributed`` point-to-point; and the entry points of rank processes.

:class:`RankRuntime` builds the rank's GraphModule (``fx.GraphModule(part.root, part.fx_graph)``: only the rank's
parameters are real) and a :class:`~opweave.capture.runtime.Captured` on it, then runs one call at a time:

* **CPU.** One worker thread per lane (:class:`~opweave.backends.cpu.LanePool`), as the single-process CPU backend
  runs them, on the rank's threads as :func:`opweave.backends.threads.budgets` shares them; the signal of each incoming
  message is an :class:`Arrival` (a lane's ``recv`` step waits for the transfer and finds the values in the
  environment). The calling thread posts the rank's messages in their global order (:meth:`RankRuntime._post_cpu`): a
  receive at once, a send once its lane has raised the send's signal.
* **CUDA.** The lanes on streams as the single-process CUDA backend runs them
  (:class:`~opweave.backends.streams.CudaLanes`: the first lane on the current stream, the others on streams of the
  device's pool, forked from and joined into it), walked by one host thread over ``part.issue`` (the rank's steps
  and messages in plan order): records and waits as CUDA events, a send posted under its lane's stream (NCCL orders
  it after the op) instead of an event, a recv step as ``work.wait()`` under the reading lane's stream.

Consecutive messages are posted as one ``batch_isend_irecv`` (one NCCL group) when they are adjacent in the
rank's order, no wait lies between them and their sends come from one lane.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import statistics
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from opweave.backends.cpu import Call, LanePool, LaneWorker
from opweave.backends.distributed import wire
from opweave.backends.distributed.split import Message, RankPart
from opweave.backends.program import Lane
from opweave.backends.streams import CudaLanes, stream_pool
from opweave.backends.threads import budgets
from opweave.capture.runtime import Captured, module_tensors
from opweave.errors import CaptureError


class CommError(RuntimeError):
    """A point-to-point transfer failed: a peer is gone, or nothing came within the process group's timeout."""


@dataclass(frozen=True)
class Settings:
    """How a rank process starts: its device kind, intra-op threads, the process group's timeout, the store."""

    device: str
    threads: int
    timeout_s: float
    port: int
    host: str = "127.0.0.1"


# ---- one rank's runtime -----------------------------------------------------------------------------------------


class Arrival:
    """An incoming message on its receiving rank: the lanes' signal for it (``wait`` returns once the values are in
    the environment; ``set`` is how a failing call releases the waiters).

    The transfer is waited for once (a gloo receive's ``wait`` consumes its completion: a second ``wait`` would
    block forever), by the first lane that needs it; on CUDA later readers wait for an event recorded on the first
    reader's stream after its ``work.wait()``."""

    def __init__(self, message: Message, env: dict, device: torch.device):
        self.message, self.env, self.device = message, env, device
        self.posted = threading.Event()
        self.works: list = []
        self.buffers: list[torch.Tensor] = []
        self.aborted = self.unpacked = False
        self.lock = threading.Lock()
        self.arrived = None  # CUDA: event on the first reader's stream once the transfer is done

    def post(self, works: list, buffers: list[torch.Tensor]) -> None:
        self.works, self.buffers = works, buffers
        self.posted.set()

    def set(self) -> None:
        self.aborted = True
        self.posted.set()

    def is_set(self) -> bool:
        return self.unpacked or self.aborted

    def wait(self) -> bool:
        self.posted.wait()
        if self.aborted:
            return True
        m = self.message
        with self.lock:
            if not self.unpacked:
                for work in self.works:  # CUDA: the current stream waits; CPU: blocks until the bytes are here
                    _checked(work.wait, f"receiving op {m.op!r}'s output from rank {m.src}")
                parts = iter(self.buffers)
                for key, layout in zip(m.keys, m.layouts, strict=True):
                    self.env[key] = wire.unpack(parts, layout, self.device)
                if self.device.type == "cuda":
                    self.arrived = torch.cuda.current_stream(self.device).record_event()
                self.unpacked = True
            elif self.arrived is not None:
                torch.cuda.current_stream(self.device).wait_event(self.arrived)
        return True


class RankRuntime:
    """Rank ``part.rank``'s share of the model and plan, ready to run calls (see the module docstring)."""

    def __init__(self, part: RankPart, device: torch.device, threads: int | None = None):
        self.part, self.rank, self.device = part, part.rank, device
        gm = fx.GraphModule(part.root, part.fx_graph)
        for p in gm.parameters():
            p.requires_grad_(False)
        if device.type == "cuda":
            _move(gm, device)
        by_name = {n.name: n for n in gm.graph.nodes}
        self.captured = Captured(part.graph, gm, {op: [by_name[n] for n in names] for op, names in part.nodes.items()})
        self.held_bytes = held_bytes(gm)
        self.messages = part.messages
        self.stand_ins = {name: None if layout is None else wire.stand_in(layout) for name, layout in part.placeholders}
        self.pool: LanePool | None = None
        self.close: Any  # gives the streams back, or stops the workers
        if device.type == "cuda":
            lanes = sorted(part.lanes)
            pool = stream_pool(device)
            side = pool.take([f"lane {lane}" for lane in lanes[1:]])
            sends = {m.signal for m in self.messages if m.src == self.rank}
            self.lanes = _RankLanes(lanes, side, part.num_signals, sends)
            self.close = weakref.finalize(self, pool.give_back, side)
        else:
            self.pool = LanePool({lane: LaneWorker(lane, steps, self.captured).run_call
                                  for lane, steps in part.lanes.items()},
                                 budget=budgets(sorted(part.lanes), total=threads))
            self.close = weakref.finalize(self, self.pool.close)

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "ops": len(self.part.ops), "lanes": len(self.part.lanes),
                "messages": len(self.messages), "param_bytes": self.held_bytes, "threads": torch.get_num_threads()}

    def run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """One call: bind the inputs this rank reads (meta stand-ins for the rest), run the lanes, exchange the
        messages; return the values of this rank's ops that the model's output reads."""
        args = []
        for name, _ in self.part.placeholders:
            value = inputs[name] if name in inputs else self.stand_ins[name]
            args.append(value.to(self.device) if isinstance(value, torch.Tensor) and not value.is_meta else value)
        env = self.captured.bind(tuple(args))
        arrivals = {m.signal: Arrival(m, env, self.device) for m in self.messages if m.dst == self.rank}
        if self.device.type == "cuda":
            self._run_cuda(env, arrivals)
        else:
            self._run_cpu(env, arrivals)
        return {key: env[key] for key in self.part.outputs}

    # ---- CPU ----
    def _run_cpu(self, env: dict, arrivals: dict[int, Arrival]) -> None:
        pool = self.pool
        assert pool is not None  # a CPU rank's
        call = Call(env, self.part.num_signals, len(pool.workers))
        for number, arrival in arrivals.items():
            call.signals[number] = arrival

        def post(call: Call) -> None:  # this thread posts the messages while the lanes run
            sent: list = []
            self._post_cpu(call, arrivals, sent)
            call.settled.wait()
            if not call.errors:
                for arrival in arrivals.values():  # a message no lane of this rank waited for
                    arrival.wait()
                for works, message in sent:
                    for work in works:
                        _checked(work.wait, f"sending op {message.op!r}'s output to rank {message.dst}")

        pool.run(call, post, caller_is_lane=False)

    def _post_cpu(self, call: Call, arrivals: dict[int, Arrival], sent: list) -> None:
        poster = _Poster(self.rank, contextlib.nullcontext)
        for m in self.messages:
            if m.dst == self.rank:
                poster.receive(m, arrivals[m.signal], self.device)
                continue
            ready = call.signals[m.signal]
            if not ready.is_set():
                poster.flush()  # nothing posted waits behind a blocking wait
                ready.wait()
            if call.errors:
                return
            poster.send(m, self._pack(call.env, m), sent)
        poster.flush()

    # ---- CUDA ----
    def _run_cuda(self, env: dict, arrivals: dict[int, Arrival]) -> None:
        origin = torch.cuda.current_stream(self.device)
        lanes = self.lanes
        sent: list = []
        poster = _Poster(self.rank, lambda lane: torch.cuda.stream(lanes.stream_of[lane] if lane else origin))
        lanes.arrivals = arrivals
        try:
            lanes.issue(self._posting(poster, env, arrivals, sent), origin, self.captured, env)
        finally:
            lanes.arrivals = {}
        for arrival in arrivals.values():  # a message no lane of this rank waited for
            arrival.wait()
        for works, message in sent:
            for work in works:
                _checked(work.wait, f"sending op {message.op!r}'s output to rank {message.dst}")
        origin.synchronize()

    def _posting(self, poster: _Poster, env: dict, arrivals: dict[int, Arrival], sent: list):
        """The rank's steps in plan order, for :class:`_RankLanes` to walk, its messages posted between them as
        they come (a send under its lane's stream, after the op that produced it)."""
        for item in self.part.issue:
            if not isinstance(item, Message):
                poster.flush()
                yield item
            elif item.dst == self.rank:
                poster.receive(item, arrivals[item.signal], self.device)
            else:
                with torch.cuda.stream(self.lanes.stream_of[item.lane]):
                    poster.send(item, self._pack(env, item), sent)
        poster.flush()

    def _pack(self, env: dict, m: Message) -> list[torch.Tensor]:
        parts = [p for key, layout in zip(m.keys, m.layouts, strict=True)
                 for p in wire.pack(env[key], layout, f"op {m.op!r}: value {key!r}", self.device)]
        return parts or [torch.zeros(1, dtype=torch.uint8, device=self.device)]  # a token: the sync alone


class _RankLanes(CudaLanes):
    """A CUDA rank's lanes: a send's signal records no event (the send itself is posted under the lane's stream),
    and a recv's wait waits for the message's :class:`Arrival` under the reading lane's stream."""

    def __init__(self, lanes: list[Lane], side: list[torch.cuda.Stream], num_signals: int, send_signals: set[int]):
        super().__init__(lanes, side, num_signals)
        self.send_signals = send_signals
        self.arrivals: dict[int, Arrival] = {}  # this call's incoming messages, by signal

    def signal(self, lane: Lane, number: int) -> None:
        if number not in self.send_signals:
            super().signal(lane, number)

    def wait(self, lane: Lane, number: int) -> None:
        arrival = self.arrivals.get(number)
        if arrival is None:
            super().wait(lane, number)
            return
        with torch.cuda.stream(self.stream_of[lane]):
            arrival.wait()


class _Poster:
    """Collects consecutive point-to-point operations and posts them as one ``batch_isend_irecv``."""

    def __init__(self, rank: int, stream_of):
        self.rank, self.stream_of = rank, stream_of
        self.ops: list[dist.P2POp] = []
        self.done: list[tuple[int, Any]] = []  # (number of ops, callback given their works)
        self.lane: tuple[int, int] | None = None

    def receive(self, m: Message, arrival: Arrival, device: torch.device) -> None:
        buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in m.sizes]
        self._add([dist.P2POp(dist.irecv, b, m.src, tag=m.tag + i) for i, b in enumerate(buffers)],
                  lambda works: arrival.post(works, buffers))

    def send(self, m: Message, parts: list[torch.Tensor], sent: list) -> None:
        if self.lane not in (None, m.lane):
            self.flush()  # a batch syncs with one stream: sends of one lane only
        self.lane = m.lane
        self._add([dist.P2POp(dist.isend, p, m.dst, tag=m.tag + i) for i, p in enumerate(parts)],
                  lambda works: sent.append((works, m)))

    def _add(self, ops: list[dist.P2POp], callback) -> None:
        self.ops += ops
        self.done.append((len(ops), callback))

    def flush(self) -> None:
        if not self.ops:
            return
        with self.stream_of(self.lane):
            if len(self.ops) == 1:
                op = self.ops[0]
                works = [_checked(op.op, "posting a transfer", op.tensor, op.peer, tag=op.tag)]
            else:
                works = _checked(dist.batch_isend_irecv, "posting transfers", self.ops)
        if len(works) != len(self.ops):  # NCCL: one work for the whole group
            works = [works[0]] * len(self.ops)
        start = 0
        for count, callback in self.done:
            callback(works[start:start + count])
            start += count
        self.ops, self.done, self.lane = [], [], None


def _checked(fn, what: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()
        raise CommError(f"{what}: {text[-1] if text else type(exc).__name__}") from exc


def _move(gm: fx.GraphModule, device: torch.device) -> None:
    """Move ``gm``'s real tensors (not the meta stand-ins) to ``device``, ``get_attr`` constants included."""
    gm._apply(lambda t: t if t.is_meta else t.to(device))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            *path, leaf = node.target.split(".")
            owner = gm.get_submodule(".".join(path))
            value = getattr(owner, leaf)
            if isinstance(value, torch.Tensor) and not value.is_meta and value.device != device:
                setattr(owner, leaf, value.to(device))


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters, buffers and ``get_attr`` tensors (meta
    stand-ins hold none)."""
    storages = {}
    for t in module_tensors(module):
        if not t.is_meta:
            storage = t.untyped_storage()
            storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


# ---- rank processes -----------------------------------------------------------------------------------------------


def serve(rank: int, world: int, control, lifeline, settings: Settings, payload: bytes) -> None:
    """A rank process of :class:`~.launch.DistributedBackend`: load its part, join the process group, then run one
    call per ``("run", inputs)`` from the caller until ``("stop",)``, the caller's end closing, or an error (reported
    as ``("error", kind, text)``, after which the process exits: the caller stops every rank)."""
    device = _start(rank, control, lifeline, settings)
    try:
        runtime = RankRuntime(wire.loads(payload), device, settings.threads)
        del payload
        _join(rank, world, settings, device)
        _reply(control, ("ready", runtime.info()))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        _report(control, exc)
        os._exit(1)
    while True:
        try:
            message = wire.loads(control.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        if message[0] != "run":
            os._exit(0)
        try:
            outputs = runtime.run(message[1])
            _reply(control, ("done", {k: _to_cpu(v) for k, v in outputs.items()}))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            _report(control, exc)
            os._exit(1)


def pingpong(rank: int, world: int, control, lifeline, settings: Settings, sizes: list[int], repeats: int,
             warmup: int) -> None:
    """A rank process of ``opweave profile-links``: ranks 0 and 1 bounce a message of each size; rank 0 reports
    ``(bytes, median one-way ms)`` per size (half the round trip)."""
    device = _start(rank, control, lifeline, settings)
    try:
        _join(rank, world, settings, device)
        samples = []
        for size in sizes:
            buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            times = []
            for _ in range(warmup + repeats):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                elif rank == 1:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append((time.perf_counter() - t0) * 1e3 / 2)
            samples.append((size, statistics.median(times[warmup:])))
        _reply(control, ("done", samples if rank == 0 else []))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        _report(control, exc)
        os._exit(1)
    try:
        control.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _start(rank: int, control, lifeline, settings: Settings) -> torch.device:
    """First steps of a rank process: the lifeline watchdog, threads, device."""
    threading.Thread(target=_watch, args=(lifeline,), name="opweave-lifeline", daemon=True).start()
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: what a stuck rank waits for
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks started here talk over loopback only
    torch.set_num_threads(settings.threads)
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _watch(lifeline) -> None:
    """Exit as soon as the caller's end of the lifeline closes (the caller exited, crashed or closed the ranks):
    nothing is ever written on it, so the read returns only then."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(0)


def init_group(rank: int, world: int, device: torch.device, timeout_s: float, store=None) -> None:
    """Join the process group (gloo on CPU; gloo for CPU tensors and NCCL for CUDA tensors on GPUs) and wait for
    every rank (a barrier, so that the first batched point-to-point call is not also the group's first call)."""
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    dist.barrier()


def _join(rank: int, world: int, settings: Settings, device: torch.device) -> None:
    store = dist.TCPStore(settings.host, settings.port, world, is_master=False,
                          timeout=timedelta(seconds=settings.timeout_s))
    init_group(rank, world, device, settings.timeout_s, store)


def _reply(control, message) -> None:
    control.send_bytes(wire.dumps(message))


def _report(control, exc: BaseException) -> None:
    kind = "op" if isinstance(exc, CaptureError) else "comm" if isinstance(exc, CommError) else "error"
    text = str(exc).strip().splitlines()
    try:
        _reply(control, ("error", kind, f"{type(exc).__name__}: {text[0] if text else ''}"))
    except (OSError, ValueError):
        pass


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
