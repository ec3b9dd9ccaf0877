"""The serving engine on CUDA (a real GPU where one is present, else the fake CUDA runtime: ``tests/cuda_runtime.py``):
combined blocks recorded into CUDA graphs, one per signature in a bounded LRU cache, answers equal eager."""

import pytest
import torch

from cuda_precision import fp32_math  # noqa: F401 - autouse: no TF32 in the CUDA tests
from cuda_runtime import DEVICE, rt  # noqa: F401 - rt: the runtime fixture
from opweave.backends.cuda import default_streams
from opweave.capture import capture
from opweave.serve.assemble import serving_options
from opweave.serve.engine import Engine, blocks, policies
from opweave.serve.engine.combined import Part
from opweave.serve.engine.cuda import CudaExecutor
from opweave.serve.engine.executors import RealClock
from serve_models import tiny

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def on_device():
    model, x = tiny()
    model, x = model.to(DEVICE), tuple(t.to(DEVICE) for t in x)
    return model, blocks.split(capture(model, x), x, name="tiny")


def test_combined_blocks_are_recorded_once_per_signature_and_answer_like_eager(on_device, rt):  # noqa: F811
    model, bm = on_device
    ex = CudaExecutor({"a": bm, "b": bm}, serving_options("cuda", runtime=rt, cache_size=2))
    assert ex.streams == default_streams()  # capped as opweave.compile caps lanes (it had no cap)
    x, y = torch.randn(3, 3, 8, 8, device=DEVICE), torch.randn(2, 3, 8, 8, device=DEVICE)
    first = Part("a", 0, 3, (x,))
    ex.run([first])  # each run ends by synchronizing its stream
    parts = [Part("a", 1, 3, first.state), Part("b", 0, 2, (y,))]
    ex.run(parts)
    with torch.no_grad():
        assert torch.allclose(parts[0].state, model(x), atol=1e-4)
        assert torch.allclose(parts[1].state[0], bm.modules[0](y), atol=1e-4)
    assert [n for sig in ex._cache for _, _, n in sig] == [4, 4, 2]  # batch 3 padded to 4
    ex.run([Part("a", 0, 1, (x[:1],))])
    assert ex.stats["evictions"] == 1 and ex.stats["misses"] == 3
    ex.run([Part("a", 0, 1, (x[:1],))])
    assert ex.stats["hits"] == 1


def test_engine_on_cuda_stacks_requests_without_mixing_them_up(on_device, rt):  # noqa: F811
    model, bm = on_device
    eng = Engine(CudaExecutor({"a": bm}, serving_options("cuda", runtime=rt)), policies.create("heuristic"),
                 RealClock(), max_batch=4)
    inputs = [torch.randn(1, 3, 8, 8) for _ in range(12)]
    requests = [eng.submit("a", (x,)) for x in inputs]
    while eng.busy():
        eng.step()
    with torch.no_grad():
        for r, x in zip(requests, inputs, strict=True):
            assert r.status == "done" and torch.allclose(r.output, model(x.to(DEVICE)).cpu(), atol=1e-4)


def test_a_combined_block_is_planned_on_the_fitted_gpu_as_the_cuda_default_plans(rt, monkeypatch):  # noqa: F811
    """The CUDA executor planned its combined blocks on roofline estimates; it builds them through the pipeline's
    CUDA target, which plans on the fitted GPU's op times (the calibrated costs the CUDA default uses)."""
    from opweave.costs import calibrated

    planned = []
    real = calibrated.costs

    def fitted(graph, *args, **kwargs):
        planned.append(graph.name)
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(calibrated, "costs", fitted)
    model, x = tiny()
    model, x = model.to(DEVICE), tuple(t.to(DEVICE) for t in x)
    bm = blocks.split(capture(model, x), x, name="a")
    ex = CudaExecutor({"a": bm}, serving_options("cuda", runtime=rt))
    ex.run([Part("a", 0, 1, ex.prepare("a", [x]))])
    assert planned == ["a.b0x1"]
