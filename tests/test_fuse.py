"""Stream segments (opweave.backends.segments): the segment plan keeps every ordering the op-level plan proved, each
segment runs as one graph, and ``compiler="inductor"`` equals eager on the CPU.

The Inductor cases compile C++ kernels (one to three seconds per segment on a 2-core machine, far less once
Inductor's on-disk caches hold them), so the fast set is small (deepfm, bert_base) and two convolutional networks
are marked ``slow``. The four largest zoo graphs (googlenet, inception_v3, nasnet_a_mobile, randwire: hundreds of
segments, 2 to 7 minutes each on a 2-core machine) would take the suite past its time budget; every zoo model at
its full input size was checked by ``benchmarks/fused_cpu.py --check-only --models all --no-torch-compile`` (every
mode ``ok`` against eager, no fallback; ``benchmarks/results/fused_cpu_check.json``), which
``benchmarks/cpu_latency.py --check-only`` has replaced.
``compiler="eager"`` runs the same segment graphs uncompiled for every model and scheduler in seconds.
"""

from __future__ import annotations

import functools
import io
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

from cuda_precision import fp32_math  # noqa: F401 - autouse: no TF32 in the CUDA tests
from dags import dags
from opweave import schedulers, zoo
from opweave.api import compile_captured
from opweave.backends.program import Program
from opweave.backends.segments import MAX_SIGNATURES, Segmented, fuse_segments, segment_groups, segment_plan
from opweave.capture import capture, opinfo
from opweave.capture.coarsen import merge_ops
from opweave.costs import from_graph
from opweave.errors import CaptureError
from opweave.ir import Edge, Op, OpGraph
from opweave.plan import Instr, LaunchPlan
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from test_coarsen import SMALL

ACCEPTANCE = ("sequential", "lios", "opara")
FAST_INDUCTOR = ("deepfm", "bert_base")
SLOW_INDUCTOR = ("squeezenet", "resnet50")  # the rest of the zoo: benchmarks/cpu_latency.py (module docstring)


@functools.cache
def captured_model(name: str):
    model, inputs = zoo.create(name, **SMALL.get(name, {}))
    with torch.inference_mode():
        reference = model(*inputs)
    return capture(model, inputs, name=name), inputs, reference


def assert_allclose(got, expected, tol: float = 1e-4) -> None:
    """fp32 allclose with rtol ``tol`` and atol ``tol`` x the output's scale (max(1, max |expected|)), leaf by leaf,
    same structure: capture's verification convention. (Coarsening folds BatchNorm into the convolutions, which
    moves Inception-v3's outputs at 139x139 by up to 1.5e-4 on a scale of 3.2 even without a compiler.)"""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(expected)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves, strict=True):
        scale = max(1.0, float(b.abs().max())) if b.is_floating_point() and b.numel() else 1.0
        assert torch.allclose(a, b, rtol=tol, atol=tol * scale), (float((a - b).abs().max()), scale)


# ---- the segment plan -------------------------------------------------------------------------------------------


def test_segments_of_a_hand_made_plan():
    launch = lambda op, s: Instr(0, "launch", s, op=op)  # noqa: E731
    plan = LaunchPlan([launch("a", 0), launch("x", 1), launch("b", 0), Instr(0, "record", 0, event=0),
                       launch("c", 0), launch("y", 1), Instr(0, "wait", 1, event=0), launch("z", 1)])
    groups = segment_groups(plan)
    assert groups == [["a", "b"], ["x", "y"], ["c"], ["z"]]
    assert [(i.kind, i.op or i.event) for i in segment_plan(plan, groups).instrs] == [
        ("launch", "a"), ("launch", "x"), ("record", 0), ("launch", "c"), ("wait", 0), ("launch", "z")]


def quotient(graph: OpGraph, groups: list[list[str]]) -> OpGraph:
    """The graph of segments: one op per group, an edge wherever an edge of ``graph`` crosses two groups."""
    group_of = {op: g[0] for g in groups for op in g}
    pairs = {(group_of[e.src], group_of[e.dst]) for e in graph.edges} - {(g, g) for g in group_of.values()}
    return OpGraph([Op(g[0]) for g in groups], [Edge(*pair) for pair in sorted(pairs)])


@given(dags(max_ops=30), st.sampled_from(schedulers.names()), st.integers(1, 4))
def test_the_segment_plan_orders_every_dependency_between_segments(graph, scheduler, streams):
    """What segments.py's docstring argues: launched as whole segments, the plan still passes the validator, for
    the graph whose ops are the segments."""
    devices = 2 if scheduler in schedulers.MULTI_DEVICE else 1
    sched = schedulers.run(scheduler, graph, from_graph(graph), streams=streams, devices=devices)
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    groups = segment_groups(plan)
    assert sorted(op for g in groups for op in g) == sorted(graph.ids)
    lanes = {ins.op: (ins.device, ins.stream) for ins in plan.instrs if ins.kind == "launch"}
    for g in groups:
        assert len({lanes[op] for op in g}) == 1
    seg_plan = segment_plan(plan, groups)
    validate(quotient(graph, groups), seg_plan)
    program = Program.from_plan(seg_plan)
    assert sum(step.kind == "launch" for steps in program.lanes.values() for step in steps) == len(groups)


