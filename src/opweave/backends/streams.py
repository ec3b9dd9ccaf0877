"""CUDA streams: one pool per device that hands out distinct streams, and the lanes of a plan run on them.

**The pool.** ``torch.cuda.Stream()`` hands out streams round robin from PyTorch's per-device pool (32 per
priority), so two lanes could share one CUDA stream and serialize. :func:`stream_pool` is the one
:class:`StreamPool` per device that every user of streams takes from: the CUDA backend (its side lanes and its
capture stream; a serving executor builds one backend per combined-block signature) and a CUDA rank of the
distributed backend (its side lanes). :meth:`StreamPool.take` gives one *distinct* stream per name, the streams
held by the fewest users first, and grows from PyTorch's pool while every stream it has is in use, so users alive
at the same time get different streams until PyTorch's 32 are all handed out; past that they share the least used
ones. :meth:`StreamPool.give_back` returns them (a backend's ``close``, or its collection). More names than PyTorch
has distinct streams is a :class:`~opweave.errors.DeviceError` naming two of them (:func:`check_distinct_streams`);
:func:`default_streams` (8, the GPU's default number of hardware queues, ``CUDA_DEVICE_MAX_CONNECTIONS``) is the
stream cap ``opweave.compile`` gives the scheduler for CUDA. Shared streams only serialize work, except while a
graph is being captured, when work another thread puts on the same CUDA stream would be recorded into the graph;
keep captures (first calls of a signature) out of such overlaps. Each runtime (:mod:`opweave.backends.runtime`) has
its own pools: the fake runtime's streams are its own.

**The lanes** (:class:`CudaLanes`, a :class:`~opweave.backends.program.Walker`). One host thread issues every lane,
in the plan's issue order: the first lane runs on the caller's current stream (``origin``), every other lane on a
side stream that waits for an event recorded on ``origin`` at the start (fork), and ``origin`` waits for every
side lane's last event at the end (join), so the caller sees an ordinary stream-ordered result. A signal is a CUDA
event recorded on its lane's stream, a wait makes the lane's stream wait for it. The current stream is switched only
where a launch is on another lane than the previous one. The CUDA backend and a CUDA rank both run their lanes so.
Every launch, record, wait and release goes through the lanes' runtime (``runtime.launch`` runs the op, its work
issued on the lane's stream; ``runtime.dropped`` is told what a release drops).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

from opweave.backends.program import Lane, Step, Walker
from opweave.backends.runtime import CUDA, Runtime
from opweave.errors import DeviceError

DEFAULT_STREAMS = 8  # CUDA's default number of hardware work queues per device (CUDA_DEVICE_MAX_CONNECTIONS)
TORCH_POOL = 32  # streams per priority and device in PyTorch's pool, handed out round robin


def default_streams() -> int:
    """The stream cap per device for CUDA plans: ``CUDA_DEVICE_MAX_CONNECTIONS`` when set to a positive integer
    (the number of hardware queues streams are multiplexed onto), else its default, 8. More lanes than queues
    share queues, and a kernel queued behind another lane's in the same queue waits for it (false dependencies)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_STREAMS


def check_distinct_streams(streams: list[tuple[str, int]]) -> None:
    """Raise :class:`DeviceError` naming two of ``streams`` (name, CUDA stream handle) that share a handle."""
    seen: dict[int, str] = {}
    for name, handle in streams:
        if handle in seen:
            raise DeviceError(f"{seen[handle]} and {name} got the same CUDA stream {handle:#x} from PyTorch's stream "
                              f"pool ({TORCH_POOL} streams per priority, handed out round robin; {len(streams)} asked "
                              f"for here): schedule with fewer streams (e.g. streams={default_streams()})")
        seen[handle] = name


