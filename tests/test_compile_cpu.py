"""End to end on CPU: every zoo model, every scheduler, outputs equal eager."""

import functools
import warnings

import pytest
import torch

import opweave
from opweave import schedulers, zoo
from opweave.backends.cpu import CpuBackend, EagerBackend
from opweave.capture import CaptureError, capture, load
from opweave.costs.roofline import estimate
from opweave.errors import UsageError
from opweave.outputs import compare
from opweave.pipeline import plan_for
from rendezvous import TwoBranches, armed

SMALL = {"bert_base": {"num_layers": 2}}  # the scheduler sweep runs 8 plans per model: a shorter BERT there


@functools.cache
def captured_model(name: str):
    model, inputs = zoo.create(name, batch_size=1, **SMALL.get(name, {}))
    with torch.inference_mode():
        reference = model(*inputs)
    return capture(model, inputs, name=name), inputs, reference


@pytest.mark.parametrize("name", zoo.names())
def test_the_zoo_s_op_counts_are_what_compile_plans(name):
    # `opweave models` shows these: each model captured at batch 1 and coarsened, as opweave.compile plans it
    from opweave.capture import coarsen

    captured = (captured_model(name)[0] if name not in SMALL
                else capture(*zoo.create(name, batch_size=1), name=name))
    graph = coarsen(captured).graph
    assert (len(graph), len(graph.edges)) == zoo.COUNTS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_compile_matches_eager_for_every_zoo_model(name):
    model, inputs = zoo.create(name, batch_size=1)  # the full models (bert_base with all 12 layers)
    fast = opweave.compile(model, inputs, scheduler="lios", device="cpu", streams=4)
    with torch.inference_mode():
        expected, got = model(*inputs), fast(*inputs)
    assert type(got) is type(expected)
    assert compare(expected, got).max_diff < 1e-4
    assert fast.schedule.streams_used >= 1 and len(fast.graph) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_every_scheduler_matches_eager(name):
    cap, inputs, reference = captured_model(name)
    costs = estimate(cap.graph, "cpu")
    for scheduler in schedulers.names():
        _, plan = plan_for(cap.graph, costs, scheduler, streams=4,
                           devices=2 if scheduler in schedulers.MULTI_DEVICE else 1)
        with torch.inference_mode():
            got = CpuBackend(cap, plan)(*inputs)
        assert compare(reference, got).max_diff < 1e-4, scheduler


def test_replay_with_new_inputs_and_repeated_calls():
    model, inputs = zoo.create("googlenet", batch_size=1)
    fast = opweave.compile(model, inputs, scheduler="nimble", device="cpu")
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn_like(inputs[0])
        with torch.inference_mode():
            assert compare(model(x), fast(x)).max_diff < 1e-4


def test_an_error_inside_an_op_reaches_the_caller_without_hanging():
    class Branchy(torch.nn.Module):
        def forward(self, x, y):
            return torch.linalg.cholesky(x) + 1, torch.sigmoid(y) * 2

    spd = torch.eye(3) * 2
    y = torch.randn(3, 3)
    fast = opweave.compile(Branchy(), (spd, y), scheduler="lios", device="cpu")
    assert fast.schedule.streams_used == 2
    with pytest.raises(RuntimeError):
        fast(-spd, y)  # not positive definite: the op fails on one lane while the other lane runs
    assert compare(Branchy()(spd, y), fast(spd, y)).max_diff == 0.0


def test_lanes_run_without_autograd_even_on_inference_tensors():
    """Worker threads do not inherit the caller's inference mode: with autograd on there, a Linear on an inference
    tensor raised "Inference tensors cannot be saved for backward"."""

    class TwoLinears(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.a(x)), self.b(x) * 2

    model = TwoLinears()
    fast = opweave.compile(model, (torch.randn(4, 8),), scheduler="lios", device="cpu")
    assert fast.schedule.streams_used == 2
    with torch.inference_mode():
        x = torch.randn(4, 8)
        got, expected = fast(x), model(x)
    assert compare(expected, got).max_diff == 0.0
    assert not any(t.requires_grad for t in fast(torch.randn(4, 8)))  # no autograd graph outside inference mode


