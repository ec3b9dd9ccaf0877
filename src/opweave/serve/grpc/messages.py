"""KServe v2's gRPC messages (``tritonclient``'s ``service_pb2``: generated from Triton's ``grpc_service.proto``, which
extends KServe's ``grpc_predict_v2.proto``) to and from the protocol's request and answer: ``ModelInfer`` takes
inputs as ``raw_input_contents`` (one entry per input, little-endian, row-major: what ``tritonclient.grpc`` sends) or
typed ``contents`` (``fp32_contents`` for FP32, ...), and answers every output in ``raw_output_contents``. A request
is turned into the protocol's request object and checked by :func:`opweave.serve.protocol.decode_request`, the HTTP
server's checks, word for word (:func:`decode`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tritonclient.grpc import service_pb2

from opweave.serve import protocol
from opweave.serve.models import ServedModel

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
    entries: list[dict[str, Any]] = []
    floats: dict[int, Any] = {}  # typed floating-point contents (IEEE values: checked as binary data is)
    for tensor in request.inputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                                 "parameters": parameters(tensor.parameters)}
        given = [f.name for f, _ in tensor.contents.ListFields()]
        if given:
            want = CONTENTS.get(tensor.datatype)
            if want is None or given != [want]:
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


__all__ = ["CONTENTS", "FLOAT_CONTENTS", "decode", "encode", "parameters"]