# ---- segment graphs, run uncompiled --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", zoo.names())
def test_segment_graphs_equal_eager_for_every_zoo_model(name):
    captured, inputs, reference = captured_model(name)
    for scheduler in (*ACCEPTANCE, "hios-lp"):
        fast = compile_captured(captured, inputs, scheduler=scheduler, streams=3, compiler="eager")
        assert fast.fused.stats["segments"] == len(segment_groups(fast.plan))
        with torch.inference_mode():
            assert_allclose(fast(*inputs), reference)


def test_compiling_the_segments_shows_a_progress_bar_on_a_terminal_only():
    from rich.console import Console

    captured, inputs, _ = captured_model("deepfm")
    plan = compile_captured(captured, inputs, scheduler="lios", streams=2, coarsen=False).plan
    for terminal in (True, False):
        segmented, segment_launches = fuse_segments(captured, plan, "eager")
        console = Console(file=io.StringIO(), force_terminal=terminal, width=120)
        segmented.prepare(inputs, segment_launches, console=console)
        text, segments = console.file.getvalue(), segmented.stats["segments"]
        assert segments > 1 and segmented.stats["compiles"] == segments
        assert ("deepfm: compiling segments with eager" in text and f"{segments}/{segments}" in text) == terminal


def test_a_scalar_crossing_segments_is_recomputed_never_baked():
    class Scalar(nn.Module):
        def forward(self, x):
            return x.relu() * x.sum().item()

    x = torch.randn(4, 4)
    captured = capture(Scalar(), (x,))
    merged = merge_ops(captured, [[op] for op in captured.graph.topo_order])  # every op its own segment
    segmented = Segmented(merged.graph, merged.gm, merged.nodes, compiler="eager")
    for _ in range(3):
        x = torch.randn(4, 4)
        env = segmented.bind((x,))
        for seg in segmented.graph.topo_order:
            segmented.run_op(seg, env)
        torch.testing.assert_close(segmented.output(env), Scalar()(x))


class Slices(nn.Module):
    """Slices of one input, each read by one op but the first, which two ops read."""

    def forward(self, x):
        first = x[:, 0]
        return first.relu() + first.sigmoid() + x[:, 1].exp() * x[:, 2].tanh()


def test_a_slice_of_an_input_read_by_one_segment_is_made_inside_it_and_one_read_by_two_is_bound():
    x = torch.randn(4, 3, 5)
    captured = capture(Slices(), (x,))
    prelude = {name for name, _ in captured._prelude}
    assert len(prelude) == 3  # the three slices, bound before the ops run
    merged = merge_ops(captured, [[op] for op in captured.graph.topo_order])  # every op its own segment
    segmented = Segmented(merged.graph, merged.gm, merged.nodes, compiler="eager")
    bound = [name for name, _ in segmented._prelude]
    assert len(bound) == 1 and bound[0] in prelude  # the slice two segments read
    inputs = {node.name for seg in segmented._segments.values() for node in seg.inputs}
    assert inputs & prelude == set(bound) and "x" in inputs
    whole = merge_ops(captured, [list(captured.graph.topo_order)])  # one segment: it takes the input itself
    one = Segmented(whole.graph, whole.gm, whole.nodes, compiler="eager")
    assert one._prelude == [] and [n.name for n in next(iter(one._segments.values())).inputs] == ["x"]
    for model in (segmented, one):
        for _ in range(2):
            x = torch.randn(4, 3, 5)
            env = model.bind((x,))
            for seg in model.graph.topo_order:
                model.run_op(seg, env)
            torch.testing.assert_close(model.output(env), Slices()(x))


