"""A hostile client against the server on 127.0.0.1 (HTTP and gRPC): every way out of the model repository refused
and never served, names that are no plain names, bad configs and deep nesting answered 4xx / INVALID_ARGUMENT in one
line that names no directory, JSON that stays RFC 8259's both ways, requests over their model's limit refused before
they are read, nothing of a refused request kept, the event loop answering while large bodies are decoded, slow
connections closed, and a model that does not load at start leaving the others served (docs/serving.md, "Security")."""

import asyncio
import gc
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from urllib.parse import quote

import grpc
import httpx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opweave.errors import UsageError
from opweave.serve import frontend, protocol
from opweave.serve.assemble import load_models, make_engine, serving_options
from opweave.serve.http.guard import default_hosts
from opweave.serve.models import ServedModel, TensorSpec, parse_model_files
from opweave.serve.protocol import HEADER, ProtocolError, encode_tensor
from opweave.serve.repository import Repository
from opweave.testing.serving import BackgroundServer
from serve_models import Fan, Silent, tiny

triton_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

BIDI = "evil\u202etxt"  # a right-to-left override inside a name
NON_UTF8 = b"caf\xe9"  # latin-1, not UTF-8


def strict_json(text: bytes | str):
    """RFC 8259 JSON only: a bare NaN or Infinity fails, as it does in JavaScript, Go or serde."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``parent/repo`` the repository: tiny/1 (served), badcfg/1 (a config.pbtxt that is not UTF-8), linked (a link
    to ``parent/outside/evil``), a model under a name with a bidi override and one under a name that is not UTF-8.
    Outside it: ``parent/1/model.pt2`` (what ``..`` would load) and ``parent/outside/evil/1/model.pt2``."""
    parent = tmp_path_factory.mktemp("hostile")
    program = parent / "tiny.pt2"
    model, x = tiny()
    torch.export.save(torch.export.export(model, x), str(program))
    root = parent / "repo"
    for folder in (root / "tiny" / "1", root / "badcfg" / "1", root / BIDI / "1", parent / "1",
                   parent / "outside" / "evil" / "1"):
        folder.mkdir(parents=True)
        shutil.copy(program, folder / "model.pt2")
    (root / "badcfg" / "config.pbtxt").write_bytes(b"max_batch_size: 2\n# caf\xe9\n")
    (root / "linked").symlink_to(parent / "outside" / "evil", target_is_directory=True)
    odd = os.path.join(os.fsencode(root), NON_UTF8, b"1")
    os.makedirs(odd)
    shutil.copy(program, os.path.join(odd, b"model.pt2"))
    return parent, root, model


@pytest.fixture(scope="module")
def server(site):
    """The repository under the repository API (``control="explicit"``), every model loaded at start, request limits
    raised to 16 MiB; HTTP and gRPC."""
    parent, root, _ = site
    served: dict = {}
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, served, root, max_batch=4, control="explicit")
    repository.load_all()
    background = BackgroundServer(engine, served, grpc=True, repository=repository, max_body_bytes=16 << 20)
    with background as url:
        background.url = url
        yield background


@pytest.fixture(scope="module")
def limited(site):
    """tiny alone under the defaults (read-only repository API, request limits from the model's inputs) with
    three-second header and idle timeouts (short enough for the slow-client test, long enough that no client of the
    other tests trips them on a loaded machine); HTTP and gRPC."""
    parent, root, _ = site
    served: dict = {}
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, served, root, max_batch=4)
    repository.load_all()
    background = BackgroundServer(engine, served, grpc=True, repository=repository, header_timeout_s=3.0,
                                  idle_timeout_s=3.0)
    with background as url:
        background.url = url
        yield background


