"""Models that come and go while the server runs: the engine gaining and losing a model between steps, Triton's
repository layout and config, the repository extension over HTTP and gRPC (tritonclient), and a load and an unload
while another model serves under load: nothing stalls it, no request to it or to the unloaded model is lost."""

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from opweave import zoo
from opweave.errors import UsageError
from opweave.serve.assemble import load_models, make_engine, serving_options
from opweave.serve.engine import Unavailable
from opweave.serve.frontend import Refused
from opweave.serve.protocol import HEADER, encode_tensor
from opweave.serve.repository import Repository
from opweave.testing.serving import BackgroundServer
from serve_models import WAIT_S, tiny

SQUEEZE = {"image_size": 64}



def http_infer(client, model: str, input_name: str, output_name: str, x: torch.Tensor) -> torch.Tensor:
    """One FP32 inference through tritonclient's HTTP client: ``model``'s output ``output_name`` for ``x``."""
    import tritonclient.http as triton_http

    item = triton_http.InferInput(input_name, list(x.shape), "FP32")
    item.set_data_from_numpy(x.numpy())
    return torch.from_numpy(np.array(client.infer(model, [item]).as_numpy(output_name)))

def export(model, inputs, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(torch.export.export(model, inputs), str(path))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """tiny/1 (seed 1) and tiny/2 (seed 2: the one served), squeezenet/1 with a config.pbtxt (max batch 2), and
    broken/1 whose config names an input the program does not have."""
    root = tmp_path_factory.mktemp("repository")
    models = {}
    for version, seed in ((1, 1), (2, 2)):
        model, x = tiny(seed=seed)
        export(model, x, root / "tiny" / str(version) / "model.pt2")
        models[f"tiny/{version}"] = model
    squeeze, x = zoo.create("squeezenet", **SQUEEZE)
    export(squeeze.eval(), x, root / "squeezenet" / "1" / "model.pt2")
    (root / "squeezenet" / "config.pbtxt").write_text(
        'name: "squeezenet"\nplatform: "pytorch_libtorch"\nmax_batch_size: 2\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]\n')
    models["squeezenet"] = squeeze
    model, x = tiny(seed=3)
    export(model, x, root / "broken" / "1" / "model.pt2")
    (root / "broken" / "config.pbtxt").write_text('max_batch_size: 4\ninput [ { name: "image" } ]\n')
    (root / "empty" / "1").mkdir(parents=True)  # no program: not a model of the repository
    return root, models


@pytest.fixture(scope="module")
def base():
    """The model served from the start (``deepfm``), loaded once."""
    return load_models(["deepfm"], max_batch=4)


def eager(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def tiny_request(x: torch.Tensor) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.numel() * 4}}],
                       "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}).encode()
    return head + encode_tensor(x), {HEADER: str(len(head))}


def deepfm_request(seed: int) -> tuple[list[torch.Tensor], bytes, dict]:
    g = torch.Generator().manual_seed(seed)
    sparse, dense = torch.randint(0, 1000, (1, 26), generator=g), torch.rand(1, 13, generator=g)
    head = (b'{"inputs": [{"name": "sparse", "shape": [1, 26], "datatype": "INT64", "parameters": '
            b'{"binary_data_size": 208}}, {"name": "dense", "shape": [1, 13], "datatype": "FP32", "parameters": '
            b'{"binary_data_size": 52}}], "outputs": [{"name": "output__0", "parameters": {"binary_data": true}}]}'
            )
    return [sparse, dense], head + encode_tensor(sparse) + encode_tensor(dense), {HEADER: str(len(head))}


def binary_output(response: httpx.Response) -> torch.Tensor:
    size = int(response.headers[HEADER])
    shape = json.loads(response.content[:size])["outputs"][0]["shape"]
    return torch.frombuffer(bytearray(response.content[size:]), dtype=torch.float32).reshape(shape)


