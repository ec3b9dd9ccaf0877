"""Tiers: the CPU default answers on its first tier at once and moves to a tier built later, off the caller's path,
only once that tier is measured faster. The builds here are ``exported`` tiers (the exported program as it is: a
second's build, the machinery of the Inductor tier without its minute), timed on a scripted clock."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings

import pytest
import torch
from torch import nn

import opweave
from opweave.backends.cpu import EagerBackend
from opweave.outputs import compare
from opweave.pipeline import search, tiers
from threads_probe import Plain as Branchy  # two branches and their sum


@pytest.fixture
def tiered(monkeypatch, tmp_path):
    """Tiers on, the ``exported`` kind, the cache in a fresh folder; a clock (``times``: label -> ms, "first" for the
    first tier's label) for the races."""
    monkeypatch.setenv("OPWEAVE_TIERS", "1")
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiers, "KINDS", ("exported",))
    monkeypatch.setattr(tiers, "SETTLE_S", 0.0)  # one untimed call a block
    times: dict[str, float] = {}
    monkeypatch.setattr(search, "TIMER", lambda label, fn: (fn(), times.get(label, times.get("first", 1.0)))[1])
    torch.manual_seed(0)
    return Branchy().eval(), (torch.randn(4, 16),), times


def raced(fast, inputs) -> None:
    """The calls that race a tier built against the tier in use (on the caller's thread), until it is decided."""
    with torch.no_grad():
        for _ in range(2 * tiers.BLOCK * tiers.BLOCKS + 2):
            if not fast.backend.racing:
                return
            fast(*inputs)
    assert not fast.backend.racing


def fixed_landed(model, inputs, times, monkeypatch):
    """``model`` compiled with the ``onnxruntime-fixed`` tier alone, the tier built and raced (and faster)."""
    monkeypatch.setattr(tiers, "KINDS", ("onnxruntime-fixed",))
    times.update({"first": 2.0, "onnxruntime-fixed": 1.0})
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.wait(120)
    raced(fast, inputs)
    return fast


@pytest.mark.parametrize("faster", [True, False])
def test_a_tier_takes_the_calls_only_once_it_wins_its_race(tiered, faster):
    model, inputs, times = tiered
    times.update({"exported": 1.0 if faster else 3.0, "first": 2.0})
    fast = opweave.compile(model, inputs, threads=1)
    first = fast.backend.first
    assert isinstance(fast.backend, tiers.Tiered) and fast.backend.wait(120)
    assert fast.backend.current is first  # built and checked: not taking the calls before it wins their race
    raced(fast, inputs)
    [outcome] = fast.backend.tiers
    assert outcome["kind"] == "exported" and outcome["landed"] is faster and not outcome["cached"], outcome
    assert (fast.backend.current is first) is not faster and fast.backend.label == (
        "exported" if faster else fast.choice["label"])
    assert ("landed_at" in fast.backend.stats) is faster  # when it took the calls (the benchmark's landed_s)
    if faster and fast.choice["label"] == "onnxruntime":  # its copy of the weights let go: the model takes other sizes
        assert isinstance(fast.backend.first, EagerBackend) and fast.fused is None
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok
        other = torch.randn(3, 16)  # another size: the first tier takes it
        assert compare(model(other), fast(other)).ok
    fast.close()


def test_a_call_while_the_tier_builds_gets_the_first_tiers_answer(tiered, monkeypatch):
    model, inputs, times = tiered
    times.update({"exported": 0.5, "first": 2.0})
    release = threading.Event()
    real = tiers.export_and_build

    def held(*args, **kwargs):
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiers, "export_and_build", held)
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.building and fast.backend.current is fast.backend.first
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok  # answered while the build is held
    assert fast.backend.stats["landed"] == 0
    release.set()
    assert fast.backend.wait(120)
    raced(fast, inputs)
    assert fast.backend.label == "exported"
    fast.close()


