"""The fitted GPU model: the device file, the per-op model, the fit (a synthetic device with known parameters is
recovered), the CUDA default's choice and the CLI's flags."""

import gzip
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opweave.backends.simulate import simulate
from opweave.cli import app
from opweave.costs import calibrate as fit
from opweave.costs import calibrated, from_graph
from opweave.costs.calibrated import Device, OpClass
from opweave.errors import UsageError
from opweave.ir import Edge, Op, OpGraph
from opweave.ir.synth import random_dag
from opweave.pipeline.choose import benchmark_graph, choose, replay, sync_options
from opweave.plan.make import plan_for, validated_plan
from opweave.schedulers.schedule import Schedule

DATA = Path(__file__).parent / "data"
RESULTS = Path(__file__).parents[1] / "benchmarks" / "results" / "gpu_latency_h200_b1_fp32.json"


@pytest.fixture(scope="module")
def h200() -> Device:
    return calibrated.device("h200")


# ---- the device file ----------------------------------------------------------------------------------------------
def test_the_shipped_device_round_trips_and_h100_differs_only_in_its_datasheet(h200, tmp_path):
    path = tmp_path / "dev.json"
    h200.save(path)
    assert Device.load(path) == h200
    assert set(h200.classes) == set(calibrated.CLASSES)
    h100 = calibrated.device("h100")
    assert h100.datasheet.bandwidth_gbs == 3350.0 and h200.datasheet.bandwidth_gbs == 4800.0
    assert replace(h100, datasheet=h200.datasheet, fit=h200.fit) == h200


@pytest.mark.parametrize("change, message", [
    ({"format": "other"}, "not an opweave device file"),
    ({"extra": 1}, "unknown field"),
    ({"classes": {"warp": {}}}, "unknown op class 'warp'"),
])
def test_a_bad_device_file_is_refused_in_one_line(h200, tmp_path, change, message):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({**h200.to_dict(), **change}))
    with pytest.raises(UsageError, match=message):
        Device.load(path)


def test_no_fitted_device_for_an_unmeasured_gpu():
    with pytest.raises(UsageError, match="no fitted device 'v100'"):
        calibrated.device("v100")


# ---- the per-op model ---------------------------------------------------------------------------------------------
def conv(channels_in: int, channels_out: int, size: int, kernel: int, batch: int = 1, groups: int = 1):
    out = batch * channels_out * size * size
    flops = 2 * out * channels_in // groups * kernel * kernel
    src = Op("x", target="torch.nn.ReLU", category="memory", shape=[batch, channels_in, size, size],
             dtype="float32", flops=batch * channels_in * size * size, bytes=8 * batch * channels_in * size * size)
    op = Op("c", target="torch.nn.Conv2d", shape=[batch, channels_out, size, size], dtype="float32", flops=flops,
            bytes=4 * (out + batch * channels_in * size * size))
    return OpGraph([src, op], [Edge("x", "c")])


@pytest.mark.parametrize("args, cls", [
    ((64, 64, 28, 1), "conv_pointwise"),
    ((64, 64, 28, 3), "conv"),
    ((64, 128, 28, 7), "conv"),
    ((64, 64, 28, 3, 1, 64), "conv_depthwise"),
    ((11, 11, 56, 5, 1, 11), "conv_depthwise"),
])
def test_convolutions_are_told_apart_by_their_depth_against_their_input_channels(args, cls):
    graph = conv(*args)
    assert calibrated.op_class(graph, graph.op["c"]) == cls
    out = calibrated._numel(graph.op["c"].shape)  # a coarse op: its ReLU and residual add count 2 FLOPs per output
    coarse = OpGraph([graph.op["x"], replace(graph.op["c"], flops=graph.op["c"].flops + 2 * out)], graph.edges)
    assert calibrated.op_class(coarse, coarse.op["c"]) == cls


def test_half_precision_and_bigger_batches_cost_what_the_datasheet_says(h200):
    small, big = conv(256, 256, 28, 3), conv(256, 256, 28, 3, batch=8)
    t = {(b, d): calibrated.op_time_us(h200, g, g.op["c"], d) for b, g in ((1, small), (8, big))
         for d in ("float32", "float16")}
    assert t[(8, "float32")] > t[(1, "float32")]  # more work
    assert t[(8, "float16")] < t[(8, "float32")]  # tensor cores twice as fast as TF32, half the bytes
    pointwise = conv(480, 128, 14, 1)
    assert calibrated.kernels(h200, pointwise, pointwise.op["c"]) == h200.classes["conv_pointwise"].kernels + 1
    batched = conv(480, 128, 14, 1, batch=8)  # no longer one GEMM over NCHW: transforms, as a convolution
    assert calibrated.kernels(h200, batched, batched.op["c"]) == h200.classes["conv"].kernels