# ---- the engine --------------------------------------------------------------------------------------------------
def test_engine_adds_and_removes_a_model_between_steps_answering_what_it_accepted(base, repo):
    root, models = repo
    engine = make_engine(dict(base), device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    extra = load_models([], {"tiny": root / "tiny" / "2" / "model.pt2"}, max_batch=4)["tiny"]
    engine.start()
    try:
        engine.add_model("tiny", extra.blocked, 4)
        with pytest.raises(Exception, match="already served"):
            engine.add_model("tiny", extra.blocked, 4)
        done = []
        xs = [torch.randn(1, 3, 8, 8) for _ in range(12)]
        for x in xs:
            engine.submit("tiny", (x,), on_done=done.append)
        remover = threading.Thread(target=engine.remove_model, args=("tiny",))
        remover.start()
        with engine.wakeup:  # remove_model marks it closing and notifies; then it may leave at once
            assert engine.wakeup.wait_for(lambda: "tiny" not in engine.models or engine.models["tiny"].closing,
                                          WAIT_S), f"remove_model did not start closing the model in {WAIT_S:g} s"
        # closing: new requests are refused while those queued are still answered (already gone: unknown, also clean)
        with pytest.raises((Unavailable, UsageError), match="being unloaded|unknown model 'tiny'"):
            engine.submit("tiny", (xs[0],))
        remover.join(timeout=WAIT_S)
        assert not remover.is_alive() and "tiny" not in engine.models and "tiny" not in engine.executor.models
        assert [r.status for r in done] == ["done"] * 12  # every accepted request answered
        by_x = {id(r.inputs[0]): r for r in done}
        for x in xs:
            assert torch.allclose(by_x[id(x)].output, eager(models["tiny/2"], [x]), atol=1e-5)
        with pytest.raises(Exception, match="unknown model 'tiny'"):
            engine.submit("tiny", (xs[0],))
        # the other model went on, and the removed one can come back
        engine.add_model("tiny", extra.blocked, 4)
        answer = threading.Event()
        engine.submit("tiny", (xs[1],), on_done=lambda r: answer.set())
        assert answer.wait(60)
    finally:
        engine.stop(timeout_s=10)


def test_an_engine_with_no_model_steps_and_takes_one(repo):
    root, models = repo
    engine = make_engine({}, device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    assert engine.step() is False and engine.observe().queue_variance == 0.0
    extra = load_models([], {"tiny": root / "tiny" / "1" / "model.pt2"}, max_batch=4)["tiny"]
    engine.add_model("tiny", extra.blocked)
    engine.start()
    try:
        x = torch.randn(2, 3, 8, 8)
        answered = threading.Event()
        request = engine.submit("tiny", (x,), batch=2, on_done=lambda r: answered.set())
        assert answered.wait(60) and torch.allclose(request.output, eager(models["tiny/1"], [x]), atol=1e-5)
        engine.remove_model("tiny")
        assert engine.models == {} and engine.step() is False
    finally:
        engine.stop(timeout_s=10)


# ---- the repository ----------------------------------------------------------------------------------------------
def test_repository_layout_versions_and_config(base, repo):
    root, models = repo
    engine = make_engine(dict(base), device="cpu", policy="heuristic", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, dict(base), root, max_batch=4, control="explicit")
    assert repository.names() == ["broken", "squeezenet", "tiny"]
    index = {m["name"]: m for m in repository.index()}
    assert index["deepfm"]["state"] == "READY" and index["tiny"] == {"name": "tiny", "version": "2",
                                                                     "state": "UNAVAILABLE", "reason": "not loaded"}
    model = repository.load("tiny")
    assert model.version == "2" and model.max_batch == 4 and "tiny" in engine.models
    assert repository.load("tiny") is model  # unchanged: not reloaded
    squeeze = repository.load("squeezenet")
    assert squeeze.max_batch == 2 and engine.models["squeezenet"].max_batch == 2
    with pytest.raises(Refused, match=r"lists inputs \['image'\], the program takes \['x'\]") as info:
        repository.load("broken")
    assert info.value.kind == "invalid"
    assert {m["name"]: m["state"] for m in repository.index()}["broken"] == "UNAVAILABLE"
    with pytest.raises(Refused, match="not in the repository") as info:
        repository.load("nope")
    assert info.value.kind == "not_found"
    # a config passed with the load request (tritonclient's load_model(config=...)): version 1 only, batch 3
    one = repository.load("tiny", '{"max_batch_size": 3, "version_policy": {"specific": {"versions": [1]}}}')
    assert one.version == "1" and one.max_batch == 3 and engine.models["tiny"].max_batch == 3
    with pytest.raises(Refused, match="does not parse"):
        repository.load("tiny", '{"max_batch_size": "many"}')
    repository.unload("tiny")
    assert "tiny" not in engine.models and {m["name"]: m for m in repository.index(ready=True)}.keys() == {
        "deepfm", "squeezenet"}
    with pytest.raises(Refused, match="not loaded"):
        repository.unload("tiny")
    without = Repository(engine, {})
    with pytest.raises(Refused, match="no model repository"):
        without.load("tiny")


def test_load_and_unload_over_http_and_grpc_while_another_model_serves_under_load(base, repo):
    """deepfm answers a steady stream throughout; squeezenet is loaded (capture and ONNX Runtime compiles, off the
    engine's thread), loaded again with requests, and unloaded with requests in flight; then the same over gRPC.
    Every deepfm request is answered and equal eager, some of them while the load was under way; every squeezenet
    request is answered equal eager or refused cleanly (503 or 404), none lost."""
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    root, models = repo
    served = dict(base)
    engine = make_engine(served, device="cpu", policy="heuristic", max_batch=4)
    repository = Repository(engine, served, root, max_batch=4, control="explicit")
    background = BackgroundServer(engine, served, grpc=True, repository=repository)
    reference = zoo.create("deepfm")[0]
    squeeze = models["squeezenet"]
    loads: list[tuple[float, float]] = []
    answered_during_load = threading.Event()
    warm = engine.executor.warm_model

    def warm_then_wait_for_deepfm(*args, **kwargs):
        """The load's last step: it returns only once a deepfm request sent after it began has been answered (or
        after WAIT_S: the assertion on ``during`` below then fails), so "during" does not depend on how long the
        compiles take against a request's round trip."""
        warm(*args, **kwargs)
        answered_during_load.wait(WAIT_S)

    engine.executor.warm_model = warm_then_wait_for_deepfm
    with background as url:
        http = triton_http.InferenceServerClient(url.removeprefix("http://"))
        loaded_blocks: list = []

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as c:
                stop = asyncio.Event()

                async def steady():
                    out, i = [], 0
                    while not stop.is_set() or len(out) <= 20:
                        inputs, body, headers = deepfm_request(i)
                        sent = time.monotonic()
                        r = await c.post("/v2/models/deepfm/infer", content=body, headers=headers)
                        out.append((inputs, r, sent, time.monotonic()))
                        if loads and sent > loads[0][0]:
                            answered_during_load.set()
                        i += 1
                        await asyncio.sleep(0.02)
                    return out

                async def squeeze_one(i):
                    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(i))
                    body, headers = tiny_request(x)
                    return x, await c.post("/v2/models/squeezenet/infer", content=body, headers=headers)

                background_load = asyncio.create_task(steady())
                await asyncio.sleep(0.5)
                loads.append((time.monotonic(), float("inf")))
                r = await c.post("/v2/repository/models/squeezenet/load")
                loads[0] = (loads[0][0], time.monotonic())
                assert r.status_code == 200, r.text
                assert 'opweave_queue_depth{model="squeezenet"}' in (await c.get("/metrics")).text
                loaded_blocks.extend(bool(b.compiled) for key, b in engine.executor._blocks.items()
                                     if key[0] == "squeezenet")  # compiled before its first request
                first = await asyncio.gather(*(squeeze_one(i) for i in range(6)))
                flight = [asyncio.create_task(squeeze_one(100 + i)) for i in range(12)]
                await asyncio.sleep(0.01)
                r = await c.post("/v2/repository/models/squeezenet/unload")
                assert r.status_code == 200, r.text
                late = await squeeze_one(999)
                index = await c.post("/v2/repository/index", json={})
                assert 'model="squeezenet"' not in (await c.get("/metrics")).text  # its series went with it
                await asyncio.sleep(0.3)
                stop.set()
                return await background_load, first, await asyncio.gather(*flight), late, index.json()

        steady, first, flight, late, index = asyncio.run(scenario())
        # the same over gRPC, while deepfm still answers
        rpc = triton_grpc.InferenceServerClient(background.grpc_address)
        assert not rpc.is_model_ready("squeezenet")
        rpc.load_model("squeezenet")
        assert rpc.is_model_ready("squeezenet")
        x = torch.randn(2, 3, 64, 64)
        item = triton_grpc.InferInput("x", [2, 3, 64, 64], "FP32")
        item.set_data_from_numpy(x.numpy())
        got = torch.from_numpy(np.array(rpc.infer("squeezenet", [item]).as_numpy("output__0")))
        assert torch.allclose(got, eager(squeeze, [x]), rtol=1e-4, atol=1e-4)
        states = {m["name"]: m["state"] for m in rpc.get_model_repository_index(as_json=True)["models"]}
        assert states["squeezenet"] == "READY" and states["broken"] == "UNAVAILABLE"
        rpc.unload_model("squeezenet")
        assert not rpc.is_model_ready("squeezenet") and http.is_model_ready("deepfm")
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as info:
            rpc.load_model("broken")
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "opweave does not rename" in \
            info.value.message()
        with pytest.raises(InferenceServerException) as info:
            http.load_model("nope")
        assert "not in the repository" in info.value.message()
        rpc.close()
        http.close()
    assert [r.status_code for _, r, _, _ in steady] == [200] * len(steady) and len(steady) > 20
    for inputs, r, _, _ in steady:
        assert torch.allclose(binary_output(r), eager(reference, inputs), rtol=1e-4, atol=1e-4)
    start, end = loads[0]
    during = [t for _, _, sent, t in steady if start < sent and t < end]
    assert during, f"no deepfm request was answered during the {end - start:.2f} s load"
    for x, r in first:
        assert r.status_code == 200 and torch.allclose(binary_output(r), eager(squeeze, [x]), rtol=1e-4, atol=1e-4)
    codes = [r.status_code for _, r in flight]
    assert set(codes) <= {200, 503, 404}, [r.text for _, r in flight]
    for x, r in flight:
        if r.status_code == 200:
            assert torch.allclose(binary_output(r), eager(squeeze, [x]), rtol=1e-4, atol=1e-4)
    assert late[1].status_code == 404 and "unknown model 'squeezenet'" in late[1].json()["error"]
    assert {m["name"]: m["state"] for m in index}["squeezenet"] == "UNAVAILABLE"
    # its ONNX Runtime blocks were compiled by the load (off the engine's thread) and went with the unload
    assert not [key for key in engine.executor._blocks if key[0] == "squeezenet"]
    assert loaded_blocks and all(loaded_blocks)


def test_cli_serves_a_model_repository_and_refuses_one_that_does_not_load(repo, tmp_path):
    import shutil
    import subprocess
    import sys

    import tritonclient.http as triton_http

    root, models = repo
    clean = tmp_path / "repo"
    shutil.copytree(root / "tiny", clean / "tiny")
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(clean), "--port",
                             "0", "--compiler", "none", "--max-batch", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "tiny (" in line and "listening on http://127.0.0.1:" in line, proc.stderr.read()
        client = triton_http.InferenceServerClient(line.strip().rsplit(" ", 1)[1].removeprefix("http://"))
        assert client.get_model_repository_index() == [{"name": "tiny", "version": "2", "state": "READY",
                                                         "reason": ""}]
        x = torch.randn(3, 3, 8, 8)
        got = http_infer(client, "tiny", "x", "output__0", x)
        assert torch.allclose(got, eager(models["tiny/2"], [x]), atol=1e-5)
        client.close()
        proc.terminate()
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # with --strict, a model of the repository that does not load stops the start, naming it (Triton's
    # exit-on-error); without it, see test_serve_hostile.py: it is UNAVAILABLE and the others are served
    proc = subprocess.run([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root), "--port", "0",
                           "--compiler", "none", "--strict"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2 and "model 'broken'" in proc.stderr and proc.stdout == ""


# ---- Triton's PyTorch layout: TorchScript model.pt ---------------------------------------------------------------
class Masked(torch.nn.Module):
    """Two inputs, taken by forward's argument names: a config that lists them in another order must not swap them."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, image, mask):
        return torch.relu(self.conv(image)) * mask


class Looped(torch.nn.Module):
    """A loop over a tensor's size: TorchScript keeps it as prim::Loop, which torch's converter does not convert."""

    def forward(self, x):
        out = []
        for i in range(int(x.shape[0])):
            out.append(x[i] * i)
        return torch.stack(out)


FP32_IMAGE = 'data_type: TYPE_FP32 dims: [ 3, 8, 8 ]'


@pytest.fixture(scope="module")
def script_repo(tmp_path_factory):
    """scripted/1 (torch.jit.script of tiny, Triton's INPUT__0 / OUTPUT__0 names), traced/1 (torch.jit.trace of
    Masked, inputs by argument name, listed mask first), noconfig/1 (TorchScript without a config), looped/1
    (TorchScript the converter refuses), onnx/1 (a model.onnx: another backend's file)."""
    root = tmp_path_factory.mktemp("torchscript")
    model, x = tiny(seed=4)
    (root / "scripted" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(model), str(root / "scripted" / "1" / "model.pt"))
    (root / "scripted" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 4\n'
        f'input [ {{ name: "INPUT__0" {FP32_IMAGE} }} ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 10 ] } ]\n')
    torch.manual_seed(5)
    masked = Masked().eval()
    (root / "traced" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.trace(masked, (torch.randn(1, 3, 8, 8), torch.rand(1, 2, 8, 8))),
                   str(root / "traced" / "1" / "model.pt"))
    (root / "traced" / "config.pbtxt").write_text(
        'max_batch_size: 4\ninput [ { name: "mask" data_type: TYPE_FP32 dims: [ 2, 8, 8 ] },\n'
        f'        {{ name: "image" {FP32_IMAGE} }} ]\n')
    (root / "noconfig" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(model), str(root / "noconfig" / "1" / "model.pt"))
    (root / "looped" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(Looped()), str(root / "looped" / "1" / "model.pt"))
    (root / "looped" / "config.pbtxt").write_text(f'max_batch_size: 4\ninput [ {{ name: "x" {FP32_IMAGE} }} ]\n')
    (root / "onnx" / "1").mkdir(parents=True)
    (root / "onnx" / "1" / "model.onnx").write_bytes(b"not opweave's")
    return root, {"scripted": model, "traced": masked}


def test_a_torchscript_repository_serves_what_converts_equal_to_eager_and_says_why_not_the_rest(script_repo):
    root, models = script_repo
    served: dict = {}
    engine = make_engine(served, device="cpu", policy="static", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, served, root, max_batch=4)
    assert repository.names() == ["looped", "noconfig", "onnx", "scripted", "traced"]
    assert sorted(repository.load_all()) == ["scripted", "traced"]
    index = {m["name"]: m for m in repository.index()}
    assert {n: m["state"] for n, m in index.items()} == {"looped": "UNAVAILABLE", "noconfig": "UNAVAILABLE",
                                                         "onnx": "UNAVAILABLE", "scripted": "READY",
                                                         "traced": "READY"}
    assert "converter cannot convert it" in index["looped"]["reason"] and "prim::Loop" in index["looped"]["reason"]
    assert "list its inputs (name, data_type, dims) in config.pbtxt" in index["noconfig"]["reason"]
    assert "no model.pt2 or model.pt" in index["onnx"]["reason"] and "1/model.onnx" in index["onnx"]["reason"]
    assert all("\n" not in m["reason"] and str(root) not in m["reason"] for m in index.values())
    scripted, traced = served["scripted"], served["traced"]
    assert [(s.name, s.shape) for s in scripted.inputs] == [("INPUT__0", (-1, 3, 8, 8))]
    assert [s.name for s in scripted.outputs] == ["OUTPUT__0"] and scripted.source == "scripted/1/model.pt"
    assert [s.name for s in traced.inputs] == ["image", "mask"]  # forward's order, not the config's
    engine.start()
    try:
        x = torch.randn(3, 3, 8, 8)
        image, mask = torch.randn(2, 3, 8, 8), torch.rand(2, 2, 8, 8)
        done = [threading.Event(), threading.Event()]
        first = engine.submit("scripted", (x,), batch=3, on_done=lambda r: done[0].set())
        second = engine.submit("traced", (image, mask), batch=2, on_done=lambda r: done[1].set())
        assert done[0].wait(60) and done[1].wait(60)
        assert torch.allclose(first.output, eager(models["scripted"], [x]), atol=1e-5)
        assert torch.allclose(second.output, eager(models["traced"], [image, mask]), atol=1e-5)
    finally:
        engine.stop(timeout_s=10)


def test_cli_serves_torchscript_to_tritonclient_and_warns_at_start_of_what_it_cannot(script_repo):
    import subprocess
    import sys

    import tritonclient.http as triton_http

    root, models = script_repo
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--model-repository", str(root), "--port",
                             "0", "--compiler", "none", "--max-batch", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read()
        assert "scripted (" in line and "UNAVAILABLE: looped, noconfig, onnx" in line, line
        client = triton_http.InferenceServerClient(line.strip().rsplit(" ", 1)[1].removeprefix("http://"))
        assert client.is_model_ready("scripted") and not client.is_model_ready("onnx")
        x = torch.randn(2, 3, 8, 8)
        got = http_infer(client, "scripted", "INPUT__0", "OUTPUT__0", x)
        assert torch.allclose(got, eager(models["scripted"], [x]), atol=1e-5)
        client.close()
        proc.terminate()
        assert proc.wait(timeout=600) == 0
        warnings = [w for w in proc.stderr.read().splitlines() if w.startswith("model repository: model ")]
        assert [w.split("'")[1] for w in warnings] == ["looped", "noconfig", "onnx"], warnings
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_a_torchscript_config_whose_example_is_huge_is_refused_before_anything_is_allocated():
    """A load request may carry the config (explicit model control): dims of 300000 x 300000 asked for 360 GB of
    example input, which the server allocated (a RuntimeError, or the OOM killer) before refusing anything."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    from opweave.serve.repository.layout import torchscript_inputs

    config = json_format.Parse('{"max_batch_size": 1, "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", '
                               '"dims": [300000, 300000]}]}', model_config_pb2.ModelConfig())
    with pytest.raises(Refused, match=r"model 'm': the inputs of its config take over 256 MiB at batch 1"):
        torchscript_inputs("m", config)
    small = json_format.Parse('{"input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2, 3]}]}',
                              model_config_pb2.ModelConfig())
    assert torchscript_inputs("m", small)["x"].shape == (2, 3)


def test_a_version_directory_that_cannot_be_listed_is_refused_in_one_line(tmp_path, monkeypatch):
    """A version directory without a program whose listing fails (a directory the server may enter but not read):
    the PermissionError escaped the load as a 500 with a traceback; it is a refusal naming the model."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    engine = make_engine({}, device="cpu", policy="static", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    repository = Repository(engine, {}, tmp_path, max_batch=4)
    listing = Path.iterdir

    def unreadable(self):
        if self.name == "1":
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", unreadable)
    with pytest.raises(Refused, match=r"model 'm' is not in the repository"):
        repository.locate("m", repository.read_config("m"))
