"""A server on a thread of this process, for tests and benchmarks (:class:`BackgroundServer`): the product's own
pieces (:mod:`opweave.serve.http`, :mod:`opweave.serve.grpc`) put together as :func:`opweave.serve.server.serve`
puts them, on 127.0.0.1 and ephemeral ports, stopped when the block ends."""

from __future__ import annotations

import signal
import threading
from typing import Any

from opweave.serve import frontend
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, Budget, State, connection_limit
from opweave.serve.http.app import create_app
from opweave.serve.http.server import DrainingServer, uvicorn_config
from opweave.serve.http.transport import MIN_BODY_RATE, limited_protocol
from opweave.serve.models import ServedModel
from opweave.serve.repository.repository import Repository


class BackgroundServer:
    """A server on a thread of this process (tests, benchmarks): ``with BackgroundServer(engine, models) as url``.
    Listens on 127.0.0.1 and an ephemeral port; leaving the block drains and stops it. ``grpc=True``: the gRPC
    service too, at :attr:`grpc_address` (``127.0.0.1:port``), with ``grpc_options``; ``repository``: a
    :class:`~opweave.serve.repository.Repository` over ``models`` (one without a directory by default), at
    :attr:`repository`. ``header_timeout_s``, ``idle_timeout_s``, ``max_held_bytes`` (its
    :class:`~opweave.serve.frontend.Budget`, at :attr:`budget`, which both front ends share), ``min_body_rate`` and
    ``max_connections`` as :func:`opweave.serve.server.serve`'s; the other options go to
    :func:`~opweave.serve.http.app.create_app`."""

    def __init__(self, engine: Engine, models: dict[str, ServedModel], *, grpc: bool = False,
                 repository: Repository | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_held_bytes: int = frontend.MAX_HELD_BYTES,
                 min_body_rate: float = MIN_BODY_RATE, max_connections: int | None = None,
                 grpc_options: dict[str, Any] | None = None, **options: Any):
        self.engine, self.models, self.options = engine, models, options
        self.repository = repository or Repository(engine, models)
        self.grpc, self.grpc_options = grpc, grpc_options or {}
        self.rpc: Any = None  # the GrpcServer, with grpc
        self.grpc_address: str | None = None
        self.header_timeout_s, self.idle_timeout_s = header_timeout_s, idle_timeout_s
        self.budget, self.min_body_rate = Budget(max_held_bytes), min_body_rate
        self.max_connections = connection_limit(max_connections, 2 if grpc else 1)

    def __enter__(self) -> str:
        self.state = State()
        self.app = create_app(self.engine, self.repository.served, state=self.state, repository=self.repository,
                              budget=self.budget, **self.options)
        protocol = limited_protocol(self.header_timeout_s, self.idle_timeout_s, self.budget, self.min_body_rate,
                                    self.max_connections)
        self.connections = protocol.pool  # the connections held, and their limits
        config = uvicorn_config(self.app, "127.0.0.1", 0, "warning", protocol)
        bound = threading.Event()
        address: list[tuple[str, int]] = []

        def listening(host: str, port: int) -> None:
            address.append((host, port))
            bound.set()

        self.server = DrainingServer(config, self.state, self.engine, listening)
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, name="opweave-http", daemon=True)
        self.thread.start()
        if not bound.wait(30):
            raise RuntimeError("the server did not start within 30 s")
        host, port = address[0]
        if self.grpc:
            from opweave.serve.grpc.server import GrpcServer  # grpcio and tritonclient: needed with gRPC only

            self.rpc = GrpcServer(self.engine, self.repository, self.state,
                                  max_body_bytes=self.options.get("max_body_bytes", 0),
                                  header_timeout_s=self.header_timeout_s, idle_timeout_s=self.idle_timeout_s,
                                  budget=self.budget, max_connections=self.max_connections, **self.grpc_options)
            self.grpc_address = f"127.0.0.1:{self.rpc.start()}"
        return f"http://{host}:{port}"

    def drain(self) -> None:
        """What the first SIGTERM does."""
        self.server.handle_exit(signal.SIGTERM, None)

    def __exit__(self, *exc) -> None:
        self.drain()
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout=10)
        if self.rpc is not None:
            self.rpc.stop(grace_s=5)
        self.engine.stop(timeout_s=10)


__all__ = ["BackgroundServer"]