class StreamPool:
    """The distinct streams of one device that opweave took from PyTorch, and how many users hold each (see the
    module docstring), from ``runtime``. Thread-safe."""

    def __init__(self, device: torch.device, runtime: Runtime = CUDA):
        self.device, self.runtime = device, runtime
        self.streams: list[torch.cuda.Stream] = []
        self.users: list[int] = []
        self.full = False  # PyTorch has no stream the pool lacks
        self._lock = threading.Lock()

    def take(self, names: list[str]) -> list[torch.cuda.Stream]:
        """One distinct stream per name, the least used first; :class:`DeviceError` when PyTorch has fewer."""
        with self._lock:
            while not self.full and self.users.count(0) < len(names):
                self._grow()
            chosen = sorted(range(len(self.streams)), key=lambda i: (self.users[i], i))[:len(names)]
            if len(chosen) < len(names):  # what PyTorch's round robin would have given: a repeat
                check_distinct_streams([(name, self.streams[chosen[k % len(chosen)]].cuda_stream)
                                        for k, name in enumerate(names)])
            for i in chosen:
                self.users[i] += 1
            return [self.streams[i] for i in chosen]

    def give_back(self, streams: Iterable[torch.cuda.Stream]) -> None:
        """Streams a user no longer runs anything on (pending work may still be queued: later users wait for it)."""
        with self._lock:
            for stream in streams:
                i = next(i for i, s in enumerate(self.streams) if s.cuda_stream == stream.cuda_stream)
                self.users[i] -= 1

    def _grow(self) -> None:
        """Add a stream PyTorch has and the pool lacks: one round of PyTorch's round robin finds every one of them
        (other callers of ``torch.cuda.Stream()`` may have moved it on); none means the pool is full."""
        known = {s.cuda_stream for s in self.streams}
        for _ in range(TORCH_POOL):
            stream = self.runtime.Stream(self.device)
            if stream.cuda_stream not in known:
                self.streams.append(stream)
                self.users.append(0)
                return
        self.full = True


def stream_pool(device: torch.device, runtime: Runtime = CUDA) -> StreamPool:
    """The one :class:`StreamPool` of ``runtime``'s device ``device`` (its current device when the index is None)."""
    device = torch.device(device)
    if device.index is None:
        device = runtime.device
    with runtime.pools_lock:
        if device.index not in runtime.pools:
            runtime.pools[device.index] = StreamPool(device, runtime)
        return runtime.pools[device.index]


class CudaLanes(Walker):
    """A plan's lanes on CUDA streams, forked from and joined into the caller's stream (see the module docstring).

    ``lanes`` in order (the first runs on ``origin``), ``side`` the streams of the others, one CUDA event per
    signal, all of ``runtime``. :meth:`issue` runs ops of a ``captured`` model in ``env``, dropping the keys a step
    releases; ``current_op`` names the op being launched when it raised (None after a walk that finished)."""

    def __init__(self, lanes: list[Lane], side: list[torch.cuda.Stream], num_signals: int,
                 runtime: Runtime = CUDA):
        if len(side) != max(0, len(lanes) - 1):
            raise ValueError(f"{len(lanes)} lanes need {max(0, len(lanes) - 1)} side streams, got {len(side)}")
        self.lanes, self.side, self.runtime = lanes, side, runtime
        self.events = [runtime.Event() for _ in range(num_signals)]
        self._fork = runtime.Event()
        self._joins = [runtime.Event() for _ in side]
        self.stream_of: dict[Lane, torch.cuda.Stream] = {}
        self.current_op: str | None = None
        self.captured: Any = None  # the running call's model, environment and current stream (None between calls)
        self.env: Any = None
        self._active: Any = None

    def issue(self, steps: Iterable[tuple[Lane, Step]], origin: torch.cuda.Stream, captured, env: dict) -> None:
        """Walk ``steps`` forked from and joined into ``origin``, the current stream, which is current again when
        this returns or raises."""
        self.stream_of = dict(zip(self.lanes, [origin, *self.side], strict=False))
        self.captured, self.env, self._active, self.current_op = captured, env, origin, None
        self.fork(origin)
        try:
            self.run(steps)
        finally:
            if self._active is not origin:
                self.runtime.set_stream(origin)
            self.captured = self.env = self._active = None  # keep no buffer alive between calls
        self.current_op = None
        self.join(origin)

    def fork(self, origin: torch.cuda.Stream) -> None:
        """Every side stream waits for the work issued to ``origin`` so far."""
        if self.side:
            self._fork.record(origin)
            for side in self.side:
                side.wait_event(self._fork)

    def join(self, origin: torch.cuda.Stream, *, quietly: bool = False) -> None:
        """``origin`` waits for the work issued to every side stream so far. ``quietly``: a step that fails (as
        after an op failed mid-capture, once the capture was invalidated) is skipped, so that the capture can end."""
        for side, event in zip(self.side, self._joins, strict=True):
            try:
                event.record(side)
                origin.wait_event(event)
            except Exception:
                if not quietly:
                    raise

    def launch(self, lane: Lane, op: str) -> None:
        stream = self.stream_of[lane]
        if stream is not self._active:
            self.runtime.set_stream(stream)
            self._active = stream
        self.current_op = op
        self.runtime.launch(stream, self.captured.run_op, op, self.env)

    def signal(self, lane: Lane, number: int) -> None:
        self.events[number].record(self.stream_of[lane])

    def wait(self, lane: Lane, number: int) -> None:
        self.stream_of[lane].wait_event(self.events[number])

    def release(self, lane: Lane, keys: tuple[str, ...]) -> None:
        self.runtime.dropped([self.env.pop(key, None) for key in keys])