def test_independent_branches_run_concurrently_on_two_lanes():
    # the two rendezvous ops wait at a barrier for each other: the call only returns if two lanes ran them at once
    x = torch.randn(4, 3)
    fast = opweave.compile(TwoBranches(), (x,), scheduler="lios", device="cpu")
    lane = {ins.op: (ins.device, ins.stream) for ins in fast.plan.instrs if ins.kind == "launch"}
    meet = [o.id for o in fast.graph.ops if o.target.endswith("rendezvous")]
    assert len(meet) == 2 and lane[meet[0]] != lane[meet[1]]
    with armed(parties=2), torch.inference_mode():
        got = fast(x)  # BrokenBarrierError unless both rendezvous ops ran at once
    assert compare(TwoBranches()(x), got).max_diff == 0.0
    one_lane = opweave.compile(TwoBranches(), (x,), scheduler="sequential", device="cpu")
    with armed(parties=2, timeout_s=0.2), pytest.raises(CaptureError, match="BrokenBarrierError"):
        one_lane(x)  # on one lane the barrier breaks: the check above can fail


def test_a_closed_backend_refuses_calls_instead_of_waiting_for_its_stopped_workers():
    import threading

    x = torch.randn(4, 3)
    fast = opweave.compile(TwoBranches(), (x,), scheduler="lios", device="cpu")
    assert fast.schedule.streams_used == 2
    fast(x)
    assert fast.backend.stats == {"calls": 1}
    fast.close()
    fast.close()  # twice: harmless
    raised: list = []

    def call():
        try:
            fast(x)
        except Exception as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "a call after close() waited forever for the stopped workers"
    assert len(raised) == 1 and isinstance(raised[0], UsageError) and "closed" in str(raised[0])


def test_bad_device_is_refused():
    with pytest.raises(ValueError, match="device"):
        opweave.compile(torch.nn.ReLU(), (torch.randn(2),), device="tpu")


def test_compile_schedules_on_a_measured_profile_and_refuses_a_stale_one(tmp_path):
    from opweave.costs.profile import ProfileKeyError, profile_model

    model, inputs, captured = load("deepfm")  # coarsened, as compile schedules it
    prof = profile_model(captured, inputs, device="cpu", repeats=2, warmup=0)
    path = tmp_path / "deepfm.profile.json"
    prof.save(path)
    fast = opweave.compile(model, inputs, scheduler="lios", profile=path)
    assert fast.costs.source == "profile" and fast.costs.latency_ms == prof.latency_ms
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).max_diff < 1e-5
    other_batch = zoo.create("deepfm", batch_size=2)[1]
    with pytest.raises(ProfileKeyError, match="input_shapes"):
        opweave.compile(model, other_batch, scheduler="lios", profile=path)


def test_the_cpu_target_runs_a_validated_plan_fused_or_not():
    """The one step from a validated plan to a backend, which every door's build takes; with a segment compiler on
    the CPU every segment is compiled before the first call."""
    from opweave.backends.segments import segment_groups
    from opweave.pipeline import resolve, validated_plan
    from opweave.pipeline.targets import CpuTarget

    model, inputs, captured = load("deepfm")
    costs = estimate(captured.graph, "cpu")
    sched, plan = plan_for(captured.graph, costs, "lios", streams=2)
    assert validated_plan(captured.graph, sched).instrs == plan.instrs
    with torch.inference_mode():
        reference = model(*inputs)
        with CpuTarget().runnable(captured, sched, plan, inputs, resolve("cpu"), costs) as fast:
            assert fast.fused is None and compare(reference, fast(*inputs)).max_diff < 1e-5
        with CpuTarget().runnable(captured, sched, plan, inputs, resolve("cpu", compiler="eager"), costs) as fast:
            assert fast.fused.stats["segments"] == fast.fused.stats["compiles"] == len(segment_groups(plan)) > 1
            assert compare(reference, fast(*inputs)).max_diff < 1e-5


def scripted(times: dict[str, float]):
    """A clock for the CPU default's race: each candidate's call takes what ``times`` says (ms), whatever it does."""
    return lambda label, fn: (fn(), times[label])[1]


@pytest.mark.parametrize("fastest", ["onnxruntime", "eager", "lanes"])
def test_the_cpu_default_keeps_the_fastest_of_onnxruntime_its_lanes_and_the_model(monkeypatch, fastest):
    # with ONNX Runtime installed the default's candidates are the model in one segment compiled by it, the lanes of
    # the captured ops and the model itself; its race keeps the one its clock says is fastest, and that one runs
    from opweave.pipeline import search, targets

    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    monkeypatch.setattr(search, "TIMER", scripted({"onnxruntime": 3.0, "eager": 3.0, "lanes": 3.0, "one lane": 3.0,
                                                     "onnxruntime lanes": 3.0, fastest: 1.0}))
    fast = opweave.compile(model, inputs, threads=targets.LANE_CORES)
    assert set(fast.choice["candidates"]) == {"onnxruntime", "onnxruntime lanes", "lanes", "eager"}
    assert fast.choice["label"] == fastest and fast.choice["compiler"] == (
        "onnxruntime" if fastest == "onnxruntime" else None)
    if fastest == "onnxruntime":
        assert fast.fused.stats["segments"] == 1 and fast.fused.stats["fallbacks"] == 0
    if fastest == "eager":
        assert isinstance(fast.backend, EagerBackend) and fast.backend.model is model
    assert (fast.schedule.streams_used > 1) == (fastest == "lanes")
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
    assert opweave.compile(model, inputs, scheduler="heft").choice is None  # a plan asked for is kept as it is


