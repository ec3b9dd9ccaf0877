"""The Open Inference Protocol (KServe v2, as Triton speaks it over HTTP/REST): request decoding with every check a
malformed request needs, and response encoding, with and without the binary tensor data extension. No HTTP server
here (see :mod:`opweave.serve.server`); :mod:`opweave.serve.loadgen` builds its requests with :func:`encode_tensor`.

Binary tensor data extension: the body is a JSON header of ``Inference-Header-Content-Length`` bytes followed by
the raw little-endian bytes of every input whose ``parameters.binary_data_size`` is set, in the order of
``inputs``. An output is answered in binary when its request entry sets ``parameters.binary_data`` or, for outputs
not listed, when the request sets ``parameters.binary_data_output`` (tritonclient sets it when it lists no outputs);
then the response carries the same header and appends the bytes.

Request ``parameters.timeout`` is Triton's per-request timeout in microseconds.

JSON is RFC 8259's, both ways: UTF-8 only, an object's keys once each; a request's ``NaN`` / ``Infinity`` tokens are
refused, as are values a datatype cannot hold (``1e39`` or ``1e400`` for FP32, ``300`` for UINT8: never a silent
``inf`` or wrap-around), and a number beyond float64 anywhere else (a field the server ignores too) is refused; a
response never carries them: an output holding NaN or an infinity is answered only as
binary data (asked for in JSON, the request is refused, naming the output). An input holding NaN or an infinity (in
binary data, or gRPC's typed contents) is refused, naming it, unless the model's config allows them
(``ServedModel.allow_non_finite``). Booleans (``binary_data``, ``binary_data_output``) are JSON's ``true`` and
``false``, ``id`` a string (its answer echoes its first :data:`ID_CHARS` characters), and
``Inference-Header-Content-Length`` digits only (the spaces and tabs around a field's value are not part of it: RFC
9110, section 5.5). An integer of more digits than Python converts is refused in the server's own words.

Sizes: an input's shape is its model's, -1 standing for the batch and for a dimension whose size varies (a sequence
length: within the range the model's program gives it, and equal wherever the program takes two dimensions equal).
:func:`request_limit` is the most bytes a valid request for a model can take (its inputs at its max batch, their
varying dimensions at their largest, :data:`JSON_BYTES_PER_VALUE` a value); the front ends refuse a larger body
before reading or decoding it. An answer costs no more than its model's outputs and a short head: an output asked for
twice is refused (as Triton does), an echoed ``id`` is cut, and :func:`response_bytes` bounds what a response takes,
all of it, before it is encoded.

The checks live in :func:`decode_request`, which the gRPC front end (:mod:`opweave.serve.grpc.messages`) calls too: it
turns a ``ModelInferRequest`` into the same request object, its ``raw_input_contents`` standing for binary data.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opweave.errors import UsageError
from opweave.serve.models import DTYPES, ServedModel, TensorSpec

HEADER = "Inference-Header-Content-Length"
HEADER_BYTES = 64 << 10  # what a request carries besides its values: names, shapes, datatypes, parameters, outputs
JSON_BYTES_PER_VALUE = 48  # one value written in JSON, its separator and indentation included (floats take <= 26)
JSON_RESPONSE_BYTES_PER_VALUE = 26  # the most one value of a response's JSON takes ("-1.2345678901234567e-308, ")
RAW_BYTES_PER_VALUE = 10  # one value in gRPC's typed contents (a varint: at most 10 bytes) or raw bytes (at most 8)
SHOWN_CHARS = 64  # of a value a client sent, what an error message quotes
ID_CHARS = 64  # of a request's id, what its answer echoes
NON_FINITE_PARAMETER = "allow_non_finite_inputs"  # a model config's parameter (ServedModel.allow_non_finite)
YIELD_BYTES = 256 << 10  # JSON this large is parsed so as to let other threads run (loads)
CHUNK_VALUES = 1 << 16  # a tensor from JSON values is built this many at a time (each step lets other threads run)


def shown(value: Any) -> str:
    """``value`` (something a client sent) as an error message quotes it: its ``repr``, cut to :data:`SHOWN_CHARS`
    characters, so a message stays one short line whatever was sent."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."


