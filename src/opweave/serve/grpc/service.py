"""KServe v2's ``inference.GRPCInferenceService`` (the Open Inference Protocol over gRPC, as Triton serves it) over
the engine, models, repository and draining state the HTTP server has too: :class:`Servicer`, registered on a
``grpc.aio`` server by :func:`add_service`.

Calls: ``ServerLive``, ``ServerReady`` (not while draining), ``ModelReady`` (false for a model not served),
``ServerMetadata``, ``ModelMetadata``, ``ModelConfig``, ``ModelInfer`` (:mod:`.messages`), ``ModelStatistics``
(:mod:`opweave.serve.metrics.stats`), ``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``; the
others (shared memory, tracing, logging, streaming) answer ``UNIMPLEMENTED``, saying which call opweave does not
implement. Refusals map to gRPC codes as :mod:`opweave.serve.frontend`'s table says (``INVALID_ARGUMENT``,
``NOT_FOUND``, ``RESOURCE_EXHAUSTED`` with a ``retry-after`` trailer, ``UNAVAILABLE`` while draining or unloading,
``DEADLINE_EXCEEDED``, ``INTERNAL``); a refusal sets the call's code and details and returns: no exception outlives
the call (an aborted call's exception kept the request's frames, and the request, in a reference cycle until the
cycle collector ran). A client deadline (``client_timeout``) is the request's deadline too, as is
``parameters.timeout`` (µs). A call's request message is read by the handler :func:`add_service` makes, within a
timeout, holding what a ``ModelInfer`` may take of the server's :class:`~opweave.serve.frontend.Budget` before it is
read; a request over :data:`OFFLOAD_BYTES` is decoded, and an answer that large
(:func:`~opweave.serve.protocol.response_bytes`) encoded, on a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from torch.utils import _pytree as pytree
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import opweave
from opweave.serve import frontend, protocol
from opweave.serve.engine.engine import Engine
from opweave.serve.frontend import Budget, Refused, State
from opweave.serve.grpc.messages import decode, encode, parameters
from opweave.serve.metrics.stats import Statistics
from opweave.serve.models import ServedModel
from opweave.serve.repository.repository import Repository

OFFLOAD_BYTES = 256 << 10  # a ModelInfer (or its answer) this large is decoded (encoded) on a worker thread
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
         "full": grpc.StatusCode.RESOURCE_EXHAUSTED, "draining": grpc.StatusCode.UNAVAILABLE,
         "overloaded": grpc.StatusCode.UNAVAILABLE,
         "timeout": grpc.StatusCode.DEADLINE_EXCEEDED, "error": grpc.StatusCode.INTERNAL}
EXTENSIONS = ["model_configuration", "model_repository", "statistics"]


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


__all__ = ["CODES", "EXTENSIONS", "OFFLOAD_BYTES", "SERVICE", "Servicer", "add_service"]
