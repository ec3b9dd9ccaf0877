"""The CUDA target's own choices, run on the fake CUDA runtime: the default plan is the one the calibrated simulator
predicts fastest (and says so), HEFT weighs a cross-stream edge at what the fit says it costs, and
``mode="max-autotune"`` times torch.compile, the simulator's first plans and their Inductor-fused versions
(segments compiled by Inductor, and plans over Inductor's kernels) on the device, keeps the fastest that equals
the model and caches the choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave
from opweave.capture import capture, coarsen
from opweave.outputs import compare
from opweave.pipeline.choose import choose
from opweave.pipeline.targets import fitted_device
from opweave.testing.fakecuda import FakeCuda


class Wide(nn.Module):
    """Four independent branches joined at the end: room for streams."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        return sum(b(x) for b in self.branches)


def wide():
    torch.manual_seed(0)
    return Wide().eval(), (torch.randn(1, 3, 16, 16),)


def run(fast, runtime, inputs):
    with torch.no_grad():
        out = fast(*inputs)
    runtime.synchronize()
    return out


def test_the_cuda_default_picks_the_plan_the_fitted_device_predicts_fastest_and_says_why():
    model, inputs = wide()
    runtime = FakeCuda(seed=3)
    fast = opweave.compile(model, inputs, device="cuda", runtime=runtime)
    graph = coarsen(capture(model, inputs)).graph
    device = fitted_device(runtime)
    best = choose(graph, fast.costs, device, stream_caps=(2, 4, 8))  # fast.costs: the fitted device's op times
    assert fast.choice["label"] == f"{best.scheduler} x{best.streams}" == \
        f"{fast.schedule.scheduler} x{best.streams}"
    assert fast.choice["predicted_ms"] == pytest.approx(best.makespan_ms)
    assert "predicted" in fast.choice["reason"] and len(fast.choice["candidates"]) == len(best.predictions)
    assert fast.schedule.streams_used <= best.streams
    assert compare(model(*inputs), run(fast, runtime, inputs)).ok


def test_heft_on_cuda_weighs_a_cross_stream_edge_at_what_the_fit_says_it_costs():
    model, inputs = wide()
    runtime = FakeCuda(seed=4)
    fast = opweave.compile(model, inputs, device="cuda", runtime=runtime, scheduler="heft")
    device = fitted_device(runtime)  # a cross-stream edge beyond what a same-stream one costs
    assert fast.schedule.options["sync_ms"] == pytest.approx(max(0.0, device.event_wait_us - device.kernel_gap_us)
                                                             / 1e3)
    mine = opweave.compile(model, inputs, device="cuda", runtime=runtime, scheduler="heft",
                           scheduler_options={"sync_ms": 0.5})
    assert mine.schedule.options["sync_ms"] == 0.5  # the caller's option wins


def test_max_autotune_on_cuda_tries_the_first_plan_with_inductor_segments_where_it_has_few_enough_syncs(
        monkeypatch):
    """Every search holds torch.compile, the simulator's first plans, the first plan with its segments compiled by
    Inductor (when it has at most SEGMENTED_SYNCS syncs: each segment is one compile) and over Inductor's kernels;
    each label says which ("+inductor": segments, as on the CPU; "+inductor-graph": Inductor's kernels)."""
    from opweave.pipeline import targets
    from opweave.pipeline.targets import CudaTarget

    model, inputs = wide()
    runtime = FakeCuda(seed=7)
    graph, device = coarsen(capture(model, inputs)).graph, fitted_device(runtime)
    costs = opweave.compile(model, inputs, device="cuda", runtime=runtime).costs  # the fitted device's op times
    ranked = CudaTarget().ranking(graph, costs, 8, device, "float32").predictions
    first = ranked[0]
    found = {c.label: c for c in targets.cuda_candidates(graph, costs, 8, device=device)}
    plan = f"{first.scheduler} x{first.streams}"
    assert found["torch.compile"].kind == "torch.compile" and plan in found
    assert found[f"{plan}+inductor"].changes == {"scheduler": first.scheduler, "streams": first.streams,
                                                 "compiler": "inductor"}
    assert found[f"{plan}+inductor-graph"].changes["graph"] == "inductor"
    assert 0 < first.syncs <= targets.SEGMENTED_SYNCS
    monkeypatch.setattr(targets, "SEGMENTED_SYNCS", first.syncs - 1)
    labels = [c.label for c in targets.cuda_candidates(graph, costs, 8, device=device)]
    assert f"{plan}+inductor" not in labels and f"{plan}+inductor-graph" in labels