def test_a_build_process_that_dies_leaves_the_first_tier_serving_with_one_warning(tiered, monkeypatch):
    model, inputs, times = tiered
    real = tiers.export_and_build

    def killed(*args, **kwargs):  # the process is killed as soon as it starts
        popen = tiers.subprocess.Popen

        def started(*args, **kwargs):
            process = popen(*args, **kwargs)
            process.kill()
            return process

        monkeypatch.setattr(tiers.subprocess, "Popen", started)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiers, "export_and_build", killed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = opweave.compile(model, inputs, threads=1)
        assert fast.backend.wait(120)
    said = [w for w in caught if "tier could not be built" in str(w.message)]
    assert len(said) == 1 and "exited with status" in str(said[0].message)
    assert fast.backend.current is fast.backend.first and "failed" in fast.backend.tiers[0]
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok
    fast.close()


def test_the_tier_cache_is_keyed_by_the_model_the_inputs_and_torch(tiered, monkeypatch):
    """A tier built once is found by the next compile of the same model (no build process); a changed weight, other
    inputs or another torch make another key, so a stale tier is never loaded."""
    model, inputs, times = tiered
    times.update({"exported": 1.0, "first": 2.0})
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.wait(120) and not fast.backend.tiers[0]["cached"]
    raced(fast, inputs)
    built = sorted(p.name for p in tiers.tier_dir().iterdir())
    assert len(built) == 1 and built[0].endswith(".exported.pt2")
    fast.close()
    again = opweave.compile(model, inputs, threads=1)
    assert again.backend.wait(120) and again.backend.tiers[0]["cached"]
    raced(again, inputs)
    assert again.backend.label == "exported"
    again.close()
    captured = fast.captured
    options = fast.options
    weights = tiers.weights_digest(model)
    base = tiers.key(captured, inputs, options, "exported", weights)
    with torch.no_grad():
        model.a.weight[0, 0] += 1
    assert tiers.weights_digest(model) != weights
    assert tiers.key(captured, (torch.randn(8, 16),), options, "exported", weights) != base
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert tiers.key(captured, inputs, options, "exported", weights) != base


def test_a_build_process_ends_with_its_parent(tmp_path):
    """A build left behind by a process that is gone would take the cores for a tier no one loads."""
    import subprocess
    import sys

    program = tmp_path / "p.pt2"
    model = Branchy().eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 16),)), program)
    # a parent that is already gone: the build process sees another parent and ends before it builds
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, opweave.pipeline.tiers as t; t.build = lambda *a: time.sleep(30); "
        f"sys.exit(t.main(['exported', {str(program)!r}, {str(tmp_path / 'out.pt2')!r}, '1', '1']))")])
    assert child.wait(timeout=20) == 3 and not (tmp_path / "out.pt2").exists()


def test_a_build_process_loads_a_timm_model_where_torchvision_needs_its_operators_defined(tmp_path):
    """timm imports torchvision; PyPI's torchvision beside a CPU torch fails its import ("operator torchvision::nms
    does not exist") unless opweave.zoo defines the operators first, which the caller's process had done and the build
    process had not: every timm or torchvision model's tier failed to build there."""
    import subprocess
    import sys

    from opweave import zoo

    model, inputs = zoo.create("timm:test_vit", image_size=32)
    saved = tmp_path / "model.pt"
    torch.save((model.eval(), inputs, ()), saved)  # as tiers._saved saves it
    out = tmp_path / "out.pt2"
    done = subprocess.run([sys.executable, "-m", "opweave.pipeline.tiers", "exported", str(saved), str(out), "1",
                           str(os.getpid())], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        assert compare(model(*inputs), torch.export.load(str(out)).module()(*inputs)).ok


def test_tiers_apply_to_the_cpu_default_only():
    from opweave.errors import UsageError
    from opweave.pipeline import resolve

    with pytest.raises(UsageError, match="option 'tiers' applies to the CPU default, whose plan it may replace: "
                                         "give no 'scheduler'"):
        resolve("cpu", scheduler="lios", tiers=True)
    with pytest.raises(UsageError, match="mode='max-autotune' chooses the plan itself: give no 'tiers'"):
        resolve("cpu", "max-autotune", tiers=True)
    assert not resolve("cpu", tiers=False).tiers and os.environ["OPWEAVE_TIERS"] == "0"
    assert not resolve("cpu").tiers  # the suite's environment keeps compiles at their first tier
    model = Branchy().eval()
    fast = opweave.compile(model, (torch.randn(2, 16),), threads=1)
    assert not isinstance(fast.backend, tiers.Tiered)


def test_a_model_that_writes_its_state_builds_no_tier(tiered):
    """A tier's race runs the model beside the caller's calls: on a model that writes state in place (a KV cache) it
    would write that state between the caller's own writes, so such a model keeps its first tier."""

    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(4, 3))
            self.opweave_state = ("cache",)

        def forward(self, x, position):
            self.cache.index_copy_(0, position, torch.tanh(x))
            return torch.cat([self.cache, x]).sum(0)

    model = Cache().eval()
    fast = opweave.compile(model, (torch.randn(1, 3), torch.tensor([0])), threads=1)
    assert not isinstance(fast.backend, tiers.Tiered)


