"""Blocks at single-tensor cut points (serve/engine/blocks.py) and the combined-block graphs of the executors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dags import dags
from opweave import zoo
from opweave.capture import capture
from opweave.errors import UsageError
from opweave.ir import OpGraph
from opweave.outputs import compare
from opweave.serve.assemble import serving_options
from opweave.serve.engine import blocks
from opweave.serve.engine.combined import Part, union_graph
from opweave.serve.engine.cpu import CpuExecutor
from opweave.serve.engine.simulation import SimExecutor
from serve_models import Pooled, tiny


@pytest.fixture(scope="module")
def tiny_blocked():
    model, x = tiny()
    return model, x, blocks.split(capture(model, x), x, name="tiny")


def test_cut_points_are_the_ops_every_path_crosses_with_one_live_tensor(tiny_blocked):
    _, _, bm = tiny_blocked
    # the branch convolutions and their ReLUs are not cut points (two values live: the other branch's input)
    assert bm.cuts == ["stem", "relu", "cat", "cat_1", "adaptive_avg_pool2d"]
    live = blocks.live_after(bm.captured)
    order = bm.captured.graph.topo_order
    assert live[order.index("m1_a")] and len(live[order.index("m1_a")]) == 2


def test_one_op_segments_join_the_block_they_feed_and_a_tail_joins_the_last(tiny_blocked):
    _, _, bm = tiny_blocked
    assert [b.ops[-1] for b in bm.blocks] == ["cat", "fc"]
    assert bm.blocks[0].ops[:2] == ("stem", "relu") and bm.blocks[1].ops[-2:] == ("adaptive_avg_pool2d", "fc")
    assert bm.blocks[1].inputs == ("cat",) and bm.blocks[0].output == "cat" and bm.blocks[1].output is None
    order = ["a", "b", "c", "d", "e", "f", "g"]
    # segments [a] [b c] [d] [e] [f g]: a joins [b c]; d, e join [f g]
    assert blocks.blocks_from_cuts(order, ["a", "c", "d", "e"]) == [["a", "b", "c"], ["d", "e", "f", "g"]]
    assert blocks.blocks_from_cuts(order, ["c", "e", "f"]) == [["a", "b", "c"], ["d", "e", "f", "g"]]
    assert blocks.blocks_from_cuts(order, order[:-1]) == [order]  # a chain is one block


def test_block_modules_chained_give_the_models_answer(tiny_blocked):
    model, _, bm = tiny_blocked
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(bm.run(x), model(x), atol=1e-6)
    assert bm.stackable


def test_manual_cuts_override_and_refuse_what_is_not_a_cut():
    model, x = tiny()
    bm = blocks.split(capture(model, x), x, cuts=["relu", "cat_1"])
    assert [b.ops[-1] for b in bm.blocks] == ["relu", "cat_1", "fc"]
    with torch.no_grad():
        assert torch.allclose(bm.run(*x), model(*x), atol=1e-6)
    with pytest.raises(UsageError, match="'m1_a' is not a single-tensor cut point .2 values live"):
        blocks.split(capture(model, x), x, cuts=["m1_a"])
    with pytest.raises(UsageError, match="'nope' is not an op"):
        blocks.split(capture(model, x), x, cuts=["nope"])


def test_a_model_whose_output_has_no_batch_dimension_is_not_stacked():
    model, x = Pooled().eval(), torch.randn(1, 3, 4, 4)
    assert not blocks.split(capture(model, x), x).stackable


def test_graph_at_extrapolates_flops_and_bytes_exactly(tiny_blocked):
    _, _, bm = tiny_blocked
    for b in range(len(bm.blocks)):
        est, real = bm.graph_at(b, 5), bm.captured_block(b, 5).graph
        assert est.ids == real.ids == list(bm.blocks[b].ops)  # block op ids are the whole model's
        for a, r in zip(est.ops, real.ops, strict=True):
            assert a.flops == pytest.approx(r.flops) and a.bytes == pytest.approx(r.bytes) and a.shape == r.shape


def test_zoo_squeezenet_splits_into_its_fire_modules():
    model, x = zoo.create("squeezenet", image_size=64)
    bm = blocks.split(capture(model, x, name="squeezenet"), x, name="squeezenet")
    assert len(bm.blocks) == 8  # Fire2-Fire9; stem, pools and classifier join their neighbours
    assert [b.ops[-1] for b in bm.blocks[:-1]] == ["cat", *(f"cat_{i}" for i in range(1, 7))]
    assert blocks.table_ii(bm)["cut_points"] == 31
    with torch.no_grad():
        assert torch.allclose(bm.run(*x), model(*x), atol=1e-5)


@given(st.lists(dags(max_ops=12), min_size=1, max_size=4))
def test_union_graph_order_is_the_graphs_own_topological_order(graphs):
    union = union_graph(graphs)
    rebuilt = OpGraph(union.ops, union.edges, "check")  # validated and sorted the ordinary way
    assert union.topo_order == rebuilt.topo_order
    assert len(union) == sum(len(g) for g in graphs)


def test_combined_block_on_the_cpu_backend_answers_each_part(tiny_blocked):
    model, _, bm = tiny_blocked
    ex = CpuExecutor({"tiny": bm}, serving_options("cpu", streams=2, compiler="none"))
    x = torch.randn(3, 3, 8, 8)
    first = Part("tiny", 0, 3, (x,))
    ex.run([first])
    second_inputs = torch.randn(2, 3, 8, 8)
    parts = [Part("tiny", 1, 3, first.state), Part("tiny", 0, 2, (second_inputs,))]
    ex.run(parts)  # block 1 of three samples beside block 0 of two others
    with torch.no_grad():
        assert torch.allclose(parts[0].state, model(x), atol=1e-5)
        assert torch.allclose(parts[1].state[0], bm.modules[0](second_inputs), atol=1e-5)
    built = ex.combined_block((("tiny", 0, 2), ("tiny", 1, 3)))
    assert ex.stats["misses"] == 2 and len(built.backend.program.lanes) >= 1


def test_padding_rounds_batches_up_and_drops_the_extra_rows(tiny_blocked):
    model, _, bm = tiny_blocked
    ex = CpuExecutor({"tiny": bm}, serving_options("cpu", compiler="none"), pad=True)
    x = torch.randn(3, 3, 8, 8)
    state = (x,)
    for b in range(2):
        part = Part("tiny", b, 3, state)
        ex.run([part])
        state = part.state
    with torch.no_grad():
        assert state.shape[0] == 3 and torch.allclose(state, model(x), atol=1e-5)
    assert all(n == 4 for sig in ex._cache for _, _, n in sig)


def test_combined_module_runs_the_parts_side_by_side(tiny_blocked):
    model, _, bm = tiny_blocked
    combined = blocks.combined_module([bm.modules[0], bm.modules[1], bm.modules[0]])
    a, b = torch.randn(2, 3, 8, 8), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        mid = bm.modules[0](b)
        out = combined(a, mid, b)
        assert torch.allclose(out[0], bm.modules[0](a)) and torch.allclose(out[1], model(b), atol=1e-5)
        assert torch.allclose(out[2], mid)
    captured = blocks.capture_block(combined, (a, mid, b), "combined")
    assert len(captured.graph) == 2 * len(bm.blocks[0].ops) + len(bm.blocks[1].ops)


def test_sim_executor_times_a_combined_block_no_longer_than_its_parts_one_after_another(tiny_blocked):
    _, _, bm = tiny_blocked
    ex = SimExecutor({"tiny": bm}, serving_options("sim"))
    alone = [ex.run([Part("tiny", b, 1)]).seconds for b in (0, 1)]
    both = ex.run([Part("tiny", 0, 1), Part("tiny", 1, 1)])
    assert max(alone) <= both.seconds <= sum(alone)
    assert 0 < both.utilization <= 1


def test_sim_executor_plans_each_combined_block_through_the_pipelines_simulation_target(tiny_blocked):
    """A combined block in simulation is a pipeline ``Compiled`` (the simulation target's): its validated plan of
    the server's scheduler, replayed by the simulator; a step takes that replay's makespan plus the step overhead.
    Before, the simulated executor planned and timed on its own, and its blocks were tuples beside the other
    executors' backends."""
    from opweave.backends.simulate import makespan_ms
    from opweave.pipeline import Compiled
    from opweave.plan.validate import validate

    _, _, bm = tiny_blocked
    ex = SimExecutor({"tiny": bm}, serving_options("sim", scheduler="wavefront"), step_overhead_ms=0.5)
    sig = (("tiny", 0, 2), ("tiny", 1, 1))
    built = ex.combined_block(sig)
    assert isinstance(built, Compiled) and built.device == "sim" and built.options is ex.options
    assert built.schedule.scheduler == "wavefront" and ex.combined_block(sig) is built and ex.stats["hits"] == 1
    validate(built.graph, built.plan, built.schedule)
    makespan, utilization = built()
    assert makespan == makespan_ms(built.graph, built.plan, built.costs) > 0 and 0 < utilization <= 1
    step = ex.run([Part("tiny", 0, 2), Part("tiny", 1, 1)])
    assert step.seconds == pytest.approx((makespan + 0.5) / 1e3)


def test_an_executor_takes_only_options_resolved_for_its_server(tiny_blocked):
    _, _, bm = tiny_blocked
    with pytest.raises(UsageError, match="serving_options\\('sim'"):
        SimExecutor({"tiny": bm}, serving_options("cpu", compiler="none"))
    with pytest.raises(UsageError, match="serving_options\\('cpu'"):
        CpuExecutor({"tiny": bm}, serving_options("sim"))


@given(dags(max_ops=20), st.sampled_from(["ideal", "gpu"]))
def test_makespan_ms_is_what_simulate_reports(graph, model):
    from dataclasses import replace

    from opweave.backends.simulate import makespan_ms, simulate
    from opweave.costs import from_graph
    from opweave.pipeline import plan_for

    costs = replace(from_graph(graph), model=model)
    _, plan = plan_for(graph, costs, "lios", streams=3)
    assert makespan_ms(graph, plan, costs) == simulate(graph, plan, costs).makespan_ms


def test_a_block_at_a_large_batch_is_captured_without_a_forward_pass_and_runs_at_that_batch():
    model, inputs = zoo.create("squeezenet", batch_size=1, image_size=64)
    blocked = blocks.split(capture(model, inputs, name="squeezenet"), inputs, name="squeezenet")
    calls = []
    inner = next(n.target for n in blocked.modules[1].graph.nodes if n.op == "call_module")
    hook = blocked.modules[1].get_submodule(inner).register_forward_hook(lambda *a: calls.append(1))
    assert {(1, 1), (1, 2)} <= set(blocked._captures)  # batches 1 and 2 captured by the split's own runs
    three = blocked.captured_block(1, 3)  # extrapolated from batches 1 and 2
    before = len(calls)
    assert before == 0
    five = blocked.captured_block(1, 5)
    assert len(calls) == before  # no forward pass for batch 5
    assert [o.shape[0] for o in five.graph.ops if o.shape] and all(
        o5.flops == o1.flops + 4 * (o2.flops - o1.flops) for o5, o1, o2 in
        zip(five.graph.ops, blocked.captured_block(1, 1).graph.ops, blocked.captured_block(1, 2).graph.ops,
            strict=True))
    hook.remove()
    assert three.graph.name.endswith("x3")
    executor = CpuExecutor({"squeezenet": blocked}, serving_options("cpu", compiler="none"))
    x = torch.randn(5, *blocked.example(1, 1)[0].shape[1:])
    part = Part("squeezenet", 1, 5, (x,))
    executor.run([part])  # binds inputs of batch 5 against the capture's shapes
    with torch.no_grad():
        (got,) = part.state
        assert torch.allclose(got, blocked.modules[1](x), atol=1e-5)


def test_blocks_compiled_whole_by_onnxruntime_run_side_by_side_and_equal_eager():
    model, inputs = zoo.create("squeezenet", batch_size=1, image_size=64)
    blocked = blocks.split(capture(model, inputs, name="sq"), inputs, name="sq")
    ex = CpuExecutor({"sq": blocked}, serving_options("cpu", compiler="onnxruntime"))
    assert not ex.pad and ex.scheduler == "heft"
    made = ex.warm_models(max_batch=4)  # one session per block: any batch, any thread count
    assert made == len(blocked.blocks)
    assert all(ex.block("sq", b).compiled.any_batch for b in range(len(blocked.blocks)))
    x, y = torch.randn(3, 3, 64, 64), torch.randn(1, 3, 64, 64)
    first = Part("sq", 0, 3, (x,))
    ex.run([first])
    second, third = Part("sq", 1, 3, first.state), Part("sq", 0, 1, (y,))
    ex.run([second, third])  # two parts: two lanes when there are two cores
    assert ex.combined_block((("sq", 0, 1), ("sq", 1, 4))).backend.program.lanes
    state = second.state
    for b in range(2, len(blocked.blocks)):
        part = Part("sq", b, 3, state)
        ex.run([part])
        state = part.state
    with torch.no_grad():
        assert compare(model(x), state, tolerance=1e-4).ok  # batch 3 on sessions exported at batch 2
        (got,) = third.state
        assert compare(blocked.modules[0](y), got, tolerance=1e-4).ok
    assert ex.warm_models(max_batch=4) == made  # nothing new to compile
    assert all(set(b.compiled) == {None} and not b.compiled[None].compiled.variants.built()
               for b in ex._blocks.values())
