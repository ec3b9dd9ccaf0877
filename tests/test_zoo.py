"""The built-in model zoo: every model builds, runs, is deterministic and traces with torch.fx to the same output."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.fx

from opweave import zoo
from opweave.errors import UsageError

# Keep the suite fast: two BERT layers are as good as twelve for checking shapes, tracing and determinism.
TEST_KWARGS = {"bert_base": {"num_layers": 2}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models have many small ops, and on a shared 2-core machine spinning worker threads
    slow them down several times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def expected_shape(name: str, batch_size: int) -> tuple[int, ...]:
    return {"bert_base": (batch_size, 128, 768), "deepfm": (batch_size, 1)}.get(name, (batch_size, 1000))


def run(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs)


@pytest.fixture(scope="module", params=zoo.names())
def built(request):
    name = request.param
    model, inputs = zoo.create(name, **TEST_KWARGS.get(name, {}))
    return name, model, inputs, run(model, inputs)


def test_names_lists_the_papers_models():
    assert set(zoo.names()) == {"inception_v3", "googlenet", "squeezenet", "resnet50", "nasnet_a_mobile",
                                "randwire", "bert_base", "deepfm"}


def test_create_gives_eval_model_and_finite_output_of_expected_shape(built):
    name, model, inputs, out = built
    assert not model.training
    assert out.shape == expected_shape(name, 1)
    assert torch.isfinite(out).all()


def test_fx_symbolic_trace_matches_eager(built):
    name, model, inputs, out = built
    before = [x.clone() for x in inputs]
    traced = torch.fx.symbolic_trace(model)
    assert len(traced.graph.nodes) > 10
    torch.testing.assert_close(run(traced, inputs), out)
    for x, y in zip(inputs, before, strict=True):  # in-place ops never write into the caller's inputs
        assert torch.equal(x, y)


def test_create_is_deterministic(built):
    name, model, inputs, out = built
    model2, inputs2 = zoo.create(name, **TEST_KWARGS.get(name, {}))
    for x, y in zip(inputs, inputs2, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(run(model2, inputs2), out)


def test_batch_size_2(built):
    name = built[0]
    model, inputs = zoo.create(name, batch_size=2, **TEST_KWARGS.get(name, {}))
    assert all(x.shape[0] == 2 for x in inputs)
    out = run(model, inputs)
    assert out.shape == expected_shape(name, 2)
    assert torch.isfinite(out).all()


def test_create_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    zoo.create("squeezenet")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_published_sizes():
    _, (image,) = zoo.create("inception_v3")
    assert image.shape == (1, 3, 299, 299)
    bert, (ids,) = zoo.create("bert_base")
    assert ids.dtype == torch.int64 and ids.shape == (1, 128)
    assert len(bert.layers) == 12
    assert sum(p.numel() for p in bert.parameters()) == 108_891_648  # BERT-base without pooler
    _, (sparse, dense) = zoo.create("deepfm", batch_size=3)
    assert sparse.dtype == torch.int64 and sparse.shape == (3, 26) and dense.shape == (3, 13)


def test_architecture_structure():
    from opweave.zoo import nasnet, randwire

    model, _ = zoo.create("nasnet_a_mobile")  # 4 @ 1056: 3 x 4 normal cells, 2 reductions + 2 stem cells
    assert model.fc.in_features == 1056
    assert sum(isinstance(c, nasnet.NormalCell) for c in model.cells) == 12
    assert sum(isinstance(c, nasnet.ReductionCell) for c in model.cells) == 4
    model, _ = zoo.create("randwire")
    assert [len(stage.nodes) for stage in model.stages] == [32, 32, 32]
    assert randwire.ws_dag(32, 4, 0.75, seed=0) == randwire.ws_dag(32, 4, 0.75, seed=0)
    assert len(randwire.ws_dag(32, 4, 0.75, seed=0)) == 32 * 4 // 2  # WS keeps N*K/2 edges
    bert, _ = zoo.create("bert_base", num_layers=1)
    graph = torch.fx.symbolic_trace(bert).graph
    qkv = [n for n in graph.nodes if n.op == "call_module" and n.target.split(".")[-1] in ("query", "key", "value")]
    assert len(qkv) == 3 and len({n.args[0] for n in qkv}) == 1  # three separate projections of one tensor


@pytest.mark.parametrize(("name", "kwargs", "params"), [
    ("squeezenet", {}, 1_248_424),  # SqueezeNet 1.0, as torchvision's squeezenet1_0
    ("resnet50", {}, 25_557_032),
    ("nasnet_a_mobile", {}, 5_289_978),  # paper: 5.3M
    ("randwire", {}, 5_651_922),  # paper, small regime: 5.6M
])
def test_parameter_counts_match_the_papers(name, kwargs, params):
    model, _ = zoo.create(name, **kwargs)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize(("name", "kwargs"), [
    ("squeezenet", {"bypass": "simple"}),
    ("squeezenet", {"bypass": "complex"}),
    ("randwire", {"regime": "regular", "image_size": 64}),
])
def test_variants_trace(name, kwargs):
    model, inputs = zoo.create(name, **kwargs)
    out = run(model, inputs)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    torch.testing.assert_close(run(torch.fx.symbolic_trace(model), inputs), out)


def test_unknown_name_lists_valid_names():
    with pytest.raises(UsageError, match="inception_v3.*deepfm"):
        zoo.create("no_such_model")
    with pytest.raises(ValueError, match="bypass"):
        zoo.create("squeezenet", bypass="sideways")


@pytest.mark.parametrize(("name", "package"), [
    ("torchvision:googlenet", "torchvision"),
    ("timm:resnet50", "timm"),
    ("hf:bert-base-uncased", "transformers"),
])
def test_missing_package_names_it(name, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(ImportError, match=f"{package} is not installed.*pip install {package}"):
        zoo.create(name)


class Recorder(torch.nn.Module):
    """Stands in for a model of an external library; remembers how it was built."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs
        self.linear = torch.nn.Linear(2, 2)


