"""What the HTTP and gRPC front ends share: the draining state, one inference from a decoded request to its answer or
a :class:`Refused` that each front end maps to its own status, the bytes requests may hold (:class:`Budget`), and
the limits each front end holds its connections to (:func:`connection_limit`); no HTTP, no gRPC here.

==============  ====  =====================  ================================================
kind            HTTP  gRPC                   when
==============  ====  =====================  ================================================
``invalid``     400   ``INVALID_ARGUMENT``   the request is malformed (:class:`ProtocolError`)
``not_found``   404   ``NOT_FOUND``          unknown model or version (or it was just unloaded)
``full``        429   ``RESOURCE_EXHAUSTED`` the model's queue is full (``retry_after_s``)
``draining``    503   ``UNAVAILABLE``        the server drains after SIGTERM, or the model is being unloaded
``overloaded``  503   ``UNAVAILABLE``        the server holds its :class:`Budget` of bytes (``retry_after_s``)
``timeout``     504   ``DEADLINE_EXCEEDED``  the request passed its deadline
``error``       500   ``INTERNAL``           the model failed
==============  ====  =====================  ================================================

A refusal says one line (:func:`one_line`) that names the culprit and no directory of the server, and keeps
nothing of the request: :func:`offload` raises its :class:`Refused` outside the handler of the
:class:`~opweave.serve.protocol.ProtocolError` it replaces, so neither the exception's context nor its traceback
(whose frames hold the request's bytes) outlives the answer. What the C heap keeps after a large request
(gRPC reads a message it refuses on its own threads, each with a glibc arena of its own, and the freed memory stays
with the arenas) goes back to the operating system through :class:`HeapTrimmer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import resource
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opweave.errors import OpweaveError, UsageError
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.requests import QueueFull, Request, Unavailable
from opweave.serve.protocol import InferRequest, ProtocolError

HTTP_STATUS = {"invalid": 400, "not_found": 404, "full": 429, "draining": 503, "overloaded": 503, "timeout": 504,
               "error": 500}
MAX_HELD_BYTES = 512 << 20  # what unfinished request bodies and unread answers may hold, server-wide
CONTROL_BYTES = 2 << 20  # a repository call's body or message (a load's parameters.config, at most 1 MiB of it)
RETRY_AFTER_S = 1.0  # when a request refused by the Budget may try again
HEADER_TIMEOUT_S = 10.0  # a request's headers (gRPC: the HTTP/2 handshake) must arrive within this
IDLE_TIMEOUT_S = 60.0  # a connection idle this long is closed
MAX_CONNECTIONS = 4096  # connections each front end holds by default (fewer where the open-file limit says so)
RESERVED_FILES = 256  # of the open-file limit, kept for the process's own files and the sockets accepted at once


class Refused(OpweaveError):
    """A request not answered with outputs: ``kind`` (module table), the message, and for ``full`` when to retry."""

    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind, self.retry_after_s = kind, retry_after_s


def one_line(text: str, limit: int = 1000) -> str:
    """What a refusal tells the client: ``text`` on one line, at most ``limit`` characters."""
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


_decoder: ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def _decoding_thread() -> ThreadPoolExecutor:
    global _decoder
    with _decoder_lock:
        if _decoder is None:
            _decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opweave-decode")
        return _decoder


async def offload(decode: Callable[..., Any], *args: Any, size: int, threshold: int) -> Any:
    """``decode(*args)`` (a request's decoding, or a response's encoding), on the process's one decoding thread when
    the request's ``size`` in bytes passes ``threshold`` (a large JSON body takes seconds to parse: the event loops
    go on answering meanwhile), else here. One thread: decoding holds the GIL, so more threads would decode no
    faster and would each take the GIL from the event loops in turn. Its
    :class:`~opweave.serve.protocol.ProtocolError` comes out as :class:`Refused` ``invalid``, raised after the
    handler so that the refusal does not hold the decoding's frames."""
    try:
        if size > threshold:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(_decoding_thread(), functools.partial(decode, *args))
        return decode(*args)
    except ProtocolError as exc:
        message = str(exc)
    raise Refused("invalid", message)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(field, ctypes.c_size_t) for field in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def release_memory() -> None:
    """Give back what the process no longer holds, at once: Python's cycle collector (a model's graphs hold reference
    cycles) and then glibc's ``malloc_trim`` (where there is one); after an unload, which frees more than
    :class:`HeapTrimmer`'s threshold only with large models."""
    import gc

    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None
    if trim is not None:
        trim(0)


