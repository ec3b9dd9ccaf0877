"""Capture: nn.Module -> OpGraph + op-by-op execution that equals eager PyTorch."""

from __future__ import annotations

import operator
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from opweave import zoo
from opweave.capture import Captured, CaptureError, capture
from rendezvous import TwoBranches, armed


def run_sequential(captured: Captured, args: tuple, order: list[str] | None = None):
    env = captured.bind(args)
    for op in order or captured.graph.topo_order:
        captured.run_op(op, env)
    return captured.output(env)


def eager(model: nn.Module, args: tuple):
    with torch.no_grad():
        return model(*[a.clone() for a in args])


def assert_same(actual, expected, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    assert got_spec == want_spec
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def inplace_targets(captured: Captured) -> list[str]:
    """Op targets or modules of the captured module that still write in place."""
    bad = [o.target for o in captured.graph.ops
           if o.target.rsplit(".", 1)[-1].endswith("_") or o.target.startswith("operator.i")]
    bad += [name for name, m in captured.gm.named_modules() if getattr(m, "inplace", False)]
    return bad


class Branchy(nn.Module):
    """stem -> relu -> {1x1 conv, grouped 3x3 conv} -> cat -> maxpool -> mean -> flatten -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 16, 1)
        self.right = nn.Conv2d(8, 16, 3, padding=1, groups=2)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        z = torch.cat([self.left(y), self.right(y)], 1)
        return self.fc(self.pool(z).mean([2, 3]).flatten(1))


@pytest.fixture(scope="module")
def branchy():
    torch.manual_seed(0)
    model, args = Branchy().eval(), (torch.randn(1, 3, 8, 8),)
    return model, args, capture(model, args)


def test_branchy_graph_structure(branchy):
    _, _, cap = branchy
    g = cap.graph
    assert g.ids == ["stem", "relu", "left", "right", "cat", "pool", "mean", "fc"]
    assert sorted(g.edge) == sorted([("stem", "relu"), ("relu", "left"), ("relu", "right"), ("left", "cat"),
                                     ("right", "cat"), ("cat", "pool"), ("pool", "mean"), ("mean", "fc")])
    assert nx.is_directed_acyclic_graph(g.nx())
    assert g.independent("left", "right")
    assert {o.id for o in g.ops if o.category == "compute"} == {"stem", "left", "right", "fc"}
    # flatten is a view: absorbed into the op that produces its input
    assert [n.name for n in cap.nodes["mean"]] == ["mean", "flatten"]
    assert g.op["stem"].target == "torch.nn.Conv2d" and g.op["cat"].target == "torch.cat"


def test_flops_and_bytes_by_hand(branchy):
    _, _, cap = branchy
    g = cap.graph
    # grouped conv: 2 * N * Cout * Hout * Wout * (Cin / groups) * kh * kw
    assert g.op["right"].flops == 2 * 1 * 16 * 8 * 8 * (8 // 2) * 3 * 3
    assert g.op["left"].flops == 2 * 1 * 16 * 8 * 8 * 8
    assert g.op["fc"].flops == 2 * 1 * 10 * 32
    assert g.op["pool"].flops == 32 * 4 * 4 * (2 * 2)  # output numel x kernel area
    assert g.op["cat"].flops == 0
    assert g.op["right"].shape == [1, 16, 8, 8] and g.op["right"].dtype == "float32"
    weights = (16 * 4 * 9 + 16) * 4
    assert g.op["right"].bytes == 8 * 64 * 4 + weights + 16 * 64 * 4  # input + weights + output
    assert g.edge[("relu", "left")].bytes == 8 * 64 * 4


def test_sequential_execution_matches_eager(branchy):
    model, args, cap = branchy
    assert_same(run_sequential(cap, args), eager(model, args))
    other = (torch.randn(1, 3, 8, 8),)  # a new input of the captured shape
    assert_same(run_sequential(cap, other), eager(model, other))


def test_every_topological_order_gives_the_same_output(branchy):
    model, args, cap = branchy
    want = eager(model, args)
    for order in nx.all_topological_sorts(cap.graph.nx()):
        assert_same(run_sequential(cap, args, list(order)), want)


def test_readers_name_every_op_that_reads_a_value(branchy):
    _, _, cap = branchy
    assert set(cap.readers()["relu"]) == {"left", "right"}


def test_run_op_from_threads_in_dependency_order(branchy):
    model, args, cap = branchy
    g = cap.graph
    env = cap.bind(args)
    done = {op: threading.Event() for op in g.ids}

    def run(op: str) -> None:
        for pred in g.preds[op]:
            done[pred].wait()
        cap.run_op(op, env)
        done[op].set()

    with ThreadPoolExecutor(max_workers=len(g)) as pool:  # one thread per op: all start at once, each waits
        list(pool.map(run, reversed(g.topo_order)))
    assert_same(cap.output(env), eager(model, args))


def test_independent_ops_run_concurrently_from_threads():
    # each rendezvous op waits at a barrier for the other: run_op must let two threads run ops at the same time
    x = torch.randn(4, 3)
    cap = capture(TwoBranches(), (x,))
    meet = [o.id for o in cap.graph.ops if o.target.endswith("rendezvous")]
    assert len(meet) == 2 and cap.graph.independent(*meet)
    env = cap.bind((x,))
    with armed(parties=2), ThreadPoolExecutor(max_workers=2) as pool:
        for op in cap.graph.topo_order:
            if op not in meet:
                cap.run_op(op, env)
            elif op == meet[-1]:
                list(pool.map(lambda o: cap.run_op(o, env), meet))  # BrokenBarrierError unless both run at once
    assert_same(cap.output(env), TwoBranches()(x))
    with armed(parties=2, timeout_s=0.2), pytest.raises(CaptureError, match="BrokenBarrierError"):
        run_sequential(cap, (x,))  # one after the other, the barrier does break: the check above can fail


def test_bind_rejects_another_shape(branchy):
    _, _, cap = branchy
    with pytest.raises(ValueError, match="captured with"):
        cap.bind((torch.randn(2, 3, 8, 8),))


def test_identity_and_view_only_models():
    class Identity(nn.Module):
        def forward(self, x):
            return x

    class Views(nn.Module):
        def forward(self, x):
            return x.flatten(1), x.transpose(0, 1)

    x = torch.randn(2, 3)
    cap = capture(Identity(), (x,))
    assert len(cap.graph) == 0 and cap.graph.topo_order == []
    assert run_sequential(cap, (x,)) is x
    cap = capture(Views(), (x,))
    assert len(cap.graph) == 0
    assert_same(run_sequential(cap, (x,)), Views()(x))


class InPlace(nn.Module):
    """An inplace ReLU overwrites a tensor another branch also reads; then ``+=``, ``relu_()`` and F.relu(inplace)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.side = nn.Conv2d(8, 8, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.conv(x)
        side = self.side(y)  # reads y, which the inplace ReLU overwrites next
        r = self.relu(y)
        r += side
        r.relu_()
        torch.sigmoid_(r)
        return F.relu(r * 2 - 1, inplace=True)  # (returning y too would expose fx's blind spot, see below)


def test_inplace_ops_rewritten_out_of_place():
    torch.manual_seed(0)
    model, args = InPlace().eval(), (torch.randn(1, 3, 6, 6),)
    cap = capture(model, args)
    assert inplace_targets(cap) == []
    assert not any(e.kind == "war" for e in cap.graph.edges)
    assert cap.graph.independent("side", "relu")  # the rewrite is what lets the two branches run concurrently
    assert model.relu.inplace  # the user's model is untouched
    assert_same(run_sequential(cap, args), eager(model, args))


def test_inplace_without_twin_runs_on_a_clone():
    class Writes(nn.Module):
        def forward(self, x):
            y = x * 2
            y.clamp_(max=1.0)  # Tensor.clamp exists
            w = y.exp()
            w.copy_(y * 3)  # Tensor.copy does not: copy_ runs on a clone of w
            return y, w

    x = torch.randn(2, 3)
    cap = capture(Writes(), (x,))
    assert [o.target for o in cap.graph.ops] == [
        "operator.mul", "torch.Tensor.clamp", "torch.Tensor.exp", "operator.mul",
        "opweave.capture.functionalize.apply_on_clone"]
    assert inplace_targets(cap) == []
    assert_same(run_sequential(cap, (x,)), eager(Writes(), (x,)))
    assert_same(cap.gm(x), eager(Writes(), (x,)))  # the rewritten module itself stays runnable


class WriteThroughView(nn.Module):
    """An in-place write through a view whose base is read later: cannot be rewritten, ordered by WAR edges."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        before = y * 3
        y[:, :2].relu_()
        after = y + 1
        return before, after


def test_write_through_view_kept_with_war_edges():
    torch.manual_seed(0)
    model, args = WriteThroughView().eval(), (torch.randn(1, 3, 4, 4),)
    cap = capture(model, args)
    g = cap.graph
    assert g.edge[("mul", "relu_")].kind == "war"  # the earlier reader finishes before the write
    assert g.reaches("relu_", "add")  # the later reader starts after it
    want = eager(model, args)
    for order in nx.all_topological_sorts(g.nx()):
        assert_same(run_sequential(cap, args, list(order)), want)


def test_inplace_through_alias_fx_cannot_see_falls_back_to_export():
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            y = self.conv(x)
            z = y  # a second name for the same tensor
            y += 1  # fx records y = y + 1: eager's z changes, fx's does not
            return z * 2

    torch.manual_seed(0)
    model, args = Aliased().eval(), (torch.randn(1, 3, 4, 4),)
    cap = capture(model, args)
    assert all(o.target.startswith("aten.") for o in cap.graph.ops)  # the export route
    assert_same(run_sequential(cap, args), eager(model, args))


def test_fold_bn_matches_eager():
    class ConvBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.bn_a = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.b, self.bn_b = nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8)

        def forward(self, x):
            return F.relu(self.bn_a(self.a(x))) + self.bn_b(self.b(x))

    torch.manual_seed(0)
    model = ConvBN()
    for bn in (model.bn_a, model.bn_b):  # non-trivial statistics
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
        bn.bias.data.uniform_(-1, 1)
    model.eval()
    args = (torch.randn(2, 3, 8, 8),)
    plain, folded = capture(model, args), capture(model, args, fold_bn=True)
    assert sum(o.target == "torch.nn.BatchNorm2d" for o in plain.graph.ops) == 2
    assert not any("BatchNorm" in o.target for o in folded.graph.ops)
    assert len(folded.graph) == len(plain.graph) - 2
    assert_same(run_sequential(folded, args), eager(model, args), atol=1e-5, rtol=1e-5)
    with pytest.raises(CaptureError, match="training mode"):
        capture(model.train(), args, fold_bn=True)


def test_shape_dependent_branch_uses_export():
    class ShapeBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            if x.shape[0] > 1:  # a Proxy cannot be used as a bool: symbolic_trace fails
                x = x * 2
            return self.conv(x).relu()

    torch.manual_seed(0)
    model, args = ShapeBranch().eval(), (torch.randn(2, 3, 4, 4),)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    cap = capture(model, args, name="shape-branch")
    assert cap.graph.name == "shape-branch"
    assert [o.target for o in cap.graph.ops] == ["aten.mul", "aten.conv2d", "aten.relu"]
    assert cap.graph.ops[1].category == "compute" and cap.graph.ops[1].flops == 2 * 2 * 4 * 16 * 3
    assert_same(run_sequential(cap, args), eager(model, args))


def test_value_dependent_branch_is_a_clear_error():
    class ValueBranch(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x - 1

    with pytest.raises(CaptureError, match="ValueBranch") as err:
        capture(ValueBranch(), (torch.randn(3),))
    assert "symbolic_trace" in str(err.value) and "torch.export" in str(err.value)


def test_rewrite_of_operator_iadd_and_setitem():
    # symbolic_trace never records these (a Proxy has no __iadd__ or __setitem__), other tracers may
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.relu, (x,))
    doubled = graph.call_function(operator.mul, (x, 2))
    total = graph.call_function(operator.iadd, (y, doubled))
    graph.call_function(operator.setitem, (doubled, 0, 0.0))
    graph.output((total, y, doubled))  # eager: y *is* total after +=, and doubled[0] is 0
    gm = torch.fx.GraphModule(nn.Module(), graph)
    from opweave.capture.functionalize import rewrite_inplace

    assert rewrite_inplace(gm) == []
    assert not {operator.iadd, operator.setitem} & {n.target for n in gm.graph.nodes}
    x_value = torch.randn(5)
    total_value, y_value, doubled_value = gm(x_value)
    assert total_value is y_value
    torch.testing.assert_close(total_value, torch.relu(x_value) + 2 * x_value)
    torch.testing.assert_close(doubled_value, torch.cat([torch.zeros(1), 2 * x_value[1:]]))


# ---- the model zoo ------------------------------------------------------------------------------------------------
# Smaller inputs than the defaults keep the suite fast; the graph (ops, edges) does not depend on them.
ZOO_TEST_KWARGS = {"bert_base": {"num_layers": 2, "seq_len": 32}, "deepfm": {}}


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_model_captures_and_runs_like_eager(name):
    model, inputs = zoo.create(name, batch_size=1, **ZOO_TEST_KWARGS.get(name, {"image_size": 96}))
    start = time.perf_counter()
    cap = capture(model, inputs, name=name, verify=False)  # the comparison below is the verification
    capture_s = time.perf_counter() - start
    g = cap.graph
    assert len(g) > 10 and nx.is_directed_acyclic_graph(g.nx())
    assert set(g.topo_order) == set(g.ids)
    assert not any(e.kind == "war" for e in g.edges)
    assert inplace_targets(cap) == []
    assert all(o.flops >= 0 and o.bytes > 0 for o in g.ops)
    assert_same(run_sequential(cap, inputs), eager(model, inputs), atol=1e-5, rtol=1e-4)
    print(f"{name}: {len(g)} ops, {len(g.edges)} edges, capture {capture_s:.2f} s")


class Cache(nn.Module):
    """A step that writes its input at ``position`` of a cache buffer it declares as state, then reads the cache."""

    def __init__(self, declared=("cache",), untraceable: bool = False):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))
        self.opweave_state = declared
        self.untraceable = untraceable

    def forward(self, x, position):
        if self.untraceable and x.shape[0] > 0:  # control flow on a size: symbolic_trace fails, export takes it
            x = x * 1
        self.cache.index_copy_(0, position, torch.tanh(x))
        return torch.cat([self.cache, x]).sum(0)  # symbolic_trace makes a read of the cache alone a constant


@pytest.mark.parametrize("untraceable", [False, True], ids=["symbolic_trace", "export"])
def test_declared_state_is_written_in_place_and_ordered_before_its_readers(untraceable):
    model = Cache(untraceable=untraceable).eval()
    x, position = torch.randn(2, 4), torch.tensor([1, 5])
    captured = capture(model, (x, position))
    assert not model.cache.any()  # capture leaves the state as it was
    writes = captured.state_writes()
    targets = {n.name: n.target for n in captured.gm.graph.nodes if n.op == "get_attr"}
    assert len(writes) == 1 and {targets[n] for n in next(iter(writes.values()))} == {"cache"}
    writer = next(iter(writes))
    assert captured.graph.op[writer].target == ("aten.index_copy_" if untraceable else "torch.Tensor.index_copy_")
    assert not any("copy_" in op.target for op in captured.graph.ops if op.id != writer)  # no write-back
    read = next(op.id for op in captured.graph.ops if op.target.endswith("cat"))
    assert captured.graph.reaches(writer, read)  # the cache read after the write
    got = captured.run((x, position))
    written = model.cache.clone()
    model.cache.zero_()
    with torch.no_grad():
        torch.testing.assert_close(got, model(x, position))
    assert torch.equal(written, model.cache) and model.cache[[1, 5]].any() and not model.cache[0].any()


def test_state_writes_need_declaring_and_a_declared_name_must_be_a_buffer():
    x, position = torch.randn(2, 4), torch.tensor([1, 5])
    with pytest.raises(CaptureError, match="changes cache"):
        capture(Cache(declared=()).eval(), (x, position))
    with pytest.raises(ValueError, match="names kv, which is no buffer"):
        capture(Cache(declared=("kv",)).eval(), (x, position))