def raw(server, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict]:
    """One request with ``path`` sent as written (no client normalizes it); the status and the strict-JSON body."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        text = response.read()
        return response.status, strict_json(text) if text else {}
    finally:
        conn.close()


def grpc_stub(server):
    channel = grpc.insecure_channel(server.grpc_address, options=[("grpc.max_send_message_length", 1 << 30)])
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def tiny_request(x: torch.Tensor, raw_bytes: bytes | None = None, model: str = "tiny"):
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(encode_tensor(x) if raw_bytes is None else raw_bytes)
    return request


def clean(message: str, parent, echo: str = "") -> None:
    """A refusal's message: one line, short, naming no directory of the server (but the name it was sent, ``echo``,
    which it may quote)."""
    rest = message.replace(protocol.shown(echo), "") if echo else message
    assert "\n" not in message and len(message) < 400 and str(parent) not in rest, message


def assert_serves(server, model) -> None:
    x = torch.randn(1, 3, 8, 8)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/v2/health/ready").status_code == 200
        r = c.post("/v2/models/tiny/infer", json={"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                                              "data": x.reshape(-1).tolist()}]})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        assert torch.allclose(torch.tensor(r.json()["outputs"][0]["data"]).reshape(1, 10), model(x), atol=1e-5)


# ---- the repository's root ---------------------------------------------------------------------------------------
def test_loads_that_leave_the_repository_are_refused_over_http_and_grpc_and_never_served(server, site):
    parent, root, model = site
    names = ["..", "../outside/evil", str(parent / "outside" / "evil"), "tiny/../../outside/evil", "linked"]
    for name in names:
        status, body = raw(server, "POST", f"/v2/repository/models/{quote(name, safe='')}/load")
        assert status in (400, 404), (name, status, body)  # a '/' in the name: no route matches it
        clean(body["error"], parent, name)
    status, body = raw(server, "POST", "/v2/repository/models/%2e%2e/load")
    assert status == 400 and "not a plain name" in body["error"], body
    status, body = raw(server, "POST", "/v2/repository/models/linked/load")
    assert status == 400 and "outside the model repository" in body["error"] and "--allow-symlinks-outside-root" in \
        body["error"], body
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    channel, stub = grpc_stub(server)
    try:
        for name in names:
            with pytest.raises(InferenceServerException) as info:
                client.load_model(name)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (name, info.value.message())
            clean(info.value.message(), parent, name)
        served = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        for name in names:  # none of them answers an inference
            assert not client.is_model_ready(name)
            with pytest.raises(grpc.RpcError) as rpc:
                stub.ModelInfer(tiny_request(torch.randn(1, 3, 8, 8), model=name), timeout=60)
            assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
            status, _ = raw(server, "POST", f"/v2/models/{quote(name, safe='')}/infer", b"{}")
            assert status == 404
    finally:
        client.close()
        channel.close()
    assert set(served) == {"tiny", "badcfg", "linked"}
    assert served["linked"]["state"] == "UNAVAILABLE" and "outside the model repository" in served["linked"]["reason"]
    assert_serves(server, model)


def test_a_link_leaving_the_root_loads_only_with_the_operators_flag(site):
    parent, root, _ = site
    engine = make_engine({}, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    allowed = Repository(engine, {}, root, max_batch=4, control="explicit", allow_symlinks_outside_root=True)
    assert allowed.load("linked").source == "linked/1/model.pt2" and "linked" in engine.models


def test_a_bad_config_at_run_time_is_a_clean_refusal_and_the_server_stays_ready(server, site):
    parent, root, model = site
    status, body = raw(server, "POST", "/v2/repository/models/badcfg/load")
    assert status == 400 and "config.pbtxt is not UTF-8" in body["error"], body
    clean(body["error"], parent)
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("badcfg")
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "not UTF-8" in info.value.message()
        state = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}["badcfg"]
        assert state["state"] == "UNAVAILABLE" and "not UTF-8" in state["reason"]
        assert client.is_server_ready()
    finally:
        client.close()
    assert_serves(server, model)


@pytest.mark.parametrize("name", ["a" * 300, "tiny\x07", "tiny\u202e", "\u202etiny", BIDI, ".tiny", "tiny name",
                                  "tiny\x00"])
def test_names_that_are_not_plain_are_refused_in_one_short_line(server, site, name):
    parent, _, _ = site
    status, body = raw(server, "POST", f"/v2/repository/models/{quote(name, safe='')}/load")
    assert status == 400 and "not a plain name" in body["error"], body
    clean(body["error"], parent)
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model(name)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "not a plain name" in info.value.message()
        clean(info.value.message(), parent)
    finally:
        client.close()


def test_the_index_lists_plain_names_only_and_survives_a_name_that_is_not_utf8(server):
    status, index = raw(server, "POST", "/v2/repository/index", b"{}")
    assert status == 200 and {m["name"] for m in index} == {"tiny", "badcfg", "linked"}
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        names = {m["name"] for m in client.get_model_repository_index(as_json=True)["models"]}
    finally:
        client.close()
    assert names == {"tiny", "badcfg", "linked"}


def test_a_client_config_cannot_raise_the_batch_past_the_servers(server, site):
    parent, _, model = site
    body = json.dumps({"parameters": {"config": json.dumps({"max_batch_size": 1000000})}}).encode()
    status, answer = raw(server, "POST", "/v2/repository/models/tiny/load", body)
    assert status == 400 and "max_batch_size 1000000 is outside 0..4" in answer["error"], answer
    assert server.repository.served["tiny"].max_batch == 4
    assert_serves(server, model)


# ---- a web page ---------------------------------------------------------------------------------------------------
def test_a_web_page_cannot_drive_the_server(server, site):
    """What a page open in a browser can send without asking (a cross-origin "simple" request: text/plain or a form,
    any Origin), a DNS name rebound to 127.0.0.1 (any Host) and a redirect built from the Host header: all refused,
    and the model stays loaded."""
    parent, _, model = site
    port = server.url.rsplit(":", 1)[1]
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    for path in ("/v2/repository/models/tiny/unload", "/v2/repository/models/tiny/load", "/v2/repository/index",
                 "/v2/models/tiny/infer"):
        status, answer = raw(server, "POST", path, b"{}", evil)
        assert status == 403 and "origin 'http://evil.example' is refused" in answer["error"], (path, answer)
    status, answer = raw(server, "POST", "/v2/models/tiny/infer", b"{}",
                         {"Origin": "null", "Content-Type": "application/json"})
    assert status == 403, answer
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, answer = raw(server, "POST", "/v2/repository/models/tiny/unload", b"{}", {"Content-Type": kind})
        assert status == 415 and "is not accepted: send application/json" in answer["error"], (kind, answer)
    assert server.repository.served.get("tiny") is not None and server.engine.models.get("tiny") is not None
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        for method, path in (("GET", "/v2/health/live"), ("POST", "/v2/repository/models/tiny/unload")):
            status, answer = raw(server, method, path, headers={"Host": host})
            assert status == 400 and "Host header names no host" in answer["error"], (host, answer)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert raw(server, "GET", "/v2/health/live", headers={"Host": host})[0] == 200, host
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:  # a trailing slash: no redirect to http://<Host>/...
        conn.request("GET", "/v2/health/live/", headers={"Host": "localhost"})
        response = conn.getresponse()
        assert response.status == 404 and response.getheader("location") is None and strict_json(response.read())
        conn.request("GET", "/v2/models/tiny", headers={"Origin": "http://evil.example"})  # a read: no CORS answer
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("access-control-allow-origin") is None
        response.read()
        conn.request("OPTIONS", "/v2/models/tiny/infer", headers={"Origin": "http://evil.example",
                                                                   "Access-Control-Request-Method": "POST"})
        response = conn.getresponse()
        assert response.status == 403 and "error" in strict_json(response.read())
    finally:
        conn.close()
    assert_serves(server, model)


def test_the_default_hosts_are_the_names_of_the_address_bound():
    assert default_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "[::1]")
    assert default_hosts("localhost") == ("localhost", "127.0.0.1", "[::1]")
    assert default_hosts("::1") == ("localhost", "127.0.0.1", "[::1]")
    assert default_hosts("127.0.0.2") == ("localhost", "127.0.0.1", "[::1]", "127.0.0.2")
    assert default_hosts("10.1.2.3") == ("10.1.2.3",)
    assert default_hosts("fd00::1") == ("[fd00::1]",)
    assert default_hosts("Box.example") == ("box.example",)
    assert default_hosts("0.0.0.0") == default_hosts("::") == ("*",)


def test_a_loads_config_holds_for_that_load_only_and_an_equal_one_changes_nothing(server, site):
    """A client's ``parameters.config`` outlived its load (a plain load kept max batch 2), and every load carrying a
    config reloaded the model (a moment of 404/503 for its users) even when nothing changed."""
    _, _, model = site
    first = server.repository.served["tiny"]
    assert load(server, "tiny") == (200, {}) and server.repository.served["tiny"] is first  # nothing changed
    two = json.dumps({"max_batch_size": 2})
    try:
        assert load(server, "tiny", two) == (200, {})
        loaded = server.repository.served["tiny"]
        assert loaded is not first and loaded.max_batch == 2 and raw(server, "GET", "/v2/models/tiny")[1][
            "max_batch_size"] == 2
        assert load(server, "tiny", two) == (200, {}) and server.repository.served["tiny"] is loaded  # the same
    finally:
        assert load(server, "tiny") == (200, {})  # the repository's config again
    assert server.repository.served["tiny"].max_batch == 4 and server.engine.models["tiny"].max_batch == 4
    assert raw(server, "GET", "/v2/models/tiny")[1]["max_batch_size"] == 4
    assert_serves(server, model)


# ---- every error a clean 4xx -------------------------------------------------------------------------------------
def test_deep_nesting_and_huge_numbers_are_400_not_500(server, site):
    parent, _, model = site
    deep = b"[" * 100_000
    for path, body in (("/v2/models/tiny/infer", deep), ("/v2/repository/models/tiny/load",
                                                         b'{"parameters": {"config": ' + deep),
                       ("/v2/repository/index", deep),
                       ("/v2/models/tiny/infer", b'{"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": '
                                                 b'"FP32", "data": [1' + b"0" * 5000 + b"]}]}")):
        status, answer = raw(server, "POST", path, body)
        assert status == 400 and answer["error"].startswith("malformed JSON"), (path, status, answer)
        clean(answer["error"], parent)
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("tiny", config="[" * 100_000)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()
    assert_serves(server, model)


def test_headers_over_64_kib_are_refused_however_they_arrive(limited):
    """A request's line and headers must fit 64 KiB: 100 KiB arriving at once was answered 200."""
    host = limited.url.removeprefix("http://")
    address = (host.split(":")[0], int(host.split(":")[1]))

    def ask(extra: int) -> bytes:
        request = f"GET /v2/health/live HTTP/1.1\r\nHost: {host}\r\nX-A: {'a' * extra}\r\nConnection: close\r\n\r\n"
        with socket.create_connection(address, timeout=60) as s:
            s.sendall(request.encode())
            answer = b""
            try:
                while part := s.recv(65536):
                    answer += part
            except ConnectionResetError:
                pass
        return answer

    assert ask(60 << 10).startswith(b"HTTP/1.1 200 ")
    answer = ask(100 << 10)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:100]  # closed unanswered, or told
    if answer:
        assert "over the limit of 65536" in strict_json(answer.partition(b"\r\n\r\n")[2])["error"]