def test_below_lane_cores_the_cpu_default_races_onnxruntime_against_the_model_alone(monkeypatch):
    # on 2 cores one ONNX Runtime segment beat the lanes of eager ops on every zoo model and batch: they are not
    # raced there (each round of a large model's race costs a second), unless ONNX Runtime's candidate failed
    from opweave.pipeline import search

    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    monkeypatch.setattr(search, "TIMER", scripted({"onnxruntime": 2.0, "eager": 3.0, "lanes": 1.0}))
    fast = opweave.compile(model, inputs, threads=2)
    assert set(fast.choice["candidates"]) == {"onnxruntime", "eager"} and fast.choice["label"] == "onnxruntime"
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_the_cpu_defaults_onnxruntime_segment_reads_the_models_own_weights_where_lanes_fold_batchnorm(monkeypatch):
    """One ONNX Runtime segment plans on the model as captured (ONNX Runtime folds BatchNorm itself): it holds no
    folded copy of the weights, and its session reads the model's own tensors; a candidate of lanes plans on the
    coarse graph (BatchNorm folded into a copy of the convolutions' weights), which both of its candidates share
    while they are raced, and which the compiled model no longer holds once the one segment won (the cache of coarse
    graphs kept it, and its folded copy of the weights, as long as the captured model lived)."""
    import gc

    from opweave.capture.runtime import Captured
    from opweave.pipeline import search, targets

    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    own = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    monkeypatch.setattr(search, "TIMER", scripted({"onnxruntime": 1.0, "eager": 3.0, "lanes": 3.0,
                                                     "onnxruntime lanes": 2.0}))
    fast = opweave.compile(model, inputs, threads=targets.LANE_CORES)
    assert fast.choice["label"] == "onnxruntime"
    weights = list(fast.captured.gm.state_dict().values())
    assert weights and all(t.untyped_storage().data_ptr() in own for t in weights)
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok
    assert fast.options.coarsen is False
    gc.collect()
    ptrs = [[t.untyped_storage().data_ptr() for t in c.gm.state_dict().values()] for c in gc.get_objects()
            if isinstance(c, Captured)]
    assert not [p for p in ptrs if set(p) & own and set(p) - own], "a folded copy of the weights outlived the race"
    lanes = fast.options.derive(coarsen=True)
    coarse = targets.coarsened(fast.captured, lanes)
    assert coarse is targets.coarsened(fast.captured, lanes) and len(coarse.graph.ops) < len(
        fast.captured.graph.ops)
    assert any(t.untyped_storage().data_ptr() not in own for t in coarse.gm.state_dict().values())


