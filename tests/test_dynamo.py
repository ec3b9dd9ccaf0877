"""``torch.compile(model, backend="opweave")`` on the CPU: registered by entry point, same results as eager,
options reach the scheduler, symbolic shapes fall back to eager with a warning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave.dynamo
import opweave.errors
from opweave import zoo
from opweave.outputs import compare
from opweave.pipeline import targets


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 5, padding=2)
        self.norm = nn.BatchNorm2d(24)

    def forward(self, x):
        y = torch.cat([self.a(x).relu(), self.b(x).sigmoid(), self.c(x)], 1)
        return self.norm(y).relu_(), x.mean()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_is_registered_by_entry_point():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "opweave" in list_backends(exclude_tags=())
    assert lookup_backend("opweave") is opweave.dynamo.opweave_backend


def test_branchy_model_matches_eager_and_options_reach_the_scheduler():
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(2, 3, 16, 16)
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 3})
    with torch.no_grad():
        expected, got = model(x), fast(x)
    assert isinstance(got, tuple) and len(got) == 2
    for e, g in zip(expected, got, strict=True):
        assert torch.allclose(e, g, atol=1e-5)
    compiled = opweave.dynamo.last_compiled()
    assert compiled.schedule.scheduler == "lios" and compiled.device == "cpu"
    assert 1 < compiled.schedule.streams_used <= 3
    placeholders = [n for n in compiled.backend.captured.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 1  # the lifted parameters and buffers were baked back into the module
    with torch.no_grad():  # replay with new values, same shapes: no recompilation
        x2 = torch.randn_like(x)
        assert torch.allclose(model(x2)[0], fast(x2)[0], atol=1e-5)
    assert opweave.dynamo.compiled_graphs()[-1] is compiled


def test_zoo_model_matches_eager():
    model, inputs = zoo.create("squeezenet")
    fast = torch.compile(model, backend="opweave")
    with torch.no_grad():
        assert torch.allclose(model(*inputs), fast(*inputs), atol=1e-4)
    compiled = opweave.dynamo.last_compiled()  # the same default plan as opweave.compile's on the CPU
    assert compiled.choice["label"] in targets.DEFAULT_LABELS  # what the guard kept, measured


def test_torch_modes_and_opweave_options_mean_what_they_mean_for_compile():
    x = torch.randn(1, 3, 8, 8)
    for kwargs, match in (({"options": {"fuse": "inductor"}}, "unknown option 'fuse' \\(now 'compiler'\\)"),
                          ({"mode": "reduce-overhead"}, "records CUDA Graphs, which the CPU does not have"),
                          ({"options": {"cudagraphs": True}}, "'cudagraphs' applies to device='cuda' only")):
        torch._dynamo.reset()
        fast = torch.compile(Branchy().eval(), backend="opweave", **kwargs)
        with torch.no_grad(), pytest.raises(Exception, match=match) as info:
            fast(x)
        assert any(isinstance(e, opweave.errors.UsageError) for e in _chain(info.value))


def test_symbolic_shapes_are_compiled_for_each_signature_at_its_first_call():
    """``dynamic=True``: dynamo hands over a graph with symbolic sizes, which ran eagerly with a warning; it is now
    compiled at its first call, for that call's inputs, and for each later signature."""
    import warnings

    import opweave.dynamo

    model = Branchy().eval()
    torch._dynamo.reset()
    opweave.dynamo._COMPILED.clear()
    fast = torch.compile(model, backend="opweave", dynamic=True, options={"scheduler": "lios", "streams": 2})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing runs eagerly
        for batch in (3, 5):
            x = torch.randn(batch, 3, 16, 16)
            got = fast(x)
            assert torch.allclose(model(x)[0], got[0], atol=1e-5)
    built = opweave.dynamo.compiled_graphs()
    assert built and all(g.schedule.scheduler == "lios" for g in built)  # compiled, by the options given
    torch._dynamo.reset()


def test_cuda_only_options_are_refused_for_cpu_graphs():
    fast = torch.compile(Branchy().eval(), backend="opweave", options={"static_outputs": True})
    with torch.no_grad(), pytest.raises(Exception, match="'static_outputs' applies to device='cuda' only"):
        fast(torch.randn(1, 3, 8, 8))


def test_a_swapped_weight_is_used_not_the_baked_one():
    """Dynamo passes lifted parameters unguarded: after a swap the backend must rebuild, not run the old weight."""
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(2, 3, 16, 16)
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 2})
    with torch.no_grad():
        fast(x)
        first = opweave.dynamo.last_compiled()
        model.a.weight = nn.Parameter(torch.randn_like(model.a.weight))
        model.norm.running_var = torch.rand_like(model.norm.running_var) + 0.5  # a buffer swapped too
        for e, g in zip(model(x), fast(x), strict=True):
            assert torch.allclose(e, g, atol=1e-5)
        assert opweave.dynamo.last_compiled() is not first  # rebuilt by the identity check
        again = opweave.dynamo.last_compiled()
        model.a.weight.mul_(2)  # in place: same tensor, no rebuild, and the new values are read
        for e, g in zip(model(x), fast(x), strict=True):
            assert torch.allclose(e, g, atol=1e-5)
        assert opweave.dynamo.last_compiled() is again


@pytest.mark.parametrize("name", ["googlenet", "bert_base"])
def test_a_model_called_without_no_grad_equals_eager_and_refuses_a_backward_in_one_line(name):
    # torch.compile's users call an eval() model so; the backend refused the graph ("needs autograd") before
    model, inputs = zoo.create(name, batch_size=1, **({"num_layers": 2} if name == "bert_base" else
                                                      {"image_size": 64}))
    fast = torch.compile(model, backend="opweave")
    expected, got = model(*inputs), fast(*inputs)
    assert compare(expected, got).ok
    first = got if isinstance(got, torch.Tensor) else next(iter(got.values())) if isinstance(got, dict) else got[0]
    assert first.requires_grad and first.grad_fn is not None  # as eager's
    with pytest.raises(opweave.errors.UsageError, match="opweave compiles for inference") as info:
        first.float().sum().backward()
    assert "\n" not in str(info.value)
    with torch.no_grad():  # the same model under no_grad: outputs as eager's, no autograd
        out = fast(*inputs)
        assert compare(model(*inputs), out).ok


def test_graphs_compiled_with_grad_mode_on_run_and_refuse_their_backward():
    model, x = Branchy().eval(), torch.randn(1, 3, 8, 8)
    fast = torch.compile(model, backend="opweave")
    got = fast(x)  # grad mode on and the parameters require grad
    assert all(torch.allclose(e, g, atol=1e-5) for e, g in zip(model(x), got, strict=True))
    assert all(g.requires_grad for g in got)
    with pytest.raises(opweave.errors.UsageError, match="backward is not planned"):
        (got[0].sum() + got[1].sum()).backward()
    with torch.no_grad():  # the same model compiles under no_grad (dynamo guards on grad mode)
        assert torch.allclose(model(x)[0], fast(x)[0], atol=1e-5)
    with torch.inference_mode():
        assert torch.allclose(model(x)[0], fast(x)[0], atol=1e-5)
    frozen = Branchy().eval().requires_grad_(False)
    plain = torch.compile(frozen, backend="opweave")  # grad mode on, but nothing requires grad: plain outputs
    out = plain(x)
    assert torch.allclose(frozen(x)[0], out[0], atol=1e-5) and not out[0].requires_grad


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