def test_a_tier_is_raced_on_the_callers_own_thread(tiered, monkeypatch):
    """Timed from the builder's thread, an Inductor tier's OpenMP kernels ran 2.6x slower than on the caller's (beside
    the caller's idle team), and the race kept it out for that: the built tier now runs only on the calls."""
    model, inputs, times = tiered
    times.update({"exported": 1.0, "first": 2.0})
    seen: list[int] = []
    real = tiers.load

    def recorded(kind, path, *rest):
        tier = real(kind, path, *rest)
        return lambda *args: seen.append(threading.get_ident()) or tier(*args)

    monkeypatch.setattr(tiers, "load", recorded)
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.wait(120)
    checked = len(seen)  # the builder's check of its output against the model, before any race
    raced(fast, inputs)
    assert checked == 1 and set(seen[checked:]) == {threading.get_ident()} and fast.backend.label == "exported"


def test_a_tier_built_during_anothers_race_races_the_winner_after_it(tiered, monkeypatch):
    """Two tiers: the second, built while the first is raced, waits for that race, then races the tier that won it
    (proposed at once, it would have replaced the first's race, leaving that tier neither landed nor let go)."""
    model, inputs, times = tiered
    monkeypatch.setattr(tiers, "KINDS", ("onnxruntime-fixed", "exported"))
    times.update({"first": 3.0, "onnxruntime-fixed": 2.0, "exported": 1.0})
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.choice["label"] == "onnxruntime" and fast.backend.wait(120)
    assert fast.backend.racing and len(fast.backend.pending) == 1  # both built, the first raced, the second waits
    with torch.no_grad():
        for _ in range(4 * tiers.BLOCK * tiers.BLOCKS + 4):
            assert compare(model(*inputs), fast(*inputs)).ok
    sized, exported = fast.backend.tiers
    assert sized["landed"] and sized["against"] == "onnxruntime", sized
    assert exported["landed"] and exported["against"] == "onnxruntime-fixed", exported
    assert fast.backend.label == "exported" and not fast.backend.racing and not fast.backend.pending
    fast.close()