def test_the_cpu_default_tries_lanes_of_onnxruntime_segments_only_where_the_cores_allow(monkeypatch):
    from opweave.pipeline import search, targets

    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    monkeypatch.setattr(search, "TIMER", scripted({"onnxruntime": 3.0, "eager": 3.0, "lanes": 3.0,
                                                     "onnxruntime lanes": 1.0}))
    fast = opweave.compile(model, inputs, threads=targets.LANE_CORES)
    assert set(fast.choice["candidates"]) == {"onnxruntime", "onnxruntime lanes", "lanes", "eager"}
    assert fast.choice["label"] == "onnxruntime lanes" and fast.schedule.streams_used > 1
    assert fast.fused.stats["segments"] > 1
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_the_cpu_default_without_onnxruntime_says_so_once_and_chooses_as_before(monkeypatch):
    from opweave.backends import compilers
    from opweave.pipeline import search, targets

    monkeypatch.setattr(compilers, "available", lambda: ["inductor"])
    monkeypatch.setattr(search, "TIMER", scripted({"eager": 3.0, "lanes": 1.0, "one lane": 2.0}))
    targets._say_missing.cache_clear()
    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    with pytest.warns(UserWarning, match=r"ONNX Runtime does not import.*pip install onnxruntime"):
        fast = opweave.compile(model, inputs, threads=2)
    assert set(fast.choice["candidates"]) == {"lanes", "one lane", "eager"} and fast.choice["label"] == "lanes"
    assert fast.fused is None and fast.choice["compiler"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second compile is silent
        again = opweave.compile(model, inputs, threads=2)
    assert again.choice["label"] == "lanes"
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_a_compiled_candidate_that_does_not_equal_the_model_is_left_out_of_the_default(monkeypatch):
    from opweave.backends import compilers
    from opweave.pipeline import search

    class Wrong:
        name, per_op_threads = "onnxruntime", True

        def __call__(self, gm, inputs, threads, **options):
            return lambda *xs: tuple(y + 1 for y in gm(*xs))

    monkeypatch.setitem(compilers.COMPILERS, "onnxruntime", Wrong)
    monkeypatch.setattr(search, "TIMER", scripted({"eager": 2.0, "lanes": 3.0, "one lane": 1.0}))
    model, inputs = zoo.create("googlenet", batch_size=1, image_size=64)
    fast = opweave.compile(model, inputs, threads=2)
    assert "onnxruntime" in fast.choice["left_out"] and "onnxruntime" not in fast.choice["candidates"]
    assert fast.choice["label"] == "one lane" and fast.fused is None
    with torch.inference_mode():
        assert compare(model(*inputs), fast(*inputs)).ok


def test_the_race_drops_what_cannot_win_after_two_calls_and_times_the_rest():
    from opweave.costs.timing import race_ms

    calls = {"fast": 0, "close": 0, "slow": 0}

    def counted(label):
        return lambda: calls.__setitem__(label, calls[label] + 1)

    ms = {"fast": 1.0, "close": 1.1, "slow": 2.0}
    times, dropped = race_ms({k: counted(k) for k in ms}, rounds=6, warmup=1,
                             timer=lambda label, fn: (fn(), ms[label])[1])
    assert dropped == {"slow"} and calls == {"fast": 7, "close": 7, "slow": 3}
    assert len(times["slow"]) == 2 and len(times["fast"]) == 6
    times, dropped = race_ms({k: counted(k) for k in ("fast", "slow")}, rounds=6, warmup=0,
                             timer=lambda label, fn: (fn(), ms[label])[1])
    assert dropped == {"slow"} and len(times["fast"]) == 2  # one left: the race ends


def test_the_race_times_each_call_right_after_an_untimed_call_of_the_same_function_when_asked():
    """A function timed right after another one paid for what the other left running (thread pools that spin): with
    ``settle`` each timed call follows an untimed call of the same function."""
    from opweave.costs.timing import race_ms

    trace: list[str] = []
    timed: list[str] = []

    def timer(label, fn):
        timed.append(label)
        assert trace[-1] == label  # the call just before was the same function's, untimed
        fn()
        return 1.0

    race_ms({k: (lambda k=k: trace.append(k)) for k in ("a", "b")}, rounds=3, warmup=0, settle=1, timer=timer)
    assert trace == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"] and len(timed) == 6


def test_the_race_settles_each_timed_call_for_a_time_as_well_as_a_number_of_calls(monkeypatch, four_ms_calls):
    """A pool left spinning by the function before spins for a time: with ``settle_ms`` the untimed calls go on until
    that long has passed (here each call takes 4 ms on a scripted clock: three untimed calls reach 10 ms), and a
    measured choice settles so (search.SETTLE_MS)."""
    from opweave.costs import timing
    from opweave.pipeline import search

    fns, trace = four_ms_calls

    def timer(label, fn):
        trace.append(label.upper())  # a timed call
        fn()
        trace.pop()
        return 1.0

    timing.race_ms(fns, rounds=1, warmup=0, settle=1, settle_ms=10.0, timer=timer)
    assert trace == ["a", "a", "a", "A", "b", "b", "b", "B"]
    trace.clear()
    timing.race_ms(fns, rounds=1, warmup=0, settle=2, timer=timer)  # no time asked: the number of calls
    assert trace == ["a", "a", "A", "b", "b", "B"]
    trace.clear()
    monkeypatch.setattr(search, "SETTLE_MS", 22.0)
    monkeypatch.setattr(search, "TIMER", timer)
    search.fastest(fns, (), rounds=1, runs=1)  # 22 ms: six calls, past search.SETTLE's three
    assert trace.count("A") == 1 and trace[:trace.index("A")] == ["a"] * 6


def test_the_default_times_a_candidate_as_a_loop_calls_it_not_in_the_wake_of_another(monkeypatch):
    """A candidate whose first calls after another one's run slow (a decode step's kernels after a plan's calls)
    is timed as a loop calling it back to back sees it: the CPU race keeps the one that is faster in a loop."""
    from opweave.pipeline import search

    trace: list[str] = []

    def after_own(label: str) -> int:  # calls of ``label`` in a row just before the one being timed
        run = 0
        for seen in reversed(trace[:-1]):
            if seen != label:
                break
            run += 1
        return run

    def timer(label, fn):
        fn()
        if label == "model":  # slow for its first calls after the plan's, then fastest
            return 7.5 if after_own("model") >= 3 else 40.0
        return 14.0

    monkeypatch.setattr(search, "TIMER", timer)
    built = {k: (lambda k=k: trace.append(k)) for k in ("plan", "model")}
    best, medians = search.fastest(built, ())
    assert best == "model" and medians["model"] == 7.5


def test_a_call_timed_before_the_race_is_its_first_round():
    """A compiled candidate's check is timed right after the call that compiled it, as a round would time it: the
    race takes it as that candidate's first timed call, calls it no more in that round, and counts it in the budget."""
    from opweave.costs.timing import race_ms

    trace: list[str] = []
    ms = {"seeded": 5.0, "other": 5.0}
    timer = lambda label, fn: (fn(), ms[label])[1]  # noqa: E731
    fns = {k: (lambda k=k: trace.append(k)) for k in ms}
    times, _ = race_ms(fns, rounds=3, warmup=0, settle=1, timer=timer, seed={"seeded": [4.5]})
    assert trace[:2] == ["other", "other"] and times["seeded"][0] == 4.5 and len(times["seeded"]) == 3
    trace.clear()
    times, _ = race_ms(fns, rounds=3, warmup=0, settle=1, budget_ms=15.0, timer=timer, seed={"seeded": [4.5]})
    assert trace == ["other", "other"] and times == {"seeded": [4.5], "other": [5.0]}  # 2 x (4.5 + 5) ms: one round


def test_the_default_checks_its_candidates_against_the_output_capture_checked(monkeypatch):
    """The captured graph's output on the example inputs, which capture compared with the model, is the reference a
    candidate is checked against: the graph is not run once more to make it (other inputs still are)."""
    from opweave.capture.runtime import Captured
    from opweave.pipeline.search import OutputCheck
    from opweave.pipeline.targets import DEFAULT_LABELS

    model, inputs = zoo.create("squeezenet", batch_size=1, image_size=64)
    runs = []
    original = Captured.run
    monkeypatch.setattr(Captured, "run", lambda self, args: runs.append(args) or original(self, args))
    fast = opweave.compile(model, inputs)
    assert runs == [] and fast.choice["label"] in DEFAULT_LABELS
    other = tuple(x.clone() for x in inputs)
    check = OutputCheck(fast.captured, other, model)
    with torch.no_grad():
        agrees = check(model(*other)).ok  # the graph runs for other inputs, once, when the check is made
    assert len(runs) == 1 and runs[0] is other and agrees
    # kept for the build that follows the capture only: one from an earlier capture (weights may have changed
    # since) checks against a new run of the graph
    from opweave.api import compile_captured
    from opweave.capture import capture

    captured = capture(model, inputs)
    assert captured.example_output is not None
    with torch.no_grad():
        model.features[0].weight.mul_(2)
    again = compile_captured(captured, captured.example_inputs, eager=model)
    assert len(runs) == 2 and runs[1] is captured.example_inputs and again.choice["label"] in DEFAULT_LABELS


def test_the_default_keeps_the_model_itself_when_it_wins_and_runs_it_as_the_lanes_would():
    # DeepFM-sized models lost to eager by the lanes' per-call cost (0.6 against 0.4 ms); the guard now times the
    # model itself, and a kept model runs under no_grad like the lanes, on the live weights
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) * self.b(x)

    model, x = Tiny().eval(), torch.randn(2, 4)
    fast = opweave.compile(model, (x,))
    assert "eager" in fast.choice["candidates"]
    eager = EagerBackend(model)
    out = eager(x)
    assert not out.requires_grad and eager.stats["calls"] == 1 and torch.equal(out, model(x).detach())
    if fast.choice["label"] == "eager":
        assert fast.backend.model is model and fast.schedule.streams_used == 1
    # a plan asked for is kept as it is: no guard, no fallback to the model
    assert opweave.compile(model, (x,), scheduler="sequential").choice is None