class CheckedSlice(nn.Module):
    """A slice of a weight, made float (a check ``torch.export`` leaves in the graph), read by one op: timm's
    position embedding. The branch on a size makes capture use ``torch.export``."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 5))

    def forward(self, x):
        if x.shape[0] > 64:
            raise ValueError("at most 64 rows")
        return (x @ self.table[1:].float().t()).relu()


@pytest.mark.parametrize("compiler", ["eager", "onnxruntime"])
def test_a_slice_of_a_weight_that_export_checked_is_made_inside_the_segment_that_reads_it(compiler):
    """Not an input of every call: a compiler then sees a constant it folds (ONNX Runtime resized timm's position
    embedding on every call, 2.2x slower than the model exported whole)."""
    model, x = CheckedSlice().eval(), torch.randn(4, 5)
    captured = capture(model, (x,))
    assert any(opinfo.is_assertion(n, captured.gm) for n in captured.gm.graph.nodes)
    whole = merge_ops(captured, [list(captured.graph.topo_order)])
    one = Segmented(whole.graph, whole.gm, whole.nodes, compiler=compiler)
    [segment] = one._segments.values()
    assert one._prelude == [] and [n.name for n in segment.inputs] == [n.name for n in captured.gm.graph.nodes
                                                                         if n.op == "placeholder"]
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 5)
            env = one.bind((x,))
            for seg in one.graph.topo_order:
                one.run_op(seg, env)
            torch.testing.assert_close(one.output(env), model(x))
    assert one.stats["fallbacks"] == 0


def test_a_segment_past_its_signature_bound_runs_op_by_op_and_warns_once():
    class Scalar(nn.Module):
        def forward(self, x):
            return x.relu() * x.sum().item()

    captured = capture(Scalar(), (torch.randn(4, 4),))
    merged = merge_ops(captured, [[op] for op in captured.graph.topo_order])
    segmented = Segmented(merged.graph, merged.gm, merged.nodes, compiler="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(MAX_SIGNATURES + 3):  # a new scalar, so a new signature of the segment reading it, every call
            x = torch.randn(4, 4)
            env = segmented.bind((x,))
            for seg in segmented.graph.topo_order:
                segmented.run_op(seg, env)
            torch.testing.assert_close(segmented.output(env), Scalar()(x))
    bound = [w for w in caught if f"more than {MAX_SIGNATURES} input signatures" in str(w.message)]
    assert len(bound) == 1
    assert max(len(s.compiled) for s in segmented._segments.values()) == MAX_SIGNATURES  # none evicted


# ---- TorchInductor on the CPU ------------------------------------------------------------------------------------


def inductor_matches_eager(name: str) -> None:
    captured, inputs, reference = captured_model(name)
    for scheduler in ACCEPTANCE:
        fast = compile_captured(captured, inputs, scheduler=scheduler, streams=2, compiler="inductor")
        stats = fast.fused.stats
        assert stats["compiles"] == stats["segments"] and stats["fallbacks"] == 0 and stats["compile_s"] > 0
        with torch.inference_mode():
            assert_allclose(fast(*inputs), reference)


@pytest.mark.parametrize("name", FAST_INDUCTOR)
def test_inductor_segments_equal_eager(name):
    inductor_matches_eager(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_INDUCTOR)
def test_inductor_segments_equal_eager_on_convolutional_networks(name):
    inductor_matches_eager(name)


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, m):
        return torch.relu(self.a(x)) + 1, torch.linalg.cholesky(m) * 2


def test_new_values_reuse_the_compiled_segments_and_new_strides_compile_again():
    model = TwoBranches()
    x, m = torch.randn(4, 8), torch.eye(3) * 2
    fast = compile_captured(capture(model, (x, m)), (x, m), scheduler="lios", compiler="inductor")
    assert fast.schedule.streams_used == 2
    compiles = fast.fused.stats["compiles"]
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(4, 8)
            assert_allclose(fast(x, m), model(x, m))
        assert fast.fused.stats["compiles"] == compiles
        x_t = torch.randn(8, 4).t()  # same shape, other strides: Inductor checks strides, so a new signature
        assert_allclose(fast(x_t, m), model(x_t, m))
    assert fast.fused.stats["compiles"] == compiles + 1


@torch.library.custom_op("opweave_test::positive", mutates_args=())
def positive(x: torch.Tensor) -> torch.Tensor:
    """``x`` where every element is positive, else an error: an op that fails inside compiled code on every torch
    (Inductor calls a custom op as is; torch 2.11's compiled ``linalg.cholesky`` returns garbage where eager raises)."""
    if bool((x <= 0).any()):
        raise RuntimeError("opweave_test::positive: an element is not positive")
    return x.clone()


@positive.register_fake
def _(x):
    return torch.empty_like(x)


class FailingBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(3, 3)

    def forward(self, x, m):
        return torch.relu(self.a(x)) + 1, positive(self.b(m).exp() * m) * 2


def test_an_error_inside_a_compiled_segment_reaches_the_caller_without_hanging():
    model = FailingBranch()
    x, m = torch.randn(4, 8), torch.rand(3, 3) + 0.5
    fast = compile_captured(capture(model, (x, m)), (x, m), scheduler="lios", compiler="inductor")
    assert fast.schedule.streams_used == 2 and fast.fused.stats["fallbacks"] == 0  # both lanes compiled
    with pytest.raises((CaptureError, RuntimeError), match="not positive"):
        fast(x, -m)  # fails on one lane while the other runs
    assert_allclose(fast(x, m), model(x, m))


@torch.library.custom_op("opweave_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_segment_inductor_cannot_compile_runs_op_by_op_with_a_warning():
    class Custom(nn.Module):  # a custom op without a fake (meta) implementation cannot be traced by AOTAutograd
        def forward(self, x):
            return twice(x.relu()) + 1

    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = compile_captured(capture(Custom(), (x,)), (x,), scheduler="sequential", compiler="inductor")
    assert any("could not be compiled with inductor" in str(w.message) for w in caught)
    assert fast.fused.stats["fallbacks"] == 1
    torch.testing.assert_close(fast(x), Custom()(x))


def test_a_segment_run_op_by_op_reads_the_weights_it_takes_as_get_attr_nodes():
    class Weighted(nn.Module):  # its weight is a get_attr node the segment reads, not a module's own
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return twice(torch.nn.functional.linear(x, self.weight)) + 1

    model, x = Weighted(), torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = compile_captured(capture(model, (x,)), (x,), scheduler="sequential", compiler="inductor")
    assert fast.fused.stats["fallbacks"] == 1
    torch.testing.assert_close(fast(x), model(x))


def test_unknown_compiler_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="option 'compiler' must be one of"):
        compile_captured(capture(nn.Linear(8, 8), (x,)), (x,), compiler="tvm")


def test_torch_compile_backend_takes_a_segment_compiler():
    torch._dynamo.reset()
    model, x = TwoBranches(), (torch.randn(4, 8), torch.eye(3) * 2)
    fast = torch.compile(model, backend="opweave", options={"compiler": "inductor", "scheduler": "lios", "streams": 2})
    with torch.inference_mode():
        assert_allclose(fast(*x), model(*x))
    import opweave.dynamo

    compiled = opweave.dynamo.last_compiled()
    assert compiled.fused is not None and compiled.fused.stats["compiles"] == compiled.fused.stats["segments"] >= 2
    torch._dynamo.reset()


@pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "streams"])
def test_the_cuda_backend_compiles_every_segment_before_the_first_call(cudagraphs):
    """On the fake CUDA runtime: building compiles every segment, with graphs (the capture's warm-ups) and without
    (a run of the example when the backend is made), so no first call pays for a compile. (Without graphs no
    segment was compiled before a call: found on an H200.)"""
    from opweave.testing.fakecuda import FakeCuda

    model, x = TwoBranches(), (torch.randn(4, 8), torch.eye(3) * 2)
    runtime = FakeCuda(seed=0)
    fast = compile_captured(capture(model, x), x, scheduler="lios", device="cuda", streams=3, compiler="eager",
                            cudagraphs=cudagraphs, runtime=runtime)
    stats = dict(fast.fused.stats)
    assert stats["segments"] == stats["compiles"] == 2 and stats["fallbacks"] == 0
    out = fast(*x)
    runtime.synchronize()
    assert fast.fused.stats["compiles"] == 2  # the call compiled nothing
    assert_allclose(out, model(*x))


