"""The HTTP front end: FastAPI + uvicorn speaking the Open Inference Protocol (KServe v2) as Triton does, over the
engine (:mod:`opweave.serve.engine`), with Prometheus metrics and a draining shutdown.

Endpoints: ``GET /v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}`` (inputs
and outputs: names, shapes, datatypes), ``/v2/models/{name}/ready``, ``/v2/models/{name}/config``, ``POST
/v2/models/{name}/infer`` (JSON tensors or the binary tensor data extension; the ``/versions/1/`` forms too) and
``GET /metrics`` (Prometheus text format); the repository extension (:mod:`opweave.serve.repository`): ``POST
/v2/repository/index``, ``/v2/repository/models/{name}/load`` and ``/unload``; the statistics extension
(:mod:`opweave.serve.stats`): ``GET /v2/models/stats``, ``/v2/models/{name}/stats`` and
``/v2/models/{name}/versions/{version}/stats``. The gRPC front end
(:mod:`opweave.serve.grpc_server`) runs beside it on the same engine, models and draining state (``grpc_port``).

Status codes: 200; 400 with ``{"error": message}`` for malformed JSON, a wrong input name, shape, datatype or data
length, and a body over its model's limit (400 as Triton answers it, where HTTP would say 413); 404 for an unknown
model; 429 with ``Retry-After`` (seconds) when the model's queue is full; 503 once draining; 504 for a request past
its deadline (Triton's ``parameters.timeout`` in microseconds, or the server's ``timeout_s``); 500 if the model fails
(:mod:`opweave.serve.frontend` holds the table both front ends share). Every error, the framework's own (an unknown
route: 404, a wrong method: 405) included, is ``{"error": one line}``.

In front of every route (:func:`guard`, docs/serving.md, "Security"): a ``Host`` among ``allowed_hosts``
(``--allowed-hosts``; by default the names of the address bound, :func:`default_hosts`), a request other than
``GET`` or ``HEAD`` from a web page only from an origin of ``allow_origins`` (``--cors-allow-origin``, which CORS
answers), a body of JSON or binary data, a request line and headers within :data:`MAX_HEADER_BYTES`; every error
answered as ``{"error": one line}``, and a request answered before its body was read to its end answered with
``Connection: close``, its connection closed in stages (:func:`_http_protocol`: the server reads at most
:data:`LINGER_BYTES` more of it). No redirect (a trailing ``/`` is a 404, never a redirect to the ``Host`` the client
named).

Limits (docs/serving.md, "Security"): an infer body may take its model's
:func:`~opweave.serve.protocol.request_limit` bytes (raised to ``max_body_bytes`` if that is larger, the CLI's
``--max-body-mb``), checked against ``Content-Length`` before reading and again while the body streams in (and once
decompressed); the repository calls' bodies :data:`CONTROL_BODY_BYTES`. Every body is held in the server's
:class:`~opweave.serve.frontend.Budget` (``max_held_bytes``, the CLI's ``--max-held-mb``) with the answers clients
have not read: one that would pass it is refused 503 with ``Retry-After``. A body over :data:`OFFLOAD_BYTES` is
decoded, and a response that large (:func:`~opweave.serve.protocol.response_bytes`: what it will write) encoded, on
a worker thread, never on the event loop, so ``/v2/health/live`` answers while large requests are read. Connections
(:func:`_http_protocol`): at most ``max_connections`` (:func:`connection_limit`: within the open-file limit), the one
idle longest closed to make room for a new one, a new one answered 503 and closed when none is idle; a failed accept
logged once per :data:`LOG_EVERY_S`; a request's headers must arrive within ``header_timeout_s`` and fit
:data:`MAX_HEADER_BYTES`; a body must bring ``min_body_rate`` bytes a second over every ``idle_timeout_s`` (a
trickle does not keep it), and an answer be read as fast, else the connection is closed, as is a kept-alive
connection idle that long; a request the parser cannot read is answered 400 in JSON too.

One HTTP parser, h11, on asyncio's event loop, whatever else is installed (:func:`_uvicorn_config`): uvicorn would
pick httptools and uvloop where they are (``opweave[ray]`` brings them), and the server's answers to hostile input,
and what its tests tried, would depend on them.

Draining (:class:`DrainingServer`): the first SIGTERM stops admission (new requests get 503, readiness goes 503)
while every accepted request is still answered; once none is left uvicorn shuts down and the process exits 0. A
second SIGTERM or a SIGINT stops at once (uvicorn's own behaviour).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from torch.utils import _pytree as pytree

import opweave
from opweave.errors import UsageError
from opweave.serve import frontend, protocol
from opweave.serve.engine import Engine, Observer, Request
from opweave.serve.engine.combined import Part
from opweave.serve.engine.executors import StepCost
from opweave.serve.frontend import Budget, Refused, State
from opweave.serve.models import ServedModel
from opweave.serve.repository import Repository
from opweave.serve.stats import Statistics

CONTROL_BODY_BYTES = frontend.CONTROL_BYTES  # a repository call's body (a load's parameters.config, at most 1 MiB)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # what a client on this machine calls a server bound to loopback
WILDCARD_BINDS = ("0.0.0.0", "::", "")  # a server bound to every address of the machine
SAFE_METHODS = ("GET", "HEAD")  # what a request of another origin may do (read, which its page cannot see: no CORS)
BODY_TYPES = ("application/json", "application/octet-stream")  # a POST's Content-Type (JSON; binary tensor data)
OFFLOAD_BYTES = 256 << 10  # a body (or a response) this large is decoded (encoded) on a worker thread
MAX_HEADER_BYTES = 64 << 10  # a request's line and headers
LINGER_BYTES = 64 << 10  # of a refused request's body, the most the server reads after its answer (then closes)
LINGER_S = 2.0  # how long after the answer to a refused request its connection is closed (the client reads it)
HEADER_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
MIN_BODY_RATE = 16 << 10  # bytes a second a body must bring (an answer be read) over every idle_timeout_s
MAX_CONNECTIONS = 4096  # connections each front end holds by default (fewer where the open-file limit says so)
RESERVED_FILES = 256  # of the open-file limit, kept for the process's own files and the sockets accepted at once
LISTEN_BACKLOG = 2048  # connections the kernel queues for the server to accept (uvicorn's default)
ACCEPT_BATCH = 16  # the most the event loop accepts in one turn (files taken before their connections are counted)
LOG_EVERY_S = 10.0  # a failure that may come thousands of times a second is logged once per this interval
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_DECISION_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)

log = logging.getLogger(__name__)


class Metrics(Observer):
    """Prometheus metrics of one engine, in their own registry: per model queue depth, queue time, compute time,
    end-to-end latency, requests by outcome, rejections, batch sizes; per step duration, sub-blocks and decision time;
    the plan cache; GPU utilization through NVML where it is installed and a GPU is there."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.engine = engine
        models = list(engine.models)
        self.queue_depth = Gauge("opweave_queue_depth", "Requests waiting in the model's queue", ["model"], registry=r)
        self.instances = Gauge("opweave_instances", "Inference instances of the model in flight", ["model"],
                               registry=r)
        self.requests = Counter("opweave_requests", "Requests by outcome (answered, timeout, error, rejected)",
                                ["model", "outcome"], registry=r)
        self.rejections = Counter("opweave_rejections", "Requests refused with 429 (queue full)", ["model"],
                                  registry=r)
        self.queue_time = Histogram("opweave_queue_time_seconds", "Time from arrival to dequeue", ["model"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.compute_time = Histogram("opweave_compute_time_seconds", "Time from dequeue to answer", ["model"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("opweave_request_latency_seconds", "End-to-end latency (arrival to answer)",
                                 ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("opweave_batch_size", "Samples stacked in a sub-block run", ["model"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step = Histogram("opweave_step_seconds", "Duration of a combined block", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.parts = Histogram("opweave_step_sub_blocks", "Sub-blocks in a combined block", buckets=(1, 2, 3, 4, 6, 8),
                               registry=r)
        self.decision = Histogram("opweave_decision_seconds", "What a step spent observing the engine and asking the "
                                  "policy before its combined block ran", buckets=_DECISION_BUCKETS, registry=r)
        cache = Gauge("opweave_plan_cache", "Compiled combination signatures: hits, misses, evictions", ["event"],
                      registry=r)
        for event in ("hits", "misses", "evictions"):
            cache.labels(event).set_function(lambda e=event: engine.executor.stats[e])
        for m in models:  # every series exists from the start, at 0
            self.on_add(m)
        handle = _nvml_handle() if getattr(engine.executor, "device", "cpu") != "cpu" else None
        if handle is not None:
            import pynvml

            Gauge("opweave_gpu_utilization_ratio", "GPU utilization (NVML, last sample period)", registry=r
                  ).set_function(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)

    def on_add(self, model: str) -> None:
        """A model's series, at 0 (at start, and when a model is loaded)."""
        models = self.engine.models

        def length(field: str):
            return lambda: len(getattr(models[model], field)) if model in models else 0

        self.queue_depth.labels(model).set_function(length("queue"))
        self.instances.labels(model).set_function(length("instances"))
        self.rejections.labels(model)
        for outcome in ("answered", "timeout", "error", "rejected"):
            self.requests.labels(model, outcome)

    def on_remove(self, model: str) -> None:
        """An unloaded model's series go (Prometheus keeps what it scraped)."""
        labels = [(m, (model,)) for m in (self.queue_depth, self.instances, self.rejections, self.queue_time,
                                          self.compute_time, self.latency, self.batch)]
        for metric, values in labels + [(self.requests, (model, o)) for o in ("answered", "timeout", "error",
                                                                            "rejected")]:
            try:
                metric.remove(*values)
            except KeyError:  # never observed
                pass

    def on_reject(self, model: str) -> None:
        self.rejections.labels(model).inc()
        self.requests.labels(model, "rejected").inc()

    def on_dequeue(self, request: Request) -> None:
        self.queue_time.labels(request.model).observe(request.queue_s)

    def on_step(self, parts: list[Part], cost: StepCost) -> None:
        self.step.observe(cost.seconds)
        self.parts.observe(len(parts))
        for p in parts:
            self.batch.labels(p.model).observe(p.batch)

    def on_decision(self, seconds: float) -> None:
        self.decision.observe(seconds)

    def on_done(self, request: Request) -> None:
        outcome = {"done": "answered"}.get(request.status, request.status)
        self.requests.labels(request.model, outcome).inc()
        if request.status == "done":
            self.latency.labels(request.model).observe(request.latency_s)
            self.compute_time.labels(request.model).observe(request.finished - request.dequeued)


def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        import torch

        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no NVML, no GPU metric
        return None


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


def default_hosts(bind: str) -> tuple[str, ...]:
    """The ``Host`` names a server bound to ``bind`` answers by default (``--allowed-hosts``): a loopback address's
    or ``localhost``'s, the loopback names (:data:`LOOPBACK_HOSTS`); a wildcard's (``0.0.0.0``, ``::``), any (``*``:
    the server takes every address of the machine, whose names it cannot know; a deployment names them); any other
    address or name, itself."""
    import ipaddress

    if bind in WILDCARD_BINDS:
        return ("*",)
    try:
        address = ipaddress.ip_address(bind)
    except ValueError:
        address = None
    named = f"[{bind}]" if address is not None and address.version == 6 else bind.lower()
    if bind.lower() == "localhost" or (address is not None and address.is_loopback):
        return tuple(dict.fromkeys((*LOOPBACK_HOSTS, named)))
    return (named,)


def _media_type(headers: list[tuple[bytes, bytes]]) -> str | None:
    value = next((v for k, v in headers if k == b"content-type"), None)
    return None if value is None else value.decode("latin-1").split(";", 1)[0].strip().lower()


class Guard:
    """What the server checks of every HTTP request before a route sees it, and what it does to every answer (ASGI
    middleware; docs/serving.md, "Security"). Refused, as ``{"error": one line}``: a request line and headers over
    :data:`MAX_HEADER_BYTES` (431, whichever HTTP parser read them); a request framed twice, by ``Content-Length``
    and ``Transfer-Encoding`` (400 and the connection closed, as RFC 9112 section 6.1 asks: h11 reads such a
    request as chunked and keeps the connection, the shape of request smuggling behind a proxy that trusts
    ``Content-Length``); a request that is not ``GET`` or ``HEAD`` from
    a web page of an origin not in ``allow_origins`` (403: a browser sends ``Origin`` with every such request, and a
    cross-origin "simple" request reaches the server whatever its CORS answer says); a body whose ``Content-Type``
    is neither JSON nor binary data (415: a form or ``text/plain``, what a page can post without asking first).
    Answered: every error as ``{"error": one line}`` (the plain-text ones of the layers inside, Starlette's
    ``TrustedHostMiddleware`` and ``CORSMiddleware`` among them, turned into it), and with ``Connection: close``
    when the request's body has not been read to its end (refused before it was read or while it streamed in):
    uvicorn then closes the connection (:func:`_http_protocol`), reading at most :data:`LINGER_BYTES` more of it,
    however much the client declared or keeps sending."""

    HINTS = {"Invalid host header": "the Host header names no host this server answers to (opweave serve "
                                    "--allowed-hosts)"}

    def __init__(self, app, allow_origins: tuple[str, ...] | list[str] = ()):
        self.app = app
        self.origins = frozenset(o.rstrip("/") for o in allow_origins)

    def refusal(self, scope) -> tuple[int, str] | None:
        """The status and message that refuse the request, or None."""
        headers = scope["headers"]
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16 + \
            sum(len(k) + len(v) + 4 for k, v in headers)
        if size > MAX_HEADER_BYTES:
            return 431, f"the request's line and headers take {size} bytes, over the limit of {MAX_HEADER_BYTES}"
        if any(k == b"transfer-encoding" for k, _ in headers) and any(k == b"content-length" for k, _ in headers):
            return 400, ("a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 6.1: one "
                         "framing per request)")
        if scope["method"] in SAFE_METHODS:
            return None
        origin = next((v.decode("latin-1") for k, v in headers if k == b"origin"), None)
        if origin is not None and "*" not in self.origins and origin.rstrip("/") not in self.origins:
            return 403, (f"a request from the web page of origin {protocol.shown(origin)} is refused (opweave serve "
                         f"--cors-allow-origin ORIGIN lets a page of ORIGIN call the server)")
        media = _media_type(headers)
        if media is not None and media not in BODY_TYPES and not media.endswith("+json"):
            return 415, (f"Content-Type {protocol.shown(media)} is not accepted: send application/json (or, with "
                         f"binary tensor data, application/octet-stream)")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        length = next((v for k, v in headers if k == b"content-length"), None)
        unread = any(k == b"transfer-encoding" for k, _ in headers) or length not in (None, b"0")
        held: dict | None = None  # a plain-text error being turned into JSON

        async def receiving():
            nonlocal unread
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread = False
            return message

        async def sending(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                start = {**message, "headers": [*message.get("headers", []),
                                                *([(b"connection", b"close")] if unread else [])]}
                if message["status"] >= 400 and _media_type(start["headers"]) != "application/json":
                    held = {**start, "body": bytearray()}
                    return
                await send(start)
            elif held is not None:
                held["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                text = held.pop("body").decode("utf-8", "replace").strip()
                body = json.dumps({"error": frontend.one_line(self.HINTS.get(text, text) or
                                                              HTTPStatus(held["status"]).phrase)}).encode()
                kept = [(k, v) for k, v in held["headers"] if k.lower() not in (b"content-type", b"content-length")]
                await send({**held, "headers": [*kept, (b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            else:
                await send(message)

        refused = self.refusal(scope)
        if refused is not None:
            status, message = refused
            await JSONResponse({"error": message}, status_code=status)(scope, receiving, sending)
            return
        await self.app(scope, receiving, sending)


CORS_HEADERS = ("Content-Type", "Content-Encoding", "Accept-Encoding", protocol.HEADER)  # a page may send these


def guard(app, allowed_hosts: tuple[str, ...] | list[str] = LOOPBACK_HOSTS,
          allow_origins: tuple[str, ...] | list[str] = ()):
    """``app`` (an ASGI app) behind the server's checks: :class:`Guard`, then Starlette's ``TrustedHostMiddleware``
    (a ``Host`` not in ``allowed_hosts`` is refused 400: DNS rebinding; ``*`` allows any, ``*.example.com`` a
    domain's), then, when ``allow_origins`` names any, Starlette's ``CORSMiddleware`` for those origins."""
    from starlette.middleware.cors import CORSMiddleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    if allow_origins:
        app = CORSMiddleware(app, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                             allow_headers=list(CORS_HEADERS), expose_headers=[protocol.HEADER, "Retry-After"])
    return Guard(TrustedHostMiddleware(app, allowed_hosts=list(allowed_hosts), www_redirect=False), allow_origins)



def create_app(engine: Engine, models: dict[str, ServedModel], *, max_body_bytes: int = 0,
               state: State | None = None, repository: Repository | None = None,
               allowed_hosts: tuple[str, ...] | list[str] = LOOPBACK_HOSTS,
               allow_origins: tuple[str, ...] | list[str] = (), guarded: bool = True, budget: Budget | None = None):
    """The FastAPI app over ``engine`` (whose loop must be running: :meth:`Engine.start`). ``repository`` (one
    over ``models`` and no directory by default) answers the repository extension; ``models`` is its live dict.
    ``max_body_bytes`` raises every model's request limit to at least that many bytes (module docstring);
    ``budget``: what request bodies may hold (one of its own by default; :func:`serve` shares one with the
    connections, which count their unread answers in it);
    ``allowed_hosts`` and ``allow_origins``: what :func:`guard` lets in (``guarded=False``: no :func:`guard`, for
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
        app.add_middleware(_Guarded, allowed_hosts=tuple(allowed_hosts), allow_origins=tuple(allow_origins))
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


class _Guarded:
    """:func:`guard` as a middleware class (what FastAPI's ``add_middleware`` takes)."""

    def __init__(self, app, allowed_hosts: tuple[str, ...], allow_origins: tuple[str, ...]):
        self.app = guard(app, allowed_hosts, allow_origins)

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


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


def _accept_errors(loop: asyncio.AbstractEventLoop) -> None:
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


class _Connections:
    """The HTTP connections a server holds, at most ``limit`` (nginx's ``worker_connections``), and of them the idle
    ones (waiting for a request of which no byte has come: new, or kept alive after an answer), longest idle
    first. At the limit a new connection takes the place of the connection idle longest, which is closed (as nginx
    closes idle kept-alive connections first when its connections run short), and is refused if none is idle. Used
    on the event loop's thread only."""

    def __init__(self, limit: int):
        self.limit, self.open = limit, 0
        self.idle: dict[Any, None] = {}  # insertion order: the connection idle longest first
        self.refusals = _Every("refused a connection")

    def admit(self) -> bool:
        """Count one more connection, closing the one idle longest at the limit; False: none is idle, refuse it."""
        if self.open >= self.limit:
            if not self.idle:
                return False
            next(iter(self.idle))._evict()
        self.open += 1
        return True


def _http_protocol(header_timeout_s: float, idle_timeout_s: float, budget: Budget,
                   min_body_rate: float = MIN_BODY_RATE, max_connections: int = MAX_CONNECTIONS):
    """uvicorn's h11 protocol (the server's one HTTP parser, whichever others are installed: module docstring) with
    the limits it lacks: at most ``max_connections`` connections (:class:`_Connections`: idle ones closed first to
    make room; past it, a new connection is answered 503 and closed at once); a request's line and
    headers must arrive within ``header_timeout_s`` of the connection (or of its first byte, on a kept-alive one)
    and fit :data:`MAX_HEADER_BYTES`; a body must bring ``min_body_rate`` bytes a second (at least one byte) over
    every ``idle_timeout_s`` (nginx's ``client_body_timeout`` with a minimum rate: a trickle does not keep it alive),
    and an answer must be read as fast, else the connection is closed. A request being computed has no timer (its
    deadline is the engine's), nor one the server is slow to read. An answer that waits in the connection's buffer
    (the client does not read it) is held in ``budget``. A connection closed while its request's body still comes
    (an answer with ``Connection: close``, which :class:`Guard` gives a refusal that left the body unread) is closed
    in stages and reads at most :data:`LINGER_BYTES` more (``_lingering``); what the parser cannot read is answered
    400 in JSON."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    least = max(1, int(min_body_rate * idle_timeout_s))  # the bytes a body brings (an answer is read) every window
    pool = _Connections(max_connections)
    full = json.dumps({"error": f"the server holds its {max_connections} connections and none of them is idle "
                                f"(opweave serve --max-connections); retry later"}).encode()
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
               b"retry-after: %d\r\nconnection: close\r\n\r\n" % (len(full), math.ceil(frontend.RETRY_AFTER_S))
               ) + full

    class LimitedProtocol(H11Protocol):
        connections = pool  # every connection's
        _counted = False  # admitted by the pool (and not evicted from it)
        _timer: asyncio.TimerHandle | None = None
        _head = 0  # bytes received while waiting for a request's headers
        _arrived = 0  # bytes of a request's body received in the current window of idle_timeout_s
        _linger: int | None = None  # bytes of a refused body the server may still read before closing (lingering)
        _socket = None  # the connection's own transport (self.transport: the _Closing in front of it)
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
            if (self.flow is not None and self.flow.read_paused) or (body and self._arrived >= least):
                self._arrived = 0  # the server, not the client, is behind; or the body comes at the minimum rate
                self._arm(seconds)
            elif not self._socket.is_closing():
                self._socket.close()

        def _holding(self, unsent: int) -> None:
            budget.change(unsent - self._unsent)
            self._unsent = unsent

        def pause_writing(self) -> None:  # the answer fills the connection's buffer: the client reads it slower
            super().pause_writing()
            self._holding(self._socket.get_write_buffer_size())
            self._sending = self.loop.call_later(idle_timeout_s, self._reading)

        def _reading(self) -> None:
            """A window of the client reading its answer has passed: closed (the buffer dropped) if it read less than
            the minimum rate, else a new window."""
            unsent = self._socket.get_write_buffer_size()
            read, self._sending = self._unsent - unsent, None
            self._holding(unsent)
            if read < least:
                self._socket.abort()
            else:
                self._sending = self.loop.call_later(idle_timeout_s, self._reading)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._sending is not None:
                self._sending.cancel()
                self._sending = None
            self._holding(self._socket.get_write_buffer_size())

        def connection_made(self, transport) -> None:
            self._socket = transport
            if not pool.admit():  # answered at once (the client may not have sent a byte), its file freed
                transport.write(refusal)
                transport.close()
                pool.refusals(f"all {pool.limit} connections busy (opweave serve --max-connections)")
                return
            self._counted = True
            super().connection_made(_Closing(transport, self._lingering))
            self._arm(header_timeout_s)
            pool.idle[self] = None

        def _evict(self) -> None:
            """Closed to make room for a new connection (it is idle: nothing of a request is lost)."""
            pool.idle.pop(self, None)
            pool.open -= 1
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
            pool.idle.pop(self, None)
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
                    self._arm(header_timeout_s)
            else:
                self._head = 0
                if not self.cycle.more_body:
                    self._disarm()
                elif waiting:  # the headers are in: the body's first window
                    self._arrived = 0
                    self._arm(idle_timeout_s)
                else:
                    self._arrived += len(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # uvicorn's keep-alive timer waits for the next request's first byte
            if self._awaiting_headers():
                self._disarm()
                if not self._socket.is_closing() and not self.conn.trailing_data[0]:
                    pool.idle[self] = None  # kept alive, no byte of a next request yet

        def connection_lost(self, exc) -> None:
            if self.transport is None:  # refused when it came (connection_made)
                return
            pool.idle.pop(self, None)
            if self._counted:
                pool.open -= 1
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

    return LimitedProtocol


class _Closing:
    """A connection's transport as uvicorn's protocol sees it: the transport itself, but for :meth:`close`, which
    asks ``lingering()`` first (True: it closes the connection later, itself) and is then closing."""

    def __init__(self, transport, lingering):
        self._transport, self._lingering, self._closing = transport, lingering, False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._closing or self._transport.is_closing():
            return
        self._closing = True
        if not self._lingering():
            self._transport.close()

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()


def _uvicorn_config(app, host: str, port: int, log_level: str, header_timeout_s: float, idle_timeout_s: float,
                    budget: Budget, min_body_rate: float, max_connections: int, **options: Any):
    """uvicorn's configuration: h11 (:func:`_http_protocol`) on asyncio's event loop, whichever others are installed
    (uvicorn would pick httptools and uvloop where they are: the server's answers to hostile input, and its tests,
    would depend on them)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", loop="asyncio",
                          http=_http_protocol(header_timeout_s, idle_timeout_s, budget, min_body_rate,
                                              max_connections),
                          timeout_keep_alive=idle_timeout_s, backlog=ACCEPT_BATCH,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options)


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a draining SIGTERM (module docstring). ``on_listen(host, port)`` is called once bound."""

        def __init__(self, config, state: State, engine: Engine, on_listen=None):
            super().__init__(config)
            self.serving, self.engine, self.on_listen = state, engine, on_listen

        async def startup(self, sockets=None) -> None:
            _accept_errors(asyncio.get_running_loop())
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

    return DrainingServer


def serve(engine: Engine, models: dict[str, ServedModel], *, host: str = "127.0.0.1", port: int = 8000,
          max_body_bytes: int = 0, log_level: str = "warning", on_listen=None, grpc_port: int | None = None,
          repository: Repository | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
          idle_timeout_s: float = IDLE_TIMEOUT_S, allowed_hosts: tuple[str, ...] | list[str] | None = None,
          allow_origins: tuple[str, ...] | list[str] = (), max_held_bytes: int = frontend.MAX_HELD_BYTES,
          min_body_rate: float = MIN_BODY_RATE, max_connections: int | None = None,
          grpc_options: dict[str, Any] | None = None) -> None:
    """Run the server until it is stopped (SIGTERM drains; see the module docstring), then stop the engine.
    ``grpc_port``: the gRPC service beside it (0: any free port; ``on_listen(host, port, grpc_port)`` then), with
    ``grpc_options`` (:class:`~opweave.serve.grpc_server.GrpcServer`'s ``max_calls``, ``max_metadata_bytes``).
    ``max_body_bytes``, ``header_timeout_s``, ``idle_timeout_s``, ``max_held_bytes`` (the
    :class:`~opweave.serve.frontend.Budget`) and ``max_connections`` (each front end's; default
    :func:`connection_limit`'s): the limits of the module docstring, on both front ends; ``min_body_rate`` (bytes
    a second), HTTP's. ``allowed_hosts`` (default :func:`default_hosts` of ``host``) and ``allow_origins``:
    :func:`guard`'s."""
    state = State()
    budget = Budget(max_held_bytes)
    connections = connection_limit(max_connections, 1 if grpc_port is None else 2)
    repository = repository or Repository(engine, models)
    app = create_app(engine, repository.served, max_body_bytes=max_body_bytes, state=state, repository=repository,
                     allowed_hosts=default_hosts(host) if allowed_hosts is None else allowed_hosts,
                     allow_origins=allow_origins, budget=budget)
    config = _uvicorn_config(app, host, port, log_level, header_timeout_s, idle_timeout_s, budget, min_body_rate,
                             connections, timeout_graceful_shutdown=30)
    rpc = None
    if grpc_port is not None:  # made (and its limits checked) before the engine starts
        from opweave.serve.grpc_server import GrpcServer

        rpc = GrpcServer(engine, repository, state, host=host, port=grpc_port, max_body_bytes=max_body_bytes,
                         header_timeout_s=header_timeout_s, idle_timeout_s=idle_timeout_s, budget=budget,
                         max_connections=connections, **(grpc_options or {}))
    engine.start()
    if rpc is not None:
        grpc_port = rpc.start()
    listening = on_listen if on_listen is None or rpc is None else (lambda h, p: on_listen(h, p, grpc_port))
    server = _server_class()(config, state, engine, listening)
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


class BackgroundServer:
    """A server on a thread of this process (tests, benchmarks): ``with BackgroundServer(engine, models) as url``.
    Listens on 127.0.0.1 and an ephemeral port; leaving the block drains and stops it. ``grpc=True``: the gRPC
    service too, at :attr:`grpc_address` (``127.0.0.1:port``), with ``grpc_options``; ``repository``: a
    :class:`Repository` over ``models`` (one without a directory by default), at :attr:`repository`.
    ``header_timeout_s``, ``idle_timeout_s``, ``max_held_bytes`` (its :class:`~opweave.serve.frontend.Budget`, at
    :attr:`budget`, which both front ends share), ``min_body_rate`` and ``max_connections`` as :func:`serve`'s; the
    other options go to :func:`create_app`."""

    def __init__(self, engine: Engine, models: dict[str, ServedModel], *, grpc: bool = False,
                 repository: Repository | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_held_bytes: int = frontend.MAX_HELD_BYTES,
                 min_body_rate: float = MIN_BODY_RATE, max_connections: int | None = None,
                 grpc_options: dict[str, Any] | None = None, **options: Any):
        self.engine, self.models, self.options = engine, models, options
        self.repository = repository or Repository(engine, models)
        self.grpc, self.rpc, self.grpc_address, self.grpc_options = grpc, None, None, grpc_options or {}
        self.timeouts = {"header_timeout_s": header_timeout_s, "idle_timeout_s": idle_timeout_s}
        self.budget, self.min_body_rate = Budget(max_held_bytes), min_body_rate
        self.max_connections = connection_limit(max_connections, 2 if grpc else 1)

    def __enter__(self) -> str:
        import threading

        self.state = State()
        self.app = create_app(self.engine, self.repository.served, state=self.state, repository=self.repository,
                              budget=self.budget, **self.options)
        config = _uvicorn_config(self.app, "127.0.0.1", 0, "warning", budget=self.budget,
                                 min_body_rate=self.min_body_rate, max_connections=self.max_connections,
                                 **self.timeouts)
        self.connections = config.http.connections  # the connections held (_Connections)
        bound = threading.Event()
        address: list = []
        self.server = _server_class()(config, self.state, self.engine,
                                      lambda h, p: (address.append((h, p)), bound.set()))
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, name="opweave-http", daemon=True)
        self.thread.start()
        if not bound.wait(30):
            raise RuntimeError("the server did not start within 30 s")
        host, port = address[0]
        if self.grpc:
            from opweave.serve.grpc_server import GrpcServer

            self.rpc = GrpcServer(self.engine, self.repository, self.state,
                                  max_body_bytes=self.options.get("max_body_bytes", 0), budget=self.budget,
                                  max_connections=self.max_connections, **self.grpc_options, **self.timeouts)
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


__all__ = ["BackgroundServer", "CONTROL_BODY_BYTES", "EXTENSIONS", "Guard", "LINGER_BYTES", "LINGER_S",
           "LOOPBACK_HOSTS", "MAX_CONNECTIONS", "MAX_HEADER_BYTES", "MIN_BODY_RATE", "Metrics", "OFFLOAD_BYTES",
           "State", "connection_limit", "create_app", "default_hosts", "guard", "serve"]
