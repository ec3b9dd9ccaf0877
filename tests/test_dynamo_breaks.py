"""``torch.compile(model, backend="opweave")`` on models that whole-graph capture refuses: dynamo splits them at a
data-dependent ``if``, a ``print`` and an ``.item()``; every captured subgraph gets its own opweave plan and the
whole equals eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave.dynamo
from opweave.capture import CaptureError


class Breaks(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu() + self.b(x).sigmoid()
        if self.kind == "if":
            h = self.c(h) if h.sum() > 0 else -self.c(h)
        elif self.kind == "print":
            print("opweave test: between two subgraphs")
            h = self.c(h)
        else:
            h = self.c(h) / (1.0 + h.abs().max().item())
        return h + self.b(h).tanh()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["if", "print", "item"])
def test_graph_breaks_equal_eager_with_one_plan_per_subgraph(kind, capsys):
    torch.manual_seed(0)
    model = Breaks(kind).eval()
    before = len(opweave.dynamo.compiled_graphs())
    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios"}, dynamic=False)
    for sign in (1, -1):  # both branches of the data-dependent if
        x = sign * torch.randn(4, 8).abs()
        with torch.no_grad():  # opweave plans inference only: each grad mode compiles its own graphs
            expected, got = model(x), fast(x)
        torch.testing.assert_close(got, expected)
    graphs = opweave.dynamo.compiled_graphs()[before:]
    assert len(graphs) >= 2  # split at the break: a subgraph before it and one after
    assert len({id(g.plan) for g in graphs}) == len(graphs)
    assert all(g.schedule.scheduler == "lios" and len(g.graph) >= 1 for g in graphs)
    if kind == "print":
        assert "between two subgraphs" in capsys.readouterr().out


def test_whole_graph_capture_refuses_the_data_dependent_if_and_points_to_the_backend():
    line = r"`h = self\.c\(h\) if h\.sum\(\) > 0 else -self\.c\(h\)`"
    with pytest.raises(CaptureError, match=rf'at <root> \(Breaks\), .*test_dynamo_breaks\.py:\d+ {line}.*'
                                           r'torch\.compile\(model, backend="opweave"\)'):
        opweave.compile(Breaks("if").eval(), (torch.randn(4, 8),))