# The fake compiles no segment with Inductor (FakeCuda's docstring): those segments run op by op, with a warning.
@pytest.mark.filterwarnings("ignore:.*could not be compiled with inductor")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_max_autotune_on_cuda_keeps_the_fastest_candidate_that_equals_the_model_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    model, inputs = wide()
    runtime = FakeCuda(seed=5)
    torch._dynamo.reset()
    fast = opweave.compile(model, inputs, device="cuda", runtime=runtime, mode="max-autotune")
    choice = fast.choice
    timed = {k: v["median_ms"] for k, v in choice["candidates"].items() if "median_ms" in v}
    assert "torch.compile" in choice["candidates"]
    assert {k.split("+", 1)[1] for k in choice["candidates"] if "+" in k} == {"inductor", "inductor-graph"}
    segmented = next(k for k in choice["candidates"] if k.endswith("+inductor"))
    record = choice["candidates"][segmented]
    assert "median_ms" in record, record  # built, checked (else it would be left out) and timed
    stats = record["segments"]  # what Inductor compiled, and what ran op by op (here all: the fake compiles none)
    assert stats["segments"] >= 2 and stats["compiles"] + stats["fallbacks"] == stats["segments"], stats
    assert len(timed) >= 3 and timed[choice["label"]] == min(timed.values()) and not choice["cached"]
    assert compare(model(*inputs), run(fast, runtime, inputs)).ok
    again = opweave.compile(model, inputs, device="cuda", runtime=runtime, mode="max-autotune")
    assert again.choice["cached"] and again.choice["label"] == choice["label"]
    assert compare(model(*inputs), run(again, runtime, inputs)).ok
    torch._dynamo.reset()


