"""What a crowd of hostile clients cannot take from the server on 127.0.0.1 (docs/serving.md, "Security"): its
connections (idle ones give way to a new one, busy ones refuse it), its gRPC calls and the memory their messages
hold, its log (a failed accept said once an interval, not once an attempt), answers grown by what a client echoes,
and the model's checks, which a client's load config cannot loosen."""

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opweave.serve import protocol
from opweave.serve.assemble import make_engine, serving_options
from opweave.serve.models import ServedModel, TensorSpec
from opweave.serve.repository import Repository
from opweave.testing.serving import BackgroundServer
from serve_models import Silent, tiny
from test_serve_hostile import NON_FINITE, binary_infer, declare, load, raw, strict_json, tiny_json, tiny_request, until

pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

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
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, served, repo, max_batch=4, control=control)
    repository.load_all()
    return BackgroundServer(engine, served, grpc=True, repository=repository, **options)


@pytest.fixture(scope="module")
def few(repo):
    """tiny over HTTP and gRPC, each holding at most three connections, at most two gRPC calls at once (a request's
    headers may take a minute: a test holds some unfinished)."""
    server = background(repo, max_connections=3, grpc_options={"max_calls": 2}, header_timeout_s=60.0)
    with server as url:
        server.url = url
        yield server


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


# ---- connections -------------------------------------------------------------------------------------------------
def test_idle_connections_give_way_to_a_new_one_and_busy_ones_refuse_it(few):
    """Clients holding as many connections as the open-file limit locked every other client out: now at most
    --max-connections are held, the one idle longest closed to make room for a new one, and a new one is answered
    503 when every one held is busy."""
    pool = few.connections
    host, port = address(few)
    idle = [socket.create_connection((host, port), timeout=60) for _ in range(3)]
    try:
        until(lambda: pool.open == 3 and len(pool.idle) == 3, "three idle connections held")
        with socket.create_connection((host, port), timeout=60) as fresh:
            assert live(fresh, host).startswith(b"HTTP/1.1 200 ")
        assert idle[0].recv(1) == b"", "the connection idle longest was not closed"
        until(lambda: pool.open == 2, "the fresh connection gone")
        busy = idle[1:] + [socket.create_connection((host, port), timeout=60)]
        idle = busy
        for s in busy:  # a request begun: not idle
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        until(lambda: pool.open == 3 and not pool.idle, "three busy connections held")
        with socket.create_connection((host, port), timeout=60) as refused:
            head, _, body = until_closed(refused).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head and b"connection: close" in head
        assert "--max-connections" in strict_json(body)["error"]
        for s in busy:  # the busy ones were kept: their requests are answered
            s.sendall(f"Host: {host}\r\nConnection: close\r\n\r\n".encode())
            assert until_closed(s).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in idle:
            s.close()
    until(lambda: pool.open == 0, "every connection gone")


def test_grpc_connections_and_calls_are_bounded_and_calls_that_never_send_their_message_too(few):
    """gRPC took any number of connections, and any number of calls that never sent their message (30,000 held
    190 MB for the idle timeout): now --max-connections and --max-grpc-calls bound them."""
    def server_live(channel) -> str:
        try:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return "live" if stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60).live else "not live"
        except grpc.RpcError as exc:
            return exc.code().name

    own = [("grpc.use_local_subchannel_pool", 1)]  # each channel on a connection of its own
    channels = [grpc.insecure_channel(few.grpc_address, options=own) for _ in range(4)]
    try:
        assert [server_live(c) for c in channels] == ["live", "live", "live", "UNAVAILABLE"]
    finally:
        for c in channels:
            c.close()
    silence = Silent()

    channel = grpc.insecure_channel(few.grpc_address)
    try:
        until(lambda: server_live(channel) == "live", "a connection again, the others closed")
        call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)
        silent = [call.future(silence.messages()) for _ in range(2)]
        try:
            until(lambda: server_live(channel) == "RESOURCE_EXHAUSTED", "a third call refused")
        finally:
            silence.release()
            for future in silent:
                future.cancel()
        until(lambda: server_live(channel) == "live", "calls again once the two ended")
    finally:
        channel.close()


def test_grpc_metadata_is_refused_past_16_kib_every_time(few):
    """--max-grpc-metadata-kib (16): metadata of 17 KiB was taken at random (gRPC's soft limit), up to 20 KiB."""
    channel = grpc.insecure_channel(few.grpc_address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60, metadata=(("x-a", "a" * (15 << 10)),))
        for _ in range(10):
            with pytest.raises(grpc.RpcError) as info:
                stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=60, metadata=(("x-a", "a" * (17 << 10)),))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    finally:
        channel.close()


