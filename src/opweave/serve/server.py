"""The HTTP front end: FastAPI + uvicorn speaking the Open Inference Protocol (KServe v2) as Triton does, over the
engine (:mod:`opweave.serve.engine`), with Prometheus metrics and a draining shutdown.

Endpoints: ``GET /v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}`` (inputs
and outputs: names, shapes, datatypes), ``/v2/models/{name}/ready``, ``/v2/models/{name}/config``, ``POST
/v2/models/{name}/infer`` (JSON tensors or the binary tensor data extension; the ``/versions/1/`` forms too) and
``GET /metrics`` (Prometheus text format); the repository extension (:mod:`opweave.serve.repository`): ``POST
/v2/repository/index``, ``/v2/repository/models/{name}/load`` and ``/unload``. The gRPC front end
(:mod:`opweave.serve.grpc_server`) runs beside it on the same engine, models and draining state (``grpc_port``).

Status codes: 200; 400 with ``{"error": message}`` for malformed JSON, a wrong input name, shape, datatype or data
length, and a body over ``max_body_bytes`` (the issue asks 400 where HTTP would say 413); 404 for an unknown model;
429 with ``Retry-After`` (seconds) when the model's queue is full; 503 once draining; 504 for a request past its
deadline (Triton's ``parameters.timeout`` in microseconds, or the server's ``timeout_s``); 500 if the model fails
(:mod:`opweave.serve.frontend` holds the table both front ends share).

Draining (:class:`DrainingServer`): the first SIGTERM stops admission (new requests get 503, readiness goes 503)
while every accepted request is still answered; once none is left uvicorn shuts down and the process exits 0. A
second SIGTERM or a SIGINT stops at once (uvicorn's own behaviour).
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import sys
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from torch.utils import _pytree as pytree

import opweave
from opweave.serve import frontend, protocol
from opweave.serve.engine import Engine, Observer, Request
from opweave.serve.executors import Part, StepCost
from opweave.serve.frontend import Refused, State
from opweave.serve.models import ServedModel
from opweave.serve.repository import Repository

MAX_BODY_BYTES = 64 << 20
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository"]
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Metrics(Observer):
    """Prometheus metrics of one engine, in their own registry: per model queue depth, queue time, compute time,
    end-to-end latency, requests by outcome, rejections, batch sizes; per step duration and sub-blocks; the plan
    cache; GPU utilization through NVML where it is installed and a GPU is there."""

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


class _NotServed(Exception):
    """A path names a model (or version) the server does not serve; the app answers 404 with the message."""


def create_app(engine: Engine, models: dict[str, ServedModel], *, max_body_bytes: int = MAX_BODY_BYTES,
               state: State | None = None, repository: Repository | None = None):
    """The FastAPI app over ``engine`` (whose loop must be running: :meth:`Engine.start`). ``repository`` (one
    over ``models`` and no directory by default) answers the repository extension; ``models`` is its live dict."""
    state = state or State()
    repository = repository or Repository(engine, models)
    models = repository.served
    metrics = Metrics(engine)
    engine.observers.append(metrics)
    app = FastAPI(title="opweave serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.repository = repository

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(_NotServed)
    def not_served(_request, exc: _NotServed) -> JSONResponse:
        return error(404, str(exc))

    def served(name: str, version: str | None) -> ServedModel:
        """The model a path names; :class:`_NotServed` (answered 404) for an unknown name or version."""
        if name not in models:
            raise _NotServed(f"unknown model {name!r}; serving {', '.join(models)}")
        model = models[name]
        if version not in (None, "", model.version):
            raise _NotServed(f"model {name!r} has no version {version!r} (only {model.version})")
        return model

    @app.get("/v2")
    def server_metadata():
        return {"name": "opweave", "version": getattr(opweave, "__version__", "0"), "extensions": EXTENSIONS}

    @app.get("/v2/health/live")
    def live():
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    def ready():
        return Response(status_code=503 if state.draining else 200)

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
        raw = await http.body()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise Refused("invalid", f"malformed JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("parameters", {}), dict):
            raise Refused("invalid", "the body must be a JSON object (with an object 'parameters')")
        return body

    @app.exception_handler(Refused)
    def refused(_request, exc: Refused) -> JSONResponse:
        return error(frontend.HTTP_STATUS[exc.kind], str(exc))

    @app.post("/v2/repository/index")
    async def repository_index(http: HttpRequest):
        body = await body_object(http)
        return repository.index(ready=bool(body.get("ready", False)))

    @app.post("/v2/repository/models/{name}/load")
    async def repository_load(name: str, http: HttpRequest):
        body = await body_object(http)
        config = body.get("parameters", {}).get("config")
        if config is not None and not isinstance(config, str):
            raise Refused("invalid", "parameters.config must be the model config as a JSON string")
        extra = sorted(k for k in body.get("parameters", {}) if k != "config")
        if extra:
            raise Refused("invalid", f"load parameters {extra} are not supported (only config)")
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

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, http: HttpRequest, version: str | None = None):
        if state.draining:
            return error(503, "the server is shutting down")
        model = served(name, version)
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return error(400, f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes")
        body = bytearray()
        async for chunk in http.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return error(400, f"request body exceeds the limit of {max_body_bytes} bytes")
        try:
            raw = protocol.decompress(bytes(body), http.headers.get("content-encoding"), max_body_bytes)
            request = protocol.decode(model, raw, http.headers.get(protocol.HEADER))
        except protocol.ProtocolError as exc:
            return error(400, str(exc))
        try:
            result = await frontend.infer(engine, state, name, request)
        except Refused as exc:
            headers = {"Retry-After": str(math.ceil(exc.retry_after_s))} if exc.kind == "full" else None
            return error(frontend.HTTP_STATUS[exc.kind], str(exc), headers)
        body_out, headers = protocol.encode(model, request, pytree.tree_leaves(result.output))
        return Response(body_out, headers=headers, media_type=headers["Content-Type"])

    return app


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a draining SIGTERM (module docstring). ``on_listen(host, port)`` is called once bound."""

        def __init__(self, config, state: State, engine: Engine, on_listen=None):
            super().__init__(config)
            self.serving, self.engine, self.on_listen = state, engine, on_listen

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
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
          max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "warning", on_listen=None,
          grpc_port: int | None = None, repository: Repository | None = None) -> None:
    """Run the server until it is stopped (SIGTERM drains; see the module docstring), then stop the engine.
    ``grpc_port``: the gRPC service beside it (0: any free port; ``on_listen(host, port, grpc_port)`` then)."""
    import uvicorn

    state = State()
    repository = repository or Repository(engine, models)
    app = create_app(engine, repository.served, max_body_bytes=max_body_bytes, state=state, repository=repository)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=30)
    engine.start()
    rpc = None
    if grpc_port is not None:
        from opweave.serve.grpc_server import GrpcServer

        rpc = GrpcServer(engine, repository, state, host=host, port=grpc_port, max_message_bytes=max_body_bytes)
        grpc_port = rpc.start()
    listening = on_listen if on_listen is None or rpc is None else (lambda h, p: on_listen(h, p, grpc_port))
    server = _server_class()(config, state, engine, listening)
    try:
        server.run()
    finally:
        if rpc is not None:
            rpc.stop(grace_s=5)
        engine.stop(timeout_s=30)
        sys.stdout.flush()


class BackgroundServer:
    """A server on a thread of this process (tests, benchmarks): ``with BackgroundServer(engine, models) as url``.
    Listens on 127.0.0.1 and an ephemeral port; leaving the block drains and stops it. ``grpc=True``: the gRPC
    service too, at :attr:`grpc_address` (``127.0.0.1:port``); ``repository``: a :class:`Repository` over
    ``models`` (one without a directory by default), at :attr:`repository`."""

    def __init__(self, engine: Engine, models: dict[str, ServedModel], *, grpc: bool = False,
                 repository: Repository | None = None, **options: Any):
        self.engine, self.models, self.options = engine, models, options
        self.repository = repository or Repository(engine, models)
        self.grpc, self.rpc, self.grpc_address = grpc, None, None

    def __enter__(self) -> str:
        import threading

        import uvicorn

        self.state = State()
        self.app = create_app(self.engine, self.repository.served, state=self.state, repository=self.repository,
                              **self.options)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
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
                                  max_message_bytes=self.options.get("max_body_bytes", MAX_BODY_BYTES))
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


__all__ = ["BackgroundServer", "EXTENSIONS", "MAX_BODY_BYTES", "Metrics", "State", "create_app", "serve"]
