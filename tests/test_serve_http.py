"""The Open Inference Protocol server on 127.0.0.1 (ephemeral ports): answers equal eager, tritonclient with binary
data on and off, every status code of a bad or unlucky request, SIGTERM draining, metrics, and the CLI."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from opweave import zoo
from opweave.serve import loadgen
from opweave.serve.assemble import load_models, make_engine
from opweave.serve.protocol import HEADER, encode_tensor
from opweave.testing.serving import BackgroundServer
from serve_models import WAIT_S, Gate

SQUEEZE = {"image_size": 64}


@pytest.fixture(scope="module")
def served(tiny_file):
    return load_models(["squeezenet", "deepfm"], {"tiny": tiny_file[1]}, max_batch=4, image_size=64)


@pytest.fixture(scope="module")
def server(served):
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4)
    with BackgroundServer(engine, served, max_body_bytes=1 << 20) as url:
        yield url


@pytest.fixture(scope="module")
def references(tiny_file):
    return {"squeezenet": zoo.create("squeezenet", **SQUEEZE)[0], "deepfm": zoo.create("deepfm")[0],
            "tiny": tiny_file[0]}


def random_inputs(model: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model == "deepfm":
        return [torch.randint(0, 1000, (1, 26), generator=g), torch.rand(1, 13, generator=g)]
    size = 64 if model == "squeezenet" else 8
    return [torch.randn(1, 3, size, size, generator=g)]


def binary_request(model: str, inputs: list[torch.Tensor]) -> tuple[bytes, dict]:
    names = {"squeezenet": ["x"], "deepfm": ["sparse", "dense"], "tiny": ["x"]}[model]
    header = {"inputs": [], "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}
    blobs = [encode_tensor(t) for t in inputs]
    for name, t, blob in zip(names, inputs, blobs, strict=True):
        header["inputs"].append({"name": name, "shape": list(t.shape), "datatype": "INT64" if t.dtype == torch.int64
                                 else "FP32", "parameters": {"binary_data_size": len(blob)}})
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {HEADER: str(len(head))}


def decode_binary(response: httpx.Response) -> torch.Tensor:
    size = int(response.headers[HEADER])
    head = json.loads(response.content[:size])
    out = head["outputs"][0]
    return torch.frombuffer(bytearray(response.content[size:]), dtype=torch.float32).reshape(out["shape"])


def eager(references, model, inputs):
    with torch.no_grad():
        return references[model](*inputs)


def test_metadata_health_and_unknown_models(server, served):
    with httpx.Client(base_url=server) as c:
        assert c.get("/v2").json()["extensions"][0] == "binary_tensor_data"
        assert c.get("/v2/health/live").status_code == 200 and c.get("/v2/health/ready").status_code == 200
        meta = c.get("/v2/models/deepfm").json()
        assert meta["inputs"] == [{"name": "sparse", "datatype": "INT64", "shape": [-1, 26]},
                                  {"name": "dense", "datatype": "FP32", "shape": [-1, 13]}]
        assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1]}]
        assert c.get("/v2/models/tiny").json()["source"].endswith("tiny.pt2")
        assert c.get("/v2/models/squeezenet/ready").status_code == 200
        assert c.get("/v2/models/squeezenet/versions/1/ready").status_code == 200
        assert c.get("/v2/models/squeezenet/config").json()["max_batch_size"] == 4
        for path in ("/v2/models/nope", "/v2/models/nope/ready", "/v2/models/nope/config",
                     "/v2/models/squeezenet/versions/2"):
            r = c.get(path)
            assert r.status_code == 404 and "error" in r.json()
        r = c.post("/v2/models/nope/infer", json={"inputs": []})
        assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]


def test_three_models_under_load_every_answer_is_eagers_on_its_own_input(server, references):
    async def send_all():
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            async def one(i):
                model = ("squeezenet", "deepfm", "tiny")[i % 3]
                inputs = random_inputs(model, 1000 + i)
                await asyncio.sleep(0.004 * i)
                body, headers = binary_request(model, inputs)
                r = await c.post(f"/v2/models/{model}/infer", content=body, headers=headers)
                return model, inputs, r
            return await asyncio.gather(*(one(i) for i in range(45)))

    results = asyncio.run(send_all())
    assert all(r.status_code == 200 for _, _, r in results), [r.text for _, _, r in results if r.status_code != 200]
    for model, inputs, r in results:
        assert torch.allclose(decode_binary(r), eager(references, model, inputs), rtol=1e-4, atol=1e-4), model


def test_tritonclient_http_with_binary_data_on_and_off(server, references):
    import tritonclient.http as triton

    client = triton.InferenceServerClient(server.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("deepfm")
    assert client.get_model_metadata("squeezenet")["inputs"][0]["shape"] == [-1, 3, 64, 64]
    for binary in (True, False):
        for model, names, types in (("squeezenet", ["x"], ["FP32"]), ("deepfm", ["sparse", "dense"],
                                                                       ["INT64", "FP32"])):
            tensors = random_inputs(model, 7 if binary else 8)
            inputs = []
            for name, kind, t in zip(names, types, tensors, strict=True):
                item = triton.InferInput(name, list(t.shape), kind)
                item.set_data_from_numpy(t.numpy(), binary_data=binary)
                inputs.append(item)
            outputs = [triton.InferRequestedOutput("output__0", binary_data=binary)]
            result = client.infer(model, inputs, outputs=outputs, request_id="r1")
            got = torch.from_numpy(np.array(result.as_numpy("output__0")))
            assert result.get_response()["id"] == "r1"
            assert torch.allclose(got, eager(references, model, tensors), rtol=1e-4, atol=1e-4)
    # no outputs listed: tritonclient asks for every output in binary
    t = random_inputs("tiny", 9)
    item = triton.InferInput("x", list(t[0].shape), "FP32")
    item.set_data_from_numpy(t[0].numpy())
    got = np.array(client.infer("tiny", [item]).as_numpy("output__0"))
    assert torch.allclose(torch.from_numpy(got), eager(references, "tiny", t), atol=1e-5)
    client.close()


def json_request(x: torch.Tensor, **override) -> dict:
    entry = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}
    entry.update(override)
    return {"inputs": [entry]}


@pytest.mark.parametrize("case, needle", [
    ("malformed", "malformed JSON"),
    ("name", "unknown input 'y' for model 'tiny' (inputs: x)"),
    ("shape", "input 'x': shape [1, 3, 8, 9], expected [-1, 3, 8, 8]"),
    ("datatype", "input 'x': datatype 'FP64', expected FP32"),
    ("length", "input 'x': 191 values for shape [1, 3, 8, 8] (192 needed)"),
    ("binary_size", "input 'x': binary_data_size 100, expected 768 bytes"),
    ("binary_short", "input 'x': the body holds 700 bytes of binary data, 768 needed"),
    ("batch", "input 'x': batch 5 is outside 1..4"),
    ("oversized", "exceeds the limit of 1048576 bytes"),
    ("missing", "missing input 'dense' for model 'deepfm'"),
    ("output", "unknown output 'out' for model 'tiny'"),
])
def test_each_bad_request_gets_400_with_its_message_and_the_server_keeps_serving(server, references, case, needle):
    x = torch.randn(1, 3, 8, 8)
    url = "/v2/models/tiny/infer"
    with httpx.Client(base_url=server, timeout=60) as c:
        if case == "malformed":
            r = c.post(url, content=b'{"inputs": [', headers={"Content-Type": "application/json"})
        elif case == "name":
            r = c.post(url, json=json_request(x, name="y"))
        elif case == "shape":
            r = c.post(url, json=json_request(torch.randn(1, 3, 8, 9)))
        elif case == "datatype":
            r = c.post(url, json=json_request(x, datatype="FP64"))
        elif case == "length":
            r = c.post(url, json=json_request(x, data=x.reshape(-1).tolist()[:-1]))
        elif case == "batch":
            r = c.post(url, json=json_request(torch.randn(5, 3, 8, 8)))
        elif case == "oversized":
            r = c.post(url, content=b" " * ((1 << 20) + 10))
        elif case == "missing":
            r = c.post("/v2/models/deepfm/infer", json={"inputs": [
                {"name": "sparse", "shape": [1, 26], "datatype": "INT64", "data": [0] * 26}]})
        elif case == "output":
            r = c.post(url, json={**json_request(x), "outputs": [{"name": "out"}]})
        else:
            head = json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32",
                                           "parameters": {"binary_data_size": 100 if case == "binary_size"
                                                          else 768}}]}).encode()
            blob = encode_tensor(x)[:700]
            r = c.post(url, content=head + blob, headers={HEADER: str(len(head))})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]
        good = c.post(url, json=json_request(x))
        assert good.status_code == 200
        out = torch.tensor(good.json()["outputs"][0]["data"]).reshape(good.json()["outputs"][0]["shape"])
        assert torch.allclose(out, eager(references, "tiny", [x]), atol=1e-5)


def test_a_request_past_its_deadline_gets_504(server):
    x = torch.randn(1, 3, 64, 64)
    with httpx.Client(base_url=server, timeout=60) as c:
        body = {**json_request(x), "parameters": {"timeout": 1}}  # one microsecond
        r = c.post("/v2/models/squeezenet/infer", json=body)
        assert r.status_code == 504 and "deadline" in r.json()["error"]
        assert c.post("/v2/models/squeezenet/infer", json=json_request(x)).status_code == 200


def test_metrics_in_prometheus_format(server):
    with httpx.Client(base_url=server) as c:
        c.post("/v2/models/tiny/infer", json=json_request(torch.randn(1, 3, 8, 8)))
        text = c.get("/metrics").text
    for needle in ('opweave_queue_depth{model="tiny"}', 'opweave_requests_total{model="tiny",outcome="answered"}',
                   "opweave_request_latency_seconds_bucket", "opweave_queue_time_seconds_count",
                   "opweave_compute_time_seconds_sum", "opweave_batch_size_bucket", 'opweave_rejections_total',
                   'opweave_plan_cache{event="hits"}', "opweave_step_sub_blocks_bucket",
                   "opweave_decision_seconds_count"):
        assert needle in text, needle
    assert loadgen._queue_depths(text, {"tiny": 1.0}) == {"tiny": 0}


def test_overload_answers_429_with_retry_after_and_loses_nothing(served, references):
    """A queue of 2 and 30 requests at once: the first block waits at a gate until all 30 reached the engine, so 2 or
    3 are accepted (the 2 queued, and the one running if it left the queue before the queue filled) and the rest are
    refused, whatever the machine's load."""
    engine = make_engine({"squeezenet": served["squeezenet"]}, device="cpu", policy="static", max_queue=2,
                         max_batch=4, warm=False)
    gate = Gate(engine)
    with BackgroundServer(engine, {"squeezenet": served["squeezenet"]}) as url:
        async def flood():
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
                async def one(i):
                    inputs = random_inputs("squeezenet", i)
                    body, headers = binary_request("squeezenet", inputs)
                    return inputs, await c.post("/v2/models/squeezenet/infer", content=body, headers=headers)
                sent = [asyncio.create_task(one(i)) for i in range(30)]
                await asyncio.to_thread(gate.wait_for, 30)
                gate.open()
                return await asyncio.gather(*sent)

        try:
            results = asyncio.run(flood())
        finally:
            gate.open()
    codes = [r.status_code for _, r in results]
    assert codes.count(200) in (2, 3) and codes.count(200) + codes.count(429) == 30, codes
    rejected = [r for _, r in results if r.status_code == 429]
    assert all(int(r.headers["Retry-After"]) >= 1 and "queue full" in r.json()["error"] for r in rejected)
    assert engine.stats["answered"] == codes.count(200) and engine.stats["rejected"] == codes.count(429)
    for inputs, r in results:
        if r.status_code == 200:
            assert torch.allclose(decode_binary(r), eager(references, "squeezenet", inputs), rtol=1e-4, atol=1e-4)


