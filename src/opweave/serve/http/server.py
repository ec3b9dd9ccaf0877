"""The HTTP server: uvicorn running the app (:mod:`.app`) with the transport's limits (:mod:`.transport`), and its
draining.

One HTTP parser, h11, on asyncio's event loop, whatever else is installed (:func:`uvicorn_config` of
:func:`~opweave.serve.http.transport.limited_protocol`): uvicorn would
pick httptools and uvloop where they are (``opweave[ray]`` brings them), and the server's answers to hostile input,
and what its tests tried, would depend on them. The kernel queues :data:`LISTEN_BACKLOG` connections for the server
to accept, while its event loop accepts at most :data:`ACCEPT_BATCH` a turn (asyncio takes the listen backlog for
both: files taken before their connections are counted stay few).

Draining (:class:`DrainingServer`): the first SIGTERM stops admission (new requests get 503, readiness goes 503)
while every accepted request is still answered; once none is left uvicorn shuts down and the process exits 0. A
second SIGTERM or a SIGINT stops at once (uvicorn's own behaviour).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import uvicorn

from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import State
from opweave.serve.http.transport import MAX_HEADER_BYTES, LimitedProtocol, accept_errors

LISTEN_BACKLOG = 2048  # connections the kernel queues for the server to accept (uvicorn's default)
ACCEPT_BATCH = 16  # the most the event loop accepts in one turn (files taken before their connections are counted)


def uvicorn_config(app: Any, host: str, port: int, log_level: str, protocol: type[LimitedProtocol],
                   **options: Any) -> uvicorn.Config:
    """uvicorn's configuration: ``protocol`` (h11 with the transport's limits, :func:`limited_protocol`) on asyncio's
    event loop, whichever others are installed (uvicorn would pick httptools and uvloop where they are: the server's
    answers to hostile input, and its tests, would depend on them); a kept-alive connection waits for its next
    request the protocol's ``idle_timeout_s``."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", loop="asyncio", http=protocol,
                          # uvicorn types it int, yet hands it to call_later, which takes seconds as a float
                          timeout_keep_alive=protocol.pool.idle_timeout_s,  # type: ignore[arg-type]
                          backlog=ACCEPT_BATCH, h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options)


class DrainingServer(uvicorn.Server):
    """uvicorn with a draining SIGTERM (module docstring). ``on_listen(host, port)`` is called once bound."""

    def __init__(self, config, state: State, engine: Engine, on_listen=None):
        super().__init__(config)
        self.serving, self.engine, self.on_listen = state, engine, on_listen

    async def startup(self, sockets=None) -> None:
        accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)
        for server in self.servers:  # asyncio takes its listen backlog for how many it accepts in one turn
            for listening in server.sockets:
                with socket.socket(fileno=os.dup(listening.fileno())) as same:  # the socket, another descriptor
                    same.listen(LISTEN_BACKLOG)
        if self.on_listen is not None and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_listen(host, port)

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.serving.draining:
            self.serving.draining = True
            self.engine.drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.serving.draining and self.serving.inflight == 0 and not self.engine.busy():
            self.should_exit = True
        return await super().on_tick(counter)


__all__ = ["ACCEPT_BATCH", "LISTEN_BACKLOG", "DrainingServer", "uvicorn_config"]
