"""What a crowd of hostile clients cannot take from the server on 127.0.0.1 (docs/serving.md, "Security"): its
connections (idle ones give way to a new one, busy ones refuse it), its gRPC calls and the memory their messages
hold, its log (a failed accept said once an interval, not once an attempt), answers grown by what a client echoes,
and the model's checks, which a client's load config cannot loosen."""

import json
import socket

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opweave.serve import protocol
from opweave.serve.assemble import make_engine
from opweave.serve.models import ServedModel, TensorSpec
from opweave.serve.protocol import HEADER, encode_tensor
from opweave.serve.repository import Repository
from opweave.serve.server import BackgroundServer
from serve_models import tiny
from test_serve_hostile import NON_FINITE, load, raw, tiny_json, tiny_request

pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2_grpc  # noqa: E402

EMOJI = "\U0001F600"  # four bytes of UTF-8, twelve as JSON's \uXXXX\uXXXX


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repository holding tiny/1/model.pt2 only."""
    root = tmp_path_factory.mktemp("bounds")
    model, x = tiny()
    (root / "tiny" / "1").mkdir(parents=True)
    torch.export.save(torch.export.export(model, x), str(root / "tiny" / "1" / "model.pt2"))
    return root


def background(repo, control: str = "none", **options) -> BackgroundServer:
    served: dict = {}
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4, compiler=None)
    repository = Repository(engine, served, repo, max_batch=4, control=control)
    repository.load_all()
    return BackgroundServer(engine, served, grpc=True, repository=repository, **options)


@pytest.fixture(scope="module")
def explicit(repo):
    """tiny under the repository API, its request limit raised to 1 MiB, 2.5 MiB held at most in all."""
    server = background(repo, control="explicit", max_body_bytes=1 << 20, max_held_bytes=5 << 19)
    with server as url:
        server.url = url
        yield server


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def live(sock: socket.socket, host: str) -> bytes:
    """``/v2/health/live`` asked on ``sock`` (the connection then closed): the whole answer."""
    sock.sendall(f"GET /v2/health/live HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    return until_closed(sock)


def until_closed(sock: socket.socket) -> bytes:
    received = b""
    while part := sock.recv(65536):
        received += part
    return received


# ---- echoes ------------------------------------------------------------------------------------------------------
def test_an_echoed_id_cannot_grow_an_answer(explicit):
    """An id of a million emoji (4.25 MB of UTF-8) came back as 12 MB of \\uXXXX: an answer echoes an id's first 64
    characters, over HTTP and gRPC."""
    long_id = EMOJI * 200_000
    body = json.dumps({"id": long_id, **json.loads(tiny_json())}, ensure_ascii=False).encode()
    status, answer = raw(explicit, "POST", "/v2/models/tiny/infer", body)
    assert status == 200 and answer["id"] == EMOJI * 64
    assert len(json.dumps(answer)) < 4096
    request = tiny_request(torch.randn(1, 3, 8, 8))
    request.id = long_id
    channel = grpc.insecure_channel(explicit.grpc_address, options=[("grpc.max_send_message_length", 1 << 30)])
    try:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    finally:
        channel.close()
    assert response.id == EMOJI * 64 and response.ByteSize() < 4096


def fan_model() -> ServedModel:
    return ServedModel("m", None, (TensorSpec("x", "FP32", (-1, 3)),), (TensorSpec("y", "FP32", (-1, 3)),
                                                                        TensorSpec("n", "INT64", (-1,))), 4, "m")


@given(st.text(max_size=200), st.integers(1, 4), st.booleans(), st.booleans())
def test_the_size_that_decides_where_an_answer_is_encoded_counts_all_of_it(request_id, batch, binary, named):
    """The size that decides whether an answer is encoded off the event loop counted its outputs' values only, not
    its head: names, shapes, and the echoed id (12 bytes a character as JSON writes an emoji)."""
    model = fan_model()
    outputs = [{"name": n, "parameters": {"binary_data": binary}} for n in ("y", "n")] if named else None
    body = {"id": request_id, "inputs": [{"name": "x", "shape": [batch, 3], "datatype": "FP32",
                                          "data": [0.5] * (3 * batch)}]}
    decoded = protocol.decode_request(model, {**body, **({"outputs": outputs} if outputs else {})})
    leaves = [torch.randn(batch, 3) * 1e-300, torch.full((batch,), -(2 ** 63))]
    written, _ = protocol.encode(model, decoded, leaves)
    assert len(written) <= protocol.response_bytes(model, decoded, leaves)


# ---- what a client's load config may change ----------------------------------------------------------------------
def test_a_clients_load_config_cannot_loosen_the_models_checks(explicit):
    """Under explicit control a load's config with parameters {allow_non_finite_inputs: true} let every client's NaN
    and infinities in until a plain reload: the model's parameters are the repository's config's."""
    first = explicit.repository.served["tiny"]
    status, answer = load(explicit, "tiny", NON_FINITE)
    assert status == 400 and "a client's config cannot change a model's parameters" in answer["error"], answer
    assert explicit.repository.served["tiny"] is first and not first.allow_non_finite
    x = torch.randn(1, 3, 8, 8)
    x[0, 0, 0, 0] = float("nan")
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 768}}]}).encode()
    status, answer = raw(explicit, "POST", "/v2/models/tiny/infer", header + encode_tensor(x),
                         {HEADER: str(len(header))})
    assert status == 400 and answer["error"].startswith("input 'x' holds NaN"), answer


def test_an_integer_of_thousands_of_digits_is_refused_in_the_servers_words(explicit):
    """Python's own advice (sys.set_int_max_str_digits()) was the answer to an integer of more than 4,300 digits."""
    huge = "1" + "0" * 5000
    body = b'{"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [' + huge.encode() + b"]}]}"
    status, answer = raw(explicit, "POST", "/v2/models/tiny/infer", body)
    assert status == 400 and answer["error"] == ("malformed JSON: an integer of more than 4300 digits, beyond the "
                                                 "range of float64"), answer
    status, answer = load(explicit, "tiny", '{"max_batch_size": ' + huge + "}")
    assert status == 400 and "an integer of more than 4300 digits" in answer["error"], answer
    assert "set_int_max_str_digits" not in answer["error"]

