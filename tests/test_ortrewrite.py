"""Rewrites before an ONNX Runtime export (opweave.backends.ortrewrite): every rewritten graph computes what the
original does, the forms ONNX Runtime runs slowly are gone from the export, and what is not rewritten is left as it
is."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from opweave.backends.compilers import export_onnx
from opweave.backends.ortrewrite import rewrite


def traced(module: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """``module`` traced, with the shapes capture records (``tensor_meta``)."""
    gm = fx.symbolic_trace(module)
    ShapeProp(gm).propagate(*inputs)
    return gm


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


class Pool(nn.Module):
    def __init__(self, functional: bool, **pool):
        super().__init__()
        self.functional, self.pool = functional, pool
        self.module = nn.AvgPool2d(**pool)

    def forward(self, x):
        y = F.avg_pool2d(x, **self.pool) if self.functional else self.module(x)
        return y + 1


@settings(max_examples=60, deadline=None)
@given(kernel=st.integers(1, 4), stride=st.integers(1, 3), pad=st.integers(0, 2), include=st.booleans(),
       functional=st.booleans(), channels=st.integers(1, 5), height=st.integers(4, 11), width=st.integers(4, 11),
       batch=st.integers(1, 3))
def test_an_average_pool_becomes_a_depthwise_convolution_with_the_same_values(kernel, stride, pad, include,
                                                                               functional, channels, height, width,
                                                                               batch):
    pad = min(pad, kernel // 2)
    model = Pool(functional, kernel_size=kernel, stride=stride, padding=pad, count_include_pad=include)
    x = torch.randn(batch, channels, height, width)
    gm = traced(model, x)
    new, counts = rewrite(gm)
    assert counts == {"pools": 1, "stacks": 0, "crops": 0, "casts": 0}
    assert F.conv2d in targets(new) and "module" not in targets(new) and F.avg_pool2d not in targets(new)
    torch.testing.assert_close(new(x), model(x), rtol=1e-5, atol=1e-5)
    assert targets(gm) == targets(traced(model, x))  # the graph given is left as it is


@pytest.mark.parametrize("pool", [dict(ceil_mode=True), dict(divisor_override=2)])
def test_a_pool_with_ceil_mode_or_a_divisor_is_left_as_it_is(pool):
    model, x = Pool(False, kernel_size=3, stride=2, padding=1, **pool), torch.randn(1, 3, 9, 9)
    new, counts = rewrite(traced(model, x))
    assert counts["pools"] == 0 and "module" in targets(new)


def test_pools_are_left_as_they_are_where_the_export_frees_a_size():
    model, x = Pool(False, kernel_size=3, stride=1, padding=1, count_include_pad=False), torch.randn(1, 3, 9, 9)
    assert rewrite(traced(model, x), fixed_sizes=False)[1]["pools"] == 0


class Aggregate(nn.Module):
    """RandWire's aggregation and its variants."""

    def __init__(self, form: str, parts: int):
        super().__init__()
        self.form, self.parts = form, parts
        self.weight = nn.Parameter(torch.randn(parts))
        self.channel = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, x):
        xs = [x * (i + 1) for i in range(self.parts)]
        if self.form == "weighted":
            return (torch.stack(xs) * torch.sigmoid(self.weight).reshape(-1, 1, 1, 1, 1)).sum(0).relu()
        if self.form == "weight first":
            return (torch.sigmoid(self.weight).reshape(-1, 1, 1, 1, 1) * torch.stack(xs)).sum(dim=0)
        if self.form == "one row":
            return (torch.stack(xs) * self.weight[:1].reshape(1, 1, 1, 1, 1)).sum(0)
        if self.form == "per channel":  # broadcast from the right: one weight per channel, the same for every part
            return (torch.stack(xs) * self.channel).sum(0)
        if self.form == "scalar":
            return (torch.stack(xs) * 0.5).sum(0)
        if self.form == "plain":
            return torch.sum(torch.stack(xs), 0)
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["weighted", "weight first", "one row", "per channel", "scalar", "plain"])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_a_sum_over_a_stack_becomes_a_sum_of_its_parts(form, parts):
    model, x = Aggregate(form, parts), torch.randn(2, 3, 4, 5)
    new, counts = rewrite(traced(model, x))
    assert counts == {"pools": 0, "stacks": 1, "crops": 0, "casts": 0}
    assert torch.stack not in targets(new) and "sum" not in targets(new) and torch.sum not in targets(new)
    torch.testing.assert_close(new(x), model(x), rtol=1e-5, atol=1e-5)