@pytest.mark.skipif(not hasattr(resource, "prlimit") or not os.path.exists("/proc/self/fd"),
                    reason="lowers the server's open-file limit (prlimit) and counts its files in /proc")
def test_a_failed_accept_is_logged_once_an_interval_without_a_traceback(repo):
    """Past the open-file limit, asyncio logged "socket.accept() out of system resource" with a traceback for every
    attempt, about 9 MB/s: now one line per interval, and the server answers again once files are free."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-file",
                                 f"tiny={repo / 'tiny' / '1' / 'model.pt2'}", "--compiler", "none", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        sockets: list[socket.socket] = []
        try:
            line = proc.stdout.readline()
            assert "listening on" in line
            url = line.strip().rsplit(" ", 1)[1]
            host, port = url.removeprefix("http://").split(":")
            limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{proc.pid}/fd")) + 4,
                                                                limits[1]))

            def logged() -> bytes:
                log.seek(0)
                return log.read()

            for _ in range(40):  # some are accepted (four files free), the others wait in the backlog
                sockets.append(socket.create_connection((host, int(port)), timeout=60))
            until(lambda: b"accepting a connection failed" in logged(), "the failed accept logged")
            first = time.monotonic()
            threading.Event().wait(2.5)  # the event loop tries again every second
            text = logged().decode(errors="replace")
            lines = 1 + int((time.monotonic() - first) // 10)  # one line every 10 s
            assert 1 <= text.count("accepting a connection failed") <= lines, text[-2000:]
            assert "Too many open files" in text
            assert "Traceback" not in text and "socket.accept() out of system resource" not in text, text[-2000:]
            for s in sockets:
                s.close()
            sockets.clear()
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
            with socket.create_connection((host, int(port)), timeout=60) as s:
                assert live(s, host).startswith(b"HTTP/1.1 200 ")
        finally:
            for s in sockets:
                s.close()
            proc.kill()
            proc.wait(timeout=30)


# ---- gRPC messages and the memory budget -------------------------------------------------------------------------
def test_grpc_messages_under_explicit_control_are_held_to_the_models_own_limit(explicit):
    """Under explicit control gRPC took 64 MiB messages whatever the models' own limits (1 MiB for a 64 px
    SqueezeNet), each read whole before it was refused: now a message over the largest model's limit (here 1 MiB;
    a repository call's message takes 2 MiB) is refused by the length it declares."""
    channel = grpc.insecure_channel(explicit.grpc_address, options=[("grpc.max_send_message_length", 1 << 30)])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(tiny_request(torch.randn(1, 3, 8, 8), raw_bytes=b"\0" * (3 << 20)), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in info.value.details()
    finally:
        channel.close()


def test_grpc_messages_are_held_in_the_servers_budget(explicit):
    """gRPC's messages were outside --max-held-mb: 40 calls of 60 MiB raised the RSS by 1.56 GB. Now a ModelInfer
    holds the most its message may take (here 2 MiB) in the budget before the message is read: while an HTTP body
    holds 1 MiB of the 2.5 MiB, a call is refused UNAVAILABLE with retry-after, its message unread; answered again once
    the body is gone."""
    channel, x = grpc.insecure_channel(explicit.grpc_address), torch.randn(1, 3, 8, 8)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        with declare(explicit, 1 << 20):
            until(lambda: explicit.budget.held >= 1 << 20, "the declared body held")
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(tiny_request(x), timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "--max-held-mb" in info.value.details()
            assert ("retry-after", "1") in info.value.trailing_metadata()
        until(lambda: explicit.budget.held == 0, "the body given back")
        assert stub.ModelInfer(tiny_request(x), timeout=60).outputs
        assert explicit.budget.held == 0
    finally:
        channel.close()


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
    status, answer = binary_infer(explicit, x)
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



def test_a_grpc_stream_reads_no_more_than_its_window_before_the_message_is_asked_for():
    """gRPC grew each stream's receive window by bandwidth probing, so concurrent calls of 60 MB over the cap pushed
    megabytes each into the server before it refused them (its RSS rose 163 MB against a 64 MB budget beside eight
    such clients); probing is off: a stream takes its 64 KiB window until the server reads."""
    from opweave.serve.grpc.server import GrpcServer

    options = dict(GrpcServer.options(types.SimpleNamespace(
        max_message_bytes=2 << 20, max_metadata_bytes=16 << 10, max_connections=64, header_timeout_s=10.0,
        idle_timeout_s=60.0)))
    assert options["grpc.http2.bdp_probe"] == 0 and options["grpc.max_receive_message_length"] == 2 << 20
