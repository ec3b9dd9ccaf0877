"""The gRPC front end: KServe v2's ``inference.GRPCInferenceService`` (the Open Inference Protocol over gRPC, as
Triton serves it) over the same engine, models, repository and draining state as the HTTP server.

The service's messages and stubs are ``tritonclient``'s (``tritonclient.grpc.service_pb2``, ``service_pb2_grpc``,
``model_config_pb2``: generated from Triton's ``grpc_service.proto`` / ``model_config.proto``, which extend KServe's
``grpc_predict_v2.proto`` with the repository and configuration calls); ``pip install opweave[serve]`` brings them.

Calls: ``ServerLive``, ``ServerReady`` (not while draining), ``ModelReady`` (false for a model not served),
``ServerMetadata``, ``ModelMetadata``, ``ModelConfig``, ``ModelInfer``, ``ModelStatistics``
(:mod:`opweave.serve.stats`), ``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``; the others
(shared memory, tracing, logging, streaming) answer ``UNIMPLEMENTED``, saying which call opweave does not implement.

``ModelInfer`` takes inputs as ``raw_input_contents`` (one entry per input, little-endian, row-major: what
``tritonclient.grpc`` sends) or typed ``contents`` (``fp32_contents`` for FP32, ...), and answers every output in
``raw_output_contents``. The request is turned into the protocol's request object and checked by
:func:`opweave.serve.protocol.decode_request`, the HTTP server's checks, word for word; refusals map to gRPC codes
as :mod:`opweave.serve.frontend`'s table says (``INVALID_ARGUMENT``, ``NOT_FOUND``, ``RESOURCE_EXHAUSTED`` with a
``retry-after`` trailer, ``UNAVAILABLE`` while draining or unloading, ``DEADLINE_EXCEEDED``, ``INTERNAL``). A client
deadline (``client_timeout``) is the request's deadline too, as is ``parameters.timeout`` (µs).

The server (``grpc.aio``) runs its own event loop on a thread of its own (:class:`GrpcServer`), beside uvicorn's:
an ``infer`` waits on an asyncio future the engine's thread resolves, loads and unloads run on worker threads, and
so does the decoding of a request over :data:`OFFLOAD_BYTES`.

Limits (docs/serving.md, "Security"): gRPC refuses a message over ``max_message_bytes`` (:func:`message_limit`: the
largest request a model served takes) by the length it declares, before reading it (``RESOURCE_EXHAUSTED``); a
``ModelInfer`` holds that many bytes of the server's :class:`~opweave.serve.frontend.Budget` (shared with HTTP)
before its message is read (``UNAVAILABLE`` with ``retry-after`` if the budget cannot take them), then what its
message takes until the call ends; one over its model's :func:`~opweave.serve.protocol.request_limit` is refused
``INVALID_ARGUMENT`` before its inputs are decoded. At most ``max_connections`` connections, ``max_calls`` calls in
progress (calls waiting for their message included) and ``max_metadata_bytes`` of a call's metadata: past them gRPC
refuses (a connection closed; ``RESOURCE_EXHAUSTED``). A refusal sets the call's code and details and returns: no
exception outlives the call (an aborted call's exception kept the request's frames, and the request, in a
reference cycle until the cycle collector ran). Connections: the HTTP/2 handshake must finish within
``header_timeout_s``, a connection with no call for ``idle_timeout_s`` is closed, and keepalive pings find dead
peers; a call's request message must arrive within ``idle_timeout_s`` of the call (``DEADLINE_EXCEEDED``
otherwise). A request refused by :mod:`opweave.serve.protocol`'s checks (a repeated output, a number that is not
finite, ...) is ``INVALID_ARGUMENT``; an answer over :data:`OFFLOAD_BYTES`
(:func:`~opweave.serve.protocol.response_bytes`) is encoded on a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from typing import Any

import grpc
import torch
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from torch.utils import _pytree as pytree
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import opweave
from opweave.errors import UsageError
from opweave.serve import frontend, protocol
from opweave.serve.engine import Engine
from opweave.serve.frontend import Budget, Refused, State
from opweave.serve.models import ServedModel
from opweave.serve.repository import Repository
from opweave.serve.stats import Statistics

OFFLOAD_BYTES = 256 << 10  # a ModelInfer (or its answer) this large is decoded (encoded) on a worker thread
MAX_CALLS = 1024  # calls in progress at once, server-wide (more: RESOURCE_EXHAUSTED, from gRPC itself)
MAX_METADATA_BYTES = 16 << 10  # a call's metadata (its headers, as HTTP/2 counts them)
MAX_CONNECTIONS = 4096  # connections at once (more: closed as they come, by gRPC itself)
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
         "full": grpc.StatusCode.RESOURCE_EXHAUSTED, "draining": grpc.StatusCode.UNAVAILABLE,
         "overloaded": grpc.StatusCode.UNAVAILABLE,
         "timeout": grpc.StatusCode.DEADLINE_EXCEEDED, "error": grpc.StatusCode.INTERNAL}
EXTENSIONS = ["model_configuration", "model_repository", "statistics"]

# the typed contents field of each datatype (FP16 and BF16 travel only as raw bytes)
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}
FLOAT_CONTENTS = ("FP32", "FP64")  # typed contents that hold IEEE values of the datatype itself


def parameters(params) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` (or ``ModelRepositoryParameter``) as plain values."""
    out = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which is not None else None
    return out