def test_external_prefixes_build_offline_with_fake_packages(monkeypatch):
    # The real packages are not installed here, so check the plumbing against stand-ins.
    models = types.SimpleNamespace(inception_v3=Recorder, resnet18=Recorder)
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))
    model, (image,) = zoo.create("torchvision:inception_v3", batch_size=2)
    assert model.kwargs == {"weights": None, "aux_logits": False, "init_weights": True}
    assert image.shape == (2, 3, 299, 299) and not model.training
    model, (image,) = zoo.create("torchvision:resnet18")
    assert model.kwargs == {"weights": None} and image.shape == (1, 3, 224, 224)
    with pytest.raises(UsageError, match="no_such_net"):
        zoo.create("torchvision:no_such_net")

    def timm_create_model(name, pretrained, **kwargs):
        model = Recorder(name=name, pretrained=pretrained, **kwargs)
        model.pretrained_cfg = {"input_size": (3, 256, 256)}
        return model

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=timm_create_model))
    model, (image,) = zoo.create("timm:convnext_tiny")
    assert model.kwargs == {"name": "convnext_tiny", "pretrained": False} and image.shape == (1, 3, 256, 256)

    def for_model(model_type, **overrides):
        return types.SimpleNamespace(model_type=model_type, vocab_size=overrides.get("vocab_size", 30522), **overrides)

    transformers = types.SimpleNamespace(
        AutoConfig=types.SimpleNamespace(for_model=for_model),
        AutoModel=types.SimpleNamespace(from_config=lambda config, **kw: Recorder(config=config, **kw)),
    )
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    model, (ids,) = zoo.create("hf:bert-base-uncased", seq_len=16, num_hidden_layers=2)
    assert model.kwargs["config"].model_type == "bert" and model.kwargs["config"].num_hidden_layers == 2
    assert ids.shape == (1, 16) and ids.dtype == torch.int64 and int(ids.max()) < 30522
    with pytest.raises(UsageError, match="bert-base-uncased"):
        zoo.create("hf:some-org/unknown-model")


def test_paper_counts_document_builtin_models():
    assert set(zoo.PAPER_COUNTS) <= set(zoo.names())
    assert zoo.PAPER_COUNTS["inception_v3"]["ops"] == 119 and zoo.PAPER_COUNTS["inception_v3"]["edges"] == 153
    assert (zoo.PAPER_COUNTS["nasnet_a_mobile"]["ops"], zoo.PAPER_COUNTS["nasnet_a_mobile"]["edges"]) == (374, 576)