def test_errors_of_the_http_layer_are_json_too(server):
    """What the HTTP parser cannot read was answered in plain text."""
    host, port = server.url.removeprefix("http://").split(":")
    for request in (b"GARBAGE\r\n\r\n",
                    b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(request)
            answer = b""
            while part := s.recv(65536):
                answer += part
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, answer
        assert strict_json(body)["error"]
    for method, path in (("PUT", "/v2/health/live"), ("GET", "/v2/nowhere"), ("DELETE", "/v2/models/tiny")):
        status, answer = raw(server, method, path)
        assert status in (404, 405) and answer["error"], (method, path, answer)


def test_a_model_cannot_take_a_name_a_route_takes(server, site, tmp_path):
    """``/v2/models/stats`` is the statistics of every model: a model named ``stats`` loaded, and its metadata was
    unreachable."""
    parent, root, _ = site
    status, answer = raw(server, "POST", "/v2/repository/models/stats/load")
    assert status == 400 and answer["error"] == ("model name 'stats' is taken by the route /v2/models/stats: serve the "
                                                 "model under another name"), answer
    (tmp_path / "stats" / "1").mkdir(parents=True)
    shutil.copy(root / "tiny" / "1" / "model.pt2", tmp_path / "stats" / "1" / "model.pt2")
    engine = make_engine({}, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, {}, tmp_path, max_batch=4, control="explicit")
    assert repository.load_all() == [] and "stats" not in engine.models
    index = {m["name"]: m for m in repository.index()}
    assert index["stats"]["state"] == "UNAVAILABLE" and "taken by the route" in index["stats"]["reason"]
    with pytest.raises(UsageError, match="--model-file 'stats' is taken by the route"):
        parse_model_files([f"stats={parent / 'tiny.pt2'}"])


def test_a_program_that_does_not_load_says_why_in_one_line_and_one_log_line(tmp_path, caplog):
    """A .pt2 that is a zip but no exported program was refused with "check the warnings above" (which only the
    server's log held), and torch logged a traceback per attempt."""
    import logging
    import zipfile

    for name in ("zipped", "garbage"):
        (tmp_path / name / "1").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "zipped" / "1" / "model.pt2", "w") as z:
        z.writestr("archive/data.txt", "not a program")
    (tmp_path / "garbage" / "1" / "model.pt2").write_bytes(b"garbage")
    engine = make_engine({}, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, {}, tmp_path, max_batch=4, control="explicit")
    for name, why in (("zipped", 'Expected hasRecord("version") to be true'), ("garbage", "not a ZIP archive")):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="torch.export"), caplog.at_level(logging.WARNING):
            with pytest.raises(frontend.Refused) as info:
                repository.load(name)
        message = str(info.value)
        assert message.startswith(f"model {name!r} did not load: '{name}/1/model.pt2' is not a program saved by "
                                  f"torch.export.save") and why in message and "warnings above" not in message
        clean(message, tmp_path)
        logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(logged) == 1 and logged[0].getMessage() == f"model repository: {message}", \
            [r.getMessage() for r in logged]
        assert not any(r.exc_info for r in caplog.records)


def test_not_found_names_no_other_model_and_metadata_names_no_directory(server, site):
    parent, _, _ = site
    status, body = raw(server, "GET", "/v2/models/nope")
    assert status == 404 and body == {"error": "unknown model 'nope'"}
    status, body = raw(server, "GET", "/v2/no/such/route")
    assert status == 404 and "error" in body
    channel, stub = grpc_stub(server)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(tiny_request(torch.randn(1, 3, 8, 8), model="nope"), timeout=60)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "unknown model 'nope'"
    finally:
        channel.close()
    status, meta = raw(server, "GET", "/v2/models/tiny")
    assert status == 200 and meta["source"] == "tiny/1/model.pt2"


def test_a_grpc_message_that_does_not_parse_is_invalid_argument(server):
    channel = grpc.insecure_channel(server.grpc_address)
    try:
        for method, payload in (("ModelInfer", b"\x0a\x02\xff\xfe"), ("RepositoryModelLoad", b"\xff\xff\xff")):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")  # bytes as they are
            with pytest.raises(grpc.RpcError) as info:
                call(payload, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details().startswith("the request is no inference.")
    finally:
        channel.close()


# ---- JSON, RFC 8259 both ways ------------------------------------------------------------------------------------
NON_FINITE = json.dumps({"parameters": {"allow_non_finite_inputs": {"string_value": "true"}}})
NON_FINITE_PBTXT = 'max_batch_size: 4\nparameters { key: "allow_non_finite_inputs" value { string_value: "true" } }\n'


def load(server, name: str, config: str | None = None) -> tuple[int, dict]:
    body = json.dumps({"parameters": {"config": config}} if config is not None else {}).encode()
    return raw(server, "POST", f"/v2/repository/models/{name}/load", body, {"Content-Type": "application/json"})


def binary_nan(server, binary: bool) -> tuple[int, bytes, http.client.HTTPResponse, torch.Tensor]:
    """A request whose input holds a NaN, in binary data, its output asked for in binary or JSON."""
    x = torch.randn(1, 3, 8, 8)
    x[0, 0, 0, 0] = float("nan")
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 768}}],
                         "outputs": [{"name": "output__0", "parameters": {"binary_data": binary}}]}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v2/models/tiny/infer", body=header + encode_tensor(x),
                     headers={HEADER: str(len(header))})
        response = conn.getresponse()
        return response.status, response.read(), response, x
    finally:
        conn.close()


def test_json_stays_rfc8259_and_non_finite_values_travel_as_binary_data(server, site):
    parent, _, model = site
    x = torch.randn(1, 3, 8, 8)
    values = x.reshape(-1).tolist()
    head = '{"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [%s]}]}'
    for written, needle in (("NaN", "NaN is not a JSON number"), ("-Infinity", "-Infinity is not a JSON number"),
                            ("1e39", "beyond the range of FP32")):
        body = (head % ", ".join([written] + [repr(v) for v in values[1:]])).encode()
        status, answer = raw(server, "POST", "/v2/models/tiny/infer", body)
        assert status == 400 and needle in answer["error"], (written, answer)
        assert "malformed JSON: malformed JSON" not in answer["error"], answer
    # a NaN in binary data: refused, naming the input, unless the model's config lets non-finite inputs in
    status, content, _, _ = binary_nan(server, True)
    assert status == 400 and strict_json(content)["error"].startswith("input 'x' holds NaN or infinite values")
    _, root, _ = site
    (root / "tiny" / "config.pbtxt").write_text(NON_FINITE_PBTXT)  # the operator's config: a client's cannot
    try:
        assert load(server, "tiny") == (200, {})
        # a NaN in, asked out in JSON: refused (in strict JSON) naming the output; asked in binary: answered exactly
        for binary in (False, True):
            status, content, response, x = binary_nan(server, binary)
            if not binary:
                assert status == 400
                assert "output 'output__0' holds NaN or infinite values" in strict_json(content)["error"]
            else:
                size = int(response.getheader(HEADER))
                strict_json(content[:size])
                got = torch.frombuffer(bytearray(content[size:]), dtype=torch.float32)
                with torch.no_grad():
                    want = model(x).reshape(-1)
                assert status == 200 and torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    finally:
        (root / "tiny" / "config.pbtxt").unlink()
        assert load(server, "tiny") == (200, {})  # the repository's config again: finite inputs only
    status, content, _, _ = binary_nan(server, True)
    assert status == 400 and "input 'x' holds NaN" in strict_json(content)["error"]