class HeapTrimmer:
    """Gives memory the C heap has freed back to the operating system (glibc's ``malloc_trim``) once the process's
    *slack* (resident bytes that no live allocation holds: its resident size less what glibc's ``mallinfo2`` counts
    in use) has grown by ``threshold_bytes`` since it last did; it looks every ``period_s`` on a thread of its own.
    Memory in use (a request being decoded, a model loaded) is not slack, so it neither triggers a trim nor hides
    what is freed after it. Without ``mallinfo2`` the slack is the resident size; without glibc or ``/proc``
    nothing is done."""

    def __init__(self, period_s: float = 1.0, threshold_bytes: int = 16 << 20):
        self.period_s, self.threshold_bytes = period_s, threshold_bytes
        self.trims = 0
        libc = ctypes.CDLL(None) if os.name == "posix" else None
        self._trim = getattr(libc, "malloc_trim", None)
        self._info = getattr(libc, "mallinfo2", None)
        if self._info is not None:
            self._info.restype = _MallInfo2
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def slack(self) -> int | None:
        """Resident bytes not held by a live allocation of the C heap (the process's code and stacks among them)."""
        try:
            with open("/proc/self/statm") as f:
                resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None
        if self._info is None:
            return resident
        info = self._info()
        return resident - info.uordblks - info.hblkhd

    def start(self) -> None:
        """Trim once (so that slack freed before the start is not counted as the baseline, where a later allocation
        could reuse it unseen between two looks), then look every ``period_s``."""
        if self._trim is None or self.slack() is None:
            return
        self._trim(0)
        self._thread = threading.Thread(target=self._run, name="opweave-heap-trim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = self.slack() or 0
        while not self._stop.wait(self.period_s):
            now = self.slack() or 0
            if now > last + self.threshold_bytes and self._trim is not None:
                self._trim(0)
                self.trims += 1
                last = self.slack() or 0
            else:
                last = min(last, now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class Budget:
    """The bytes that unfinished request bodies and unread answers hold, server-wide (Envoy's overload manager, one
    budget for every connection), and the most they may hold (``limit``, ``opweave serve --max-held-mb``). A body
    takes what it declares (or, streamed, what has arrived) before it is read; one that would pass the limit is
    refused ``overloaded`` (503, ``Retry-After``); an answer that the client does not read takes what waits in its
    connection's buffer, and is never refused (it is computed), but the bodies that come after it are. Counted from
    every front end's threads, hence the lock."""

    def __init__(self, limit: int = MAX_HELD_BYTES):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def change(self, delta: int, refusable: bool = False) -> None:
        """Add ``delta`` bytes (negative: given back); ``refusable``: :class:`Refused` ``overloaded`` instead, if
        they would pass the limit."""
        with self._lock:
            if refusable and delta > 0 and self.held + delta > self.limit:
                held = self.held
            else:
                self.held += delta
                return
        raise Refused("overloaded", f"the server holds {held} bytes of unfinished requests and unread answers: "
                                    f"{delta} more would pass its budget of {self.limit} bytes (opweave serve "
                                    f"--max-held-mb); retry later", RETRY_AFTER_S)

    @contextlib.contextmanager
    def hold(self) -> Iterator[Hold]:
        """``with budget.hold() as hold``: ``hold(n)`` makes what this request holds at least ``n`` bytes (refused
        as :meth:`change` says), ``hold.shrink(n)`` at most ``n``; all of it given back when the block ends."""
        held = Hold(self)
        try:
            yield held
        finally:
            held.shrink(0)


class Hold:
    """What one request holds of a :class:`Budget` (:meth:`Budget.hold`)."""

    def __init__(self, budget: Budget):
        self.budget, self.held = budget, 0

    def __call__(self, n: int) -> None:
        """Hold at least ``n`` bytes; :class:`Refused` ``overloaded`` if the budget cannot take them."""
        if n > self.held:
            self.budget.change(n - self.held, refusable=True)
            self.held = n

    def shrink(self, n: int) -> None:
        """Hold at most ``n`` bytes (what was reserved before a size was known, given back down to it)."""
        if n < self.held:
            self.budget.change(n - self.held)
            self.held = n


class State:
    """What the front ends and the draining server share: accepted requests not yet answered (counted from every
    front end's threads, hence the lock), and the draining flag."""

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.inflight += 1

    def leave(self) -> None:
        with self._lock:
            self.inflight -= 1


def connection_limit(asked: int | None = None, front_ends: int = 1) -> int:
    """The connections each of ``front_ends`` front ends may hold (``--max-connections``): ``asked``, or by default
    :data:`MAX_CONNECTIONS`; either way within the process's open-file limit (``ulimit -n``) less
    :data:`RESERVED_FILES` (a quarter of it, where that is less), shared among the front ends, so that no connection
    past the limit leaves the server unable to accept (or open) anything. :class:`~opweave.errors.UsageError` if
    ``asked`` does not fit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    kept = min(RESERVED_FILES, soft // 4)
    room = MAX_CONNECTIONS * front_ends if soft == resource.RLIM_INFINITY else (soft - kept) // front_ends
    if asked is None:
        if room < 1:
            raise UsageError(f"the open-file limit ({soft}, ulimit -n) leaves no room for connections; raise it")
        return min(MAX_CONNECTIONS, room)
    if asked > room:
        raise UsageError(f"--max-connections {asked} does not fit the open-file limit ({soft}, ulimit -n): "
                         f"{front_ends} front end(s) x {asked} connections + {kept} files the server keeps for "
                         f"itself; raise the limit or give at most {max(room, 0)}")
    return asked


async def infer(engine: Engine, state: State, name: str, request: InferRequest,
                timeout_s: float | None = None) -> Request:
    """Queue ``request`` for model ``name`` on ``engine`` and wait (on the running event loop) for its answer; a
    request not answered ``done`` raises :class:`Refused`. ``timeout_s``: a deadline the transport adds (a gRPC
    client's), the earlier of it and the request's own is kept."""
    if state.draining:
        raise Refused("draining", "the server is shutting down")
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def done(r: Request) -> None:
        def settle() -> None:
            if not answer.done():
                answer.set_result(r)

        loop.call_soon_threadsafe(settle)

    deadline = min((t for t in (request.timeout_s, timeout_s) if t is not None), default=None)
    state.enter()
    try:
        try:
            engine.submit(name, request.inputs, batch=request.batch, timeout_s=deadline, on_done=done)
        except QueueFull as exc:
            raise Refused("full", str(exc), exc.retry_after_s) from None
        except Unavailable as exc:
            raise Refused("draining", str(exc)) from None
        except UsageError as exc:  # the model left between the lookup and the submission
            raise Refused("not_found", str(exc)) from None
        result: Request = await answer
    finally:
        state.leave()
    if result.status == "timeout":
        raise Refused("timeout", f"request for {name!r} passed its deadline after {result.latency_s * 1e3:.1f} ms")
    if result.status != "done":
        raise Refused("error", f"{name}: {result.error}")
    return result


__all__ = ["CONTROL_BYTES", "HEADER_TIMEOUT_S", "HTTP_STATUS", "IDLE_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_HELD_BYTES",
           "RESERVED_FILES", "RETRY_AFTER_S", "Budget", "HeapTrimmer", "Hold", "Refused", "State", "connection_limit",
           "infer", "offload", "one_line", "release_memory"]
