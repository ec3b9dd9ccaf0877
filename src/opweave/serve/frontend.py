"""What the HTTP and gRPC front ends share: the draining state, and one inference from a decoded request to its
answer or a :class:`Refused` that each front end maps to its own status (no HTTP, no gRPC here).

=============  ====  =====================  ================================================
kind           HTTP  gRPC                   when
=============  ====  =====================  ================================================
``invalid``    400   ``INVALID_ARGUMENT``   the request is malformed (:class:`ProtocolError`)
``not_found``  404   ``NOT_FOUND``          unknown model or version (or it was just unloaded)
``full``       429   ``RESOURCE_EXHAUSTED`` the model's queue is full (``retry_after_s``)
``draining``   503   ``UNAVAILABLE``        the server drains after SIGTERM, or the model is being unloaded
``timeout``    504   ``DEADLINE_EXCEEDED``  the request passed its deadline
``error``      500   ``INTERNAL``           the model failed
=============  ====  =====================  ================================================
"""

from __future__ import annotations

import asyncio
import threading

from opweave.errors import OpweaveError, UsageError
from opweave.serve.engine import Engine, QueueFull, Request, Unavailable
from opweave.serve.protocol import InferRequest

HTTP_STATUS = {"invalid": 400, "not_found": 404, "full": 429, "draining": 503, "timeout": 504, "error": 500}


class Refused(OpweaveError):
    """A request not answered with outputs: ``kind`` (module table), the message, and for ``full`` when to retry."""

    def __init__(self, kind: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind, self.retry_after_s = kind, retry_after_s


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
        loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(r))

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


__all__ = ["HTTP_STATUS", "Refused", "State", "infer"]