def test_the_onnxruntime_fixed_tier_is_the_session_at_the_examples_sizes(tiered, monkeypatch):
    """The first tier's session leaves every size free; its tier at the example's sizes answers as the model,
    is cached as an ONNX file, lands where faster, and is not built where the first tier is it already."""
    model, inputs, times = tiered
    fast = fixed_landed(model, inputs, times, monkeypatch)
    [outcome] = fast.backend.tiers
    assert outcome["landed"] and fast.backend.label == "onnxruntime-fixed", outcome
    assert fast.backend.current.direct is not None  # its calls skip binding the captured model
    assert [p.suffix for p in tiers.tier_dir().iterdir()] == [".onnx"]
    import onnx

    [path] = tiers.tier_dir().iterdir()
    dims = [[d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(str(path), load_external_data=False).graph.input]
    assert dims == [[4, 16]]  # every dimension fixed (the first tier's are free)
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok
        other = torch.randn(3, 16)  # another size: not the tier's
        assert compare(model(other), fast(other)).ok
        strided = torch.randn(16, 4).t()  # the example's size in another layout: not the tier's either
        assert compare(model(strided), fast(strided)).ok
    fast.close()
    fixed = opweave.compile(model, inputs, threads=1, dynamic=False)
    assert fixed.backend.wait(120) and fixed.backend.tiers == []
    fixed.close()


class StackedSum(nn.Module):
    """RandWire's aggregation, a weighted sum over a stack, between two linear layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        self.w = nn.Parameter(torch.rand(2))

    def forward(self, x):
        xs = torch.stack([self.a(x).relu(), self.b(x).relu()])
        return self.out((xs * self.w.sigmoid().view(2, 1, 1)).sum(0))


def test_the_onnxruntime_fixed_tier_is_exported_as_the_first_tiers_session_and_reads_the_models_weights(
        tiered, monkeypatch):
    """The tier's graph is rewritten for ONNX Runtime as the first tier's segments are (a stacked sum as a sum of
    its parts: no ReduceSum), although its build process gets the graph pickled (which loses the shapes the
    rewrites read); its file holds no weights: the session reads the model's own tensors."""
    _, inputs, times = tiered
    model = StackedSum().eval()
    fast = fixed_landed(model, inputs, times, monkeypatch)
    assert fast.backend.label == "onnxruntime-fixed", fast.backend.tiers
    import onnx

    [path] = tiers.tier_dir().iterdir()
    graph = onnx.load(str(path), load_external_data=False).graph
    assert "ReduceSum" not in {node.op_type for node in graph.node}
    assert graph.initializer and all(i.data_location == onnx.TensorProto.EXTERNAL for i in graph.initializer)
    own = {t.data_ptr() for t in model.state_dict().values()}
    read = {v.data_ptr() for v in fast.backend.current.segment.shared.values()}
    assert own & read and read <= own | {v.data_ptr() for v in fast.backend.current.whole.gm.buffers()}
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok
    fast.close()


class SlicedBuffer(nn.Module):
    """What Hugging Face's models do with their position ids: a buffer sliced to the input's length (captured by
    ``torch.export``, which keeps the slice an op: the branch on a size stops ``symbolic_trace``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("scale", torch.rand(1, 32))

    def forward(self, x):
        if x.shape[1] > 32:
            raise ValueError("at most 32 features")
        return self.fc(x) * self.scale[:, :x.shape[1]]


def test_the_onnxruntime_fixed_tier_lands_where_its_build_process_makes_a_constant_the_caller_lacks(
        tiered, monkeypatch):
    """The build process loads the graph traced again, which makes the sliced buffer a constant of a new name: its
    data travels in the tier's file, and the session reads the model's weights in place."""
    _, inputs, times = tiered
    model = SlicedBuffer().eval()
    fast = fixed_landed(model, inputs, times, monkeypatch)
    assert fast.backend.label == "onnxruntime-fixed", fast.backend.tiers
    assert {t.data_ptr() for t in model.fc.parameters()} <= {
        v.data_ptr() for v in fast.backend.current.segment.shared.values()}
    with torch.no_grad():
        assert compare(model(*inputs), fast(*inputs)).ok
    fast.close()


class ReturnsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return {"y": self.fc(x).relu(), "x": x}


def test_the_onnxruntime_fixed_tier_binds_the_calls_of_a_model_that_returns_an_input(tiered, monkeypatch):
    """A model whose output holds one of its inputs is not called past the captured model's binding: the tier's
    answer is the model's, its input returned as it is."""
    _, inputs, times = tiered
    model = ReturnsItsInput().eval()
    fast = fixed_landed(model, inputs, times, monkeypatch)
    assert fast.backend.label == "onnxruntime-fixed" and fast.backend.current.direct is None
    with torch.no_grad():
        out = fast(*inputs)
        assert compare(model(*inputs), out).ok and out["x"] is inputs[0]
    fast.close()


def test_the_next_build_waits_while_a_race_is_called(tiered, monkeypatch):
    """A build beside a race slows the race's calls (on 2 cores a race beside an Inductor build timed both tiers at
    3x their steady time and kept the faster out): the next build starts once the race is decided, while calls
    come."""
    model, inputs, times = tiered
    monkeypatch.setattr(tiers, "KINDS", ("onnxruntime-fixed", "exported"))
    monkeypatch.setattr(tiers, "RACE_IDLE_S", 600.0)  # calls come far more often than this
    times.update({"first": 3.0, "onnxruntime-fixed": 2.0, "exported": 1.0})
    started: list[str] = []
    real = tiers.export_and_build
    monkeypatch.setattr(tiers, "export_and_build", lambda kind, *a, **k: started.append(kind) or real(kind, *a, **k))
    fast = opweave.compile(model, inputs, threads=1)
    with torch.no_grad():
        while not fast.backend.racing:
            assert fast.backend.building
            fast(*inputs)
        for _ in range(2 * tiers.BLOCK * tiers.BLOCKS - 1):  # the race, all but its last call
            fast(*inputs)
            assert started == ["onnxruntime-fixed"] and fast.backend.racing
        fast(*inputs)  # decided: the next build starts
    assert not fast.backend.racing and fast.backend.label == "onnxruntime-fixed"
    assert fast.backend.wait(120) and started == ["onnxruntime-fixed", "exported"]
    raced(fast, inputs)
    assert fast.backend.label == "exported"
    fast.close()


def test_a_race_block_times_its_calls_only_once_the_other_tiers_pools_settle(tiered, monkeypatch):
    """Two ONNX Runtime sessions called in turn ran their first calls after a switch at twice their steady time, so
    that a race of one untimed call a block timed both at that and kept the faster tier out: a block's calls are
    timed only once SETTLE_S has passed since it began."""
    model, inputs, times = tiered
    times.update({"exported": 1.0, "first": 2.0})
    clock = [0.0]
    monkeypatch.setattr(tiers, "_now", lambda: clock[0])
    monkeypatch.setattr(tiers, "SETTLE_S", 4 / 64)
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.wait(120) and fast.backend.racing
    race, seen = fast.backend.race, []
    with torch.no_grad():
        while fast.backend.racing:
            before = (race.block, sum(map(len, race.times)))
            fast(*inputs)
            seen.append((before[0], sum(map(len, race.times)) > before[1]))  # (block, timed)
            clock[0] += 1 / 64  # each call takes 1/64 s (sums exact in binary)
    for block in range(2 * tiers.BLOCKS):
        mine = [timed for b, timed in seen if b == block]
        assert mine == [False] * 4 + [True] * (tiers.BLOCK - 1), (block, mine)  # SETTLE_S untimed, then timed
    assert fast.backend.label == "exported"
    fast.close()


def test_a_race_block_times_calls_until_they_add_up_to_timed_ms(tiered, monkeypatch):
    """A model of a tenth of a millisecond a call, timed three calls a block, was raced on 12 calls a tier whose
    spread on a 2-core machine is as wide as the gap between two tiers: a block's timed calls go on until they add
    up to TIMED_MS (at least BLOCK - 1 of them): the shorter a tier's calls, the more of them are timed."""
    model, inputs, times = tiered
    times.update({"exported": 0.5, "first": 0.25})  # ms a call on the scripted clock
    monkeypatch.setattr(tiers, "TIMED_MS", 4.0)
    fast = opweave.compile(model, inputs, threads=1)
    assert fast.backend.wait(120) and fast.backend.racing
    race, blocks = fast.backend.race, []
    with torch.no_grad():
        for _ in range(400):
            if not fast.backend.racing:
                break
            before = (race.block, [len(t) for t in race.times])
            fast(*inputs)
            blocks.append((before[0], [len(t) for t in race.times] != before[1]))
    assert not fast.backend.racing
    timed = [sum(t for b, t in blocks if b == block) for block in range(2 * tiers.BLOCKS)]
    assert timed == [16, 8] * tiers.BLOCKS  # 4 ms of 0.25 ms calls (the tier in use), of 0.5 ms (the one built)
    assert [len(t) for t in race.times] == [16 * tiers.BLOCKS, 8 * tiers.BLOCKS]
    assert fast.backend.label != "exported"  # the tier in use is faster: the one built is kept out
    fast.close()


def test_a_timed_call_that_ends_after_its_block_counts_for_no_block(monkeypatch):
    """Callers on several threads: a call timed on one tier that ends after other calls have ended its block counted
    for the next block, the other tier's, which then ended on fewer of its own calls (with many callers, a tier
    could end the race with none timed). Here the other callers are calls made while the first one runs."""
    from types import SimpleNamespace

    monkeypatch.setattr(tiers, "SETTLE_S", 0.0)
    monkeypatch.setattr(search, "TIMER", lambda label, fn: (fn(), 1.0)[1])
    state = {"nested": 0}

    def in_use(*args):
        if state["nested"]:  # the others' calls, made (and ended) while this one runs
            state["nested"] -= 1
            for _ in range(tiers.BLOCK - 1):
                race(tiered, args)
        return "in use"

    race = tiers.LiveRace("first", in_use, "built", lambda *args: "built", {})
    tiered = SimpleNamespace(current=in_use, decided=lambda r: None)
    race(tiered, ())  # block 0's untimed call
    state["nested"] = 1
    race(tiered, ())  # timed; block 0 ends inside it (the nested calls), then it ends
    assert race.block == 1 and race.timed == 0
    while race.block == 1:
        race(tiered, ())
    assert len(race.times[1]) == tiers.BLOCK - 1  # block 1 timed BLOCK - 1 calls of its own tier


def test_the_build_process_checks_the_vector_instruction_sets_side_by_side(monkeypatch):
    """Inductor checks each vector instruction set the processor names with a compiler run and a loading process, one
    after another (8 s on an empty cache on 2 cores); the build process runs those checks on threads beside its
    export, and the compile then finds their answers. A check that raises is Inductor's to report, not the build's."""
    from torch._inductor import cpu_vec_isa

    both = threading.Barrier(2, timeout=30)  # passed only by two checks running at once
    called, checked = [], []

    class Isa:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def __str__(self):
            return self.name

        def __bool__(self):
            called.append(self.name)
            if self.fails:
                raise RuntimeError("no compiler")
            both.wait()
            checked.append(self.name)
            return True

    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list",
                        [Isa("avx512"), Isa("avx2"), Isa("amx_tile"), Isa("avx512", fails=True)])
    concurrent.futures.wait(tiers.vector_checks(workers=3), timeout=60)
    assert sorted(checked) == ["avx2", "avx512"]  # side by side, each set the processor names
    assert "amx_tile" not in called  # a set the processor does not name is not checked


def test_the_vector_checks_threads_import_nothing(tmp_path):
    """The checks' threads imported what a check uses (``torch._inductor.codecache``, ``torch.utils.cpp_extension``
    and setuptools under it) while the build process's main thread imported the same for its export: the build then
    failed with ``KeyError: 'torch._dynamo'`` (a module found half made). They are imported before the threads start."""
    import subprocess
    import sys

    script = (
        "import concurrent.futures, sys, threading\n"
        "import torch\n"
        "from opweave.pipeline import tiers\n"
        "seen = []\n"
        "class Spy:  # asked first for every module not yet imported, however it is imported\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if threading.current_thread() is not threading.main_thread():\n"
        "            seen.append(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Spy())\n"
        "concurrent.futures.wait(tiers.vector_checks(), timeout=600)\n"
        "print(sorted(set(seen)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