def test_the_trace_fit_reproduces_googlenets_op_times_and_kernels(h200):
    trace = json.load(gzip.open(DATA / "googlenet-trace.json.gz", "rt"))
    graph = benchmark_graph("googlenet", 1)
    dev = fit.fit_classes(graph, trace, h200)
    errors = fit.class_errors(graph, trace, dev)
    assert sum(e["kernels_measured"] for e in errors.values()) == pytest.approx(
        sum(e["kernels_model"] for e in errors.values()), abs=3)
    assert all(e["error"] < 0.25 for e in errors.values())
    assert dev.classes["conv_depthwise"].source == "as pool"


# ---- the call fit recovers a known device -------------------------------------------------------------------------
def synthetic_configs(seed: int = 0):
    """Three random DAGs of 16, 24 and 40 ops (their sequential rows tell the kernel gap from the call's cost) whose
    ops have shapes (so they share the device) and measured times, each planned by sequential and by three
    schedulers at stream caps from 2 to 8."""
    rng = random.Random(seed)
    configs, rows = {}, []
    for i, size in enumerate((16, 24, 40)):
        dag = random_dag(size, 5, seed=seed + i)
        ops = [replace(o, latency_ms=rng.uniform(0.0005, 0.004), target="torch.nn.ReLU", category="memory",
                       shape=[1, rng.choice([16, 64, 256]), 28, 28]) for o in dag.ops]
        graph = OpGraph(ops, dag.edges, dag.name)
        cfg = fit.Config(graph, "float32", {}, graph.latencies())
        for name, cap in (("sequential", 1), ("wavefront", 8), ("lios", 2), ("lios", 8), ("heft", 4)):
            cfg.plans[(name, cap)] = plan_for(graph, from_graph(graph), name, streams=cap)[1]
            rows.append(fit.Row(graph.name, 1, "fp32", name, cap, 1.0))
        configs[(graph.name, 1, "fp32")] = cfg
    return rows, configs


def test_the_call_fit_recovers_a_synthetic_device_whose_parameters_are_known(h200):
    truth = replace(h200, kernel_gap_us=0.6, dispatch_us=1.2, event_wait_us=2.5, call_us=30.0, concurrency=2.0)
    rows, configs = synthetic_configs()
    rows = [replace(r, measured_ms=ms) for r, ms in zip(rows, fit.predict(rows, configs, truth, replay()), strict=True)]
    start = replace(h200, kernel_gap_us=1.0, dispatch_us=0.5, event_wait_us=1.0, call_us=60.0, concurrency=1.0)
    assert fit.summary(rows, fit.predict(rows, configs, start, replay()))["mean_error"] > 0.1
    fitted = fit.fit_call(rows, configs, start, replay(), iterations=100, restarts=2)
    assert fit.summary(rows, fit.predict(rows, configs, fitted, replay()))["mean_error"] < 0.01
    for name in fit.CALL_PARAMS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_the_ordering_term_counts_only_pairs_the_gpu_told_apart():
    rows = [fit.Row("m", 1, "fp32", "a", 8, 1.0, spread_ms=(0.95, 1.05)),
            fit.Row("m", 1, "fp32", "b", 8, 1.1, spread_ms=(1.04, 1.2)),  # overlaps a: not told apart
            fit.Row("m", 1, "fp32", "c", 8, 1.5, spread_ms=(1.4, 1.6)),
            fit.Row("n", 1, "fp32", "a", 8, 2.0)]  # another configuration, no spread: its median
    assert fit.ordered_pairs(rows) == [(0, 2), (1, 2)]
    assert fit.rank_loss(rows, fit.ordered_pairs(rows), [1.0, 1.1, 1.5, 9.0]) == 0.0
    inverted = [1.0, 2.0, 1.5, 9.0]  # b predicted slower than c, which the GPU measured faster: log(2 / 1.5)
    assert fit.rank_loss(rows, fit.ordered_pairs(rows), inverted) == pytest.approx(math.log(2 / 1.5) / 2)
    assert fit.summary(rows, inverted)["inverted_pairs"] == 1


def test_rows_carry_the_measured_spread():
    rows = fit.read_rows([RESULTS])
    assert all(r.spread_ms[0] <= r.measured_ms <= r.spread_ms[1] for r in rows)