def request_limit(model: ServedModel, per_value: int = JSON_BYTES_PER_VALUE, floor: int = 0,
                  batch: int | None = None) -> int:
    """The most bytes a valid request for ``model`` can take: :data:`HEADER_BYTES` and ``per_value`` bytes for each
    value of its inputs at its max batch (or ``batch``) (:data:`JSON_BYTES_PER_VALUE` covers JSON and binary data
    alike, :data:`RAW_BYTES_PER_VALUE` gRPC's contents); at least ``floor`` (the operator's ``--max-body-mb``)."""
    batch = model.max_batch if batch is None else batch
    values = sum(math.prod(s.largest(batch)) for s in model.inputs)
    return max(floor, HEADER_BYTES + per_value * values)


class ProtocolError(UsageError):
    """A request the protocol or the model does not accept: answered 400 with this message."""


@dataclass
class InferRequest:
    """A decoded, checked request: the model's inputs (flat, in the model's order), the batch, and how to answer."""

    inputs: tuple[torch.Tensor, ...]
    batch: int
    outputs: list[tuple[str, bool]]  # (name, binary) in the order to answer
    id: str | None
    timeout_s: float | None


def decompress(body: bytes | bytearray, encoding: str | None, limit: int) -> bytes | bytearray:
    """Undo ``Content-Encoding`` gzip or deflate (tritonclient's request compression), at most ``limit`` bytes."""
    if not encoding or encoding == "identity":
        return body
    try:
        if encoding == "gzip":
            with gzip.GzipFile(fileobj=io.BytesIO(body)) as f:
                out = f.read(limit + 1)
        elif encoding == "deflate":
            d = zlib.decompressobj()
            out = d.decompress(body, limit + 1)
        else:
            raise ProtocolError(f"unsupported Content-Encoding {shown(encoding)} (gzip, deflate)")
    except (OSError, zlib.error, EOFError) as exc:
        raise ProtocolError(f"request body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise ProtocolError(f"request body exceeds the limit of {limit} bytes once decompressed")
    return out


def decode(model: ServedModel, body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """Parse and check an infer request for ``model`` (see the module docstring); :class:`ProtocolError` says what
    is wrong, naming the input."""
    if header_length is not None:
        header_length = header_length.strip(" \t")  # RFC 9110 5.5: not part of the value (parsers strip it too)
        if not (header_length.isascii() and header_length.isdigit()) or len(header_length) > 19:  # int() takes
            # "+115" and "1_15"
            raise ProtocolError(f"{HEADER} {shown(header_length)} is not a byte count (at most 19 digits 0-9)")
        size = int(header_length)
        if not 0 < size <= len(body):
            raise ProtocolError(f"{HEADER} {size} does not fit a body of {len(body)} bytes")
        head, blob = body[:size], memoryview(body)[size:]
    else:
        head, blob = body, memoryview(b"")
    request = loads(head, finite=False)
    offset = 0

    def binary(index: int, entry: dict, spec: TensorSpec, shape: list[int]) -> bytes | None:
        nonlocal offset
        name = spec.name
        size = _object(entry.get("parameters", {}), f"input {name!r} parameters").get("binary_data_size")
        if size is None:
            return None
        if "data" in entry:
            raise ProtocolError(f"input {name!r} has both 'data' and binary_data_size")
        need = math.prod(shape) * spec.dtype.itemsize
        if not isinstance(size, int) or size != need:
            raise ProtocolError(f"input {name!r}: binary_data_size {shown(size)}, expected {need} bytes for shape "
                                f"{shape} of {spec.datatype}")
        if offset + size > len(blob):
            raise ProtocolError(f"input {name!r}: the body holds {len(blob) - offset} bytes of binary data, "
                                f"{size} needed")
        offset += size
        return bytes(blob[offset - size:offset])

    def leftover() -> None:
        if offset != len(blob):
            raise ProtocolError(f"the body has {len(blob) - offset} bytes of binary data that no input claims")

    return decode_request(model, request, binary, leftover)


def loads(text: bytes | bytearray | str, finite: bool = True) -> Any:
    """RFC 8259 JSON: UTF-8 text (bytes in any other encoding, which Python's ``json`` would guess and take, are
    refused), no ``NaN`` / ``Infinity``, no number beyond float64 (``1e400``, which Python's parser makes infinite;
    ``finite=False`` leaves them to :func:`decode_request`, which names the input that holds one), no key twice in an
    object (the last would silently win); anything else, however nested, refused with :class:`ProtocolError`. A
    text over :data:`YIELD_BYTES` is parsed with a Python function per number, so that the parser (C code that
    otherwise holds the GIL to the end) lets the event loop's thread run every few milliseconds while a worker
    thread decodes it (about a third slower)."""
    yielding = len(text) > YIELD_BYTES
    try:
        if not isinstance(text, str):
            text = text.decode("utf-8")
        value = json.loads(text, parse_constant=_not_json, object_pairs_hook=_unique,
                           parse_float=_float if yielding else None, parse_int=_int if yielding else None)
    except ProtocolError:
        raise
    except UnicodeDecodeError as exc:
        error = f"malformed JSON: the body is not UTF-8 text (byte {exc.start})"
    except RecursionError:
        error = "malformed JSON: nested too deep"
    except json.JSONDecodeError as exc:
        error = f"malformed JSON: {exc}"
    except ValueError:  # int() refuses a number of more digits than sys.get_int_max_str_digits() (and says so)
        error = (f"malformed JSON: an integer of more than {sys.get_int_max_str_digits()} digits, beyond the range "
                 f"of float64")
    else:
        if finite:
            refuse_non_finite(value)
        return value
    raise ProtocolError(error)


def refuse_non_finite(value: Any, skip: tuple = ()) -> None:
    """:class:`ProtocolError` naming where ``value`` (parsed JSON, or a gRPC request as :func:`decode_request` sees
    it) holds a number that is not finite: a JSON number beyond float64 (``1e400``) became an infinity, and is
    refused wherever it stands, in a field the server ignores too. ``skip``: lists not looked into (inputs' values,
    which are checked as tensors, naming the input)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        pairs = item.items() if isinstance(item, dict) else enumerate(item) \
            if isinstance(item, list) and not any(item is s for s in skip) else ()
        for key, v in pairs:
            if type(v) is float and not math.isfinite(v):
                where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
                raise ProtocolError(f"{shown(where)} holds a number beyond the range of float64 (it would become "
                                    f"infinite): no number may be infinite or NaN")
            if isinstance(v, (dict, list)):
                stack.append((f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key, v))


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys appear once each (RFC 8259 leaves a repeated key's meaning open; Python keeps the
    last, so a second ``inputs`` could hide the first from a proxy that checked it)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ProtocolError(f"malformed JSON: key {shown(key)} appears twice in an object")
            seen.add(key)
    return out


def _float(text: str) -> float:
    return float(text)


def _int(text: str) -> int:
    return int(text)


def _not_json(token: str):
    raise ProtocolError(f"malformed JSON: {token} is not a JSON number (RFC 8259); non-finite values travel as "
                        f"binary data")


RawData = Callable[[int, dict, TensorSpec, list[int]], "bytes | None"]


def decode_request(model: ServedModel, request: Any, raw: RawData | None = None,
                   after: Callable[[], None] | None = None) -> InferRequest:
    """Check a parsed request (the JSON object of the protocol) for ``model``: every input named, shaped, typed
    and sized right, the batch in range, the outputs known, the timeout positive. ``raw(index, entry, spec,
    shape)`` gives an input's bytes when they travel outside the JSON (binary data, gRPC's raw contents; checked
    against the shape by the caller) or None for ``data``; ``after()`` runs once every input is read."""
    if not isinstance(request, dict):
        raise ProtocolError("the request must be a JSON object")
    params = _object(request.get("parameters", {}), "parameters")
    entries = request.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise ProtocolError("'inputs' must be a non-empty list")
    outputs = _outputs(model, request, boolean(params.get("binary_data_output", False),
                                               "parameters.binary_data_output"))  # before the inputs' values: cheap
    specs = {s.name: s for s in model.inputs}
    given: dict[str, torch.Tensor] = {}
    batch = None
    for index, entry in enumerate(entries):
        entry = _object(entry, "an input")
        name = entry.get("name")
        if not isinstance(name, str) or name not in specs:
            raise ProtocolError(f"unknown input {shown(name)} for model {model.name!r} (inputs: "
                                f"{', '.join(specs)})")
        if name in given:
            raise ProtocolError(f"input {name!r} is given twice")
        spec = specs[name]
        shape = _shape(entry.get("shape"), name)
        if entry.get("datatype") != spec.datatype:
            raise ProtocolError(f"input {name!r}: datatype {shown(entry.get('datatype'))}, expected {spec.datatype}")
        batch = _check_shape(model, spec, shape, batch)
        data = raw(index, entry, spec, shape) if raw is not None else None
        if data is not None:
            given[name] = decode_tensor(data, spec, shape)
            if not model.allow_non_finite and given[name].is_floating_point() and \
                    not bool(torch.isfinite(given[name]).all()):
                raise ProtocolError(f"input {name!r} holds NaN or infinite values, which model {model.name!r} does "
                                    f"not take (its config's parameter {NON_FINITE_PARAMETER!r} lets them in)")
        else:
            given[name] = _json_tensor(entry.get("data"), spec, shape)
    if after is not None:
        after()
    missing = [n for n in specs if n not in given]
    if missing:
        raise ProtocolError(f"missing input {missing[0]!r} for model {model.name!r}")
    _check_equal_sizes(model, given)
    refuse_non_finite(request, skip=tuple(e["data"] for e in entries if isinstance(e.get("data"), list)))
    timeout = params.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or
                                not 0 < timeout < 1e18):
        raise ProtocolError(f"parameters.timeout must be a positive number of microseconds, got {shown(timeout)}")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"'id' must be a string, got {shown(request_id)}")
    return InferRequest(tuple(given[s.name] for s in model.inputs), batch or 1, outputs,
                        None if request_id is None else request_id[:ID_CHARS],
                        None if timeout is None else timeout / 1e6)


def boolean(value: Any, what: str) -> bool:
    """``value`` of a parameter that must be a boolean (``"false"`` is no false: it would be read as true)."""
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false, got {shown(value)}")
    return value


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    return value


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in value):
        raise ProtocolError(f"input {name!r}: shape must be a list of non-negative integers, got {shown(value)}")
    return value


def _check_shape(model: ServedModel, spec: TensorSpec, shape: list[int], batch: int | None) -> int | None:
    want = list(spec.shape)
    if len(shape) != len(want) or any(w not in (-1, d) for w, d in zip(want, shape, strict=True)):
        raise ProtocolError(f"input {spec.name!r}: shape {shape}, expected {want}")
    for dim, low, high, _ in spec.ranges:
        if not low <= shape[dim] <= high:
            raise ProtocolError(f"input {spec.name!r}: dimension {dim} is {shape[dim]}, outside {low}..{high}")
    if spec.batched:
        if not 1 <= shape[0] <= model.max_batch:
            raise ProtocolError(f"input {spec.name!r}: batch {shape[0]} is outside 1..{model.max_batch}")
        if batch is not None and shape[0] != batch:
            raise ProtocolError(f"input {spec.name!r}: batch {shape[0]} differs from the other inputs' {batch}")
        return shape[0]
    return batch


def _check_equal_sizes(model: ServedModel, given: dict[str, torch.Tensor]) -> None:
    """The dimensions the model takes equal (one symbol of :attr:`TensorSpec.ranges`) are equal in the request: a
    request the model would fail on never reaches it (beside other requests run with it)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for spec in model.inputs:
        for dim, _, _, symbol in spec.ranges:
            size = given[spec.name].shape[dim]
            first = seen.setdefault(symbol, (spec.name, dim, size))
            if first[2] != size:
                raise ProtocolError(f"input {spec.name!r}: dimension {dim} is {size}, input {first[0]!r}'s dimension "
                                    f"{first[1]} is {first[2]}: model {model.name!r} takes them equal")


def decode_tensor(data: bytes, spec: TensorSpec, shape: list[int]) -> torch.Tensor:
    if spec.datatype == "BOOL":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.bool).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=spec.dtype).reshape(shape) if data else \
        torch.empty(shape, dtype=spec.dtype)


