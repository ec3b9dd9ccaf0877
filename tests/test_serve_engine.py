"""The serving engine and its policies: in simulation (H100 preset) and for real on the CPU backend."""

import subprocess
import sys
import threading

import pytest
import torch

from opweave.capture import capture
from opweave.errors import UsageError
from opweave.serve import loadgen
from opweave.serve.assemble import load_models, make_engine, serving_options
from opweave.serve.engine import Arrival, Engine, Observer, QueueFull, blocks, policies, simulate_arrivals
from opweave.serve.engine.combined import Part
from opweave.serve.engine.cpu import CpuExecutor
from opweave.serve.engine.executors import Executor, RealClock, StepCost
from opweave.serve.engine.policy import Observation, Policy, SlotObs
from opweave.serve.engine.simulation import SimClock, SimExecutor
from opweave.serve.engine.top import TopPolicy
from opweave.testing.loads import model_latency_ms, sustainable
from serve_models import tiny

SIMULATED = serving_options("sim")  # the simulator's serving preset
OP_GRAPHS = serving_options("cpu", compiler="none")  # TOP's combined op graphs on the CPU, no segment compiler


@pytest.fixture(scope="module")
def two_tiny():
    """The tiny model served under two names (independent queues, the same blocks)."""
    model, x = tiny()
    bm = blocks.split(capture(model, x), x, name="tiny")
    return model, {"a": bm, "b": bm}


class Steps(Observer):
    def __init__(self):
        self.parts = []

    def on_step(self, parts, cost):
        self.parts.append([(p.model, p.block, p.batch) for p in parts])


def sim_engine(models, policy, **options):
    steps = Steps()
    eng = Engine(SimExecutor(models, SIMULATED), policies.create(policy), SimClock(), observers=[steps], **options)
    return eng, steps


def burst(n, models=("a", "b"), gap=1e-5):
    return [Arrival(i * gap, models[i % len(models)]) for i in range(n)]


def test_static_runs_one_block_of_one_request_at_a_time(two_tiny):
    _, models = two_tiny
    eng, steps = sim_engine(models, "static")
    run = simulate_arrivals(eng, burst(20))
    assert all(len(p) == 1 and p[0][2] == 1 for p in steps.parts)
    assert len(steps.parts) == 20 * 2  # two blocks per request
    assert all(r.status == "done" for r in run.requests) and len(run.requests) == 20


@pytest.mark.parametrize("policy", ["static", "batch", "heuristic"])
def test_every_step_that_runs_a_block_reports_its_decision_time(two_tiny, policy):
    _, models = two_tiny
    decided = []

    class Decisions(Observer):
        def on_decision(self, seconds):
            decided.append(seconds)

    eng = Engine(SimExecutor(models, SIMULATED), policies.create(policy), SimClock(), observers=[Decisions()])
    simulate_arrivals(eng, burst(20))
    times = eng.decision_times()
    assert len(times) == eng.stats["steps"] > 0 and times == decided and all(t > 0 for t in times)
    assert eng.stats["decision_s"] == pytest.approx(sum(times)) and eng.stats["decision_max_s"] == max(times)


def test_batch_stacks_requests_and_runs_models_side_by_side(two_tiny):
    _, models = two_tiny
    eng, steps = sim_engine(models, "batch", max_batch=4)
    run = simulate_arrivals(eng, burst(40))
    assert all(len({m for m, _, _ in p}) == len(p) for p in steps.parts)  # one slot per model
    assert max(n for p in steps.parts for _, _, n in p) == 4
    assert any(len(p) == 2 for p in steps.parts)
    assert sorted(r.id for r in run.requests if r.status == "done") == list(range(1, 41))


def test_heuristic_stays_within_h_and_pipelines(two_tiny):
    _, models = two_tiny
    eng, steps = sim_engine(models, "heuristic", max_batch=4, max_sub_blocks=3)
    simulate_arrivals(eng, burst(60, gap=2e-5))
    assert max(len(p) for p in steps.parts) == 3
    assert any(len({b for m, b, _ in p if m == "a"}) == 2 for p in steps.parts)  # one model at two blocks at once
    assert all(n <= 4 for p in steps.parts for _, _, n in p)