# ---- CUDA (skipped without a GPU) ----------------------------------------------------------------

@pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "streams"])
@pytest.mark.parametrize("name", ["squeezenet", "bert_base"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_segments_on_cuda_streams_inside_the_cuda_graph(name, cudagraphs):
    model, inputs = zoo.create(name, **SMALL.get(name, {}))
    model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    with torch.no_grad():
        reference = model(*inputs)
    for scheduler in ACCEPTANCE:
        fast = compile_captured(capture(model, inputs, name=name), inputs, scheduler=scheduler, device="cuda",
                                streams=3, compiler="inductor", cudagraphs=cudagraphs)
        stats = fast.fused.stats
        assert stats["compiles"] == stats["segments"] and stats["fallbacks"] == 0
        with torch.no_grad():
            assert_allclose(fast(*inputs), reference)
            x = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in inputs)
            assert_allclose(fast(*x), model(*x))  # a replay on new values


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_segments_of_a_cpu_model_compiled_for_cuda():
    """The CUDA backend moves a CPU model's Captured to the GPU (a copy, through dataclasses.replace): the copy must
    still be a Segmented, compiling its segments for CUDA."""
    model, x = TwoBranches(), (torch.randn(4, 8), torch.eye(3) * 2)
    fast = compile_captured(capture(model, x), x, scheduler="lios", device="cuda", compiler="inductor")
    assert isinstance(fast.backend.captured, Segmented) and fast.backend.captured is not fast.fused
    assert fast.fused.stats["compiles"] == fast.fused.stats["segments"]  # stats shared with the copy
    with torch.no_grad():
        assert_allclose(fast(*(t.cuda() for t in x)), tuple(t.cuda() for t in model(*x)))
