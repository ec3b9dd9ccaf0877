"""The KServe v2 gRPC service on 127.0.0.1 (ephemeral ports), spoken to by tritonclient.grpc: every call, answers
equal eager, each bad request's status code and message (the HTTP server's checks), queue overflow, deadlines,
draining, and ``opweave serve --grpc-port`` as a process."""

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from opweave import zoo
from opweave.serve.assemble import load_models, make_engine
from opweave.serve.protocol import encode_tensor
from opweave.testing.serving import BackgroundServer
from serve_models import WAIT_S, Gate

triton = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as triton_aio  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

NAMES = {"deepfm": (["sparse", "dense"], ["INT64", "FP32"]), "tiny": (["x"], ["FP32"]),
         "squeezenet": (["x"], ["FP32"])}


@pytest.fixture(scope="module")
def served(tiny_file):
    return load_models(["deepfm"], {"tiny": tiny_file[1]}, max_batch=4)


@pytest.fixture(scope="module")
def server(served):
    """The background server with its gRPC service: ``server.grpc_address``, ``server.engine``."""
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4)
    background = BackgroundServer(engine, served, grpc=True, max_body_bytes=1 << 20)
    with background:
        yield background


@pytest.fixture(scope="module")
def references(tiny_file):
    return {"deepfm": zoo.create("deepfm")[0], "tiny": tiny_file[0]}


@pytest.fixture()
def client(server):
    c = triton.InferenceServerClient(server.grpc_address)
    yield c
    c.close()


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def random_inputs(model: str, seed: int, batch: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model == "deepfm":
        return [torch.randint(0, 1000, (batch, 26), generator=g), torch.rand(batch, 13, generator=g)]
    size = 64 if model == "squeezenet" else 8
    return [torch.randn(batch, 3, size, size, generator=g)]


def triton_inputs(model: str, tensors: list[torch.Tensor]) -> list:
    out = []
    for name, kind, t in zip(*NAMES[model], tensors, strict=True):
        item = triton.InferInput(name, list(t.shape), kind)
        item.set_data_from_numpy(t.numpy())
        out.append(item)
    return out


def eager(references, model, inputs):
    with torch.no_grad():
        return references[model](*inputs)


def test_health_metadata_config_and_index(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("deepfm", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("tiny", "2")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "opweave" and "model_repository" in meta["extensions"]
    meta = client.get_model_metadata("deepfm", as_json=True)
    assert meta["versions"] == ["1"] and meta["platform"] == "opweave"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("sparse", "INT64", ["-1", "26"]), ("dense", "FP32", ["-1", "13"])]  # int64 fields are strings in JSON
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": ["-1", "1"]}]
    config = client.get_model_config("tiny", as_json=True)["config"]
    assert config["name"] == "tiny" and config["max_batch_size"] == 4
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["3", "8", "8"]}]
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["state"]) for m in index} == {("deepfm", "READY"), ("tiny", "READY")}
    for call in (lambda: client.get_model_metadata("nope"), lambda: client.get_model_config("nope"),
                 lambda: client.get_model_metadata("tiny", "2")):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:  # what opweave does not serve says so, in one line
        client.get_trace_settings()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert info.value.message() == "opweave does not implement TraceSetting"
    assert client.is_server_live()


def test_infer_equals_eager_with_raw_contents_for_every_model_and_batch(client, references):
    for model in ("tiny", "deepfm"):
        for batch, seed in ((1, 1), (3, 2), (4, 3)):
            tensors = random_inputs(model, seed, batch)
            result = client.infer(model, triton_inputs(model, tensors), request_id=f"r{seed}")
            assert result.get_response().id == f"r{seed}" and result.get_response().model_version == "1"
            got = torch.from_numpy(np.array(result.as_numpy("output__0")))
            assert got.shape[0] == batch
            assert torch.allclose(got, eager(references, model, tensors), rtol=1e-4, atol=1e-4), (model, batch)
    # the outputs asked for, by name
    tensors = random_inputs("tiny", 9)
    result = client.infer("tiny", triton_inputs("tiny", tensors), outputs=[triton.InferRequestedOutput("output__0")])
    assert torch.allclose(torch.from_numpy(np.array(result.as_numpy("output__0"))), eager(references, "tiny", tensors),
                          atol=1e-5)