def test_nelder_mead_finds_a_quadratics_minimum():
    import numpy as np

    best = fit.nelder_mead(lambda x: float(((x - np.array([0.3, 0.7])) ** 2).sum()), np.array([0.5, 0.5]), 200)
    assert best == pytest.approx([0.3, 0.7], abs=1e-3)


def test_rows_are_the_unfused_opweave_modes_with_a_median():
    rows = fit.read_rows([RESULTS])
    assert len(rows) == 40 and {r.model for r in rows} == {"googlenet", "inception_v3", "randwire", "nasnet_a_mobile"}
    assert all(r.streams == 8 and r.batch == 1 and r.dtype == "fp32" for r in rows)


def test_the_modes_opweave_chose_are_not_rows(tmp_path):
    """``opweave default`` and ``opweave max-autotune`` ran a coarsened graph with the plan they chose (a scheduler at
    its own stream cap): not the uncoarsened plan of a scheduler at the file's cap, which is what a row predicts."""
    base = {"model": "googlenet", "batch_size": 1, "dtype": "fp32", "median_ms": 1.0, "ok": True}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"settings": {"streams": 8}, "results": [
        {**base, "mode": "opweave default", "scheduler": "heft", "choice": "heft x4"},
        {**base, "mode": "opweave max-autotune", "scheduler": "nimble", "choice": "nimble x8"},
        {**base, "mode": "opweave lios", "scheduler": "lios"}]}))
    assert [r.scheduler for r in fit.read_rows([path])] == ["lios"]


def test_the_fit_benchmark_holds_each_chosen_mode_to_the_prediction_its_build_made():
    import importlib.util
    import sys

    from benchmark_module import BENCHMARKS

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # for its ``import _common``
    spec = importlib.util.spec_from_file_location("sim_gpu_fit", BENCHMARKS / "sim_gpu_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = RESULTS.parent / "gpu_latency_h200_2026-11-28_b8_fp16.json"
    chosen = module.chosen_rows([path])
    assert {c["model"] for c in chosen} == {"googlenet", "inception_v3", "nasnet_a_mobile", "randwire"}
    assert all(c["mode"] == "opweave default" for c in chosen)  # max-autotune predicts nothing: it measures
    first = chosen[0]
    assert first["error"] == pytest.approx(first["predicted_ms"] / first["measured_ms"] - 1)


def test_a_file_without_rows_is_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [{"mode": "eager", "median_ms": 1.0}]}))
    with pytest.raises(UsageError, match="no measured opweave rows"):
        fit.read_rows([path])


# ---- the simulator's new terms ------------------------------------------------------------------------------------
def test_each_kernel_waits_its_gap_and_the_front_end_starts_kernels_in_the_order_they_are_ready(h200):
    graph = OpGraph([Op("a", latency_ms=0.01), Op("b", latency_ms=0.01)])
    dev = replace(h200, kernel_gap_us=2.0, dispatch_us=3.0, call_us=0.0)
    costs = replace(calibrated.costs(graph, dev, latency_ms=graph.latencies()), kernels={"a": 2, "b": 1})
    one_stream = simulate(graph, plan_for(graph, from_graph(graph), "sequential", streams=1)[1], costs)
    assert one_stream.makespan_ms == pytest.approx(0.004 + 0.01 + 0.002 + 0.01, abs=1e-9)  # gaps 2 x 2 µs, then 2
    two_streams = simulate(graph, plan_for(graph, from_graph(graph), "wavefront", streams=2)[1], costs)
    # b, ready after its one gap (2 µs), starts first although a was issued first; a, ready after its two gaps
    # (4 µs), waits for the front end to finish starting b (3 µs from 2 µs)
    assert two_streams.start_ms == pytest.approx({"a": 0.005, "b": 0.002}, abs=1e-9)