class Scheme(Policy):
    """A fixed block combination scheme, as TOP's model-scheduler agents give one."""

    name = "scheme"

    def __init__(self, groups):
        self.groups = groups

    def combine(self, obs):
        return self.groups


def observation(ready, h=4):
    slots = tuple(SlotObs(m, b, 1, 1, age) for m, b, age in ready)
    return Observation(0.0, {}, slots, h, 0.0, 0.0, 0.0, 0.0)


def test_the_combined_block_with_the_highest_effective_input_ratio_runs_and_only_its_ready_slots(two_tiny):
    _, models = two_tiny
    scheme = [(("a", 0), ("b", 0), ("b", 1)), (("a", 1), ("b", 1)), (("a", 0),)]
    eng = Engine(SimExecutor(models, SIMULATED), Scheme(scheme), SimClock())
    # ready: a0 and b0 -> ratios 2/3, 0, 1: the singleton group wins
    assert eng._choose(observation([("a", 0, 1.0), ("b", 0, 2.0)])) == [("a", 0)]
    # ready: b0, b1 -> ratios 2/3, 1/2, 0: the first group runs, without a0 (its input has not arrived)
    assert eng._choose(observation([("b", 0, 1.0), ("b", 1, 1.0)])) == [("b", 0), ("b", 1)]
    # ready: a1 only -> 0, 1/2, 0
    assert eng._choose(observation([("a", 1, 1.0)])) == [("a", 1)]
    assert eng.stats["fallbacks"] == 0
    # a scheme that leaves a ready slot out entirely cannot stall the engine: the oldest ready slot runs alone
    assert eng._choose(observation([("b", 0, 3.0)])) == [("b", 0)] and eng.stats["fallbacks"] == 0
    eng = Engine(SimExecutor(models, SIMULATED), Scheme([(("a", 1),)]), SimClock())
    assert eng._choose(observation([("b", 0, 3.0), ("a", 0, 5.0)])) == [("a", 0)] and eng.stats["fallbacks"] == 1


def test_a_group_larger_than_h_is_refused(two_tiny):
    _, models = two_tiny
    eng = Engine(SimExecutor(models, SIMULATED), Scheme([(("a", 0), ("a", 1), ("b", 0))]), SimClock(), max_sub_blocks=2)
    with pytest.raises(UsageError, match="proposed 3 sub-blocks .* H is 2"):
        eng._choose(observation([("a", 0, 1.0)], h=2))


def test_a_full_queue_rejects_and_no_request_is_lost_or_answered_twice(two_tiny):
    _, models = two_tiny
    eng, _ = sim_engine(models, "static", max_queue=3)
    arrivals = burst(50, gap=1e-6)
    run = simulate_arrivals(eng, arrivals)
    assert run.rejected and len(run.requests) + len(run.rejected) == 50
    assert all(r.status == "done" for r in run.requests)
    assert len({r.id for r in run.requests}) == len(run.requests)
    with pytest.raises(QueueFull) as info:
        for _ in range(5):
            eng.submit("a")
    assert info.value.retry_after_s >= 1


def test_requests_past_their_deadline_time_out_without_running(two_tiny):
    _, models = two_tiny
    eng, steps = sim_engine(models, "static", timeout_s=2e-4)
    run = simulate_arrivals(eng, burst(30, gap=1e-6))
    late = [r for r in run.requests if r.status == "timeout"]
    assert late and all(r.output is None for r in late)
    assert len(steps.parts) < 30 * 2  # the timed-out ones did not run (all of their blocks)
    assert sum(r.status == "done" for r in run.requests) + len(late) == 30


