"""The HTTP front end's routes: FastAPI speaking the Open Inference Protocol (KServe v2) as Triton does, over the
engine (:mod:`opweave.serve.engine`), with Prometheus metrics (:mod:`opweave.serve.metrics.prometheus`).

Endpoints: ``GET /v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}`` (inputs
and outputs: names, shapes, datatypes), ``/v2/models/{name}/ready``, ``/v2/models/{name}/config``, ``POST
/v2/models/{name}/infer`` (JSON tensors or the binary tensor data extension; the ``/versions/1/`` forms too) and
``GET /metrics`` (Prometheus text format); the repository extension (:mod:`opweave.serve.repository`): ``POST
/v2/repository/index``, ``/v2/repository/models/{name}/load`` and ``/unload``; the statistics extension
(:mod:`opweave.serve.metrics.stats`): ``GET /v2/models/stats``, ``/v2/models/{name}/stats`` and
``/v2/models/{name}/versions/{version}/stats``. The gRPC front end (:mod:`opweave.serve.grpc`) runs beside it on the
same engine, models and draining state.

Status codes: 200; 400 with ``{"error": message}`` for malformed JSON, a wrong input name, shape, datatype or data
length, and a body over its model's limit (400 as Triton answers it, where HTTP would say 413); 404 for an unknown
model; 429 with ``Retry-After`` (seconds) when the model's queue is full; 503 once draining; 504 for a request past
its deadline (Triton's ``parameters.timeout`` in microseconds, or the server's ``timeout_s``); 500 if the model fails
(:mod:`opweave.serve.frontend` holds the table both front ends share). Every error, the framework's own (an unknown
route: 404, a wrong method: 405) included, is ``{"error": one line}``; every request passes :func:`.guard.guard`
first.

Limits (docs/serving.md, "Security"): an infer body may take its model's
:func:`~opweave.serve.protocol.request_limit` bytes (raised to ``max_body_bytes`` if that is larger, the CLI's
``--max-body-mb``), checked against ``Content-Length`` before reading and again while the body streams in (and once
decompressed); the repository calls' bodies :data:`CONTROL_BODY_BYTES`. Every body is held in the server's
:class:`~opweave.serve.frontend.Budget` (``max_held_bytes``, the CLI's ``--max-held-mb``) with the answers clients
have not read: one that would pass it is refused 503 with ``Retry-After``. A body over :data:`OFFLOAD_BYTES` is
decoded, and a response that large (:func:`~opweave.serve.protocol.response_bytes`: what it will write) encoded, on
a worker thread, never on the event loop, so ``/v2/health/live`` answers while large requests are read. What a
connection may hold is :mod:`.transport`'s.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from torch.utils import _pytree as pytree

import opweave
from opweave.serve import frontend, protocol
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import Budget, Refused, State
from opweave.serve.http.guard import LOOPBACK_HOSTS, Guarded
from opweave.serve.metrics.prometheus import Metrics
from opweave.serve.metrics.stats import Statistics
from opweave.serve.models import ServedModel
from opweave.serve.repository.repository import Repository

CONTROL_BODY_BYTES = frontend.CONTROL_BYTES  # a repository call's body (a load's parameters.config, at most 1 MiB)
OFFLOAD_BYTES = 256 << 10  # a body (or a response) this large is decoded (encoded) on a worker thread
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]


async def _read_body(http: HttpRequest, limit: int, hold: Callable[[int], None]) -> bytearray:
    """The request's body, refused (:class:`Refused` ``invalid``) once it passes ``limit`` bytes: by its
    ``Content-Length`` before a byte is read, else while it streams in; held in the server's :class:`Budget`
    through ``hold`` (what it declares before it is read, else what has arrived), which refuses it ``overloaded``
    once the budget is spent."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise Refused("invalid", f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
        hold(int(declared))
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > limit:
            raise Refused("invalid", f"request body exceeds the limit of {limit} bytes")
        hold(len(body))
    return body