class WideBN(nn.Module):
    """Four branches of a convolution and a BatchNorm: the captured graph folds each BatchNorm into its convolution,
    torch.compile of the model does not, so the two round differently."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                      for _ in range(4))

    def forward(self, x):
        return sum(b(x) for b in self.branches)


def test_max_autotune_keeps_a_candidate_that_rounds_otherwise_but_is_as_close_to_float64(tmp_path, monkeypatch):
    """A candidate whose output differs from the captured graph's by rounding alone is checked against the model run
    in float64 as the benchmark checks every mode, not left out: here the fp32 tolerance is made so small that any
    difference breaks it, as TF32 convolutions and folded BatchNorm broke it for torch.compile on an H200, where
    max-autotune then timed no torch.compile candidate."""
    from opweave import outputs
    from opweave.pipeline.options import resolve
    from opweave.pipeline.search import Candidate, search
    from opweave.pipeline.targets import CudaTarget

    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(outputs.TOLERANCE, torch.float32, 1e-12)
    torch.manual_seed(0)
    model = WideBN().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    inputs = (torch.randn(1, 3, 16, 16),)
    runtime = FakeCuda(seed=6)
    torch._dynamo.reset()
    captured = coarsen(capture(model, inputs))
    options = resolve("cuda", "max-autotune", runtime=runtime)
    fast = search(CudaTarget(), captured, inputs, options, eager=model,
                  candidates=[Candidate("torch.compile", kind="torch.compile")])
    assert fast.choice["label"] == "torch.compile" and "median_ms" in fast.choice["candidates"]["torch.compile"]
    torch._dynamo.reset()


@pytest.mark.parametrize("over", [1, 99])
def test_the_cuda_default_passes_over_a_plan_whose_planned_peak_is_over_the_cap(monkeypatch, over):
    """The memory pass says the first ``over`` plans it sees are at 1.5x the one-stream plan's peak: the default
    picks the next plan within the tolerance, and names the one it passed over; when every plan is over, it keeps
    the fastest and says so."""
    from opweave.pipeline import targets

    seen = []

    def memory_pass(*args, **kwargs):
        plan, ratio = real(*args, **kwargs)
        seen.append(ratio)
        return plan, 1.5 if len(seen) <= over else ratio

    real = targets.memory_pass
    monkeypatch.setattr(targets, "memory_pass", memory_pass)
    monkeypatch.setattr(targets, "PICK_TOLERANCE", 100.0)  # every plan is within it
    model, inputs = wide()
    runtime = FakeCuda(seed=5)
    fast = opweave.compile(model, inputs, device="cuda", runtime=runtime)
    ranked = list(fast.choice["candidates"])
    if over == 1:
        assert len(seen) == 2 and fast.choice["label"] == ranked[1]
        assert f"picked over {ranked[0].replace(' x', '/')} (1.50x): planned peak over 1.25x" in fast.choice["reason"]
    else:
        assert len(seen) == len(ranked) and fast.choice["label"] == ranked[0]
        assert "planned peak 1.50x the one-stream plan's, over the 1.25x cap, as is every plan" in \
            fast.choice["reason"]
    assert compare(model(*inputs), run(fast, runtime, inputs)).ok


def fake_runs(monkeypatch) -> list:
    """Every FakeTensorMode made from now on (one per run of the model on fake tensors)."""
    from torch._subclasses import fake_tensor

    made = []

    class Counted(fake_tensor.FakeTensorMode):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(fake_tensor, "FakeTensorMode", Counted)
    return made


def test_one_cuda_build_runs_the_model_on_fake_tensors_once(monkeypatch):
    """The memory pass of every candidate plan and the backend's release plan for the example inputs share one run
    on fake tensors, and one one-stream plan: the first two candidates are said to be over the cap here, so three
    plans go through the memory pass before the backend plans its releases."""
    from opweave.pipeline import memory_pass as pass_module
    from opweave.pipeline import targets

    sequential, seen = [], []

    def memory_pass(*args, **kwargs):
        plan, ratio = real(*args, **kwargs)
        seen.append(ratio)
        return plan, 1.5 if len(seen) <= 2 else ratio

    def plan_for(graph, costs, scheduler, **kwargs):
        if scheduler == "sequential":
            sequential.append(kwargs)
        return real_plan_for(graph, costs, scheduler, **kwargs)

    real, real_plan_for = targets.memory_pass, pass_module.plan_for
    modes = fake_runs(monkeypatch)
    monkeypatch.setattr(targets, "memory_pass", memory_pass)
    monkeypatch.setattr(pass_module, "plan_for", plan_for)
    monkeypatch.setattr(targets, "PICK_TOLERANCE", 100.0)  # every plan is within it
    model, inputs = wide()
    runtime = FakeCuda(seed=5)
    fast = opweave.compile(model, inputs, device="cuda", runtime=runtime)
    assert len(seen) == 3 and None not in seen
    assert len(modes) == 1 and len(sequential) == 1
    assert fast.backend.stats["keep_all_runs"] == 0
    assert compare(model(*inputs), run(fast, runtime, inputs)).ok


class Masked(nn.Module):
    """A boolean mask: its output's shape depends on values, which fake tensors do not have."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y, z = self.a(x).relu(), self.b(x).relu()
        return (y + z)[x > 0].sum() + y.sum()


def test_a_model_that_cannot_run_on_fake_tensors_is_tried_once_per_cuda_build(monkeypatch):
    """The memory pass finds no buffers (no waits added) and the backend learns them from a first real run, without
    trying the fake tensors again."""
    torch.manual_seed(0)
    model, x = Masked().eval(), torch.randn(4, 8)
    modes = fake_runs(monkeypatch)
    runtime = FakeCuda(seed=1)
    fast = opweave.compile(model, (x,), device="cuda", runtime=runtime, cudagraphs=False)
    assert len(modes) == 1 and fast.backend.stats["keep_all_runs"] == 1
    assert compare(model(x), run(fast, runtime, (x,))).ok