def test_observation_carries_what_a_learned_policy_needs(two_tiny):
    _, models = two_tiny
    eng, _ = sim_engine(models, "static")
    for _ in range(3):
        eng.submit("a")
    eng.submit("b")
    eng.step()  # one instance of each model dequeued, one block ran
    obs = eng.observe()
    assert obs.models["a"].queue == 2 and obs.models["b"].queue == 0
    assert obs.queue_variance == pytest.approx(1.0)
    assert sum(obs.models["a"].progress) + sum(obs.models["b"].progress) == 2
    assert obs.step_s > 0 and 0 < obs.utilization <= 1 and obs.models["a"].arrival_rate > 0


def test_simulation_is_deterministic(two_tiny):
    _, models = two_tiny
    pattern = {"a": 2000.0, "b": 1000.0}
    reports = [loadgen.run_simulated(Engine(SimExecutor(models, SIMULATED), policies.create("heuristic"), SimClock()),
                                     pattern, 0.05)[0] for _ in range(2)]
    assert reports[0]["total"] == reports[1]["total"] and reports[0]["total"]["answered"] > 50


def test_heuristic_sustains_a_rate_at_which_static_sheds_load(two_tiny):
    _, models = two_tiny
    ex = SimExecutor(models, SIMULATED)
    single = model_latency_ms(ex, "a")  # static serves one request at a time: about 1000 / single requests/s
    rate = 3 * 1000 / single
    out = {}
    for name in ("static", "heuristic"):
        eng = Engine(ex, policies.create(name), SimClock(), max_batch=8)
        out[name] = loadgen.run_simulated(eng, {"a": rate}, 0.2)[0]
    assert out["static"]["total"]["rejected"] > 0 and not sustainable(out["static"])
    assert out["heuristic"]["total"]["rejected"] == 0 and sustainable(out["heuristic"])


