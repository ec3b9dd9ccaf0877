"""A server: the engine, the HTTP front end (:mod:`opweave.serve.http`) and, with ``grpc_port``, the gRPC front end
(:mod:`opweave.serve.grpc`) beside it on the same engine, models, repository, draining state and byte budget, until
it is stopped (:func:`serve`, what ``opweave serve`` runs). The first SIGTERM drains (new requests get 503, readiness
goes 503, every accepted request is still answered; :class:`~opweave.serve.http.server.DrainingServer`), then the
gRPC service and the engine stop.
"""

from __future__ import annotations

import sys
from typing import Any

from opweave.serve import frontend
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, Budget, State, connection_limit
from opweave.serve.http.app import create_app
from opweave.serve.http.guard import default_hosts
from opweave.serve.http.server import DrainingServer, uvicorn_config
from opweave.serve.http.transport import MIN_BODY_RATE, limited_protocol
from opweave.serve.models import ServedModel
from opweave.serve.repository.repository import Repository


def serve(engine: Engine, models: dict[str, ServedModel], *, host: str = "127.0.0.1", port: int = 8000,
          max_body_bytes: int = 0, log_level: str = "warning", on_listen=None, grpc_port: int | None = None,
          repository: Repository | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
          idle_timeout_s: float = IDLE_TIMEOUT_S, allowed_hosts: tuple[str, ...] | list[str] | None = None,
          allow_origins: tuple[str, ...] | list[str] = (), max_held_bytes: int = frontend.MAX_HELD_BYTES,
          min_body_rate: float = MIN_BODY_RATE, max_connections: int | None = None,
          grpc_options: dict[str, Any] | None = None) -> None:
    """Run the server until it is stopped (SIGTERM drains; see the module docstring), then stop the engine.
    ``grpc_port``: the gRPC service beside it (0: any free port; ``on_listen(host, port, grpc_port)`` then), with
    ``grpc_options`` (:class:`~opweave.serve.grpc.server.GrpcServer`'s ``max_calls``, ``max_metadata_bytes``).
    ``max_body_bytes``, ``header_timeout_s``, ``idle_timeout_s``, ``max_held_bytes`` (the
    :class:`~opweave.serve.frontend.Budget`) and ``max_connections`` (each front end's; default
    :func:`~opweave.serve.frontend.connection_limit`'s): the limits of docs/serving.md ("Security") on both front
    ends (:mod:`opweave.serve.http.app`, :mod:`opweave.serve.http.transport`, :mod:`opweave.serve.grpc.server`);
    ``min_body_rate`` (bytes a second), HTTP's. ``allowed_hosts`` (default
    :func:`~opweave.serve.http.guard.default_hosts` of ``host``) and ``allow_origins``:
    :func:`~opweave.serve.http.guard.guard`'s."""
    state = State()
    budget = Budget(max_held_bytes)
    connections = connection_limit(max_connections, 1 if grpc_port is None else 2)
    repository = repository or Repository(engine, models)
    app = create_app(engine, repository.served, max_body_bytes=max_body_bytes, state=state, repository=repository,
                     allowed_hosts=default_hosts(host) if allowed_hosts is None else allowed_hosts,
                     allow_origins=allow_origins, budget=budget)
    protocol = limited_protocol(header_timeout_s, idle_timeout_s, budget, min_body_rate, connections)
    config = uvicorn_config(app, host, port, log_level, protocol, timeout_graceful_shutdown=30)
    rpc = None
    if grpc_port is not None:  # made (and its limits checked) before the engine starts
        from opweave.serve.grpc.server import GrpcServer  # grpcio and tritonclient: needed with a gRPC port only

        rpc = GrpcServer(engine, repository, state, host=host, port=grpc_port, max_body_bytes=max_body_bytes,
                         header_timeout_s=header_timeout_s, idle_timeout_s=idle_timeout_s, budget=budget,
                         max_connections=connections, **(grpc_options or {}))
    engine.start()
    if rpc is not None:
        grpc_port = rpc.start()
    listening = on_listen if on_listen is None or rpc is None else (lambda h, p: on_listen(h, p, grpc_port))
    server = DrainingServer(config, state, engine, listening)
    trimmer = frontend.HeapTrimmer()
    trimmer.start()
    try:
        server.run()
    finally:
        trimmer.stop()
        if rpc is not None:
            rpc.stop(grace_s=5)
        engine.stop(timeout_s=30)
        sys.stdout.flush()


__all__ = ["serve"]