def test_draining_answers_every_accepted_request_refuses_new_ones_503_then_stops(served, references):
    """What the first SIGTERM does (:meth:`BackgroundServer.drain`), with 8 requests held at a gate: a new request
    gets 503, readiness goes 503; once the gate opens the 8 are answered equal eager and the server stops by itself."""
    engine = make_engine({"squeezenet": served["squeezenet"]}, device="cpu", policy="static", max_batch=4,
                         warm=False)
    gate = Gate(engine)
    background = BackgroundServer(engine, {"squeezenet": served["squeezenet"]})
    with background as url:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
                async def one(i):
                    inputs = random_inputs("squeezenet", 50 + i)
                    body, headers = binary_request("squeezenet", inputs)
                    return inputs, await c.post("/v2/models/squeezenet/infer", content=body, headers=headers)
                accepted = [asyncio.create_task(one(i)) for i in range(8)]
                await asyncio.to_thread(gate.wait_for, 8)
                background.drain()
                late = await c.post("/v2/models/squeezenet/infer", json=json_request(torch.randn(1, 3, 64, 64)))
                ready = await c.get("/v2/health/ready")
                model_ready = await c.get("/v2/models/squeezenet/ready")
                gate.open()
                return await asyncio.gather(*accepted), late, ready, model_ready

        try:
            answers, late, ready, model_ready = asyncio.run(scenario())
        finally:
            gate.open()
        background.thread.join(WAIT_S)  # uvicorn stops once none is left, without being told again
        assert not background.thread.is_alive(), f"the drained server was still up after {WAIT_S:g} s"
    assert late.status_code == 503 and "shutting down" in late.json()["error"]
    assert ready.status_code == 503 and model_ready.status_code == 503
    for inputs, r in answers:
        assert r.status_code == 200, r.text
        assert torch.allclose(decode_binary(r), eager(references, "squeezenet", inputs), rtol=1e-4, atol=1e-4)