@pytest.mark.parametrize("written", ["1e400", "-1e400", "1e309", "1.8e308", "1e39", "-3.5e38"])
def test_numbers_beyond_float64_or_fp32_are_refused_naming_the_input(server, written):
    """1e400 is no float64: Python's parser makes it infinity, which became a tensor of infinities (answered 200
    with NaN outputs)."""
    data = ", ".join([written] + ["0.5"] * 191)
    body = b'{"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [' + data.encode() + b"]}]}"
    status, answer = raw(server, "POST", "/v2/models/tiny/infer", body)
    assert status == 400 and answer["error"].startswith("input 'x': a value lies beyond the range of FP32"), answer
    request = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP64", "data": [json.loads(written), 0.0, 1.0]}]}
    if abs(float(written)) == float("inf"):  # beyond float64 too
        with pytest.raises(ProtocolError, match="input 'x': a value lies beyond the range of FP64"):
            protocol.decode_request(spec_model("FP64"), request)
    else:
        assert protocol.decode_request(spec_model("FP64"), request).inputs[0][0, 0].item() == float(written)


def binary_infer(server, x: torch.Tensor) -> tuple[int, dict]:
    """``x`` sent to the tiny model as binary tensor data (KServe's binary extension): the status and the answer."""
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.numel() * 4}}]}).encode()
    return raw(server, "POST", "/v2/models/tiny/infer", header + encode_tensor(x), {HEADER: str(len(header))})


def test_infinities_in_binary_data_and_typed_grpc_contents_are_refused_naming_the_input(server):
    x = torch.randn(1, 3, 8, 8)
    x[0, 1, 2, 3] = float("inf")
    status, answer = binary_infer(server, x)
    assert status == 400 and answer["error"].startswith("input 'x' holds NaN or infinite values"), answer
    channel, stub = grpc_stub(server)
    try:
        for given in (x, torch.where(x.isinf(), float("nan"), x)):
            request = service_pb2.ModelInferRequest(model_name="tiny")
            request.inputs.add(name="x", datatype="FP32", shape=[1, 3, 8, 8])
            request.inputs[0].contents.fp32_contents.extend(given.reshape(-1).tolist())
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("input 'x' holds NaN or infinite values"), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(tiny_request(x), timeout=60)
        assert info.value.details().startswith("input 'x' holds NaN or infinite values"), info.value.details()
    finally:
        channel.close()


