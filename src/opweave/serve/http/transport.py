"""HTTP connections and what they may hold (docs/serving.md, "Security"): uvicorn's h11 protocol, the server's one
HTTP parser whatever else is installed, with the limits it lacks (:func:`limited_protocol`). At most
``max_connections`` connections (:class:`Connections`: the one idle longest closed to make room for a new one, as
nginx does, a new one answered 503 and closed when none is idle; :func:`~opweave.serve.frontend.connection_limit`:
within the open-file limit); a failed accept logged once per :data:`LOG_EVERY_S` (:func:`accept_errors`); a
request's line and headers must arrive within ``header_timeout_s`` and fit :data:`MAX_HEADER_BYTES`; a body must
bring ``min_body_rate`` bytes a second over every ``idle_timeout_s`` (a trickle does not keep it), and an answer be
read as fast, else the connection is closed, as is a kept-alive connection idle that long; an answer the client does
not read is held in the server's :class:`~opweave.serve.frontend.Budget`; a request answered before its body was
read to its end has its connection closed in stages, the server reading at most :data:`LINGER_BYTES` more of it; a
request the parser cannot read is answered 400 in JSON too.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import resource
import time
from collections.abc import Callable
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

from opweave.serve import frontend
from opweave.serve.frontend import MAX_CONNECTIONS, Budget

MAX_HEADER_BYTES = 64 << 10  # a request's line and headers
LINGER_BYTES = 64 << 10  # of a refused request's body, the most the server reads after its answer (then closes)
LINGER_S = 2.0  # how long after the answer to a refused request its connection is closed (the client reads it)
MIN_BODY_RATE = 16 << 10  # bytes a second a body must bring (an answer be read) over every idle_timeout_s
LOG_EVERY_S = 10.0  # a failure that may come thousands of times a second is logged once per this interval

log = logging.getLogger(__name__)


class _Every:
    """One log line per ``interval_s`` for a failure that may come thousands of times a second (a failed accept, a
    refused connection): the first when it comes, the next once ``interval_s`` has passed, saying how many came
    meanwhile; never a traceback."""

    def __init__(self, what: str, interval_s: float = LOG_EVERY_S):
        self.what, self.interval_s = what, interval_s
        self.count, self.last = 0, -math.inf

    def __call__(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            since = "" if self.last == -math.inf else f" in the last {now - self.last:.0f} s"
            log.warning("%s %d time(s)%s: %s", self.what, self.count, since, why)
            self.count, self.last = 0, now


OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # accept's errors the loop retries


def accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """``loop``'s exception handler logs a failed accept (out of files or memory: the event loop's own report, a
    traceback for each attempt, came thousands of times a second) once per :data:`LOG_EVERY_S`, naming the limit;
    other reports go on as before."""
    every = _Every("accepting a connection failed")
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            every(f"{exc.strerror} (the open-file limit is {soft}: ulimit -n; opweave serve --max-connections "
                  f"keeps the server's connections below it)")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


class Connections:
    """The HTTP connections a server holds and the limits they are held to (:func:`limited_protocol`'s): at most
    ``limit`` connections (nginx's ``worker_connections``), and of them the idle ones (waiting for a request of which
    no byte has come: new, or kept alive after an answer), longest idle first. At the limit a new connection takes
    the place of the connection idle longest, which is closed (as nginx closes idle kept-alive connections first when
    its connections run short), and is refused, with :attr:`refusal`, if none is idle. A request's headers must come
    within ``header_timeout_s``; a body must bring, and an answer be read at, :attr:`least` bytes every
    ``idle_timeout_s``; unread answers are held in ``budget``. Used on the event loop's thread only."""

    def __init__(self, limit: int, header_timeout_s: float, idle_timeout_s: float, budget: Budget,
                 min_body_rate: float = MIN_BODY_RATE):
        self.limit, self.open = limit, 0
        self.idle: dict[LimitedProtocol, None] = {}  # insertion order: the connection idle longest first
        self.refusals = _Every("refused a connection")
        self.header_timeout_s, self.idle_timeout_s, self.budget = header_timeout_s, idle_timeout_s, budget
        self.least = max(1, int(min_body_rate * idle_timeout_s))  # bytes a body brings (an answer is read) a window
        full = json.dumps({"error": f"the server holds its {limit} connections and none of them is idle "
                                    f"(opweave serve --max-connections); retry later"}).encode()
        self.refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
                        b"%d\r\nretry-after: %d\r\nconnection: close\r\n\r\n"
                        % (len(full), math.ceil(frontend.RETRY_AFTER_S))) + full

    def admit(self) -> bool:
        """Count one more connection, closing the one idle longest at the limit; False: none is idle, refuse it."""
        if self.open >= self.limit:
            if not self.idle:
                return False
            next(iter(self.idle))._evict()
        self.open += 1
        return True


