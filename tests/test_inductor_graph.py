"""Ops that are Inductor's kernels (``graph="inductor"``, opweave.backends.inductorgraph): the grouping read from
Inductor's scheduler, its acyclicity on random DAGs, the options, and compiled plans that equal eager."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import opweave
from dags import dags
from opweave import zoo
from opweave.backends import compilers
from opweave.backends.inductorgraph import (
    Kernel,
    free_layouts,
    heaviest_targets,
    inductor_graph,
    kernel_groups,
    launch_counts,
)
from opweave.capture import capture
from opweave.capture.coarsen import merge_ops
from opweave.errors import CaptureError, UsageError
from opweave.ir import Edge, Op, OpGraph
from opweave.outputs import compare
from opweave.pipeline import resolve
from opweave.pipeline.targets import segment_options
from opweave.plan.validate import validate


class Branches(nn.Module):
    """Two independent branches, each a convolution with its epilogue, joined by pointwise ops and a concatenation."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(4, 8, 1)
        self.norm = nn.BatchNorm2d(8)

    def forward(self, x):
        a = torch.relu(self.norm(self.left(x)))
        b = torch.sigmoid(self.right(x)) * 2
        return a + b, torch.cat([a, b], 1).mean((2, 3))


class Concat(nn.Module):
    """Two bias-free convolutions, each with its BatchNorm and ReLU, concatenated (an Inception block's tail)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 8, 3, padding=1, bias=False) for _ in range(2))
        self.norms = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(2))

    def forward(self, x):
        return torch.cat([torch.relu(n(c(x))) for c, n in zip(self.convs, self.norms, strict=True)], 1)


def _made(cls):
    torch.manual_seed(0)
    return cls().eval(), (torch.randn(1, 4, 16, 16),)


def _group(graph: OpGraph, fx_name: str) -> str:
    return next(op.id for op in graph.ops if fx_name in op.name.split("+"))


@pytest.fixture(scope="module")
def branches():
    model, inputs = _made(Branches)
    return model, inputs, inductor_graph(capture(model, inputs), inputs)


def test_each_convolution_is_one_op_with_its_epilogue_and_the_branches_stay_apart(branches):
    _, _, regrouped = branches
    graph = regrouped.graph
    assert _group(graph, "left") == _group(graph, "norm") == _group(graph, "relu")  # oneDNN's conv + ReLU
    assert _group(graph, "right") == _group(graph, "sigmoid")
    assert _group(graph, "left") != _group(graph, "right")  # independent: separate streams stay possible
    assert _group(graph, "mul") == _group(graph, "add")  # one pointwise kernel
    assert len(graph) < regrouped.stats["ops_before"] and regrouped.stats["split"] == 0
    assert set(regrouped.kernels) == set(graph.ids)
    assert regrouped.kernels[_group(graph, "left")] == regrouped.kernels[_group(graph, "right")] == 1
    assert sum(regrouped.kernels.values()) + regrouped.stats["unowned"] == regrouped.stats["launches"]


def test_a_concatenation_written_in_place_joins_its_epilogues_not_its_convolutions(monkeypatch):
    """Unfrozen (as on CUDA), each convolution is an extern call of its own and the epilogues (BatchNorm, ReLU)
    write straight into the concatenation's buffer: the epilogues and the concatenation are one op, the
    convolutions two others, so the convolutions may still run on two streams."""
    monkeypatch.setattr(compilers.Inductor, "freezes", lambda self, inputs: False)
    model, inputs = _made(Concat)
    graph = inductor_graph(capture(model, inputs), inputs).graph
    tail = _group(graph, "cat")
    assert {_group(graph, n) for n in ("norms_0", "relu", "norms_1", "relu_1")} == {tail}
    assert len({_group(graph, "convs_0"), _group(graph, "convs_1"), tail}) == 3


def test_the_plan_over_inductor_kernels_is_validated_and_equals_eager(branches):
    model, inputs, _ = branches
    fast = opweave.compile(model, inputs, device="cpu", graph="inductor", scheduler="lios", streams=2)
    validate(fast.graph, fast.plan, fast.schedule)
    assert fast.schedule.streams_used == 2 and fast.fused.stats["fallbacks"] == 0
    assert fast.options.compiler == "inductor" and not fast.options.coarsen
    assert set(fast.costs.kernels) == set(fast.graph.ids) and len(fast.graph) < len(capture(model, inputs).graph)
    assert fast.fused.compiler_options == {"eager_strides": False}  # segments hand on Inductor's layouts
    with torch.inference_mode():
        expected, got = model(*inputs), fast(*inputs)
    assert compare(expected, got).ok
    assert [t.stride() for t in got] == [t.stride() for t in expected]  # what the model returns: eager's layout
    fast.close()


class Viewed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y.view(y.shape[0], -1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def test_layouts_go_free_only_where_the_model_reads_none():
    assert free_layouts(capture(*_made(Branches)))
    assert not free_layouts(capture(*_made(Viewed)))  # a view of a channels-last value would fail
    torch.manual_seed(0)
    assert not free_layouts(capture(Attention().eval(), (torch.randn(1, 4, 8),)))  # a module that is not traced
    options = resolve("cpu", graph="inductor")
    assert segment_options(capture(*_made(Viewed)), options) is None
    assert segment_options(capture(*_made(Branches)), options) == {"eager_strides": False}
    assert segment_options(capture(*_made(Branches)), resolve("cpu", compiler="inductor")) is None


def test_a_zoo_model_over_inductor_kernels_equals_eager():
    model, inputs = zoo.create("squeezenet", batch_size=1, image_size=32)
    fast = opweave.compile(model, inputs, device="cpu", graph="inductor", scheduler="sequential", streams=1)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
    assert fast.fused.stats["segments"] == 1 and fast.fused.stats["fallbacks"] == 0
    fast.close()


def _fails(*args):
    raise CaptureError("m: Inductor cannot compile the whole model: RuntimeError: no")


@pytest.mark.parametrize(("found", "says"), [(lambda *args: ([], []), "name no captured node"),
                                             (_fails, "cannot compile the whole model")])
def test_without_kernels_the_captured_graph_is_kept_with_a_warning(monkeypatch, found, says):
    from opweave.backends import inductorgraph

    monkeypatch.setattr(inductorgraph, "fused_kernels", found)
    model, inputs = _made(Concat)
    captured = capture(model, inputs)
    with pytest.warns(UserWarning, match=says):
        assert inductor_graph(captured, inputs).captured is captured


# ---- the grouping alone (no torch) -----------------------------------------------------------------------------
def _chain() -> OpGraph:
    return OpGraph([Op(x) for x in "abcd"], [Edge("a", "b"), Edge("b", "c"), Edge("a", "d")])


def test_a_merge_that_would_close_a_cycle_is_refused_and_counted():
    groups, split = kernel_groups(_chain(), [Kernel(frozenset("ac"), 1, "k"), Kernel(frozenset("d"), 1, "k")])
    assert split == 1  # b lies between a and c
    group_of = {op: tuple(g) for g in groups for op in g}
    assert group_of["a"] != group_of["c"] and group_of["b"] == group_of["c"]  # b launches nothing: joins c
    assert group_of["d"] == ("d",)


def test_independent_ops_of_one_kernel_are_merged():
    groups, split = kernel_groups(_chain(), [Kernel(frozenset("cd"), 1, "k"), Kernel(frozenset("ab"), 1, "k")])
    assert split == 0 and sorted(map(tuple, groups)) == [("a", "b"), ("c", "d")]


def test_a_group_takes_the_target_of_its_heaviest_member():
    class Prologue(nn.Module):  # an elementwise op first, as a group of Inductor's kernels may begin
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            return self.linear(x + 1).relu()

    captured = capture(Prologue(), (torch.randn(8, 64),))
    groups = [list(captured.graph.topo_order)]
    merged = merge_ops(captured, groups)
    assert merged.graph.ops[0].target == "operator.add"  # the head's, as a coarse op keeps it
    (op,) = heaviest_targets(merged, captured.graph, groups).graph.ops
    assert op.id == groups[0][0] and op.target == "torch.nn.Linear"


def test_a_kernel_split_across_groups_launches_once_per_part():
    groups, split = kernel_groups(_chain(), [Kernel(frozenset("ac"), 1, "k")])
    assert split == 1 and launch_counts(groups, [Kernel(frozenset("ac"), 1, "k")]) == {"a": 1, "b": 1}  # d joins a


def test_a_concatenation_in_place_counts_each_writer_where_its_own_ops_are():
    # a concatenation written in place, united with the two kernels writing its inputs (a's and c's), which cannot
    # share a group: each writer launches once, in its own group, not both launches in both groups
    concat = Kernel(frozenset("ac"), 2, "k", parts=((frozenset("c"), 0), (frozenset("a"), 1), (frozenset("c"), 1)))
    groups, split = kernel_groups(_chain(), [concat])
    assert split == 1 and launch_counts(groups, [concat]) == {"a": 1, "b": 1}
    # a writer whose own ops are not known launches once, where the concatenation is
    unknown = Kernel(frozenset("ac"), 3, "k", parts=((frozenset("c"), 0), (frozenset("a"), 1), (frozenset(), 2)))
    assert launch_counts(groups, [unknown]) == {"a": 1, "b": 2}


@st.composite
def graphs_and_kernels(draw):
    graph = draw(dags(max_ops=25, shuffle=True, transfers=False))
    ids = graph.ids
    kernels = [Kernel(frozenset(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4))),
                      draw(st.integers(0, 2)), "k") for _ in range(draw(st.integers(0, 12)))]
    return graph, kernels


@given(graphs_and_kernels())
def test_groups_partition_the_ops_and_their_graph_stays_acyclic(case):
    graph, kernels = case
    groups, split = kernel_groups(graph, kernels)
    members = [op for g in groups for op in g]
    assert sorted(members) == sorted(graph.ids) and len(members) == len(set(members))
    assert all([graph.index[op] for op in g] == sorted(graph.index[op] for op in g) for g in groups)
    assert [graph.index[g[0]] for g in groups] == sorted(graph.index[g[0]] for g in groups)
    group_of = {op: g[0] for g in groups for op in g}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(group_of.values())
    quotient.add_edges_from((group_of[e.src], group_of[e.dst]) for e in graph.edges
                            if group_of[e.src] != group_of[e.dst])
    assert nx.is_directed_acyclic_graph(quotient)
    apart = sum(len({group_of[op] for op in k.ops}) > 1 for k in kernels)
    assert (split == 0) <= (apart == 0)  # a kernel left across groups was a refused merge


# ---- options ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_graph_inductor_implies_its_compiler_and_no_coarsening(device):
    options = resolve(device, graph="inductor", check_device=False)
    assert (options.graph, options.compiler, options.coarsen) == ("inductor", "inductor", False)
    assert resolve(device, graph="inductor", compiler="inductor", coarsen=False, check_device=False).graph
    assert not {"compiler", "coarsen"} & resolve(device, graph="inductor", check_device=False).given
    for key, value in (("compiler", "eager"), ("coarsen", True)):
        with pytest.raises(UsageError, match=f"option {key!r} does not apply with graph='inductor'"):
            resolve(device, graph="inductor", check_device=False, **{key: value})
    with pytest.raises(UsageError, match="chooses the plan itself"):
        resolve(device, "max-autotune", graph="inductor", check_device=False)


def test_graph_onnxruntime_stays_on_the_cpu():
    with pytest.raises(UsageError, match="'graph'='onnxruntime' runs ONNX Runtime sessions on the CPU"):
        resolve("cuda", graph="onnxruntime", check_device=False)