def test_a_wait_holds_its_edge_not_the_waiting_stream(h200):
    graph = OpGraph([Op("a", latency_ms=0.001), Op("b", latency_ms=0.003), Op("c", latency_ms=0.001)],
                    [Edge("a", "c"), Edge("b", "c")])
    sched = Schedule("t", ["a", "b", "c"], {"a": 0, "b": 1, "c": 1})
    plan = validated_plan(graph, sched)
    assert plan.syncs == 1
    dev = replace(h200, kernel_gap_us=1.0, event_wait_us=2.0, dispatch_us=0.0, call_us=0.0)
    costs = replace(calibrated.costs(graph, dev, latency_ms=graph.latencies()), kernels=dict.fromkeys("abc", 1))
    # c's stream is busy with b until 1 + 3 µs; a ends at 2 µs, so its edge (2 + 2) does not hold c past b + gap
    assert simulate(graph, plan, costs).start_ms["c"] == pytest.approx(0.005, abs=1e-9)
    later = replace(costs, latency_ms={**costs.latency_ms, "a": 0.0035})  # a ends at 4.5 µs: its edge holds c
    assert simulate(graph, plan, later).start_ms["c"] == pytest.approx(0.0065, abs=1e-9)


def test_kernels_a_compiler_decided_replace_the_class_count_in_floors_and_gaps(h200):
    graph = OpGraph([Op("c", target="conv2d", shape=(1, 64, 56, 56), flops=1e8, bytes=1e6)])
    eager, fused = calibrated.costs(graph, h200), calibrated.costs(graph, h200, launches={"c": 1})
    conv = h200.op_class("conv")
    assert eager.kernels == {"c": conv.kernels} and fused.kernels == {"c": 1}
    assert (eager.latency_ms["c"] - fused.latency_ms["c"]) * 1e3 == pytest.approx((conv.kernels - 1) * conv.floor_us)


def test_the_choice_replays_the_kernels_its_costs_carry(h200):
    graph = OpGraph([Op("a", target="relu", shape=(1, 64), latency_ms=0.01),
                     Op("b", target="relu", shape=(1, 64), latency_ms=0.01)], [Edge("a", "b")])
    dev = replace(h200, dispatch_us=0.0)  # the gaps alone
    one = choose(graph, replace(from_graph(graph), kernels={"a": 1, "b": 1}), dev, names=["sequential"])
    many = choose(graph, replace(from_graph(graph), kernels={"a": 11, "b": 1}), dev, names=["sequential"])
    assert (many.makespan_ms - one.makespan_ms) * 1e3 == pytest.approx(10 * dev.kernel_gap_us)


def test_an_op_that_launches_no_kernel_waits_for_its_inputs_all_the_same(h200):
    graph = OpGraph([Op("a", latency_ms=0.01), Op("c", latency_ms=0.0)], [Edge("a", "c")])
    plan = validated_plan(graph, Schedule("t", ["a", "c"], {"a": 0, "c": 1}))
    dev = replace(h200, kernel_gap_us=1.0, event_wait_us=2.0, dispatch_us=0.0, call_us=0.0)
    costs = replace(calibrated.costs(graph, dev, latency_ms=graph.latencies()), kernels={"a": 1, "c": 0})
    sim = simulate(graph, plan, costs)
    assert sim.start_ms["c"] >= sim.finish_ms["a"] + 0.002 - 1e-12  # its edge: a's end and the event's wait


# ---- the CUDA default's choice ------------------------------------------------------------------------------------
def test_the_choice_is_the_fastest_of_its_predictions_and_heft_pays_the_fitted_wait(h200):
    graph = OpGraph([replace(o, latency_ms=o.latency_ms / 100) for o in random_dag(30, 6, seed=3).ops],
                    random_dag(30, 6, seed=3).edges, "dag")
    costs = from_graph(graph)
    choice = choose(graph, costs, h200, stream_caps=(2, 4))
    assert choice.makespan_ms == min(p.makespan_ms for p in choice.predictions)
    assert (choice.scheduler, choice.streams) == (choice.predictions[0].scheduler, choice.predictions[0].streams)
    assert sum(p.scheduler == "sequential" for p in choice.predictions) == 1
    assert not {"hios-lp", "hios-mr"} & {p.scheduler for p in choice.predictions}
    assert choice.scheduler in choice.reason() and "ms predicted" in choice.reason()
    assert sync_options("lios", h200) == {}


def test_heft_pays_what_a_cross_stream_edge_costs_beyond_a_same_stream_one(h200):
    slower = replace(h200, kernel_gap_us=1.0, event_wait_us=3.5)
    assert sync_options("heft", slower) == {"sync_ms": pytest.approx(0.0025)}
    assert sync_options("heft", replace(h200, kernel_gap_us=1.0, event_wait_us=0.5)) == {"sync_ms": 0.0}


# ---- the CLI ------------------------------------------------------------------------------------------------------
def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.stderr, result.exception)
    return result.stdout