def decode(model: ServedModel, request: service_pb2.ModelInferRequest) -> protocol.InferRequest:
    """A ``ModelInferRequest`` checked for ``model`` by the protocol's checks (module docstring);
    :class:`~opweave.serve.protocol.ProtocolError` says what is wrong."""
    raw = request.raw_input_contents  # not copied: an entry is read once, by take()
    if raw and len(raw) != len(request.inputs):
        raise protocol.ProtocolError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                                     f"(one per input, or none)")
    entries = []
    floats: dict[int, Any] = {}  # typed floating-point contents (IEEE values: checked as binary data is)
    for tensor in request.inputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                                 "parameters": parameters(tensor.parameters)}
        given = [f.name for f, _ in tensor.contents.ListFields()]
        if given:
            want = CONTENTS.get(tensor.datatype)
            if given != [want]:
                raise protocol.ProtocolError(f"input {tensor.name!r}: contents in {', '.join(given)}; datatype "
                                             f"{tensor.datatype} takes {want or 'raw_input_contents only'}")
            if tensor.datatype in FLOAT_CONTENTS:
                floats[len(entries)] = getattr(tensor.contents, want)
            else:
                entry["data"] = list(getattr(tensor.contents, want))
        elif not raw:
            entry["data"] = []  # no values at all: the count check names the input
        entries.append(entry)
    body: dict[str, Any] = {"inputs": entries, "parameters": parameters(request.parameters)}
    if request.id:
        body["id"] = request.id
    if request.outputs:
        body["outputs"] = [{"name": o.name, "parameters": parameters(o.parameters)} for o in request.outputs]

    def take(index: int, entry: dict, spec, shape: list[int]) -> bytes | None:
        if index in floats:
            values = floats[index]
            if raw:
                raise protocol.ProtocolError(f"input {spec.name!r} has both contents and raw_input_contents")
            if len(values) != math.prod(shape):
                raise protocol.ProtocolError(f"input {spec.name!r}: {len(values)} values for shape {shape} "
                                             f"({math.prod(shape)} needed)")
            return protocol.encode_tensor(torch.tensor(list(values), dtype=spec.dtype)) if values else b""
        if not raw:
            return None
        if "data" in entry:
            raise protocol.ProtocolError(f"input {spec.name!r} has both contents and raw_input_contents")
        need = math.prod(shape) * spec.dtype.itemsize
        if len(raw[index]) != need:
            raise protocol.ProtocolError(f"input {spec.name!r}: raw_input_contents[{index}] holds {len(raw[index])} "
                                         f"bytes, expected {need} bytes for shape {shape} of {spec.datatype}")
        return raw[index]

    return protocol.decode_request(model, body, take)