def test_typed_contents_and_concurrent_requests_equal_eager(server, stub, references):
    x = random_inputs("tiny", 11)[0]
    request = service_pb2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape)).contents.fp32_contents.extend(
        x.reshape(-1).tolist())
    response = stub.ModelInfer(request, timeout=60)
    got = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32).reshape(
        list(response.outputs[0].shape))
    assert torch.allclose(got, eager(references, "tiny", [x]), atol=1e-5)

    async def many():
        client = triton_aio.InferenceServerClient(server.grpc_address)
        try:
            async def one(i):
                model = ("tiny", "deepfm")[i % 2]
                tensors = random_inputs(model, 100 + i)
                return model, tensors, await client.infer(model, triton_inputs(model, tensors))
            return await asyncio.gather(*(one(i) for i in range(24)))
        finally:
            await client.close()

    for model, tensors, result in asyncio.run(many()):
        got = torch.from_numpy(np.array(result.as_numpy("output__0")))
        assert torch.allclose(got, eager(references, model, tensors), rtol=1e-4, atol=1e-4), model


def _request(x: torch.Tensor, name: str = "x", datatype: str = "FP32", shape=None, raw: bytes | None = None,
             model: str = "tiny") -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=list(x.shape) if shape is None else shape)
    request.raw_input_contents.append(encode_tensor(x) if raw is None else raw)
    return request


def _bad(case: str) -> service_pb2.ModelInferRequest:
    x = torch.randn(1, 3, 8, 8)
    if case == "name":
        return _request(x, name="y")
    if case == "shape":
        return _request(torch.randn(1, 3, 8, 9))
    if case == "datatype":
        return _request(x, datatype="FP64")
    if case == "raw_size":
        return _request(x, raw=encode_tensor(x)[:700])
    if case == "raw_count":
        request = _request(x)
        request.raw_input_contents.append(b"")
        return request
    if case == "batch":
        return _request(torch.randn(5, 3, 8, 8))
    if case == "missing":
        request = service_pb2.ModelInferRequest(model_name="deepfm")
        request.inputs.add(name="sparse", datatype="INT64", shape=[1, 26])
        request.raw_input_contents.append(encode_tensor(torch.zeros(1, 26, dtype=torch.int64)))
        return request
    if case == "output":
        request = _request(x)
        request.outputs.add(name="out")
        return request
    if case == "contents_field":
        request = service_pb2.ModelInferRequest(model_name="tiny")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 3, 8, 8]).contents.int64_contents.extend([0] * 192)
        return request
    if case == "no_values":
        request = service_pb2.ModelInferRequest(model_name="tiny")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 3, 8, 8])
        return request
    if case == "timeout_param":
        request = _request(x)
        request.parameters["timeout"].int64_param = -5
        return request
    if case == "unknown_model":
        return _request(x, model="nope")
    if case == "unknown_version":
        request = _request(x)
        request.model_version = "7"
        return request
    raise AssertionError(case)