def encode_tensor(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes as the binary extension carries them (row-major, little-endian)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _json_tensor(data: Any, spec: TensorSpec, shape: list[int]) -> torch.Tensor:
    if data is None:
        raise ProtocolError(f"input {spec.name!r} has neither 'data' nor binary_data_size")
    flat = _flatten(data, spec.name)
    if len(flat) != math.prod(shape):
        raise ProtocolError(f"input {spec.name!r}: {len(flat)} values for shape {shape} ({math.prod(shape)} needed)")
    kind = bool if spec.datatype == "BOOL" else float if spec.dtype.is_floating_point else int
    if not all(isinstance(v, kind) or (kind is float and isinstance(v, int)) for v in flat) or (
            kind is not bool and any(isinstance(v, bool) for v in flat)):
        raise ProtocolError(f"input {spec.name!r}: data must be {kind.__name__} values for {spec.datatype}")
    if kind is int and flat:
        info = torch.iinfo(spec.dtype)
        if min(flat) < info.min or max(flat) > info.max:
            raise ProtocolError(f"input {spec.name!r}: a value lies outside {info.min}..{info.max}, the range of "
                                f"{spec.datatype}")
    try:
        t = torch.cat([torch.tensor(flat[i:i + CHUNK_VALUES], dtype=spec.dtype)
                       for i in range(0, len(flat), CHUNK_VALUES)]).reshape(shape) if flat else \
            torch.empty(shape, dtype=spec.dtype)
    except (RuntimeError, OverflowError, ValueError):  # an integer beyond float64 written for a float input
        t = None
    if t is None or (kind is float and not bool(torch.isfinite(t).all())):  # JSON has no NaN nor infinity: a
        # value became infinite here (1e39 for FP32) or in the parser (1e400, beyond float64)
        largest = f" (largest {torch.finfo(spec.dtype).max:.8g})" if kind is float else ""
        raise ProtocolError(f"input {spec.name!r}: a value lies beyond the range of {spec.datatype}{largest}: it "
                            f"would become infinite")
    return t


def _flatten(data: Any, name: str) -> list:
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: 'data' must be a (possibly nested) list")
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _outputs(model: ServedModel, request: dict, binary_default: bool) -> list[tuple[str, bool]]:
    names = [s.name for s in model.outputs]
    asked = request.get("outputs")
    if asked is None:
        return [(n, binary_default) for n in names]
    if not isinstance(asked, list):
        raise ProtocolError("'outputs' must be a list")
    out: list[tuple[str, bool]] = []
    for entry in asked:
        entry = _object(entry, "an output")
        if not isinstance(entry.get("name"), str) or entry.get("name") not in names:
            raise ProtocolError(f"unknown output {shown(entry.get('name'))} for model {model.name!r} (outputs: "
                                f"{', '.join(names)})")
        if any(entry["name"] == n for n, _ in out):  # each copy would be answered: a request worth far more than
            # its size (Triton refuses a repeated output too)
            raise ProtocolError(f"output {entry['name']!r} is asked for twice")
        binary = _object(entry.get("parameters", {}), "output parameters").get("binary_data", binary_default)
        out.append((entry["name"], boolean(binary, f"output {entry['name']!r} parameters.binary_data")))
    return out


def answers(model: ServedModel, request: InferRequest, leaves: list[torch.Tensor]
            ) -> list[tuple[TensorSpec, torch.Tensor, bool]]:
    """The outputs to answer, in the order asked: ``(spec, tensor, binary)`` for the model's output ``leaves``
    (flattened, in its outputs' order)."""
    by_name = {s.name: (s, t) for s, t in zip(model.outputs, leaves, strict=True)}
    return [(*by_name[name], binary) for name, binary in request.outputs]


def response_bytes(model: ServedModel, request: InferRequest, leaves: list[torch.Tensor]) -> int:
    """At least the bytes :func:`encode` writes for the model's output ``leaves``: its JSON head as written (names,
    shapes, the echoed id), and the outputs asked for, each value at its datatype's size in binary data,
    :data:`JSON_RESPONSE_BYTES_PER_VALUE` in JSON (what decides whether the response is encoded off the event
    loop)."""
    outputs = answers(model, request, leaves)
    head = {"model_name": model.name, "model_version": model.version, "id": request.id or "",
            "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(t.shape), "data": [],
                         "parameters": {"binary_data_size": t.numel() * t.element_size()}} for s, t, _ in outputs]}
    return len(json.dumps(head)) + sum(t.numel() * (t.element_size() if binary else JSON_RESPONSE_BYTES_PER_VALUE)
                                       for _, t, binary in outputs)