def test_json_is_utf8_with_each_key_once_booleans_are_booleans_and_an_id_a_string(server):
    x = torch.randn(1, 3, 8, 8)
    good = {"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
    text = json.dumps(good)
    cases = [  # (body, what the refusal says)
        (text.encode("utf-16"), "malformed JSON: the body is not UTF-8 text"),
        (text.encode("utf-32"), "malformed JSON: the body is not UTF-8 text"),
        (text.replace('"inputs": [', '"inputs": [{"name": "y"}], "inputs": [', 1).encode(),
         "malformed JSON: key 'inputs' appears twice in an object"),
        (text.replace('"name": "x"', '"name": "x", "name": "y"').encode(),
         "malformed JSON: key 'name' appears twice"),
        (json.dumps({**good, "parameters": {"binary_data_output": "false"}}).encode(),
         "parameters.binary_data_output must be true or false, got 'false'"),
        (json.dumps({**good, "outputs": [{"name": "output__0", "parameters": {"binary_data": 1}}]}).encode(),
         "output 'output__0' parameters.binary_data must be true or false, got 1"),
        (json.dumps({**good, "id": {"a": 1}}).encode(), "'id' must be a string, got {'a': 1}"),
        (json.dumps({**good, "id": 7}).encode(), "'id' must be a string, got 7"),
    ]
    for body, needle in cases:
        status, answer = raw(server, "POST", "/v2/models/tiny/infer", body)
        assert status == 400 and answer["error"].startswith(needle), (needle, answer)
    status, answer = raw(server, "POST", "/v2/models/tiny/infer", json.dumps({**good, "id": "r1"}).encode())
    assert status == 200 and answer["id"] == "r1"
    status, answer = raw(server, "POST", "/v2/repository/index", b'{"ready": true, "ready": false}')
    assert status == 400 and "appears twice" in answer["error"]
    status, answer = raw(server, "POST", "/v2/repository/index", b'{"ready": "false"}')
    assert status == 400 and "'ready' must be true or false" in answer["error"], answer


def spec_model(datatype: str) -> ServedModel:
    spec = TensorSpec("x", datatype, (-1, 3))
    return ServedModel("m", None, (spec,), (TensorSpec("output__0", "FP32", (-1, 1)),), 4, "m")


@given(st.sampled_from(["INT8", "INT16", "INT32", "INT64", "UINT8"]), st.lists(st.integers(-2 ** 70, 2 ** 70),
                                                                               min_size=3, max_size=3))
def test_integers_decode_exactly_or_are_refused_never_wrapped(datatype, values):
    info = torch.iinfo(protocol.DTYPES[datatype])
    request = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": datatype, "data": values}]}
    if all(info.min <= v <= info.max for v in values):
        assert protocol.decode_request(spec_model(datatype), request).inputs[0].reshape(-1).tolist() == values
    else:
        with pytest.raises(ProtocolError, match=f"outside {info.min}..{info.max}, the range of {datatype}"):
            protocol.decode_request(spec_model(datatype), request)


@given(st.sampled_from(["FP16", "BF16", "FP32"]), st.floats(allow_nan=False, allow_infinity=False))
def test_floats_decode_or_are_refused_never_silently_infinite(datatype, value):
    request = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": datatype, "data": [value, 0.0, 1.0]}]}
    dtype = protocol.DTYPES[datatype]
    if torch.isinf(torch.tensor(value, dtype=torch.float64).to(dtype)):
        with pytest.raises(ProtocolError, match=f"beyond the range of {datatype}"):
            protocol.decode_request(spec_model(datatype), request)
    else:
        t = protocol.decode_request(spec_model(datatype), request).inputs[0]
        assert torch.isfinite(t).all()


# ---- sizes, memory, the event loop -------------------------------------------------------------------------------
def test_a_body_over_the_models_limit_is_refused_before_it_is_read(limited, server):
    host, port = limited.url.removeprefix("http://").split(":")
    limit = protocol.request_limit(limited.repository.served["tiny"])
    assert limit < 1 << 20
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:  # the headers only, announcing 60 MB: the 400 comes before a byte of the body is sent
        conn.putrequest("POST", "/v2/models/tiny/infer")
        conn.putheader("Content-Length", str(60 << 20))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 400
        assert f"exceeds the limit of {limit} bytes" in strict_json(response.read())["error"]
    finally:
        conn.close()

    def chunks():  # no Content-Length: refused as it streams in
        for _ in range(64):
            yield b" " * (64 << 10)
    with httpx.Client(base_url=limited.url, timeout=60) as c:
        r = c.post("/v2/models/tiny/infer", content=chunks())
    assert r.status_code == 400 and f"exceeds the limit of {limit} bytes" in r.json()["error"]
    # gRPC: over the largest model's limit (here raised to 16 MiB), gRPC refuses the message before reading it
    for background, mb, code, needle in ((limited, 1, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
                                         (server, 17, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")):
        channel, stub = grpc_stub(background)
        try:
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(tiny_request(torch.randn(1, 3, 8, 8), raw_bytes=b"\0" * (mb << 20)), timeout=60)
        finally:
            channel.close()
        assert info.value.code() == code and needle in info.value.details(), info.value.details()


def test_refused_requests_leave_nothing_in_reference_cycles(server):
    """Refused 8 MB requests (under the raised limit: decoded on a worker thread, then refused) with the cycle
    collector off: once answered, nothing of them is left for it to find."""
    channel, stub = grpc_stub(server)
    x = torch.randn(1, 3, 8, 8)
    big_grpc = tiny_request(x, raw_bytes=b"\1" * (8 << 20))
    big_http = b'{"inputs": [' + b" " * (8 << 20)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(big_grpc, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            status, _ = raw(server, "POST", "/v2/models/tiny/infer", big_http)
            assert status == 400
        assert stub.ModelInfer(tiny_request(x), timeout=60).outputs  # one answered after them
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kept = [type(o).__name__ for o in gc.garbage
                if sys.getsizeof(o) > 1 << 20 or isinstance(o, service_pb2.ModelInferRequest)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        channel.close()
    assert kept == []


def pushed(server, head: bytes, cap: int = 64 << 20) -> tuple[int, bytes]:
    """``head`` (a request's line and headers), then a body sent 1 MiB at a time until the server closes the
    connection or ``cap`` bytes are sent: the bytes the connection took (its send buffer held to 64 KiB, so that
    what the kernels buffer stays small beside what the server read), and the server's answer."""
    host, port = server.url.removeprefix("http://").split(":")
    chunk = b"\0" * (1 << 20)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.settimeout(60)  # never reached while the server reads or answers; a timeout fails the test
        s.connect((host, int(port)))
        s.sendall(head)
        sent = 0
        try:
            while sent < cap:
                sent += s.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if sent >= cap:
            return sent, b""
        answer = b""
        try:
            while part := s.recv(65536):
                answer += part
        except ConnectionResetError:
            pass
    return sent, answer


@pytest.mark.parametrize("line, status", [
    ("POST /v2/models/tiny/infer", 400),  # a declared length over the model's limit
    ("POST /v2/models/nope/infer", 404),  # an unknown model
    ("POST /v2/no/such/route", 404),
    ("PUT /v2/models/tiny/infer", 405),
])
def test_a_request_refused_before_its_body_is_read_closes_the_connection(limited, line, status):
    """A client declares 100 GiB and keeps sending: the server answers, says Connection: close and reads no more
    than a little (it had read and discarded whatever followed its answer, GiBs at a core per connection, while
    bytes kept coming); the client reads the answer (the server closes in stages: the answer, the end of its
    stream, then, two seconds later, the connection)."""
    host = limited.url.removeprefix("http://")
    sent, answer = pushed(limited, f"{line} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                                   f"Content-Length: {100 << 30}\r\n\r\n".encode())
    assert sent < 2 << 20, f"the server read on: {sent >> 20} MiB taken"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"connection: close" in head.lower() and "error" in strict_json(body)


def test_a_body_refused_while_it_streams_in_closes_the_connection(limited):
    host = limited.url.removeprefix("http://")
    sent, answer = pushed(limited, f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: {host}\r\n"
                                   f"Transfer-Encoding: chunked\r\n\r\n{(100 << 30):x}\r\n".encode())
    assert sent < 2 << 20, f"the server read on: {sent >> 20} MiB taken"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower()
    assert "exceeds the limit of" in strict_json(body)["error"]


def test_a_request_read_whole_keeps_its_connection(limited):
    """Refusals after the body was read (a malformed request) keep the connection alive: the next request on it
    is answered."""
    host, port = limited.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v2/models/tiny/infer", body=b'{"inputs": 3}')
        first = conn.getresponse()
        assert first.status == 400 and first.getheader("connection") is None and strict_json(first.read())
        conn.request("GET", "/v2/health/live")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_the_heap_trimmer_gives_freed_memory_back():
    """100 MB freed below a block still in use (so glibc cannot give it back by itself): the trimmer does, also in
    a process whose heap already held 200 MB of freed memory when it started (the allocation reuses it; without the
    trim at the start, the slack then never rose above the trimmer's first look)."""
    earlier = [b"\3" * 100_000 for _ in range(2000)]
    held = b"\4" * 100_000
    del earlier
    trimmer = frontend.HeapTrimmer(period_s=0.05, threshold_bytes=16 << 20)
    if trimmer.slack() is None or trimmer._trim is None:
        pytest.skip("needs glibc and /proc")
    trimmer.start()
    try:
        blocks = [b"\1" * 100_000 for _ in range(1000)]
        keep = b"\2" * 100_000
        del blocks
        for _ in range(600):  # bounded: it looks every 50 ms
            if trimmer.trims:
                break
            threading.Event().wait(0.05)
    finally:
        trimmer.stop()
    assert trimmer.trims >= 1 and keep and held


def live_while_held(monkeypatch, url: str, step: str, posts: list[dict]) -> tuple:
    """``posts`` (keywords of ``httpx.AsyncClient.post`` to ``/v2/models/...``) sent at once while
    ``protocol.<step>`` is held as soon as one reaches it, and ``/v2/health/live`` asked meanwhile: the liveness
    answer (a step held on the event loop leaves it unanswered: the probe times out) and every post's answer, once
    released."""
    reached = threading.Semaphore(0)
    release = threading.Event()
    original = getattr(protocol, step)

    def held(*args, **kwargs):
        reached.release()
        release.wait(120)
        return original(*args, **kwargs)

    monkeypatch.setattr(protocol, step, held)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            tasks = [asyncio.create_task(c.post(**post)) for post in posts]
            try:
                assert await asyncio.to_thread(reached.acquire, True, 60), f"no request reached protocol.{step}"
                async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
                    live = await probe.get("/v2/health/live")
            finally:
                release.set()
            return live, await asyncio.gather(*tasks)

    return asyncio.run(scenario())


def test_the_event_loop_answers_liveness_while_eight_large_bodies_are_decoded(server, monkeypatch):
    """Eight 1 MB bodies whose decoding is held until liveness has answered: held on worker threads it lets the
    event loop answer; held on the event loop it would not answer at all."""
    body = b'{"inputs": [' + b" " * (1 << 20)
    live, answers = live_while_held(monkeypatch, server.url, "decode",
                                    [{"url": "/v2/models/tiny/infer", "content": body}] * 8)
    assert live.status_code == 200
    assert [r.status_code for r in answers] == [400] * 8 and all("malformed JSON" in r.json()["error"]
                                                                    for r in answers)


def closed_by_server(address, send: bytes = b"") -> bytes:
    """What the server sends before it closes the connection (a slow client's fate); fails if it is still open
    after 30 s."""
    received = b""
    with socket.create_connection(address, timeout=30) as s:
        try:
            s.sendall(send)
            while chunk := s.recv(65536):
                received += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    return received


def test_slow_and_idle_connections_are_closed(limited):
    host, port = limited.url.removeprefix("http://").split(":")
    address = (host, int(port))
    assert closed_by_server(address) == b""  # connected, said nothing
    host_line = f"Host: {host}\r\n".encode()
    assert closed_by_server(address, b"POST /v2/models/tiny/infer HTTP/1.1\r\n" + host_line) == b""  # headers trickle
    assert closed_by_server(address, b"POST /v2/models/tiny/infer HTTP/1.1\r\n" + host_line +
                            b"Content-Length: 768\r\n\r\n0123456789") == b""  # the body stops
    assert closed_by_server(address, b"GET /v2/health/live HTTP/1.1\r\n" + host_line + b"\r\n").startswith(
        b"HTTP/1.1 200")  # kept alive, then idle
    assert not closed_by_server(address, b"GET /v2/health/live HTTP/1.1\r\n" + host_line + b"X-A: " +
                                b"a" * (1 << 20)).startswith(b"HTTP/1.1 200")  # headers past the limit, trickling
    grpc_host, grpc_port = limited.grpc_address.rsplit(":", 1)
    closed_by_server((grpc_host, int(grpc_port)))  # gRPC: no handshake, no call


# ---- the command line --------------------------------------------------------------------------------------------
def test_a_model_that_does_not_load_at_start_is_unavailable_and_the_others_serve(site):
    """`opweave serve --model-repository` over the repository: tiny serves, badcfg and linked are UNAVAILABLE with
    their reasons, the other two names are left out, and the repository API is read-only (the default)."""
    parent, root, model = site
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root), "--port", "0",
                             "--grpc-port", "0", "--compiler", "none", "--max-batch", "4", "--allowed-hosts",
                             "127.0.0.1,opweave.example", "--cors-allow-origin", "http://app.example"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read()  # (read only once it has exited)
        assert "UNAVAILABLE: badcfg, linked" in line, line
        url = line.strip().rsplit(" ", 1)[1]
        address = line.split("gRPC on ", 1)[1].split(";", 1)[0]
        with httpx.Client(base_url=url, timeout=60) as c:
            index = {m["name"]: m for m in c.post("/v2/repository/index").json()}
            r = c.post("/v2/repository/models/tiny/unload")
            assert r.status_code == 400 and "--model-control-mode explicit" in r.json()["error"]
            # --allowed-hosts: the names listed, no other; --cors-allow-origin: that page's requests, with CORS
            assert c.get("/v2/health/live", headers={"Host": "opweave.example"}).status_code == 200
            assert c.get("/v2/health/live", headers={"Host": "localhost"}).status_code == 400
            page = {"Origin": "http://app.example"}
            r = c.options("/v2/models/tiny/infer", headers={**page, "Access-Control-Request-Method": "POST",
                                                            "Access-Control-Request-Headers": "content-type"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
            x = torch.randn(1, 3, 8, 8)
            request = {"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}
            r = c.post("/v2/models/tiny/infer", json=request, headers=page)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
            r = c.post("/v2/models/tiny/infer", json=request, headers={"Origin": "http://evil.example"})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert {n: m["state"] for n, m in index.items()} == {"tiny": "READY", "badcfg": "UNAVAILABLE",
                                                             "linked": "UNAVAILABLE"}
        assert "not UTF-8" in index["badcfg"]["reason"] and "outside" in index["linked"]["reason"]
        for m in index.values():
            clean(m["reason"], parent)
        client = triton_grpc.InferenceServerClient(address)
        with pytest.raises(InferenceServerException) as info:
            client.load_model("tiny", config=json.dumps({"max_batch_size": 2}))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "read-only" in info.value.message()
        item = triton_grpc.InferInput("x", [2, 3, 8, 8], "FP32")
        x = torch.randn(2, 3, 8, 8)
        item.set_data_from_numpy(x.numpy())
        got = torch.from_numpy(np.array(client.infer("tiny", [item]).as_numpy("output__0")))
        with torch.no_grad():
            assert torch.allclose(got, model(x), atol=1e-5)
        client.close()
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        assert "skipping entry" in proc.stderr.read()  # the two names left out, said in the server's log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_fifty_refused_60mb_grpc_requests_leave_the_servers_memory_where_it_was(site):
    """`opweave serve --max-body-mb 64`: 25 requests of 60 MB (under gRPC's cap: parsed, then refused by the model's
    limit) and 25 of 66 MB (refused by gRPC itself); the server's RSS comes back within 100 MB of where it was."""
    parent, _, _ = site
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-file", f"tiny={parent / 'tiny.pt2'}",
                             "--port", "0", "--grpc-port", "0", "--compiler", "none", "--max-batch", "4",
                             "--max-body-mb", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "gRPC on" in line, proc.stderr.read()
        channel = grpc.insecure_channel(line.split("gRPC on ", 1)[1].split(";", 1)[0],
                                        options=[("grpc.max_send_message_length", 1 << 30)])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        x = torch.randn(1, 3, 8, 8)
        assert stub.ModelInfer(tiny_request(x), timeout=60).outputs
        before = resident_mb(proc.pid)
        codes = []
        requests = [tiny_request(x, raw_bytes=b"\0" * (size << 20)) for size in (60, 66)]
        for i in range(50):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(requests[i % 2], timeout=120)
            codes.append(info.value.code())
        assert stub.ModelInfer(tiny_request(x), timeout=60).outputs  # still answers
        after = [resident_mb(proc.pid)]
        for _ in range(60):  # freed C heap goes back within a second or two (HeapTrimmer): bounded wait
            if after[-1] <= before + 100:
                break
            threading.Event().wait(0.5)
            after.append(resident_mb(proc.pid))
        print(f"server RSS before {before:.0f} MB, after 50 refused requests {after[0]:.0f} MB, settled "
              f"{after[-1]:.0f} MB")
        channel.close()
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED] * 25
        assert after[-1] <= before + 100, (before, after)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ---- what a request costs: answers, memory held, framing ---------------------------------------------------------
@pytest.fixture(scope="module")
def fan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fan") / "fan.pt2"
    torch.export.save(torch.export.export(Fan(), (torch.randn(1, 1, 8, 8),)), str(path))
    return path


def bounded_server(site, fan_file, **options) -> BackgroundServer:
    """tiny and fan (an answer far larger than its request) at max batch 32, over HTTP."""
    parent, _, _ = site
    served = load_models([], {"tiny": parent / "tiny.pt2", "fan": fan_file}, max_batch=32)
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=32,
                         options=serving_options("cpu", compiler="none"))
    return BackgroundServer(engine, served, **options)


@pytest.fixture(scope="module")
def bounded(site, fan_file):
    """A budget of 256 KiB for unfinished bodies and unread answers, generous timeouts."""
    background = bounded_server(site, fan_file, max_held_bytes=256 << 10)
    with background as url:
        background.url = url
        yield background


@pytest.fixture(scope="module")
def trickled(site, fan_file):
    """Three-second windows in which a body must bring (and an answer be read at) 1 KiB/s."""
    background = bounded_server(site, fan_file, header_timeout_s=3.0, idle_timeout_s=3.0, min_body_rate=1024)
    with background as url:
        background.url = url
        yield background


def fan_request(batch: int, binary_output: bool) -> tuple[bytes, dict]:
    x = torch.randn(batch, 1, 8, 8)
    header = json.dumps({"inputs": [{"name": "x", "shape": [batch, 1, 8, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.numel() * 4}}],
                         "outputs": [{"name": "output__0", "parameters": {"binary_data": binary_output}}]}).encode()
    return header + encode_tensor(x), {HEADER: str(len(header)), "Content-Type": "application/octet-stream"}


def until(check, what: str, wait_s: float = 60.0) -> None:
    """Wait (bounded) until ``check()`` holds."""
    for _ in range(int(wait_s / 0.05)):
        if check():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"{what}: not within {wait_s:g} s")


def tiny_json(**extra) -> bytes:
    x = torch.randn(1, 3, 8, 8)
    return json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}], **extra}).encode()


def test_an_output_asked_for_twice_is_refused_over_http_and_grpc(server):
    """Each copy of a repeated output was answered: 20,000 copies in a 469 KB request made a 314 MB answer."""
    status, answer = raw(server, "POST", "/v2/models/tiny/infer",
                         tiny_json(outputs=[{"name": "output__0"}, {"name": "output__0"}]))
    assert status == 400 and answer["error"] == "output 'output__0' is asked for twice", answer
    request = tiny_request(torch.randn(1, 3, 8, 8))
    request.outputs.add(name="output__0")
    request.outputs.add(name="output__0")
    channel, stub = grpc_stub(server)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "output 'output__0' is asked for twice"
    finally:
        channel.close()


def test_an_answer_large_in_json_is_encoded_off_the_event_loop(bounded, monkeypatch):
    """fan's output takes 64 KiB as a tensor but about 330 KB written in JSON: its encoding, held until liveness has
    answered, must be on a worker thread (the decision was taken by the tensor's size: on the event loop, which
    then answered nothing)."""
    body, headers = fan_request(1, binary_output=False)
    live, (answer,) = live_while_held(monkeypatch, bounded.url, "encode",
                                      [{"url": "/v2/models/fan/infer", "content": body, "headers": headers}])
    assert live.status_code == 200
    assert answer.status_code == 200 and len(answer.content) > 256 << 10
    assert answer.json()["outputs"][0]["shape"] == [1, 256, 8, 8]


def declare(background, length: int) -> socket.socket:
    """A connection that sends an infer request's headers declaring ``length`` bytes, and no body yet."""
    host, port = background.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode())
    return s


def answer_of(s: socket.socket) -> tuple[bytes, bytes]:
    """The head and body of the answer on ``s`` (read until the server closes it, or as long as it says)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = s.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), None)
    while length is not None and len(body) < length and (part := s.recv(65536)):
        body += part
    return head, body


def test_bodies_past_the_servers_budget_get_503_with_retry_after(bounded):
    """Twelve connections could each hold a body of 58 MB unfinished for as long as they liked: now a body is held
    in a server-wide budget (here 256 KiB), and one that would pass it is refused at once, before it is read."""
    body = tiny_json()
    size = 100_000
    first, second = declare(bounded, size), declare(bounded, size)
    try:
        until(lambda: bounded.budget.held >= 2 * size, "two declared bodies held")
        third = declare(bounded, size)
        with third:
            head, answer = answer_of(third)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), head
        assert b"connection: close" in head.lower()
        assert "--max-held-mb" in strict_json(answer)["error"]
        for s in (first, second):  # the two held finish their bodies and are answered
            s.sendall(body + b" " * (size - len(body)))
            head, answer = answer_of(s)
            assert head.startswith(b"HTTP/1.1 200 "), head
    finally:
        first.close()
        second.close()
    until(lambda: bounded.budget.held == 0, "the budget given back")
    assert raw(bounded, "POST", "/v2/models/tiny/infer", body)[0] == 200


def test_answers_a_client_does_not_read_count_in_the_budget(bounded):
    """Clients that never read their answers held 350 MB: an answer that waits in its connection's buffer is held
    in the budget, so the bodies after it get 503 until it is read."""
    body, headers = fan_request(32, binary_output=False)  # about 10 MB of JSON
    host, port = bounded.url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(60)
        s.connect((host, int(port)))
        s.sendall(b"POST /v2/models/fan/infer HTTP/1.1\r\nHost: " + host.encode() + b"\r\n" +
                  b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) +
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        until(lambda: bounded.budget.held > bounded.budget.limit, "the unread answer held")
        status, answer = raw(bounded, "POST", "/v2/models/tiny/infer", tiny_json())
        assert status == 503 and "unread answers" in answer["error"], answer
        head, content = answer_of(s)
        assert head.startswith(b"HTTP/1.1 200 ") and len(content) > 4 << 20
    until(lambda: bounded.budget.held == 0, "the read answer given back")
    assert raw(bounded, "POST", "/v2/models/tiny/infer", tiny_json())[0] == 200


def test_a_trickling_body_is_cut_and_one_arriving_at_the_minimum_rate_is_not(trickled):
    """A body that sent one byte every 20 s was never cut by --idle-timeout-s: now it must bring the minimum rate
    (here 1 KiB/s) over every window of --idle-timeout-s (here 3 s)."""
    import select

    host, port = trickled.url.removeprefix("http://").split(":")
    with declare(trickled, 768) as s:
        closed = False
        for _ in range(120):  # 30 s of a byte every 0.25 s, unless the server cuts it first
            try:
                s.send(b" ")
                if select.select([s], [], [], 0.25)[0] and s.recv(65536) == b"":
                    closed = True
                    break
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, "the server kept a body that brought 4 bytes a second for 30 s"
    body = tiny_json()
    body += b" " * ((40 << 10) - len(body))
    with declare(trickled, len(body)) as s:
        for i in range(0, len(body), 2048):  # 8 KiB/s for 5 s: above the minimum rate, longer than a window
            s.sendall(body[i:i + 2048])
            threading.Event().wait(0.25)
        head, _ = answer_of(s)
    assert head.startswith(b"HTTP/1.1 200 "), head


def test_a_client_that_does_not_read_its_answer_is_cut(trickled):
    """An answer that waits in the connection's buffer, unread, was held for as long as the client liked."""
    body, headers = fan_request(32, binary_output=False)
    host, port = trickled.url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(60)
        s.connect((host, int(port)))
        s.sendall(b"POST /v2/models/fan/infer HTTP/1.1\r\nHost: " + host.encode() + b"\r\n" +
                  b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) +
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = s.recv(1024)  # the answer has begun
        assert received.startswith(b"HTTP/1.1 200 ")
        threading.Event().wait(10)  # three windows without reading
        try:
            while part := s.recv(1 << 20):
                received += part
        except ConnectionResetError:
            pass
    head, _, content = received.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                 .split(b":")[1])
    assert len(content) < length, "the whole answer waited for a client that did not read"
    until(lambda: trickled.budget.held == 0, "the dropped answer given back")