def test_max_autotune_no_cudagraphs_never_times_a_cuda_graph(tmp_path, monkeypatch):
    """``mode="max-autotune-no-cudagraphs"`` timed ``torch.compile(mode="reduce-overhead")``, which records CUDA
    Graphs; its torch.compile candidate is Inductor alone now, and every plan it builds runs its streams live."""
    from opweave.pipeline.options import resolve
    from opweave.pipeline.search import search
    from opweave.pipeline.targets import CudaTarget

    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    modes = []

    def recording(model, mode=None, **kwargs):
        modes.append(mode)
        return model  # the model itself stands for what Inductor would compile

    monkeypatch.setattr(torch, "compile", recording)
    model, inputs = wide()
    captured = coarsen(capture(model, inputs))
    for mode, graphs in (("max-autotune", True), ("max-autotune-no-cudagraphs", False)):
        options = resolve("cuda", mode, runtime=FakeCuda(seed=7))
        candidates = [c for c in CudaTarget().search_candidates(captured, inputs, options)
                      if c.kind != "plan" or "graph" not in c.changes][:3]
        fast = search(CudaTarget(), captured, inputs, options, eager=model, candidates=candidates)
        assert modes[-1] == ("reduce-overhead" if graphs else "default"), mode
        plans = [c for c in candidates if c.kind == "plan"]
        assert plans and fast.options.cudagraphs is graphs
        built = CudaTarget().build_candidate(captured, inputs, options, plans[0], None, model)
        assert built.backend.cudagraphs is graphs, mode
        built.close()
        fast.close()


def test_a_cached_choice_is_keyed_by_every_setting_that_changes_it(tmp_path, monkeypatch):
    """The key of a max-autotune choice left out the mode, CUDA Graphs and the threads: a choice made under one was
    reused under another; and the version of the candidate lists, so a choice cached before CUDA's list gained its
    segments compiled by Inductor came back with a label that now means another candidate."""
    from opweave.pipeline import search as choices
    from opweave.pipeline.options import resolve

    model, inputs = wide()
    captured = coarsen(capture(model, inputs))
    runtime = FakeCuda(seed=8)
    cuda = {choices.key(captured, inputs, resolve("cuda", mode, runtime=runtime))
            for mode in ("max-autotune", "max-autotune-no-cudagraphs")}
    cpu = {choices.key(captured, inputs, resolve("cpu", "max-autotune", threads=t)) for t in (1, 2)}
    assert len(cuda) == 2 and len(cpu) == 2
    assert choices.key(captured, inputs, resolve("cpu", "max-autotune", threads=1)) in cpu  # the same settings
    # a choice made from an older candidate list is made again (its label may now name another candidate)
    monkeypatch.setattr(choices, "SEARCH", choices.SEARCH + 1)
    assert choices.key(captured, inputs, resolve("cpu", "max-autotune", threads=1)) not in cpu


def test_reduce_overhead_with_several_devices_is_refused_not_dropped():
    """``mode="reduce-overhead"`` with ``devices > 1`` resolved to CUDA Graphs on, which the ranks then dropped."""
    from opweave.errors import UsageError
    from opweave.pipeline.options import resolve

    with pytest.raises(UsageError, match="reduce-overhead.*devices=2"):
        resolve("cuda", "reduce-overhead", devices=2, check_device=False)
    assert resolve("cuda", devices=2, check_device=False).cudagraphs is False


def test_max_autotune_times_its_candidates_in_the_grad_mode_they_were_checked_in(tmp_path, monkeypatch):
    """The search checks each candidate under no_grad and times it in the same mode (as a user's inference calls
    and the benchmark run). Timed under inference_mode instead, torch.compile's candidate runs code compiled for
    another grad mode: on an H200 the search measured it 1.2-1.8x slower than the benchmark measured the same
    torch.compile in the same process, so it chose a plan over a faster torch.compile. Every call a candidate
    gets is recorded here: none runs in inference mode."""
    from opweave.pipeline.options import resolve
    from opweave.pipeline.search import Candidate, search
    from opweave.pipeline.targets import CudaTarget

    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    modes = []

    class Recorded(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if not torch.compiler.is_compiling():
                modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return self.inner(x)

    model, inputs = wide()
    runtime = FakeCuda(seed=7)
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: fn)  # the candidate runs the model itself
    options = resolve("cuda", "max-autotune", runtime=runtime)
    fast = search(CudaTarget(), coarsen(capture(model, inputs)), inputs, options, eager=Recorded(model),
                  candidates=[Candidate("torch.compile", kind="torch.compile")])
    assert fast.choice["label"] == "torch.compile" and len(modes) > 5
    assert set(modes) == {(False, False)}, modes