class Other(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, a, b):
        stacked = torch.stack([a, b])
        if self.form == "integer":  # an integer sum widens to int64: not a sum of the parts' dtype
            return stacked.sum(0)
        if self.form == "other dim":
            return stacked.sum(1)
        if self.form == "keepdim":
            return stacked.sum(0, keepdim=True)
        if self.form == "read twice":
            return stacked.sum(0) + stacked[0]
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["integer", "other dim", "keepdim", "read twice"])
def test_other_sums_and_stacks_are_left_as_they_are(form):
    dtype = torch.int32 if form == "integer" else torch.float32
    a, b = (torch.arange(6, dtype=dtype).reshape(2, 3) for _ in range(2))
    model = Other(form)
    new, counts = rewrite(traced(model, a, b))
    assert counts["stacks"] == 0 and torch.stack in targets(new)
    assert torch.equal(new(a, b), model(a, b))


def onnx_ops(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> set[str]:
    import onnx

    return {n.op_type for n in onnx.load_from_string(export_onnx(gm, inputs, 1)).graph.node}


def test_the_export_for_onnx_runtime_has_no_average_pool_and_no_reduce_sum():
    pytest.importorskip("onnx")
    x = torch.randn(1, 3, 9, 9)
    pool = Pool(False, kernel_size=3, stride=1, padding=1, count_include_pad=False)
    ops = onnx_ops(traced(pool, x), [x])
    assert "AveragePool" not in ops and "Conv" in ops
    x = torch.randn(1, 3, 4, 4)
    ops = onnx_ops(traced(Aggregate("weighted", 3), x), [x])
    assert "ReduceSum" not in ops and "Concat" not in ops


def test_onnx_runtime_runs_the_rewritten_export_with_the_models_values():
    pytest.importorskip("onnxruntime")
    from opweave.backends.compilers import get

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.aggregate = Aggregate("weighted", 2)
            self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

        def forward(self, x):
            return (self.pool(self.aggregate(x)),)

    model, x = Cell(), torch.randn(2, 3, 7, 7)
    run = get("onnxruntime")(traced(model, x), [x], 1)
    with torch.no_grad():
        torch.testing.assert_close(run(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)


class Crop(nn.Module):
    def __init__(self, amounts: tuple, index: tuple, mode: str = "constant"):
        super().__init__()
        self.amounts, self.index, self.mode = amounts, index, mode

    def forward(self, x):
        return F.pad(x, self.amounts, mode=self.mode)[self.index] * 2


@settings(max_examples=60, deadline=None)
@given(amounts=st.lists(st.integers(0, 2), min_size=4, max_size=4), starts=st.lists(st.integers(0, 2), min_size=2,
                                                                                   max_size=2),
       ends=st.lists(st.sampled_from([None, -1, -2]), min_size=2, max_size=2))
def test_a_zero_pad_cropped_by_a_slice_becomes_one_pad(amounts, starts, ends):
    index = (slice(None), slice(None), *(slice(s, e) for s, e in zip(starts, ends, strict=True)))
    model, x = Crop(tuple(amounts), index), torch.randn(2, 3, 6, 7)
    new, counts = rewrite(traced(model, x))
    assert counts["crops"] == 1 and targets(new).count(F.pad) == 1
    assert not any(n.target is operator.getitem for n in new.graph.nodes)
    assert torch.equal(new(x), model(x))


@pytest.mark.parametrize("amounts, index, mode", [
    ((1, 1, 1, 1), (slice(None), slice(1, None)), "constant"),  # a dimension not padded
    ((1, 1, 1, 1), (slice(None), slice(None), slice(1, None, 2)), "constant"),  # a step
    ((1, 1, 1, 1), (slice(None), slice(None), slice(1, None)), "reflect"),
    ((1, 2, 3, 4), (slice(None), slice(None), slice(-3, None)), "constant"),  # within the padding only
])
def test_other_crops_are_left_as_they_are(amounts, index, mode):
    model, x = Crop(amounts, index, mode), torch.randn(2, 3, 6, 7)
    new, counts = rewrite(traced(model, x))
    assert counts["crops"] == 0 and torch.equal(new(x), model(x))


def test_nasnets_shift_exports_as_one_pad_read_by_the_next_op():
    onnx = pytest.importorskip("onnx")
    x = torch.randn(1, 3, 9, 9)
    gm = traced(Crop((0, 1, 0, 1), (slice(None), slice(None), slice(1, None), slice(1, None))), x)
    nodes = onnx.load_from_string(export_onnx(gm, [x], 1)).graph.node
    (pad,) = [n for n in nodes if n.op_type == "Pad"]  # its amounts may be computed by small ops ORT folds
    assert [n.op_type for n in nodes if pad.output[0] in n.input] == ["Mul"]  # no Slice copies the data


class InPlace(nn.Module):
    def forward(self, x):
        y = F.avg_pool2d(x, 3, 1, 1)
        y.relu_()  # its result unused: a pass that drops dead code would drop it
        return y


def test_an_in_place_op_whose_result_is_unused_stays():
    model, x = InPlace(), torch.randn(1, 2, 5, 5)
    new, counts = rewrite(traced(model, x))
    assert counts["pools"] == 1 and "relu_" in targets(new)
    torch.testing.assert_close(new(x), model(x))
