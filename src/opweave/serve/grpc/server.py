"""The gRPC front end's server: the service (:mod:`.service`) on ``grpc.aio``, on a thread of its own with its own
event loop (:class:`GrpcServer`), beside uvicorn's: an ``infer`` waits on an asyncio future the engine's thread
resolves, and loads and unloads run on worker threads.

Limits (docs/serving.md, "Security"): gRPC refuses a message over ``max_message_bytes`` (:func:`message_limit`: the
largest request a model served takes) by the length it declares, before reading it (``RESOURCE_EXHAUSTED``); a
``ModelInfer`` holds that many bytes of the server's :class:`~opweave.serve.frontend.Budget` (shared with HTTP)
before its message is read (``UNAVAILABLE`` with ``retry-after`` if the budget cannot take them), then what its
message takes until the call ends; one over its model's :func:`~opweave.serve.protocol.request_limit` is refused
``INVALID_ARGUMENT`` before its inputs are decoded. At most ``max_connections`` connections, ``max_calls`` calls in
progress (calls waiting for their message included) and ``max_metadata_bytes`` of a call's metadata: past them gRPC
refuses (a connection closed; ``RESOURCE_EXHAUSTED``). Connections: the HTTP/2 handshake must finish within
``header_timeout_s``, a connection with no call for ``idle_timeout_s`` is closed, and keepalive pings find dead
peers; a call's request message must arrive within ``idle_timeout_s`` of the call (``DEADLINE_EXCEEDED``
otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from opweave.errors import UsageError
from opweave.serve import frontend, protocol
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, Budget, State
from opweave.serve.grpc.service import Servicer, add_service
from opweave.serve.models import ServedModel
from opweave.serve.repository.repository import Repository

MAX_CALLS = 1024  # calls in progress at once, server-wide (more: RESOURCE_EXHAUSTED, from gRPC itself)
MAX_METADATA_BYTES = 16 << 10  # a call's metadata (its headers, as HTTP/2 counts them)
SEND_MESSAGE_BYTES = 64 << 20  # the largest answer gRPC sends (what a model answers is not the client's to size)

log = logging.getLogger(__name__)


def message_limit(repository: Repository, max_body_bytes: int = 0) -> int:
    """The largest message gRPC takes (a larger one is refused by the length its prefix declares, before it is
    read): the largest gRPC request limit (:func:`~opweave.serve.protocol.request_limit`) of the models served,
    each at its max batch or, while the repository API may load models (a client's config may raise a model's batch
    up to the server's ``--max-batch``), at the larger of that and ``--max-batch``, then also a repository call's
    message (:data:`~opweave.serve.frontend.CONTROL_BYTES`); at least ``max_body_bytes``. Fixed when the server
    starts: a model loaded later that takes more is served up to it (:meth:`GrpcServer` logs so)."""
    changes = repository.changes is None
    limits = [protocol.request_limit(m, protocol.RAW_BYTES_PER_VALUE,
                                     batch=max(m.max_batch, repository.max_batch) if changes else None)
              for m in repository.served.values()]
    control = frontend.CONTROL_BYTES if changes else 0
    return min(max([protocol.HEADER_BYTES, max_body_bytes, control, *limits]), (1 << 31) - 1)


class GrpcServer:
    """The gRPC service on ``host:port`` (0: any free port) on a thread with its own event loop: :meth:`start`
    returns the bound port; :meth:`stop` lets calls in flight finish (at most ``grace_s``) and ends the thread.
    ``max_body_bytes`` raises every model's request limit (``--max-body-mb``); ``max_message_bytes`` bounds a
    message (default :func:`message_limit`; a larger one: ``RESOURCE_EXHAUSTED``, from gRPC itself), and a
    ``ModelInfer`` holds that much of ``budget`` (the HTTP server's, shared) until its message is read, then what
    the message takes until the call ends. ``max_connections``, ``max_calls`` (in progress at once) and
    ``max_metadata_bytes`` (a call's): more are refused by gRPC itself. ``header_timeout_s``: for the HTTP/2
    handshake; ``idle_timeout_s``: a connection without calls is closed, and a call whose request message has not
    arrived (:func:`add_service`) is ended."""

    def __init__(self, engine: Engine, repository: Repository, state: State, *, host: str = "127.0.0.1",
                 port: int = 0, max_message_bytes: int | None = None, max_body_bytes: int = 0,
                 header_timeout_s: float = HEADER_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 budget: Budget | None = None,
                 max_connections: int = MAX_CONNECTIONS, max_calls: int = MAX_CALLS,
                 max_metadata_bytes: int = MAX_METADATA_BYTES):
        self.servicer = Servicer(engine, repository, state, max_body_bytes)
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes or message_limit(repository, max_body_bytes)
        self.budget = budget or Budget()
        if self.max_message_bytes > self.budget.limit:
            raise UsageError(f"a gRPC message may take {self.max_message_bytes} bytes (the largest request a model "
                             f"served takes), more than the server may hold in all ({self.budget.limit} bytes): "
                             f"raise opweave serve --max-held-mb")
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s, self.idle_timeout_s = header_timeout_s, idle_timeout_s
        self.max_connections, self.max_calls, self.max_metadata_bytes = max_connections, max_calls, max_metadata_bytes
        repository.on_load.append(self._loaded)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace_s = 5.0

    def _loaded(self, model: ServedModel) -> None:
        """A model loaded while the server runs: said in the log if its requests can pass the message cap."""
        limit = protocol.request_limit(model, protocol.RAW_BYTES_PER_VALUE, self.max_body_bytes)
        if limit > self.max_message_bytes:
            log.warning("model %r takes gRPC requests of up to %d bytes, but gRPC takes messages of at most %d "
                        "(fixed when the server started): larger ones are refused RESOURCE_EXHAUSTED (opweave serve "
                        "--max-body-mb raises it)", model.name, limit, self.max_message_bytes)

    def options(self) -> list[tuple[str, int]]:
        """The channel arguments the server runs with (module docstring)."""
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", max(self.max_message_bytes, SEND_MESSAGE_BYTES)),
                ("grpc.max_metadata_size", self.max_metadata_bytes),
                ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),  # else refused at random up to 1.25x
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", int(self.header_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.so_reuseport", 0),
                ("grpc.http2.bdp_probe", 0)]  # each stream's window stays at 64 KiB: no megabytes read unasked

    def start(self, timeout_s: float = 30.0) -> int:
        bound = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            server = grpc.aio.server(options=self.options(), maximum_concurrent_rpcs=self.max_calls)
            add_service(self.servicer, server, self.idle_timeout_s, self.budget, self.max_message_bytes)
            try:
                self.port = server.add_insecure_port(f"{self.host}:{self.port}")
                await server.start()
            except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                failure.append(exc)
                bound.set()
                return
            self._stop = asyncio.Event()
            bound.set()
            await self._stop.wait()
            await server.stop(self._grace_s)

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self.thread = threading.Thread(target=run, name="opweave-grpc", daemon=True)
        self.thread.start()
        if not bound.wait(timeout_s):
            raise RuntimeError(f"the gRPC server did not start within {timeout_s:g} s")
        if failure:
            raise RuntimeError(f"the gRPC server could not listen on {self.host}:{self.port}: {failure[0]}")
        if not self.port:
            raise RuntimeError(f"the gRPC server could not listen on {self.host}:{self.port}")
        return self.port

    def stop(self, grace_s: float = 5.0) -> None:
        if self._loop is None or self._stop is None or not self.thread.is_alive():
            return
        self._grace_s = grace_s
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=grace_s + 10)


__all__ = ["MAX_CALLS", "MAX_METADATA_BYTES", "SEND_MESSAGE_BYTES", "GrpcServer", "message_limit"]