def metric(text: str, name: str, model: str) -> float:
    """The value of ``name{model="..."}`` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {model} in the metrics")


def test_sigterm_drains_every_accepted_request_then_exits(references):
    """`opweave serve` in a subprocess and a real SIGTERM: the 24 requests it had accepted are all answered (equal
    eager) and it exits 0. They are held in its queue until then by the batch policy (a batch of 32 waited for up
    to an hour), so that the signal comes while the server holds all of them, however slow the machine; a drain
    waits for no fuller batch. (That new requests get 503 while draining is the test above, in process.)"""
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--models", "squeezenet", "--image-size", "64",
                             "--port", "0", "--policy", "batch", "--policy-options", "max_queue_delay_ms=3600000",
                             "--max-batch", "32", "--max-queue", "64", "--compiler", "none", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read()
        url = line.strip().rsplit(" ", 1)[1]

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
                async def one(i):
                    inputs = random_inputs("squeezenet", i)
                    body, headers = binary_request("squeezenet", inputs)
                    return inputs, await c.post("/v2/models/squeezenet/infer", content=body, headers=headers)
                first = [asyncio.create_task(one(i)) for i in range(24)]
                deadline = time.monotonic() + WAIT_S
                while (depth := metric((await c.get("/metrics")).text, "opweave_queue_depth", "squeezenet")) < 24:
                    assert time.monotonic() < deadline, f"the server queued {depth:g} of 24 requests in {WAIT_S:g} s"
                    await asyncio.sleep(0.01)
                os.kill(proc.pid, signal.SIGTERM)
                return await asyncio.gather(*first)

        answers = asyncio.run(scenario())
        for inputs, r in answers:
            assert r.status_code == 200, r.text
            assert torch.allclose(decode_binary(r), eager(references, "squeezenet", inputs), rtol=1e-4, atol=1e-4)
        assert proc.wait(timeout=WAIT_S) == 0, proc.stderr.read()[-3000:]
        said = proc.stderr.read()  # what it said while loading (one line a step where stderr is not a terminal)
        assert "opweave serve: loading squeezenet (1/1): capture and blocks" in said, said[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, timeout=900)


def test_cli_loadgen_simulate_and_blocks(tmp_path):
    out = tmp_path / "rep.json"
    png = tmp_path / "rep.png"
    proc = run_cli("loadgen", "--simulate", "--pattern", "squeezenet:500", "--duration", "0.2", "--image-size", "64",
                   "--policy", "batch", "-o", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["mode"] == "simulate" and rep["policy"] == "batch" and rep["device_preset"] == "h100"
    assert rep["total"]["sent"] == rep["total"]["answered"] > 50 and png.stat().st_size > 1000
    proc = run_cli("blocks", "--models", "squeezenet", "--image-size", "64", "--json")
    row = json.loads(proc.stdout)[0]
    assert row["blocks"] == 8 and row["top_blocks"] == 12
    proc = run_cli("loadgen", "--pattern", "squeezenet:0", "--simulate")
    assert proc.returncode == 2 and "positive rate" in proc.stderr
    proc = run_cli("serve", "--models", "squeezenet", "--model-file", "x=/nonexistent.pt2")
    assert proc.returncode == 2 and "no file" in proc.stderr


def test_loadgen_over_http_reports_what_the_server_did(server):
    rep, outcomes = loadgen.run_http(server, {"tiny": 40.0, "deepfm": 20.0}, 1.0, "constant", sample_s=0.05)
    assert rep["total"]["sent"] == len(outcomes) == 60
    assert rep["total"]["answered"] + rep["total"]["rejected"] + rep["total"]["errors"] == 60
    assert rep["total"]["errors"] == 0 and rep["models"]["tiny"]["p99_ms"] > 0
    assert rep["queue_samples"] and set(rep["queue_samples"][0][1]) == {"tiny", "deepfm"}