def encode(model: ServedModel, request: protocol.InferRequest, leaves) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version,
                                              id=request.id or "")
    for spec, t, _ in protocol.answers(model, request, leaves):
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(t.shape))
        response.raw_output_contents.append(protocol.encode_tensor(t))
    return response


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The calls of the module docstring over ``engine`` and ``repository`` (whose ``served`` is the live model
    dict), sharing ``state`` (in flight, draining) with the HTTP server."""

    def __init__(self, engine: Engine, repository: Repository, state: State, max_body_bytes: int = 0):
        self.engine, self.repository, self.state = engine, repository, state
        self.max_body_bytes = max_body_bytes  # --max-body-mb: raises every model's request limit
        self.statistics = Statistics.of(engine)

    def _served(self, name: str, version: str) -> ServedModel:
        model = self.repository.served.get(name)
        if model is None:
            raise Refused("not_found", f"unknown model {protocol.shown(name)}")
        if version not in ("", model.version):
            raise Refused("not_found", f"model {name!r} has no version {protocol.shown(version)} (only "
                                       f"{model.version})")
        return model

    async def _call(self, context, work):
        """Run ``work()`` (a coroutine function); a :class:`Refused` ends the call with its status code and one line
        (set, not raised: module docstring)."""
        try:
            return await work()
        except Refused as exc:
            refused = _Refusal(exc)
        return refused.end(context)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=not self.state.draining)

    async def ModelReady(self, request, context):
        model = self.repository.served.get(request.name)
        ok = model is not None and request.version in ("", model.version) and not self.state.draining
        return service_pb2.ModelReadyResponse(ready=ok)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="opweave", version=getattr(opweave, "__version__", "0"),
                                                  extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        async def work():
            model = self._served(request.name, request.version)
            meta = protocol.metadata(model)

            def tensors(specs):
                return [service_pb2.ModelMetadataResponse.TensorMetadata(**s) for s in specs]

            return service_pb2.ModelMetadataResponse(name=model.name, versions=meta["versions"], platform="opweave",
                                                     inputs=tensors(meta["inputs"]), outputs=tensors(meta["outputs"]))
        return await self._call(context, work)

    async def ModelConfig(self, request, context):
        async def work():
            model = self._served(request.name, request.version)
            config = protocol.config(model, self.engine.policy.describe(), self.engine.max_queue)
            parsed = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
            return service_pb2.ModelConfigResponse(config=parsed)
        return await self._call(context, work)

    async def ModelInfer(self, request, context):
        async def work():
            if self.state.draining:
                raise Refused("draining", "the server is shutting down")
            model = self._served(request.model_name, request.model_version)
            size = request.ByteSize()
            limit = protocol.request_limit(model, protocol.RAW_BYTES_PER_VALUE, self.max_body_bytes)
            if size > limit:
                raise Refused("invalid", f"request of {size} bytes exceeds the limit of {limit} bytes for model "
                                         f"{model.name!r}")
            decoded = await frontend.offload(decode, model, request, size=size, threshold=OFFLOAD_BYTES)
            result = await frontend.infer(self.engine, self.state, model.name, decoded,
                                          timeout_s=context.time_remaining())
            leaves = pytree.tree_leaves(result.output)
            return await frontend.offload(encode, model, decoded, leaves, threshold=OFFLOAD_BYTES,
                                          size=protocol.response_bytes(model, decoded, leaves))
        return await self._call(context, work)

    async def ModelStatistics(self, request, context):
        async def work():
            report = self.statistics.report(self.repository.served, request.name, request.version)
            return json_format.ParseDict(report, service_pb2.ModelStatisticsResponse())
        return await self._call(context, work)

    async def RepositoryIndex(self, request, context):
        models = [service_pb2.RepositoryIndexResponse.ModelIndex(**m)
                  for m in self.repository.index(ready=request.ready)]
        return service_pb2.RepositoryIndexResponse(models=models)

    async def RepositoryModelLoad(self, request, context):
        async def work():
            params = parameters(request.parameters)
            extra = sorted(k for k in params if k != "config")
            if extra:
                raise Refused("invalid", f"load parameters {protocol.shown(extra)} are not supported (only config)")
            config = params.get("config")
            if config is not None and not isinstance(config, str):
                raise Refused("invalid", "parameters.config must be the model config as a JSON string")
            await asyncio.to_thread(self.repository.load, request.model_name, config)
            return service_pb2.RepositoryModelLoadResponse()
        return await self._call(context, work)

    async def RepositoryModelUnload(self, request, context):
        async def work():
            await asyncio.to_thread(self.repository.unload, request.model_name)
            return service_pb2.RepositoryModelUnloadResponse()
        return await self._call(context, work)


class _Refusal:
    """A :class:`Refused`'s code, one line and retry-after, kept without the exception (whose traceback holds the
    request's frames), and set on a call's context by :meth:`end`."""

    def __init__(self, exc: Refused):
        self.code, self.details, self.retry = CODES[exc.kind], frontend.one_line(str(exc)), exc.retry_after_s

    def end(self, context) -> None:
        if self.retry is not None:
            context.set_trailing_metadata((("retry-after", str(math.ceil(self.retry))),))
        context.set_code(self.code)
        context.set_details(self.details)
        return None


SERVICE = "inference.GRPCInferenceService"


class _Unparsable:
    """What a request deserializer answers for bytes that are no message of its type (raising, the call would end
    ``UNKNOWN`` with the parser's exception): the servicer's method then ends the call ``INVALID_ARGUMENT``."""

    def __init__(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        self.reason, self.code = reason, code


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return _Unparsable(f"the request is no {message_class.DESCRIPTOR.full_name} message")
    return parse


def _one_message(behaviour, timeout_s: float, budget: Budget | None = None, reserve: int = 0):
    """``behaviour(request, context)`` as a handler of a call whose request message is read here, within
    ``timeout_s`` of the call's start (a call whose message never arrives ends ``DEADLINE_EXCEEDED``: gRPC's own
    unary handler waits for it as long as the connection lives, and a connection with a call open is never idle); a
    message that does not parse (:class:`_Unparsable`) or is missing ends ``INVALID_ARGUMENT``. With ``budget``, the
    call holds ``reserve`` bytes of it (the most its message may take) before the message is read, ending
    ``UNAVAILABLE`` with a ``retry-after`` trailer, its message unread, if the budget cannot take them; once read,
    what the message takes, until the call ends."""
    async def call(_requests, context):
        with budget.hold() if budget is not None else contextlib.nullcontext() as hold:
            if hold is not None:
                try:
                    hold(reserve)
                except Refused as exc:
                    refused = _Refusal(exc)
                else:
                    refused = None
                if refused is not None:
                    return refused.end(context)
            try:
                request = await asyncio.wait_for(context.read(), timeout_s)
            except asyncio.TimeoutError:
                request = _Unparsable(f"the request's message did not arrive within {timeout_s:g} s (opweave serve "
                                      f"--idle-timeout-s)", grpc.StatusCode.DEADLINE_EXCEEDED)
            if request is grpc.aio.EOF:
                request = _Unparsable("the call carries no request message")
            if isinstance(request, _Unparsable):
                context.set_code(request.code)
                context.set_details(request.reason)
                return None
            if hold is not None:
                hold.shrink(request.ByteSize())
            return await behaviour(request, context)
    return call


def _unimplemented(name: str, handler):
    """A handler of call ``name`` that answers ``UNIMPLEMENTED``, saying so in one line."""
    details = f"opweave does not implement {name}"

    async def refuse(request, context):
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details(details)

    async def refuse_stream(requests, context):
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details(details)
        return
        yield  # an async generator that answers nothing

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(refuse, **codec)


def add_service(servicer: Servicer, server, message_timeout_s: float = 60.0, budget: Budget | None = None,
                max_message_bytes: int = 0) -> None:
    """Register ``servicer`` on ``server`` as tritonclient's generated code does, but with the request deserializers
    of :func:`_parser` on the calls the servicer implements (coroutines), each reading its message within
    ``message_timeout_s`` (:func:`_one_message`; on the wire a unary call is a stream of one message), a
    ``ModelInfer`` holding ``max_message_bytes`` of ``budget`` while it does: a message that does not parse is
    ``INVALID_ARGUMENT``; the calls it does not implement answer ``UNIMPLEMENTED`` (:func:`_unimplemented`)."""
    class Table:  # what the generated registration hands a server
        def __init__(self) -> None:
            self.handlers: dict = {}

        def add_generic_rpc_handlers(self, _handlers) -> None:
            pass

        def add_registered_method_handlers(self, _service, handlers) -> None:
            self.handlers = handlers

    table = Table()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, table)
    handlers = dict(table.handlers)
    for name, handler in handlers.items():
        if handler.unary_unary is not None and asyncio.iscoroutinefunction(handler.unary_unary):
            held = budget if name == "ModelInfer" else None
            handlers[name] = grpc.stream_unary_rpc_method_handler(
                _one_message(handler.unary_unary, message_timeout_s, held, max_message_bytes),
                request_deserializer=_parser(handler.request_deserializer.__self__),
                response_serializer=handler.response_serializer)
        else:  # the generated base class's: it would end the call with its NotImplementedError
            handlers[name] = _unimplemented(name, handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


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
                 header_timeout_s: float = 10.0, idle_timeout_s: float = 60.0, budget: Budget | None = None,
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
                ("grpc.so_reuseport", 0)]

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


__all__ = ["CODES", "CONTENTS", "MAX_CALLS", "MAX_CONNECTIONS", "MAX_METADATA_BYTES", "OFFLOAD_BYTES", "SERVICE",
           "GrpcServer", "Servicer", "add_service", "decode", "encode", "message_limit", "parameters"]