def encode(model: ServedModel, request: InferRequest, leaves: list[torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for the model's output ``leaves`` (flattened, in its outputs' order)."""
    outputs, blobs = [], []
    for spec, t, binary in answers(model, request, leaves):
        name = spec.name
        entry: dict[str, Any] = {"name": name, "datatype": spec.datatype, "shape": list(t.shape)}
        if binary:
            blob = encode_tensor(t)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t = t.detach().cpu()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ProtocolError(f"output {name!r} holds NaN or infinite values, which JSON cannot carry: ask "
                                    f"for it as binary data (parameters.binary_data: true)")
            entry["data"] = t.reshape(-1).tolist()
        outputs.append(entry)
    response = {"model_name": model.name, "model_version": model.version, "outputs": outputs}
    if request.id is not None:
        response["id"] = request.id
    head = json.dumps(response, allow_nan=False).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def metadata(model: ServedModel) -> dict:
    """``GET /v2/models/{name}``: name, versions, platform, inputs and outputs; ``source``, where it came from, names
    no directory of the server (a file's name, a repository model's path under the repository, a zoo name)."""
    return {"name": model.name, "versions": [model.version], "platform": "opweave", "source": model.source,
            "max_batch_size": model.max_batch, "blocks": len(model.blocked.blocks),
            "inputs": [s.to_json() for s in model.inputs], "outputs": [s.to_json() for s in model.outputs]}


def config(model: ServedModel, policy: dict, max_queue: int) -> dict:
    """``GET /v2/models/{name}/config``: Triton's model configuration (its JSON form; the batch dimension is left
    out of ``dims`` when the model batches), with the engine's batching policy and the model's block count."""
    def tensor(s: TensorSpec) -> dict:
        return {"name": s.name, "data_type": f"TYPE_{s.datatype}",
                "dims": list(s.shape[1:]) if model.max_batch > 1 else list(s.shape)}

    return {"name": model.name, "platform": "opweave", "max_batch_size": model.max_batch,
            "input": [tensor(s) for s in model.inputs], "output": [tensor(s) for s in model.outputs],
            "dynamic_batching": {"policy": policy, "max_queue_size": max_queue},
            "blocks": len(model.blocked.blocks)}


__all__ = ["DTYPES", "HEADER", "HEADER_BYTES", "ID_CHARS", "JSON_BYTES_PER_VALUE", "JSON_RESPONSE_BYTES_PER_VALUE",
           "NON_FINITE_PARAMETER", "RAW_BYTES_PER_VALUE", "InferRequest", "ProtocolError", "answers", "boolean",
           "config", "decode", "decode_request", "decode_tensor", "decompress", "encode", "encode_tensor", "loads",
           "metadata", "refuse_non_finite", "request_limit", "response_bytes", "shown"]