class LimitedProtocol(H11Protocol):
    """uvicorn's h11 protocol (the server's one HTTP parser, whichever others are installed: module docstring) with
    the limits it lacks: at most the pool's ``limit`` connections (:class:`Connections`: idle ones closed first to
    make room; past it, a new connection is answered 503 and closed at once); a request's line and
    headers must arrive within ``header_timeout_s`` of the connection (or of its first byte, on a kept-alive one)
    and fit :data:`MAX_HEADER_BYTES`; a body must bring ``min_body_rate`` bytes a second (at least one byte) over
    every ``idle_timeout_s`` (nginx's ``client_body_timeout`` with a minimum rate: a trickle does not keep it alive),
    and an answer must be read as fast, else the connection is closed. A request being computed has no timer (its
    deadline is the engine's), nor one the server is slow to read. An answer that waits in the connection's buffer
    (the client does not read it) is held in the pool's ``budget``. A connection closed while its request's body
    still comes (an answer with ``Connection: close``, which :class:`~opweave.serve.http.guard.Guard` gives a refusal
    that left the body unread) is closed in stages and reads at most :data:`LINGER_BYTES` more (``_lingering``);
    what the parser cannot read is answered 400 in JSON."""

    pool: ClassVar[Connections]  # every connection's, and their limits (limited_protocol makes a class per pool)
    _counted = False  # admitted by the pool (and not evicted from it)
    _timer: asyncio.TimerHandle | None = None
    _head = 0  # bytes received while waiting for a request's headers
    _arrived = 0  # bytes of a request's body received in the current window of idle_timeout_s
    _linger: int | None = None  # bytes of a refused body the server may still read before closing (lingering)
    _socket: asyncio.Transport  # the connection's own transport (self.transport: the _Closing in front of it)
    _sending: asyncio.TimerHandle | None = None  # the window in which the client must read on
    _unsent = 0  # bytes of an answer waiting in the connection's buffer, held in the budget

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or (self.cycle.response_complete and not self.cycle.more_body)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, seconds: float) -> None:
        self._timer = None
        body = not self._awaiting_headers() and self.cycle.more_body
        if (self.flow is not None and self.flow.read_paused) or (body and self._arrived >= self.pool.least):
            self._arrived = 0  # the server, not the client, is behind; or the body comes at the minimum rate
            self._arm(seconds)
        elif not self._socket.is_closing():
            self._socket.close()

    def _holding(self, unsent: int) -> None:
        self.pool.budget.change(unsent - self._unsent)
        self._unsent = unsent

    def pause_writing(self) -> None:  # the answer fills the connection's buffer: the client reads it slower
        super().pause_writing()
        self._holding(self._socket.get_write_buffer_size())
        self._sending = self.loop.call_later(self.pool.idle_timeout_s, self._reading)

    def _reading(self) -> None:
        """A window of the client reading its answer has passed: closed (the buffer dropped) if it read less than
        the minimum rate, else a new window."""
        unsent = self._socket.get_write_buffer_size()
        read, self._sending = self._unsent - unsent, None
        self._holding(unsent)
        if read < self.pool.least:
            self._socket.abort()
        else:
            self._sending = self.loop.call_later(self.pool.idle_timeout_s, self._reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._sending is not None:
            self._sending.cancel()
            self._sending = None
        self._holding(self._socket.get_write_buffer_size())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream's, as asyncio hands every TCP connection
        self._socket = transport
        if not self.pool.admit():  # answered at once (the client may not have sent a byte), its file freed
            transport.write(self.pool.refusal)
            transport.close()
            self.pool.refusals(f"all {self.pool.limit} connections busy (opweave serve --max-connections)")
            return
        self._counted = True
        super().connection_made(cast(asyncio.Transport, _Closing(transport, self._lingering)))  # stands for it
        self._arm(self.pool.header_timeout_s)
        self.pool.idle[self] = None

    def _evict(self) -> None:
        """Closed to make room for a new connection (it is idle: nothing of a request is lost)."""
        self.pool.idle.pop(self, None)
        self.pool.open -= 1
        self._counted = False
        self._disarm()
        self._socket.close()

    def _lingering(self) -> bool:
        """Asked to close the connection (its answer written) while the request's body still comes (refused
        before it was read to its end), close it in stages, as RFC 9112 (section 9.6) advises: shut the writing
        side (the client reads the answer, then the end of the stream), read and drop at most
        :data:`LINGER_BYTES` more, and close :data:`LINGER_S` later; closing at once, with the client's bytes
        unread, sends a reset that may erase the answer before the client reads it. False: close now."""
        if self._linger is not None or self.cycle is None or not self.cycle.more_body or \
                self._socket.is_closing():
            return False
        self._linger = LINGER_BYTES
        self._disarm()
        if self._socket.can_write_eof():
            self._socket.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self._socket.close)
        return True

    def data_received(self, data: bytes) -> None:
        self.pool.idle.pop(self, None)
        if self._linger is not None:  # the body of a refused request: dropped, and only so much of it
            self._linger -= len(data)
            if self._linger <= 0 and not self._socket.is_closing():
                self._socket.pause_reading()
            return
        waiting = self._awaiting_headers()
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self._awaiting_headers():
            self._head = self._head + len(data) if waiting else len(data)
            if self._head > MAX_HEADER_BYTES:
                self._disarm()
                self._socket.close()
            elif self._timer is None:  # the first byte of a kept-alive connection's next request
                self._arm(self.pool.header_timeout_s)
        else:
            self._head = 0
            if not self.cycle.more_body:
                self._disarm()
            elif waiting:  # the headers are in: the body's first window
                self._arrived = 0
                self._arm(self.pool.idle_timeout_s)
            else:
                self._arrived += len(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # uvicorn's keep-alive timer waits for the next request's first byte
        if self._awaiting_headers():
            self._disarm()
            if not self._socket.is_closing() and not self.conn.trailing_data[0]:
                self.pool.idle[self] = None  # kept alive, no byte of a next request yet

    def connection_lost(self, exc) -> None:
        if self.transport is None:  # refused when it came (connection_made)
            return
        self.pool.idle.pop(self, None)
        if self._counted:
            self.pool.open -= 1
            self._counted = False
        self._disarm()
        if self._sending is not None:
            self._sending.cancel()
        self._holding(0)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:  # a request the parser cannot read: answered in JSON too
        body = json.dumps({"error": msg.rstrip(".")}).encode()
        head = [b"HTTP/1.1 400 Bad Request\r\n", *(k + b": " + v + b"\r\n" for k, v in
                                                  self.server_state.default_headers),
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def limited_protocol(header_timeout_s: float, idle_timeout_s: float, budget: Budget,
                     min_body_rate: float = MIN_BODY_RATE, max_connections: int = MAX_CONNECTIONS
                     ) -> type[LimitedProtocol]:
    """:class:`LimitedProtocol` over a pool of its own (:class:`Connections`) of ``max_connections`` connections,
    held to these limits: what uvicorn makes every connection's protocol of."""

    class Limited(LimitedProtocol):
        pool = Connections(max_connections, header_timeout_s, idle_timeout_s, budget, min_body_rate)

    return Limited


class _Closing:
    """A connection's transport as uvicorn's protocol sees it: the transport itself, but for :meth:`close`, which
    asks ``lingering()`` first (True: it closes the connection later, itself) and is then closing."""

    def __init__(self, transport: asyncio.Transport, lingering: Callable[[], bool]):
        self._transport, self._lingering, self._closing = transport, lingering, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._closing or self._transport.is_closing():
            return
        self._closing = True
        if not self._lingering():
            self._transport.close()

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()


__all__ = ["LINGER_BYTES", "LINGER_S", "LOG_EVERY_S", "MAX_HEADER_BYTES", "MIN_BODY_RATE", "Connections",
           "LimitedProtocol", "accept_errors", "limited_protocol"]