@pytest.mark.parametrize("case, code, needle", [
    ("name", "INVALID_ARGUMENT", "unknown input 'y' for model 'tiny' (inputs: x)"),
    ("shape", "INVALID_ARGUMENT", "input 'x': shape [1, 3, 8, 9], expected [-1, 3, 8, 8]"),
    ("datatype", "INVALID_ARGUMENT", "input 'x': datatype 'FP64', expected FP32"),
    ("raw_size", "INVALID_ARGUMENT", "input 'x': raw_input_contents[0] holds 700 bytes, expected 768 bytes"),
    ("raw_count", "INVALID_ARGUMENT", "raw_input_contents has 2 entries for 1 inputs"),
    ("batch", "INVALID_ARGUMENT", "input 'x': batch 5 is outside 1..4"),
    ("missing", "INVALID_ARGUMENT", "missing input 'dense' for model 'deepfm'"),
    ("output", "INVALID_ARGUMENT", "unknown output 'out' for model 'tiny'"),
    ("contents_field", "INVALID_ARGUMENT", "input 'x': contents in int64_contents; datatype FP32 takes fp32_contents"),
    ("no_values", "INVALID_ARGUMENT", "input 'x': 0 values for shape [1, 3, 8, 8] (192 needed)"),
    ("timeout_param", "INVALID_ARGUMENT", "parameters.timeout must be a positive number of microseconds"),
    ("unknown_model", "NOT_FOUND", "unknown model 'nope'"),
    ("unknown_version", "NOT_FOUND", "model 'tiny' has no version '7' (only 1)"),
])
def test_each_bad_request_gets_its_status_code_and_the_server_keeps_serving(stub, references, case, code, needle):
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_bad(case), timeout=60)
    assert info.value.code() == getattr(grpc.StatusCode, code), info.value.details()
    assert needle in info.value.details()
    x = torch.randn(1, 3, 8, 8)
    response = stub.ModelInfer(_request(x), timeout=60)
    got = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32).reshape(1, 10)
    assert torch.allclose(got, eager(references, "tiny", [x]), atol=1e-5)