def test_real_engine_never_mixes_up_stacked_requests(two_tiny):
    """24 requests from 24 threads into a running engine; a batch waits for its 4 requests (up to an hour), so
    that they are stacked however the threads' submissions interleave with the engine's steps."""
    model, models = two_tiny
    eng = Engine(CpuExecutor(models, OP_GRAPHS), policies.create("batch", max_queue_delay_ms=3.6e6), RealClock(),
                 max_batch=4)
    steps = Steps()
    eng.observers.append(steps)
    eng.start()
    inputs = [torch.randn(1, 3, 8, 8) for _ in range(24)]
    results: dict[int, torch.Tensor] = {}
    done = threading.Event()

    def finished(request):
        results[request.inputs[0].data_ptr()] = request.output
        if len(results) == len(inputs):
            done.set()

    threads = [threading.Thread(target=lambda i=i: eng.submit("ab"[i % 2], (inputs[i],), on_done=finished))
               for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done.wait(60)
    eng.stop()
    assert [n for p in steps.parts for _, _, n in p] == [4] * 12  # 3 instances of 4 per model, 2 blocks each
    with torch.no_grad():
        for x in inputs:
            assert torch.allclose(results[x.data_ptr()], model(x), atol=1e-5)


def test_draining_or_unloading_runs_a_batch_held_for_more_requests_at_once(two_tiny):
    """A dequeue held for a fuller batch (Triton's max queue delay) waits for requests that can no longer come once
    the engine drains or the model is being unloaded: both run what is queued at once (a long delay once held a
    drain past the shutdown's grace period)."""
    _, models = two_tiny
    hour = {"max_batch": 4, "max_queue_delay_ms": 3.6e6}
    eng = Engine(SimExecutor(models, SIMULATED), policies.create("batch", **hour), SimClock(), max_batch=4)
    held = [eng.submit(m) for m in "abab"]
    assert eng.step() is False and eng.queue_lengths() == {"a": 2, "b": 2}  # waiting for two more each
    eng.drain()
    while eng.busy():
        assert eng.step()
    assert [r.status for r in held] == ["done"] * 4 and eng.clock.now() < 1.0

    eng = Engine(CpuExecutor(dict(models), OP_GRAPHS), policies.create("batch", **hour), RealClock(), max_batch=4)
    eng.start()
    try:
        answered = threading.Event()
        held = [eng.submit("a", (torch.randn(1, 3, 8, 8),)), eng.submit("a", (torch.randn(1, 3, 8, 8),),
                                                                       on_done=lambda r: answered.set())]
        eng.remove_model("a", timeout_s=300)  # returns once "a" holds nothing (else raises after 300 s)
        assert answered.is_set() and [r.status for r in held] == ["done"] * 2 and "a" not in eng.models
    finally:
        eng.stop(timeout_s=120)


def test_a_failing_block_answers_its_requests_with_an_error_and_the_engine_goes_on(two_tiny):
    _, models = two_tiny
    eng = Engine(CpuExecutor(models, OP_GRAPHS), policies.create("static"), RealClock())
    bad = eng.submit("a", (torch.randn(1, 5, 8, 8),))  # 5 channels: the stem convolution fails
    good = eng.submit("b", (torch.randn(1, 3, 8, 8),))
    while eng.busy():
        eng.step()
    assert bad.status == "error" and "has shape (1, 5, 8, 8)" in bad.error
    assert good.status == "done" and good.output.shape == (1, 10)


def test_unknown_models_and_policies_are_usage_errors(two_tiny):
    _, models = two_tiny
    eng, _ = sim_engine(models, "static")
    with pytest.raises(UsageError, match="unknown model 'c'"):
        eng.submit("c")
    with pytest.raises(UsageError, match="unknown policy 'no-such-policy'"):
        policies.create("no-such-policy")
    with pytest.raises(UsageError, match="policy 'batch'"):
        policies.create("batch", nope=1)
    assert policies.parse_options("max_batch=8,max_queue_delay_ms=0.5") == {"max_batch": 8,
                                                                          "max_queue_delay_ms": 0.5}


def test_the_policies_are_one_table_whatever_was_imported_before():
    """The policies a server runs by name are one table, TOP's learned ``top`` among them, in a process that imported
    nothing else: before, ``top`` was a name only once some module had imported its module (a registry filled as a
    side effect of imports)."""
    code = "from opweave.serve.engine import policies; print(','.join(policies.names()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["static,batch,heuristic,top"]
    assert policies.names() == list(policies.POLICIES) and isinstance(policies.create("top", shipped=False), TopPolicy)


def test_patterns_and_arrivals():
    assert loadgen.parse_pattern("inception_v3:30, resnet50:60") == {"inception_v3": 30.0, "resnet50": 60.0}
    for bad in ("a", "a:x", "a:-1", "a:1,a:2", ""):
        with pytest.raises(UsageError):
            loadgen.parse_pattern(bad)
    constant = loadgen.arrivals({"a": 10.0, "b": 5.0}, 2.0, "constant")
    assert [a.model for a in constant].count("a") == 20 and [a.model for a in constant].count("b") == 10
    assert constant[0].time == pytest.approx(0.05)
    poisson = loadgen.arrivals({"a": 1000.0}, 2.0, seed=3)
    assert poisson == loadgen.arrivals({"a": 1000.0}, 2.0, seed=3) != loadgen.arrivals({"a": 1000.0}, 2.0, seed=4)
    assert 1800 < len(poisson) < 2200 and all(0 <= a.time < 2.0 for a in poisson)
    assert len(loadgen.arrivals({"a": 1000.0}, 2.0, scale=2.0)) > 3600


def test_report_counts_every_outcome_and_only_the_patterns_queues():
    out = [loadgen.Outcome("a", 0.0, "answered", 0.010), loadgen.Outcome("a", 0.1, "rejected"),
           loadgen.Outcome("b", 0.2, "answered", 0.030), loadgen.Outcome("b", 0.3, "timeout")]
    samples = [(0.0, {"a": 2, "b": 0, "idle": 9}), (0.1, {"a": 4, "b": 2, "idle": 9})]
    rep = loadgen.report(out, samples, pattern={"a": 1.0, "b": 1.0}, duration_s=1.0, mode="test")
    assert rep["total"]["sent"] == 4 and rep["total"]["answered"] == 2 and rep["total"]["rejected"] == 1
    assert rep["total"]["timeouts"] == 1 and rep["total"]["p99_all_ms"] == float("inf")
    assert rep["models"]["a"]["p50_ms"] == pytest.approx(10.0) and rep["models"]["a"]["queue_var"] == 1.0
    assert rep["queue_variance"] == pytest.approx(1.0)  # (2-1)^2 at both samples: "idle" is not the pattern's
    assert not sustainable(rep)


def test_a_measured_profile_sets_the_simulated_latencies(two_tiny):
    from opweave.costs.profile import profile_model

    _, models = two_tiny
    bm = models["a"]
    prof = profile_model(bm.captured, bm.example_inputs, device="cpu", repeats=3, warmup=1)
    ex = SimExecutor({"a": bm}, serving_options("sim", cost_model="ideal"), profiles={"a": {1: prof}},
                     step_overhead_ms=0.0)
    costs = ex.part_costs("a", 0, 1)
    assert costs.source == "profile@1"
    # at the profiled batch the latency is the measured one (times a roofline ratio of 1: equal to the last ulp)
    assert costs.latency_ms == pytest.approx({op: prof.latency_ms[op] for op in bm.blocks[0].ops}, rel=1e-12)
    # at batch 4: the measured latency times the roofline ratio of batch 4 to batch 1
    roof = SimExecutor({"a": bm}, serving_options("sim", cost_model="ideal"))
    four, one = roof.part_costs("a", 0, 4), roof.part_costs("a", 0, 1)
    op = bm.blocks[0].ops[0]
    assert ex.part_costs("a", 0, 4).latency_ms[op] == pytest.approx(prof.latency_ms[op] * four.latency_ms[op]
                                                                    / one.latency_ms[op])
    chain = ex.run([Part("a", 0, 1)]).seconds * 1e3  # ms -> s -> ms may round one ulp down
    assert chain >= max(prof.latency_ms[o] for o in bm.blocks[0].ops) * (1 - 1e-12)


def test_the_default_policy_follows_the_device():
    """static on a CPU (the highest sustained rates measured there, docs/serving.md), heuristic on a GPU."""
    from opweave.serve.assemble import default_policy, make_engine

    assert (default_policy("cpu"), default_policy("cuda"), default_policy("sim")) == ("static", "heuristic",
                                                                                      "heuristic")
    assert make_engine({}, device="cpu", options=OP_GRAPHS).policy.name == "static"
    assert make_engine({}, device="sim").policy.name == "heuristic"
    assert make_engine({}, device="cpu", policy="batch", options=OP_GRAPHS).policy.name == "batch"
    from opweave.cli.serve import ON_DEVICE  # what `opweave serve` prints after the default it chose
    from opweave.serve.assemble import DEVICES

    assert set(ON_DEVICE) == set(DEVICES) and ON_DEVICE["sim"] == "the simulator"  # it printed "a CPU" for sim


def test_the_many_models_benchmark_reports_the_decision_time_of_every_step_not_only_the_latest_kept(
        tmp_path, monkeypatch, tiny_file):
    """``benchmarks/serve_many.py``'s engine run gives the percentiles and maximum of every step's decision time:
    the engine keeps only its latest steps' (``DECISIONS_KEPT``) for ``decision_times()``."""
    from benchmark_module import serve_many
    from opweave.serve.engine import engine as engine_module

    _, path = tiny_file
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.pt2").write_bytes(path.read_bytes())
    monkeypatch.setattr(engine_module, "DECISIONS_KEPT", 16)
    seen: list[float] = []
    decided = engine_module.Engine._decided
    monkeypatch.setattr(engine_module.Engine, "_decided", lambda self, s: (seen.append(s), decided(self, s)))
    row, = serve_many().engine_scale(tmp_path, 2, ["static"], rate=200.0, seconds=0.5)
    assert len(seen) > 16 and row["decision_steps"] == len(seen)
    assert row["decision_max_ms"] == max(seen) * 1e3


def test_loading_says_each_model_as_it_loads_and_compiles(tiny_file):
    """What a server does before it listens is said model by model (``opweave serve`` shows it as a progress
    line): each model loaded, each one's blocks compiled, then the run of every model once."""
    said: list[str] = []
    served = load_models(["deepfm"], {"tiny": tiny_file[1]}, max_batch=4, say=said.append)
    made = make_engine(served, device="cpu", policy="static", max_batch=4, say=said.append)
    assert made.executor.compiler is not None  # the CPU's default compiles each block
    assert said == ["loading deepfm (1/2): capture and blocks", "loading tiny (2/2): capture and blocks",
                    "compiling deepfm's blocks (1/2)", "compiling tiny's blocks (2/2)", "running every model once"]


class Chain:
    """Stands for a blocked model on :class:`Scripted`: only its block count and stackability are read."""

    def __init__(self, blocks: int):
        self.blocks, self.stackable = [None] * blocks, True


class Scripted(Executor):
    """A block costs 0.1 ms plus 1 ms per sample, as a CPU's does (its time grows with the batch)."""

    def __init__(self, models):
        self.models = models

    def run(self, parts):
        return StepCost(sum(1e-4 + 1e-3 * p.batch for p in parts))


def chain_engine(policy="static", blocks=12, **options):
    steps = Steps()
    eng = Engine(Scripted({"m": Chain(blocks)}), policies.create(policy, **options), SimClock(), max_batch=16,
                 observers=[steps])
    return eng, steps


def test_static_answers_a_small_request_before_the_large_one_in_flight_without_stacking_them():
    eng, steps = chain_engine()
    large = eng.submit("m", batch=13)
    assert eng.step() and steps.parts == [[("m", 0, 13)]]
    small = eng.submit("m", batch=1)
    for _ in range(12):  # its 12 blocks, one a step, none waiting for the large one's
        assert eng.step()
    assert small.status == "done" and large.status == "running"
    assert steps.parts[1:] == [[("m", b, 1)] for b in range(12)]
    while eng.step():
        pass
    assert large.status == "done" and all(len(p) == 1 and p[0][2] in (1, 13) for p in steps.parts)  # never stacked


def test_static_runs_requests_of_one_size_one_at_a_time_in_arrival_order():
    eng, steps = chain_engine(blocks=3)
    requests = [eng.submit("m", batch=4) for _ in range(3)]
    assert eng.observe().models["m"].head_batch == 4
    while eng.step():
        pass
    assert steps.parts == [[("m", b, 4)] for _ in requests for b in range(3)]
    assert [r.finished for r in requests] == sorted(r.finished for r in requests)


@pytest.mark.parametrize("patience", [None, 3])
def test_static_never_starves_a_large_request_behind_a_stream_of_small_ones(patience):
    """A batch-1 request always queued: the batch-13 one still moves, one block at least every patience + 2 of its
    model's steps (patience: the model's 12 blocks unless given)."""
    eng, steps = chain_engine(patience=patience)
    large = eng.submit("m", batch=13)
    for _ in range(400):
        if large.status == "done":
            break
        if not eng.queue_lengths()["m"]:
            eng.submit("m", batch=1)
        assert eng.step()
    assert large.status == "done"
    ran = [i for i, p in enumerate(steps.parts) if p[0][2] == 13]
    assert len(ran) == 12 and max(b - a for a, b in zip(ran, ran[1:], strict=False)) <= (patience or 12) + 2
    assert sum(p[0][2] == 1 for p in steps.parts) >= 11 * (patience or 12)  # and small ones ran ahead of it


def test_static_counts_a_requests_work_by_its_inputs_so_a_short_sequence_runs_before_a_long_one_in_flight():
    """Two batch-1 requests of one model, one of 128 tokens and one of 16: counted in samples they were equal and the
    short one waited for all of the long one's blocks; counted by their inputs' elements the short one starts beside
    the long one and is answered first."""
    eng, steps = chain_engine(blocks=12)
    long = eng.submit("m", [torch.zeros(1, 128, dtype=torch.long)], batch=1)
    assert eng.step()
    short = eng.submit("m", [torch.zeros(1, 16, dtype=torch.long)], batch=1)
    for _ in range(12):
        assert eng.step()
    assert short.status == "done" and long.status == "running"
    assert long.work == 128 and short.work == 16
