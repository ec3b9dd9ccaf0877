"""The engine on Ray Serve: ``opweave serve --ray --replicas 2`` on a local Ray cluster on 127.0.0.1 (CPU), answered
through Ray Serve's proxy and the front by tritonclient (HTTP) equal to eager; one replica process killed mid-load,
every accepted request still answered 200 (the front hands the dead replica's requests to the other: no client sees
a 5xx), Ray replacing the replica; SIGTERM shuts it all down. And one replica alone and the front alone, without
Ray."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import numpy as np
import pytest
import torch

from opweave import zoo
from opweave.serve.protocol import HEADER, encode_tensor
from opweave.serve.ray import Replica, ReplicaOptions, retrying_post


def eager(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def binary_request(x: torch.Tensor) -> tuple[bytes, dict]:
    import json

    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.numel() * 4}}],
                       "outputs": [{"name": "output__0", "parameters": {"binary_data": True}}]}).encode()
    return head + encode_tensor(x), {HEADER: str(len(head))}


def binary_output(response: httpx.Response) -> torch.Tensor:
    import json

    size = int(response.headers[HEADER])
    shape = json.loads(response.content[:size])["outputs"][0]["shape"]
    return torch.frombuffer(bytearray(response.content[size:]), dtype=torch.float32).reshape(shape)


def test_one_replica_alone_serves_the_v2_routes(tiny_file):
    from fastapi.testclient import TestClient

    replica = Replica(ReplicaOptions(model_files={"tiny": str(tiny_file[1])}, options={"compiler": "none"},
                                     max_batch=4))
    try:
        assert replica.healthy()
        x = torch.randn(3, 3, 8, 8)
        body, headers = binary_request(x)
        status, answer_headers, content = asyncio.run(replica.forward(  # what the front hands a replica
            "POST", b"/v2/models/tiny/infer", b"", [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            body))
        assert status == 200 and torch.allclose(binary_output(httpx.Response(status, headers=answer_headers,
                                                                             content=content)),
                                                eager(tiny_file[0], [x]), atol=1e-5)
        with TestClient(replica.app()) as client:
            assert client.get("/v2/health/ready").status_code == 200
            x = torch.randn(2, 3, 8, 8)
            body, headers = binary_request(x)
            r = client.post("/v2/models/tiny/infer", content=body, headers=headers)
            assert r.status_code == 200 and torch.allclose(binary_output(r), eager(tiny_file[0], [x]), atol=1e-5)
            assert [m["name"] for m in client.post("/v2/repository/index").json()] == ["tiny"]
            r = client.post("/v2/repository/models/tiny/unload")
            assert r.status_code == 400 and "one replica only" in r.json()["error"]
    finally:
        replica.stop()
    assert not replica.healthy()


def test_pin_puts_a_replica_on_its_own_cores():
    code = ("import os; from opweave.serve.ray import pin; usable = sorted(os.sched_getaffinity(0)); "
            "chosen = pin(1, 1); print(chosen == [usable[1 % len(usable)]], sorted(os.sched_getaffinity(0)) == chosen)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.stdout.split() == ["True", "True"], result.stderr


def test_a_local_cluster_gives_serves_proxy_a_minute_to_start(monkeypatch):
    """Ray Serve killed its HTTP proxy when it was not ready 5 s after its start, which a busy machine missed (the
    deployment then failed); the local cluster's processes inherit a minute, unless the environment says otherwise."""
    ray = pytest.importorskip("ray")
    from opweave.serve import ray as opweave_ray

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "7")
    opweave_ray.start_local()
    assert seen["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
    assert seen["RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"] == "7"


def test_retrying_post_waits_out_a_429_and_gives_up_on_other_refusals():
    """The CI run of 2026-11-25 lost two requests of the kill test to 429s: the surviving replica's queue filled
    with the dead one's share, and the client gave up on a refusal that said when to come back."""
    seen = []

    def handler(request):
        seen.append(request.url.path)
        if request.url.path == "/bad":
            return httpx.Response(400, json={"error": "bad"})
        if len(seen) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": "queue full"})
        if len(seen) == 2:
            return httpx.Response(503)
        return httpx.Response(200, json={"ok": True})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as c:
            ok = await retrying_post(c, "/infer", backoff_s=0.0)
            bad = await retrying_post(c, "/bad", backoff_s=0.0)
            return ok, bad

    (ok, ok_failures), (bad, bad_failures) = asyncio.run(go())
    assert ok.status_code == 200 and ok_failures == ["429", "503"]
    assert bad.status_code == 400 and bad_failures == [] and seen.count("/bad") == 1


def test_the_front_hands_a_dead_replicas_request_to_another_and_answers_its_own_errors_as_json():
    """Ray's proxy answered a request whose replica died with a plain-text 500 that tritonclient cannot parse; the
    front hands it to another replica, and what it answers itself is ``{"error": ...}``."""
    from ray.exceptions import ActorDiedError

    from opweave.serve.ray import front_app

    calls = []

    async def flaky(request):
        calls.append(request)
        if len(calls) == 1:
            raise ActorDiedError()
        return 200, [(b"content-type", b"application/json")], b'{"ok": true}'

    async def broken(request):
        raise RuntimeError("boom")

    async def dead(request):
        raise ActorDiedError()

    async def go():
        answers = []
        for forward, body in ((flaky, b"abc"), (broken, b""), (dead, b""), (flaky, b"x" * 101)):
            app = front_app(forward, limit=100, attempts=3, backoff_s=0.0)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as c:
                answers.append(await c.post("/v2/models/tiny/infer?a=1", content=body))
        return answers

    ok, bad, gone, large = asyncio.run(go())
    assert ok.status_code == 200 and ok.json() == {"ok": True} and len(calls) == 2
    assert calls[1][:3] == ("POST", b"/v2/models/tiny/infer", b"a=1") and calls[1][4] == b"abc"
    assert bad.status_code == 500 and bad.json() == {"error": "RuntimeError: boom"}
    assert gone.status_code == 503 and gone.json()["error"].startswith("no replica answered in 3 tries")
    assert large.status_code == 400 and "exceeds the limit of 100 bytes" in large.json()["error"]
    assert len(calls) == 2  # the body over the limit never reached a replica


def test_the_fronts_body_limit_is_the_replicas_asked_once():
    """The front took up to 64 MiB per body (192 at once) and shipped it to a replica that refused anything over the
    model's limit; it now asks the replicas for their limit (a dead one's question handed on) and refuses a larger
    body itself, before reading it whole."""
    from ray.exceptions import ActorDiedError

    from opweave.serve.ray import front_app

    asked, forwarded = [], []

    async def limit():
        asked.append(1)
        if len(asked) == 1:
            raise ActorDiedError()
        return 1000

    async def forward(request):
        forwarded.append(request)
        return 200, [], b"{}"

    async def go():
        app = front_app(forward, limit, attempts=3, backoff_s=0.0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as c:
            return [await c.post("/v2/models/tiny/infer", content=b"x" * n) for n in (1000, 1001, 10)]

    fits, large, small = asyncio.run(go())
    assert (fits.status_code, large.status_code, small.status_code) == (200, 400, 200)
    assert large.json()["error"] == "request body of 1001 bytes exceeds the limit of 1000 bytes"
    assert len(asked) == 2 and len(forwarded) == 2  # asked once (after the dead replica), the large body kept back


def test_a_replicas_body_limit_is_its_largest_models(tiny_file):
    from opweave.serve.protocol import request_limit

    replica = Replica(ReplicaOptions(model_files={"tiny": str(tiny_file[1])}, options={"compiler": "none"},
                                     max_batch=4))
    try:
        assert replica.body_limit() == request_limit(replica.repository.served["tiny"]) < 1 << 20
    finally:
        replica.stop()


def _replicas(pid: int) -> list[int]:
    """The Ray Serve replica processes under the server process ``pid`` (Ray's workers are its descendants)."""
    import psutil

    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "OpweaveReplica" in " ".join(child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.ray
def test_two_ray_serve_replicas_answer_equal_eager_and_a_killed_one_loses_no_accepted_request(tiny_file, tmp_path):
    pytest.importorskip("ray.serve")
    pytest.importorskip("psutil")
    import tritonclient.http as triton

    squeeze = zoo.create("squeezenet", image_size=64)[0]
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "serve", "--ray", "--replicas", "2", "--models",
                             "squeezenet", "--image-size", "64", "--model-file", f"tiny={tiny_file[1]}", "--port", "0",
                             "--max-batch", "4", "--policy", "batch"], stdout=out, stderr=err, env=env)
    try:
        url = None
        deadline = time.monotonic() + 600  # Ray's start and both replicas' loads (minutes on a loaded machine)
        while time.monotonic() < deadline:
            text = (tmp_path / "out.txt").read_text()
            if "listening on http://127.0.0.1:" in text:
                url = text.split("listening on ", 1)[1].split()[0]
                break
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.1)
        assert url, "opweave serve --ray did not come up within 600 s"
        first = _replicas(proc.pid)
        assert len(first) == 2, first

        # tritonclient through Ray Serve's proxy, equal eager
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        assert client.is_server_ready() and client.is_model_ready("squeezenet")
        assert client.get_model_metadata("tiny")["inputs"][0]["shape"] == [-1, 3, 8, 8]
        for model, reference, shape in (("squeezenet", squeeze, (3, 3, 64, 64)), ("tiny", tiny_file[0], (2, 3, 8, 8))):
            for binary in (True, False):
                x = torch.randn(*shape)
                item = triton.InferInput("x", list(shape), "FP32")
                item.set_data_from_numpy(x.numpy(), binary_data=binary)
                result = client.infer(model, [item], outputs=[triton.InferRequestedOutput("output__0",
                                                                                          binary_data=binary)])
                got = torch.from_numpy(np.array(result.as_numpy("output__0")))
                assert torch.allclose(got, eager(reference, [x]), rtol=1e-4, atol=1e-4), (model, binary)
        client.close()

        # a steady load; one replica process killed in the middle of it
        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                async def one(i):
                    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(i))
                    body, headers = binary_request(x)
                    await asyncio.sleep(0.002 * i)
                    # the documented retry, with a budget for a loaded machine (Ray may take seconds there to see
                    # the replica gone, and the other one's queue to make room): 20 tries, 38 s of back-off at most
                    r, tries = await retrying_post(c, "/v2/models/squeezenet/infer", attempts=20, content=body,
                                                   headers=headers)
                    return x, r, tries

                tasks = [asyncio.create_task(one(i)) for i in range(150)]
                await asyncio.sleep(0.25)  # both replicas hold requests by now: 150 are sent within 0.3 s
                os.kill(first[0], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        results = asyncio.run(load())
        codes = [r.status_code for _, r, _ in results]
        assert codes == [200] * 150, [r.text[:200] for _, r, _ in results if r.status_code != 200]
        for x, r, _ in results:
            assert torch.allclose(binary_output(r), eager(squeeze, [x]), rtol=1e-4, atol=1e-4)
        failures = Counter(f for _, _, fs in results for f in fs)
        print(f"ray kill: 150 requests, {sum(bool(fs) for _, _, fs in results)} answered after a retry; failed "
              f"tries {dict(failures)}")
        # the front handed the dead replica's requests to the survivor: no client saw a 5xx (a 429 is a refusal
        # that says when to come back, not a failure)
        assert not [f for f in failures if f.startswith("5") or not f.isdigit()], failures

        # Ray replaces the killed replica
        deadline = time.monotonic() + 600  # a new replica starts and loads its models
        while time.monotonic() < deadline:
            now = _replicas(proc.pid)
            if len(now) == 2 and first[0] not in now:
                break
            time.sleep(0.1)
        assert len(now) == 2 and first[0] not in now, f"Ray had not replaced the killed replica in 600 s: {now}"
        with httpx.Client(base_url=url, timeout=60) as c:
            x = torch.randn(1, 3, 8, 8)
            body, headers = binary_request(x)
            r = c.post("/v2/models/tiny/infer", content=body, headers=headers)
            assert r.status_code == 200 and torch.allclose(binary_output(r), eager(tiny_file[0], [x]), atol=1e-5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=600) == 0  # Ray Serve and the cluster shut down (slow on a loaded machine)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        out.close()
        err.close()