def cli_fails(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, (result.stderr, result.exception)
    return result.stderr


def test_simulate_takes_a_dtype_and_the_fitted_preset():
    out = cli("simulate", "--model", "squeezenet", "--dtype", "fp16", "--preset", "h200", "--cost-model", "gpu",
              "--streams", "8", "--scheduler", "lios", "--json")
    data = json.loads(out)
    assert data["costs"] == "fitted:NVIDIA H200 SXM:float16" and data["results"][0]["makespan_ms"] > 0
    fp32 = json.loads(cli("simulate", "--model", "squeezenet", "--preset", "h200", "--cost-model", "gpu",
                          "--scheduler", "lios", "--json"))
    assert fp32["results"][0]["makespan_ms"] > data["results"][0]["makespan_ms"]


def test_simulate_plans_over_inductors_kernels_lowered_as_for_cuda():
    fine = json.loads(cli("simulate", "--model", "squeezenet", "--no-coarsen", "--preset", "h200", "--cost-model",
                          "gpu", "--scheduler", "sequential", "--json"))
    fused = json.loads(cli("simulate", "--model", "squeezenet", "--inductor", "--preset", "h200", "--cost-model",
                           "gpu", "--scheduler", "sequential", "--json"))
    grouping = fused["inductor"]
    assert fused["ops"] == grouping["ops"] < fine["ops"] == grouping["ops_before"]
    # every launch of an op counted once; convolutions one extern call each, against their class's count in eager
    assert fused["kernels_per_call"] == grouping["launches"] - grouping["unowned"] < fine["kernels_per_call"]
    assert fused["results"][0]["makespan_ms"] < fine["results"][0]["makespan_ms"]


def test_inductors_kernels_are_priced_on_a_fitted_gpu_only():
    assert "--inductor needs --cost-model gpu" in cli_fails("simulate", "--model", "squeezenet", "--inductor")
    assert "--inductor goes with --model" in cli_fails("simulate", "lios-fig3", "--inductor", "--cost-model", "gpu",
                                                      "--preset", "h200")


def test_a_model_inductor_cannot_lower_whole_is_refused_not_simulated_as_it_is(monkeypatch):
    from opweave.backends import inductorgraph

    def fallback(captured, inputs, threads=None, freeze=None):  # what inductor_graph returns when Inductor fails
        return inductorgraph.InductorGraph(captured, {}, {"error": "Inductor cannot compile the whole model"})

    monkeypatch.setattr(inductorgraph, "inductor_graph", fallback)
    assert "no plan over Inductor's kernels: Inductor cannot compile" in cli_fails(
        "simulate", "--model", "squeezenet", "--inductor", "--cost-model", "gpu", "--preset", "h200")


def test_calibrate_writes_this_users_device_file_never_the_packages_unless_told(tmp_path, monkeypatch):
    """By default the refit goes to this user's device file, which the preset then reads before the shipped one;
    the file inside the installed package is left as it is."""
    monkeypatch.setenv("OPWEAVE_CONFIG_DIR", str(tmp_path / "config"))
    shipped = calibrated.shipped_path("h200")
    before = shipped.read_bytes()
    measured = json.loads(RESULTS.read_text())
    measured["results"] = [r for r in measured["results"] if r["model"] == "googlenet"][:6]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(measured))
    data = json.loads(cli("calibrate", str(results), "--iterations", "1", "--no-leave-one-out", "--json"))
    mine = tmp_path / "config" / "devices" / "h200.json"
    assert data["out"] == str(mine) and mine.exists() and shipped.read_bytes() == before
    assert calibrated.device_path("h200") == mine and calibrated.device("h200").fit["rows"] == [str(results)]


def test_an_unknown_dtype_is_refused():
    assert "unknown dtype" in cli_fails("simulate", "lios-fig3", "--dtype", "fp8")


def test_calibrate_writes_a_device_file_the_preset_can_read(tmp_path):
    measured = json.loads(RESULTS.read_text())
    measured["results"] = [r for r in measured["results"] if r["model"] == "googlenet"][:6]  # 3 opweave rows
    results, out = tmp_path / "results.json", tmp_path / "dev.json"
    results.write_text(json.dumps(measured))
    text = cli("calibrate", str(results), "--out", str(out), "--iterations", "1", "--no-leave-one-out", "--json")
    data = json.loads(text)
    assert data["fitted"]["rows"] == 3 and Device.load(out).fit["rows"] == [str(results)]
    assert calibrated.device("h200", out).name == "NVIDIA H200 SXM"
    assert isinstance(OpClass(**data["device"]["classes"]["conv"]), OpClass)
