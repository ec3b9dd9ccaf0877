"""One owner for each concept: an op's kind is set at capture and read by the costs, the device is resolved one way
for every door, and a compiled model meets other inputs one way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opweave import zoo
from opweave.capture import capture, coarsen
from opweave.costs import calibrated
from opweave.devices import resolve_device
from opweave.errors import UsageError
from opweave.ir import Op, OpGraph
from opweave.ir.kinds import kind_of


def test_capture_sets_each_ops_kind_and_a_coarse_op_keeps_its_heads():
    model, inputs = zoo.create("squeezenet", batch_size=1, image_size=64)
    fine = capture(model, inputs)
    assert all(op.kind == kind_of(op.target) for op in fine.graph.ops)
    assert {"conv", "pool"} <= {op.kind for op in fine.graph.ops}
    coarse = coarsen(fine)
    assert all(op.kind == fine.graph.op[op.id].kind for op in coarse.graph.ops)
    again = OpGraph.from_dict(coarse.graph.to_dict())  # the JSON form keeps it
    assert [op.kind for op in again.ops] == [op.kind for op in coarse.graph.ops]


def test_the_fitted_costs_price_an_op_by_the_kind_capture_gave_it():
    """The cost model worked the kind out again from the target with a table of its own (which called ones_like an
    elementwise op where capture called it data); it reads the op's kind now, and a graph without kinds gets them
    from its targets by the same table."""
    graph = OpGraph([Op("a", target="aten.relu", kind="matmul", shape=[64, 64], flops=1e6),
                     Op("b", target="aten.ones_like", shape=[64, 64]), Op("c", target="torch.softmax")])
    assert calibrated.op_class(graph, graph.op["a"]) == "matmul"  # the kind set, not the target's
    assert calibrated.op_class(graph, graph.op["b"]) == "data" and calibrated.op_class(graph, graph.op["c"]) == "norm"


def test_the_device_is_resolved_one_way_with_the_name_it_was_likely_meant_to_be():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError, match=r"device must be cpu, cuda or auto, got 'cdua' \(did you mean 'cuda'\?\)"):
        resolve_device("cdua")


def test_a_compiled_model_meets_other_inputs_through_the_one_attach():
    import opweave
    from opweave.pipeline import signatures

    calls = []
    real = signatures.attach
    try:
        signatures.attach = lambda *a, **k: calls.append(k) or real(*a, **k)
        import opweave.api

        opweave.api.attach = signatures.attach
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
        fast = opweave.compile(model, (torch.randn(2, 4),), scheduler="sequential")
    finally:
        signatures.attach = real
        opweave.api.attach = real
    assert len(calls) == 1 and calls[0]["sizes"] is fast.variants.sizes
    with torch.no_grad():
        assert torch.allclose(fast(torch.randn(3, 4)).shape[0] * torch.ones(1), torch.tensor([3.0]))