@pytest.fixture(scope="module")
def parsed(site):
    """tiny behind the server's HTTP parser (h11, whichever others are installed)."""
    parent, _, _ = site
    served = load_models([], {"tiny": parent / "tiny.pt2"}, max_batch=4)
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    background = BackgroundServer(engine, served)
    with background as url:
        background.url = url
        yield background


def test_the_server_runs_one_http_parser_on_one_event_loop_whatever_is_installed(parsed):
    """uvicorn picked httptools and uvloop where they were installed (opweave[ray] brings them): the server's answers
    to hostile input, and which of them its tests tried, depended on what else was installed."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    config = parsed.server.config
    assert issubclass(config.http_protocol_class, H11Protocol)
    assert config.loop == "asyncio"


def test_a_request_framed_by_both_content_length_and_chunks_is_refused_and_its_connection_closed(parsed):
    """Content-Length beside Transfer-Encoding: chunked was read as chunked and the connection kept (h11): what
    followed the chunks, a second request here, was answered too, the shape of request smuggling behind a proxy
    that trusts Content-Length (RFC 9112 6.1)."""
    host, port = parsed.url.removeprefix("http://").split(":")
    body = tiny_json()
    chunked = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    request = (f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + chunked + \
        f"GET /v2/health/live HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        answer = b""
        try:
            while part := s.recv(65536):
                answer += part
        except ConnectionResetError:
            pass
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), answer[:300]
    assert b"HTTP/1.1 " not in rest, "a second answer on the connection"
    assert strict_json(rest)["error"]


def test_a_client_config_cannot_make_a_torchscript_models_inputs_larger(tmp_path):
    """A 300-byte load with dims [3, 2048, 2048] cost 1.45 GB and 17 s, and raised the model's body limit to
    2.4 GB: a client's config may give an input no more values than the repository's config.pbtxt does, nor another
    data type (FP64 for FP32 doubled what each request takes)."""
    class Cast(torch.nn.Module):  # converts at any floating type, FP64 included
        def __init__(self):
            super().__init__()
            self.model = tiny()[0]

        def forward(self, x):
            return self.model(x.float())

    (tmp_path / "scripted" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(Cast()), str(tmp_path / "scripted" / "1" / "model.pt"))
    (tmp_path / "scripted" / "config.pbtxt").write_text(
        'max_batch_size: 4\ninput [{ name: "x" data_type: TYPE_FP32 dims: [3, 8, 8] }]\n')
    engine = make_engine({}, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, {}, tmp_path, max_batch=4, control="explicit")
    repository.load_all()
    limit = protocol.request_limit(repository.served["scripted"])
    background = BackgroundServer(engine, repository.served, repository=repository)

    def config(dims, name="x", kind="TYPE_FP32") -> str:
        return json.dumps({"max_batch_size": 4, "input": [{"name": name, "data_type": kind, "dims": dims}]})

    with background as url:
        background.url = url
        for dims, name in (([3, 64, 64], "x"), ([3, 2048, 2048], "x"), ([3, 8, 8], "y")):
            status, answer = load(background, "scripted", config(dims, name))
            assert status == 400 and "a client's config cannot make a model's inputs larger" in answer["error"], \
                answer
        status, answer = load(background, "scripted", config([3, 8, 8], kind="TYPE_FP64"))  # twice the bytes
        assert status == 400 and "data_type TYPE_FP64, its config.pbtxt TYPE_FP32" in answer["error"], answer
        assert "a client's config cannot change a model's data types" in answer["error"]
        assert protocol.request_limit(repository.served["scripted"]) == limit
        assert load(background, "scripted", config([3, 8, 8])) == (200, {})  # what the repository says: taken
        assert load(background, "scripted", config([3, 4, 4])) == (200, {})  # smaller: taken
        assert repository.served["scripted"].inputs[0].shape == (-1, 3, 4, 4)


def test_echoes_of_a_clients_headers_are_cut_to_64_characters(server):
    for header in (HEADER, "Content-Encoding"):
        status, answer = raw(server, "POST", "/v2/models/tiny/infer", tiny_json(), {header: "x" * 900})
        assert status == 400 and "x" * 60 in answer["error"] and "x" * 65 not in answer["error"], answer
        assert len(answer["error"]) < 200, answer


def test_the_binary_headers_length_is_digits_only(server):
    """int() took "+115" and "1_15"; the spaces around a field's value are no part of it (RFC 9110 5.5): " 115 " is
    115, whichever parser read it (decode() refused it, and the parsers strip it)."""
    x = torch.randn(1, 3, 8, 8)
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 768}}]}).encode()
    size = str(len(header))
    for written in (size, f" {size} ", f"\t{size}"):
        assert raw(server, "POST", "/v2/models/tiny/infer", header + encode_tensor(x), {HEADER: written})[0] == 200
        assert protocol.decode(server.repository.served["tiny"], header + encode_tensor(x), written).batch == 1
    for written in (f"+{size}", f"{size[0]}_{size[1:]}", f"{size[0]} {size[1:]}", "\u00b2" * 3, "9" * 5000):
        status, answer = raw(server, "POST", "/v2/models/tiny/infer", header + encode_tensor(x), {HEADER: written})
        assert status == 400 and "is not a byte count" in answer["error"], (written, answer)


@pytest.mark.parametrize("where", [{"parameters": {"ignored": "NUMBER"}}, {"ignored": ["a", {"deep": ["NUMBER"]}]},
                                   {"outputs": [{"name": "output__0", "parameters": {"x": "NUMBER"}}]}])
def test_a_number_beyond_float64_is_refused_wherever_it_stands(server, where):
    """1e400 (infinite once parsed) in a field the server ignores was answered 200."""
    body = tiny_json(**where).replace(b'"NUMBER"', b"1e400")
    status, answer = raw(server, "POST", "/v2/models/tiny/infer", body)
    assert status == 400 and "beyond the range of float64" in answer["error"], answer
    status, answer = raw(server, "POST", "/v2/repository/index", b'{"ready": false, "other": [-1e400]}')
    assert status == 400 and "'other[0]' holds a number beyond the range of float64" in answer["error"], answer
    request = tiny_request(torch.randn(1, 3, 8, 8))
    request.parameters["ignored"].double_param = float("inf")
    channel, stub = grpc_stub(server)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'parameters.ignored'" in \
            info.value.details(), info.value.details()
    finally:
        channel.close()


def test_a_grpc_call_whose_message_never_comes_ends_after_the_idle_timeout(limited):
    """1,842 calls that sent their headers and no message were kept for 150 s: a connection with a call open is
    never idle, and gRPC waited for the message as long as the connection lived."""
    silence = Silent()

    channel = grpc.insecure_channel(limited.grpc_address)
    try:
        call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)
        future = call.future(silence.messages())
        try:
            with pytest.raises(grpc.RpcError) as info:
                future.result(timeout=60)
        finally:
            silence.release()
            future.cancel()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive within 3 s" in info.value.details(), info.value.details()
    finally:
        channel.close()