def test_an_oversized_message_is_refused_by_grpc(stub):
    big = _request(torch.randn(1, 3, 8, 8), raw=b"\0" * ((1 << 20) + 10))
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(big, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_request_past_its_deadline_gets_deadline_exceeded(client):
    tensors = random_inputs("tiny", 5)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tiny", triton_inputs("tiny", tensors), timeout=1)  # parameters.timeout: one microsecond
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED" and "deadline" in info.value.message()
    assert client.infer("tiny", triton_inputs("tiny", tensors)).as_numpy("output__0").shape == (1, 10)


def test_a_full_queue_answers_resource_exhausted_and_loses_nothing(served, references):
    """A queue of 2 and 40 calls at once, the first block held at a gate until all 40 reached the engine: 2 or 3
    accepted (see the HTTP test), the rest refused, whatever the machine's load."""
    background = BackgroundServer(make_engine({"tiny": served["tiny"]}, device="cpu", policy="static",
                                              max_queue=2, max_batch=4, warm=False), {"tiny": served["tiny"]},
                                  grpc=True)
    gate = Gate(background.engine)
    with background:
        async def flood():
            async with grpc.aio.insecure_channel(background.grpc_address) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

                async def one(i):
                    x = random_inputs("tiny", 200 + i)[0]
                    call = stub.ModelInfer(_request(x), timeout=WAIT_S)
                    try:
                        return x, await call, None, None
                    except grpc.aio.AioRpcError as exc:
                        return x, None, exc.code(), dict(exc.trailing_metadata() or ())
                calls = [asyncio.create_task(one(i)) for i in range(40)]
                await asyncio.to_thread(gate.wait_for, 40)
                gate.open()
                return await asyncio.gather(*calls)

        try:
            results = asyncio.run(flood())
        finally:
            gate.open()
        stats = dict(background.engine.stats)
    ok = [(x, r) for x, r, code, _ in results if code is None]
    refused = [(code, meta) for _, _, code, meta in results if code is not None]
    assert len(ok) in (2, 3) and len(ok) + len(refused) == 40
    assert {code for code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(int(meta["retry-after"]) >= 1 for _, meta in refused)
    assert stats["answered"] == len(ok) and stats["rejected"] == len(refused)
    for x, response in ok:
        got = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32).reshape(1, 10)
        assert torch.allclose(got, eager(references, "tiny", [x]), atol=1e-5)


def test_draining_refuses_new_calls_unavailable_and_answers_those_accepted(served, references):
    """16 calls held at a gate, then the drain: a new call is UNAVAILABLE and the server not ready; once the gate
    opens every one of the 16 is answered equal eager."""
    background = BackgroundServer(make_engine({"tiny": served["tiny"]}, device="cpu", policy="static", max_queue=64,
                                              max_batch=4, warm=False), {"tiny": served["tiny"]}, grpc=True)
    gate = Gate(background.engine)
    with background:
        async def scenario():
            async with grpc.aio.insecure_channel(background.grpc_address) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                xs = [random_inputs("tiny", 300 + i)[0] for i in range(16)]
                calls = [asyncio.ensure_future(stub.ModelInfer(_request(x), timeout=WAIT_S)) for x in xs]
                await asyncio.to_thread(gate.wait_for, 16)
                background.drain()
                try:
                    await stub.ModelInfer(_request(xs[0]), timeout=WAIT_S)
                    late_code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    late_code = exc.code()
                ready = await stub.ServerReady(service_pb2.ServerReadyRequest())
                gate.open()
                return xs, await asyncio.gather(*calls), late_code, ready.ready

        try:
            xs, answers, late_code, ready = asyncio.run(scenario())
        finally:
            gate.open()
    assert late_code == grpc.StatusCode.UNAVAILABLE and ready is False
    assert gate.accepted == 16 and gate.refused == 0
    for x, response in zip(xs, answers, strict=True):
        got = torch.frombuffer(bytearray(response.raw_output_contents[0]), dtype=torch.float32).reshape(1, 10)
        assert torch.allclose(got, eager(references, "tiny", [x]), atol=1e-5)


def test_cli_serves_every_grpc_call_beside_http_and_drains_on_sigterm(references, tiny_file, tmp_path):
    """`opweave serve --grpc-port 0 --model-repository DIR` as a process: every call of the service through
    tritonclient.grpc, a bad request refused while the server stays up, HTTP beside it, SIGTERM exits 0."""
    import shutil

    import tritonclient.http as triton_http

    repo = tmp_path / "repo"
    (repo / "tiny" / "1").mkdir(parents=True)
    shutil.copy(tiny_file[1], repo / "tiny" / "1" / "model.pt2")
    (repo / "other" / "1").mkdir(parents=True)
    shutil.copy(tiny_file[1], repo / "other" / "1" / "model.pt2")
    (repo / "other" / "config.pbtxt").write_text("max_batch_size: 2\n")
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(repo),
                             "--port", "0", "--grpc-port", "0", "--policy", "static", "--compiler", "none",
                             "--max-batch", "4", "--model-control-mode", "explicit"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line and "gRPC on 127.0.0.1:" in line, proc.stderr.read()
        address = line.split("gRPC on ", 1)[1].split(";", 1)[0]
        client = triton.InferenceServerClient(address)
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("tiny") and client.is_model_ready("other")
        assert "model_repository" in client.get_server_metadata(as_json=True)["extensions"]
        assert client.get_model_metadata("tiny", as_json=True)["inputs"][0]["shape"] == ["-1", "3", "8", "8"]
        assert client.get_model_config("other", as_json=True)["config"]["max_batch_size"] == 2
        tensors = random_inputs("tiny", 21, 2)
        for model in ("tiny", "other"):
            got = np.array(client.infer(model, triton_inputs("tiny", tensors)).as_numpy("output__0"))
            assert torch.allclose(torch.from_numpy(got), eager(references, "tiny", tensors), atol=1e-5)
        with pytest.raises(InferenceServerException) as info:
            client.infer("other", triton_inputs("tiny", random_inputs("tiny", 22, 3)))  # batch 3 > 2
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "outside 1..2" in info.value.message()
        client.unload_model("other")
        assert not client.is_model_ready("other")
        states = {m["name"]: m["state"] for m in client.get_model_repository_index(as_json=True)["models"]}
        assert states == {"tiny": "READY", "other": "UNAVAILABLE"}
        client.load_model("other")
        assert client.is_model_ready("other")
        http = triton_http.InferenceServerClient(line.strip().rsplit(" ", 1)[1].removeprefix("http://"))
        assert http.is_model_ready("other") and [m["name"] for m in http.get_model_repository_index()] == [
            "other", "tiny"]
        http.close()
        client.close()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
