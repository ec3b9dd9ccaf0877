"""The statistics extension over HTTP and gRPC, read by tritonclient's ``get_inference_statistics``: its counts are the
requests sent (samples, executions, successes, a failure), the four parts of a request add up to its success time,
and unknown models and versions are refused; the gRPC calls opweave does not implement say so in one line."""

import httpx
import numpy as np
import pytest
import torch

from opweave.serve.assemble import load_models, make_engine, serving_options
from opweave.testing.serving import BackgroundServer

triton_http = pytest.importorskip("tritonclient.http")
import tritonclient.grpc as triton_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

PARTS = ("queue", "compute_input", "compute_infer", "compute_output")


def infer(client, module, batch: int, seed: int, model) -> None:
    x = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    item = module.InferInput("x", [batch, 3, 8, 8], "FP32")
    item.set_data_from_numpy(x.numpy())
    got = torch.from_numpy(np.array(client.infer("tiny", [item]).as_numpy("output__0")))
    with torch.no_grad():
        assert torch.allclose(got, model(x), atol=1e-5)


def count(duration: dict) -> tuple[int, int]:
    """A StatisticDuration's count and ns (gRPC's JSON leaves zeros out and writes 64-bit integers as strings)."""
    return int(duration.get("count", 0)), int(duration.get("ns", 0))


def test_statistics_over_http_and_grpc_count_the_requests_sent(tiny_file):
    """Requests one after another under ``static``: every request is one execution; one more request past its
    deadline (1 µs) is a failure and no execution."""
    model, path = tiny_file
    served = load_models([], {"tiny": path}, max_batch=4)
    engine = make_engine(served, device="cpu", policy="static", max_batch=4,
                         options=serving_options("cpu", compiler="none"))
    background = BackgroundServer(engine, served, grpc=True)
    with background as url:
        http = triton_http.InferenceServerClient(url.removeprefix("http://"))
        rpc = triton_grpc.InferenceServerClient(background.grpc_address)
        assert "statistics" in http.get_server_metadata()["extensions"]
        assert "statistics" in rpc.get_server_metadata(as_json=True)["extensions"]
        empty = http.get_inference_statistics("tiny")["model_stats"][0]
        assert (empty["name"], empty["version"], empty["inference_count"], empty["execution_count"]) == (
            "tiny", "1", 0, 0)
        assert set(empty["inference_stats"]) == {"success", "fail", *PARTS, "cache_hit", "cache_miss"}
        batches = [1, 2, 3, 4, 1, 2]
        for i, batch in enumerate(batches):
            infer(*((http, triton_http) if i % 2 else (rpc, triton_grpc)), batch, i, model)
        with httpx.Client(base_url=url, timeout=60) as c:
            late = c.post("/v2/models/tiny/infer", json={
                "inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}],
                "parameters": {"timeout": 1}})
            assert late.status_code == 504
            unknown = c.get("/v2/models/nope/stats")
            assert unknown.status_code == 404 and unknown.json() == {"error": "unknown model 'nope'"}
            assert c.get("/v2/models/tiny/versions/2/stats").status_code == 404
        answers = [http.get_inference_statistics(), http.get_inference_statistics("tiny"),
                   http.get_inference_statistics("tiny", "1"), rpc.get_inference_statistics(as_json=True),
                   rpc.get_inference_statistics("tiny", as_json=True)]
        for answer in answers:
            assert [m["name"] for m in answer["model_stats"]] == ["tiny"]
            stats = answer["model_stats"][0]
            assert int(stats["inference_count"]) == sum(batches)
            assert int(stats["execution_count"]) == len(batches)
            assert int(stats["last_inference"]) > 0
            inference = stats["inference_stats"]
            assert count(inference["fail"])[0] == 1
            successes, success_ns = count(inference["success"])
            assert successes == len(batches) and all(count(inference[p])[0] == len(batches) for p in PARTS)
            assert count(inference["compute_infer"])[1] > 0
            assert abs(success_ns - sum(count(inference[p])[1] for p in PARTS)) <= len(PARTS) * len(batches)
        with pytest.raises(InferenceServerException) as info:
            rpc.get_inference_statistics("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            rpc.get_cuda_shared_memory_status()
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"
        assert info.value.message() == "opweave does not implement CudaSharedMemoryStatus"
        http.close()
        rpc.close()