def create_app(engine: Engine, models: dict[str, ServedModel], *, max_body_bytes: int = 0,
               state: State | None = None, repository: Repository | None = None,
               allowed_hosts: tuple[str, ...] | list[str] = LOOPBACK_HOSTS,
               allow_origins: tuple[str, ...] | list[str] = (), guarded: bool = True, budget: Budget | None = None):
    """The FastAPI app over ``engine`` (whose loop must be running: :meth:`Engine.start`). ``repository`` (one
    over ``models`` and no directory by default) answers the repository extension; ``models`` is its live dict.
    ``max_body_bytes`` raises every model's request limit to at least that many bytes (module docstring);
    ``budget``: what request bodies may hold (one of its own by default; :func:`opweave.serve.server.serve` shares one
    with the connections, which count their unread answers in it);
    ``allowed_hosts`` and ``allow_origins``: what :func:`~.guard.guard` lets in (``guarded=False``: no guard, for
    an app that only a guarded front reaches, a Ray replica's)."""
    state = state or State()
    budget = budget or Budget()
    repository = repository or Repository(engine, models)
    models = repository.served
    metrics = Metrics(engine)
    engine.observers.append(metrics)
    statistics = Statistics.of(engine)
    app = FastAPI(title="opweave serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    if guarded:
        app.add_middleware(Guarded, allowed_hosts=tuple(allowed_hosts), allow_origins=tuple(allow_origins))
    app.state.serving = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.repository = repository

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": frontend.one_line(message)}, status_code=status, headers=headers)

    def refusal(exc: Refused) -> JSONResponse:
        headers = None if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
        return error(frontend.HTTP_STATUS[exc.kind], str(exc), headers)

    @app.exception_handler(Refused)
    async def refused(_request, exc: Refused) -> JSONResponse:
        return refusal(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException) -> JSONResponse:  # unknown routes, wrong methods
        return error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "the request does not fit the route")

    @app.exception_handler(Exception)
    async def failed(_request, exc: Exception) -> JSONResponse:  # a bug: logged by the framework, told in one line
        return error(500, f"the server failed to answer ({type(exc).__name__})")

    def served(name: str, version: str | None) -> ServedModel:
        """The model a path names; :class:`Refused` ``not_found`` (404) for an unknown name or version."""
        if name not in models:
            raise Refused("not_found", f"unknown model {protocol.shown(name)}")
        model = models[name]
        if version not in (None, "", model.version):
            raise Refused("not_found", f"model {name!r} has no version {protocol.shown(version)} (only "
                                       f"{model.version})")
        return model

    @app.get("/v2")
    def server_metadata():
        return {"name": "opweave", "version": getattr(opweave, "__version__", "0"), "extensions": EXTENSIONS}

    @app.get("/v2/health/live")
    async def live():  # on the event loop, no worker thread: it answers as long as the loop turns
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready():
        return Response(status_code=503 if state.draining else 200)

    @app.get("/v2/models/stats")  # before /v2/models/{name}, which would take "stats" for a name
    @app.get("/v2/models/{name}/stats")
    @app.get("/v2/models/{name}/versions/{version}/stats")
    def model_statistics(name: str = "", version: str = ""):
        return statistics.report(models, name, version)

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    def model_metadata(name: str, version: str | None = None):
        return protocol.metadata(served(name, version))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    def model_ready(name: str, version: str | None = None):
        served(name, version)
        return Response(status_code=503 if state.draining else 200)

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    def model_config(name: str, version: str | None = None):
        return protocol.config(served(name, version), engine.policy.describe(), engine.max_queue)

    async def body_object(http: HttpRequest) -> dict:
        """A repository request's optional JSON object body (:class:`Refused` if it is not one)."""
        with budget.hold() as hold:
            raw = await _read_body(http, CONTROL_BODY_BYTES, hold)
            if not raw.strip():
                return {}
            body = await frontend.offload(protocol.loads, raw, size=len(raw), threshold=OFFLOAD_BYTES)
        if not isinstance(body, dict) or not isinstance(body.get("parameters", {}), dict):
            raise Refused("invalid", "the body must be a JSON object (with an object 'parameters')")
        return body

    @app.post("/v2/repository/index")
    async def repository_index(http: HttpRequest):
        body = await body_object(http)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise Refused("invalid", f"'ready' must be true or false, got {protocol.shown(ready)}")
        return repository.index(ready=ready)

    @app.post("/v2/repository/models/{name}/load")
    async def repository_load(name: str, http: HttpRequest):
        body = await body_object(http)
        config = body.get("parameters", {}).get("config")
        if config is not None and not isinstance(config, str):
            raise Refused("invalid", "parameters.config must be the model config as a JSON string")
        extra = sorted(k for k in body.get("parameters", {}) if k != "config")
        if extra:
            raise Refused("invalid", f"load parameters {protocol.shown(extra)} are not supported (only config)")
        await asyncio.to_thread(repository.load, name, config)  # off the event loop: other requests go on
        return Response(status_code=200)

    @app.post("/v2/repository/models/{name}/unload")
    async def repository_unload(name: str, http: HttpRequest):
        await body_object(http)
        await asyncio.to_thread(repository.unload, name)
        return Response(status_code=200)

    @app.get("/metrics")
    def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def decode(model: ServedModel, body: bytearray, encoding: str | None, header: str | None, limit: int):
        return protocol.decode(model, protocol.decompress(body, encoding, limit), header)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, http: HttpRequest, version: str | None = None):
        try:
            return await answer(name, http, version)
        except Refused as exc:  # answered here: the refusal's traceback (frames holding the body) ends with it
            return refusal(exc)

    async def answer(name: str, http: HttpRequest, version: str | None) -> Response:
        if state.draining:
            return error(503, "the server is shutting down")
        model = served(name, version)
        limit = protocol.request_limit(model, floor=max_body_bytes)
        with budget.hold() as hold:
            try:
                body = await _read_body(http, limit, hold)
            except ClientDisconnect:  # gone (or timed out) mid-body: nobody to answer
                return Response(status_code=400)
            request = await frontend.offload(decode, model, body, http.headers.get("content-encoding"),
                                             http.headers.get(protocol.HEADER), limit, size=len(body),
                                             threshold=OFFLOAD_BYTES)
            del body
        result = await frontend.infer(engine, state, name, request)
        leaves = pytree.tree_leaves(result.output)
        body_out, headers = await frontend.offload(protocol.encode, model, request, leaves,
                                                   size=protocol.response_bytes(model, request, leaves),
                                                   threshold=OFFLOAD_BYTES)
        return Response(body_out, headers=headers, media_type=headers["Content-Type"])

    return app


__all__ = ["CONTROL_BODY_BYTES", "EXTENSIONS", "OFFLOAD_BYTES", "create_app"]
