"""The CUDA backend's parts that run without a GPU: the one-line error, the join-aware liveness analysis, buffer
aliasing, input signatures and copies, the bounded cache, the walker every backend shares, stream checks, capture
error messages; the profiler's CPU path (round trip,
key check, costs) and its reading of Kineto traces (a synthetic CUDA trace in torch's export format under
tests/data/, a real CPU trace, and a real CUDA trace once one is committed); and the GPU benchmark's fresh inputs,
summary, table and JSON (its output check, :func:`opweave.outputs.compare`, is tested in tests/test_outputs.py)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import gzip
import json
import subprocess
import sys
import weakref
from pathlib import Path

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import opweave
from benchmark_module import BENCHMARKS, gpu_latency
from dags import dags
from opweave import costs as costs_mod
from opweave import schedulers
from opweave.backends.cache import BoundedCache, signature
from opweave.backends.cuda import CudaBackend, InputCopies, _static_copy, input_signature, on_device, require_cuda
from opweave.backends.cudagraph import capture_error
from opweave.backends.liveness import (
    Buffer,
    FakeRun,
    launch_positions,
    release_keys,
    release_points,
    static_buffers,
    steps_with_releases,
    storage_buffers,
)
from opweave.backends.program import Program, Step, Walker
from opweave.backends.streams import check_distinct_streams, default_streams
from opweave.capture import capture
from opweave.capture.runtime import module_tensors
from opweave.costs.profile import Profile, ProfileKeyError, profile_key, profile_model
from opweave.costs.profile.kineto import kernels_by_op, range_runs, trace_ops
from opweave.costs.profile.measure import full_env, latencies_from_runs
from opweave.costs.profile.occupancy import occupancy, op_demand
from opweave.costs.roofline import estimate
from opweave.errors import CaptureError, DeviceError, ProfileError
from opweave.ir import OpGraph
from opweave.ir.graph import Op
from opweave.pipeline import plan_for
from opweave.plan import Instr, LaunchPlan
from opweave.plan.lower import lower

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")


class Branchy(nn.Module):
    """Three branches off one input; a view of one branch read by another op; an in-place add that stays in place
    (a view of its tensor is read after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 5, padding=2)

    def forward(self, x):
        a, b, c = self.a(x), self.b(x).sigmoid(), self.c(x)
        head = a[:, :4]  # a view of a, absorbed into a's op
        side = head * 2
        flat = c.flatten(1)
        c.add_(1.0)  # kept in place: ``flat`` (a view of c) is read below
        return torch.cat([a.relu(), b, side.mean(1, keepdim=True).expand_as(b)], 1), flat.sum(1)


@functools.cache
def branchy():
    torch.manual_seed(0)
    model, x = Branchy().eval(), (torch.randn(2, 3, 12, 12),)
    return model, x, capture(model, x, name="branchy")

# ---- random plans ----------------------------------------------------------------------------------------------------


@st.composite
def random_plans(draw, max_instrs: int = 40):
    """Any well-formed plan: launches, records and waits on up to 4 streams of device 0, sends/recvs to device 1.

    Unlike lowered plans, these have redundant waits, events recorded several times, and lanes that never join.
    """
    instrs: list[Instr] = []
    recorded: set[int] = set()
    sent: list[tuple[str, int]] = []  # (op, stream it was sent from)
    ops = 0
    for _ in range(draw(st.integers(1, max_instrs))):
        kind = draw(st.sampled_from(["launch", "launch", "record", "wait", "send", "recv"]))
        device = 0 if kind != "recv" else 1
        stream = draw(st.integers(0, 3))
        if kind == "launch":
            device = draw(st.sampled_from([0, 0, 0, 1]))
            instrs.append(Instr(device, "launch", stream, op=f"o{ops}"))
            ops += 1
        elif kind == "record":
            event = draw(st.integers(0, 3))
            recorded.add(event)
            instrs.append(Instr(0, "record", stream, event=event))
        elif kind == "wait" and recorded:
            instrs.append(Instr(0, "wait", stream, event=draw(st.sampled_from(sorted(recorded)))))
        elif kind == "send" and ops:
            op = f"o{draw(st.integers(0, ops - 1))}"
            if (op, stream) not in sent and all(o != op for o, _ in sent):
                sent.append((op, stream))
                instrs.append(Instr(0, "send", stream, op=op, peer=1))
        elif kind == "recv" and sent:
            op, _ = sent.pop(draw(st.integers(0, len(sent) - 1)))
            instrs.append(Instr(1, "recv", stream, op=op, peer=0))
    if not ops:
        instrs.append(Instr(0, "launch", 0, op="o0"))
    return LaunchPlan(instrs)


def happens_before_graph(program: Program) -> nx.DiGraph:
    """The oracle: one node per step, lane order plus signal -> wait edges."""
    g = nx.DiGraph()
    signal_at = {}
    for lane, steps in program.lanes.items():
        for i, step in enumerate(steps):
            g.add_node((lane, i))
            if i:
                g.add_edge((lane, i - 1), (lane, i))
            if step.kind == "signal":
                signal_at[step.signal] = (lane, i)
    for lane, steps in program.lanes.items():
        for i, step in enumerate(steps):
            if step.kind == "wait":
                g.add_edge(signal_at[step.signal], (lane, i))
    return g


def check_releases(program: Program, buffers: list[Buffer]) -> None:
    g = happens_before_graph(program)
    where = launch_positions(program)
    released = {name: at for at, names in release_points(program, buffers).items() for name in names}

    def covered(point, buf: Buffer) -> bool:
        return all(where[u] == point or nx.has_path(g, where[u], point) for u in buf.users)

    for buf in buffers:
        steps = len(program.lanes[buf.alloc_lane])
        if buf.name in released:
            lane, i = released[buf.name]
            assert lane == buf.alloc_lane
            assert covered((lane, i), buf), f"{buf.name} released before a use that is not ordered before it"
            if i:
                assert not covered((lane, i - 1), buf), f"{buf.name} could have been released earlier"
        else:
            assert not covered((buf.alloc_lane, steps - 1), buf), f"{buf.name} kept although its lane joins"


@settings(max_examples=150, deadline=None)
@given(plan=random_plans(), data=st.data())
def test_release_points_on_random_plans(plan, data):
    program = Program.from_plan(plan)
    where = launch_positions(program)
    ops = sorted(where)
    buffers = []
    for b in range(data.draw(st.integers(1, 6))):
        users = data.draw(st.sets(st.sampled_from(ops), min_size=1, max_size=4))
        producer = min(users, key=lambda o: int(o[1:]))  # issued first: the op that allocated it
        buffers.append(Buffer(f"b{b}", where[producer][0], frozenset(users)))
    check_releases(program, buffers)


@settings(max_examples=40, deadline=None)
@given(graph=dags(max_ops=25), scheduler=st.sampled_from(["lios", "opara", "nimble", "wavefront"]),
       streams=st.integers(1, 4))
def test_release_points_on_lowered_schedules(graph, scheduler, streams):
    sched = schedulers.run(scheduler, graph, costs_mod.from_graph(graph), streams=streams)
    program = Program.from_plan(lower(graph, sched))
    where = launch_positions(program)
    buffers = [Buffer(op, where[op][0], frozenset([op, *graph.succs[op]])) for op in graph.ids]
    check_releases(program, buffers)
    if streams == 1 or sched.streams_used == 1:  # one stream: every output dies right after its last reader
        released = {n: at for at, names in release_points(program, buffers).items() for n in names}
        assert set(released) == set(graph.ids)


def test_release_waits_for_the_join_in_the_docstring_example():
    plan = LaunchPlan([Instr(0, "launch", 0, op="x"), Instr(0, "record", 0, event=0),
                       Instr(0, "wait", 1, event=0), Instr(0, "launch", 1, op="y"), Instr(0, "record", 1, event=1),
                       Instr(0, "launch", 0, op="z"), Instr(0, "wait", 0, event=1)])
    program = Program.from_plan(plan)
    a = (0, 0)
    got = release_points(program, [Buffer("x_out", a, frozenset({"x", "y"})), Buffer("z_out", a, frozenset({"z"}))])
    assert got == {(a, 2): ["z_out"], (a, 3): ["x_out"]}  # after z (step 2); after A's wait for y (step 3)
    never_joined = LaunchPlan(plan.instrs[:-1])
    assert release_points(Program.from_plan(never_joined), [Buffer("x_out", a, frozenset({"x", "y"}))]) == {}


def test_release_points_reject_unknown_users():
    program = Program.from_plan(LaunchPlan([Instr(0, "launch", 0, op="x")]))
    with pytest.raises(ValueError, match="'nope'"):
        release_points(program, [Buffer("b", (0, 0), frozenset({"nope"}))])


# ---- buffers of a real run, released where the analysis says ---------------------------------------------------------


def keep_all_run(cap, program, inputs) -> dict:
    """The environment after running every op in issue order, keeping every intermediate."""
    env = cap.bind(inputs)
    for _, step in program.issue_order:
        if step.kind == "launch":
            cap.run_op(step.op, env)
    return env


class Dropping(Walker):
    """The walker every backend subclasses, on one thread in issue order (as the CUDA lanes are walked): runs the
    ops and deletes the keys each step releases."""

    def __init__(self, cap, env: dict):
        self.cap, self.env, self.dropped = cap, env, 0

    def launch(self, lane, op):
        self.cap.run_op(op, self.env)  # a KeyError here would be a read of a released buffer

    def signal(self, lane, number):
        pass

    def wait(self, lane, number):
        pass

    def release(self, lane, keys):
        for k in keys:
            del self.env[k]
            self.dropped += 1


def run_with_releases(cap, plan, inputs):
    """A keep-all run, the storage groups and their release points, then a run that drops each group's env keys
    right after its release step (in issue order, as the CUDA interpreter does). Returns (output, groups, dropped)."""
    program = Program.from_plan(plan)
    with torch.no_grad():
        env = keep_all_run(cap, program, inputs)
        groups = storage_buffers(cap, env, program)
        releases = release_keys(program, groups)
        walker = Dropping(cap, cap.bind(inputs))
        walker.run(steps_with_releases(program, releases))
        return cap.output(walker.env), groups, walker.dropped


def test_storage_groups_join_views_and_in_place_results():
    model, x, cap = branchy()
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), "sequential")
    program = Program.from_plan(plan)
    with torch.no_grad():
        env = keep_all_run(cap, program, x)
    groups = storage_buffers(cap, env, program)
    storage = {k: env[k].untyped_storage().data_ptr() for b in groups for k in b.keys}
    for b in groups:
        assert len({storage[k] for k in b.keys}) == 1
    assert len({storage[b.keys[0]] for b in groups}) == len(groups)
    view_group = next(b for b in groups if len(b.keys) > 1 and any("getitem" in k for k in b.keys))
    assert len(view_group.users) >= 3  # the conv that made it, the op reading the view, the relu reading the base
    output = next(n for n in reversed(cap.gm.graph.nodes) if n.op == "output")
    returned = {n.name for n in output.all_input_nodes}
    assert not returned & set(storage), "a returned value must never be released"


def same_buffers(found: list[Buffer]) -> list[tuple]:
    return sorted((b.name, b.alloc_lane, sorted(b.users), b.keys, b.nbytes) for b in found)


@pytest.mark.parametrize("scheduler", ["sequential", "lios", "wavefront"])
@pytest.mark.parametrize("name", ["branchy", "squeezenet"])
def test_buffers_found_on_fake_tensors_are_those_of_a_real_run(name, scheduler):
    """Views, an in-place add kept in place, outputs and parameters: the run on fake tensors groups, places and
    sizes every buffer as a real run that kept every intermediate does."""
    if name == "branchy":
        _, x, cap = branchy()
    else:
        from opweave import zoo

        model, x = zoo.create(name)
        cap = capture(model, x, name=name)
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), scheduler, streams=3)
    program = Program.from_plan(plan)
    with torch.no_grad():
        env = keep_all_run(cap, program, x)
    real = storage_buffers(cap, env, program, module_tensors(cap.gm))
    assert len(real) > 3 and all(b.nbytes > 0 for b in real)
    assert same_buffers(static_buffers(cap, x, program)) == same_buffers(real)


@pytest.mark.parametrize("name", ["branchy", "squeezenet"])
def test_one_run_on_fake_tensors_gives_each_program_the_buffers_of_its_own_real_run(name):
    """One run on fake tensors serves the plans of several schedulers (as a build's memory pass and its backend share
    one): each program gets the buffers, in order and by name, that a real run of it in its issue order gives."""
    if name == "branchy":
        _, x, cap = branchy()
    else:
        from opweave import zoo

        model, x = zoo.create(name)
        cap = capture(model, x, name=name)
    run = FakeRun(cap, x)
    for scheduler in ("lios", "sequential", "wavefront", "opara", "heft"):
        _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), scheduler, streams=3)
        program = Program.from_plan(plan)
        with torch.no_grad():
            env = keep_all_run(cap, program, x)
        assert static_buffers(cap, x, program, run) == storage_buffers(cap, env, program, module_tensors(cap.gm))


def test_a_run_on_fake_tensors_serves_only_its_module_and_inputs_of_its_layout(monkeypatch):
    """A view or a copy, and a convolution's output layout, depend on the inputs' strides and devices: a build's run
    is not used for inputs laid out otherwise, nor for another module (a model moved to the device)."""
    _, x, cap = branchy()
    run = FakeRun(cap, x)
    (t,) = x
    wide = t.contiguous(memory_format=torch.channels_last)  # the same shape, other strides
    assert run.serves(cap, x) and run.serves(cap, (t.clone(),))
    assert not run.serves(cap, (wide,)) and not run.serves(dataclasses.replace(cap, gm=copy.deepcopy(cap.gm)), x)
    made, original = [], FakeRun.__init__

    def counting(self, *args):
        made.append(args)
        original(self, *args)

    monkeypatch.setattr(FakeRun, "__init__", counting)
    program = Program.from_plan(plan_for(cap.graph, estimate(cap.graph, "cpu"), "lios", streams=3)[1])
    static_buffers(cap, x, program, run)
    assert made == []  # served: no run of its own
    static_buffers(cap, (wide,), program, run)
    assert len(made) == 1  # laid out otherwise: a run of its own


def test_buffers_of_a_segmented_model_on_fake_tensors_are_those_of_its_segments():
    """A segmented model's run writes only its segments' outputs; the run on fake tensors (node by node) finds the
    same buffers, plus those of values inside a segment, which no environment entry of a real run holds."""
    from opweave.backends.segments import fuse_segments

    _, x, cap = branchy()
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), "lios", streams=3)
    segmented, segment_plan = fuse_segments(cap, plan, "eager")
    program = Program.from_plan(segment_plan)
    with torch.no_grad():
        env = keep_all_run(segmented, program, x)
    real = storage_buffers(segmented, env, program, module_tensors(segmented.gm))
    found = {b.keys[0]: b for b in static_buffers(segmented, x, program)}
    by_key = {k: b for b in found.values() for k in b.keys}
    for buffer in real:
        twin = by_key[buffer.keys[0]]
        assert (twin.alloc_lane, twin.users, twin.nbytes) == (buffer.alloc_lane, buffer.users, buffer.nbytes)
        assert set(buffer.keys) <= set(twin.keys)
    inside = [b for b in found.values() if not set(b.keys) & set(env)]
    assert inside and all(len(b.users) == 1 for b in inside)  # values inside one segment


@pytest.mark.parametrize("scheduler", ["sequential", "lios", "opara", "nimble", "wavefront", "ios", "hios-mr"])
def test_releasing_at_the_analysed_points_keeps_outputs_exact(scheduler):
    model, x, cap = branchy()
    with torch.no_grad():
        expected = model(*x)
    devices = 2 if scheduler in schedulers.MULTI_DEVICE else 1
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), scheduler, streams=3, devices=devices)
    got, groups, dropped = run_with_releases(cap, plan, x)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    assert groups and dropped > 0


def test_a_zoo_model_frees_almost_every_intermediate_on_one_stream():
    from opweave import zoo

    model, x = zoo.create("squeezenet")
    cap = capture(model, x, name="squeezenet")
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), "sequential")
    got, groups, dropped = run_with_releases(cap, plan, x)
    with torch.no_grad():
        assert torch.allclose(model(*x), got)
    assert dropped >= len(cap.graph) - 2  # all but what the output returns


# ---- no CUDA: one clear line -----------------------------------------------------------------------------------------


@no_cuda
def test_require_cuda_says_what_to_do_in_one_line():
    with pytest.raises(RuntimeError, match=r"^CUDA is not available: .*use device='cpu' \(--device cpu\)$") as info:
        require_cuda()
    assert "\n" not in str(info.value)


@no_cuda
def test_compile_for_cuda_without_cuda_fails_before_capturing():
    model, x, cap = branchy()
    with pytest.raises(RuntimeError, match="^CUDA is not available") as info:
        opweave.compile(model, x, device="cuda")
    assert "\n" not in str(info.value)
    _, plan = plan_for(cap.graph, estimate(cap.graph, "cpu"), "sequential")
    with pytest.raises(RuntimeError, match="^CUDA is not available"):
        CudaBackend(cap, plan, x)


@no_cuda
def test_gpu_benchmark_exits_with_status_2_and_one_line():
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_latency.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("gpu_latency: CUDA is not available") and len(result.stderr.splitlines()) == 1


def test_moving_a_captured_model_leaves_the_callers_model_in_place():
    model, x, cap = branchy()
    meta = torch.device("meta")  # stands in for the GPU: runs every op, computes only shapes
    moved = on_device(cap, meta)
    assert moved is not cap and on_device(cap, torch.device("cpu")) is cap
    assert {p.device for p in moved.gm.parameters()} == {meta}
    assert {p.device.type for p in model.parameters()} == {"cpu"} == {p.device.type for p in cap.gm.parameters()}
    assert all(n.graph is moved.gm.graph for group in moved.nodes.values() for n in group)
    env = moved.bind((x[0].to(meta),))
    for op in moved.graph.topo_order:
        moved.run_op(op, env)
    assert [tuple(t.shape) for t in moved.output(env)] == [(2, 24, 12, 12), (2,)]


# ---- profile on CPU --------------------------------------------------------------------------------------------------


def test_cpu_profile_round_trips_and_refuses_another_key(tmp_path):
    model, x, cap = branchy()
    prof = profile_model(cap, x, device="cpu", repeats=3, warmup=1)
    assert set(prof.latency_ms) == set(cap.graph.ids) and all(v > 0 for v in prof.latency_ms.values())
    assert prof.key["model"] == "branchy" and prof.key["input_shapes"] == [[2, 3, 12, 12]]
    assert prof.key["dtype"] == "float32" and prof.key["torch"] == torch.__version__
    assert prof.kernels == {}  # no kernels on a CPU
    path = tmp_path / "branchy.profile.json"
    prof.save(path)
    expect = profile_key("branchy", x, "cpu")
    again = Profile.load(path, expect=expect)
    assert again == prof
    for wrong in ({**expect, "input_shapes": [[8, 3, 12, 12]]}, {**expect, "torch": "1.0"},
                  {**expect, "device": "NVIDIA H100"}, {**expect, "dtype": "float16"}):
        with pytest.raises(ProfileKeyError, match="was measured for"):
            Profile.load(path, expect=wrong)
    costs = again.costs(cap.graph, model="gpu")
    assert costs.latency_ms == prof.latency_ms and costs.model == "gpu" and costs.source == "profile"
    sched = schedulers.run("lios", cap.graph, costs, streams=3)
    assert sorted(sched.order) == sorted(cap.graph.ids)
    with pytest.raises(ProfileKeyError, match="no latency for op 'zz'"):
        again.costs(OpGraph.from_dict({"ops": [{"id": "zz"}]}))


def test_profiling_a_model_that_is_not_on_the_device_is_refused():
    _, x, cap = branchy()
    with pytest.raises(ValueError, match="profiling on cuda, but the model or its inputs are on cpu"):
        profile_model(cap, x, device="cuda")


def test_profile_load_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"format": "opweave.graph/1"}')
    with pytest.raises(ValueError, match="not an opweave profile"):
        Profile.load(path)
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(path)


def test_categories_are_checked_against_the_ridge_point():
    model, x, cap = branchy()
    prof = profile_model(cap, x, device="cpu", repeats=1, warmup=0, ridge_flops_per_byte=1e9)
    compute_ops = [o.id for o in cap.graph.ops if o.category == "compute" and o.bytes > 0]
    assert compute_ops and {d["op"] for d in prof.category_disagreements} >= set(compute_ops)
    assert prof.category == {o.id: o.category for o in cap.graph.ops}  # the table's category is kept


# ---- kernel trace parsing and occupancy arithmetic -------------------------------------------------------------------


def test_kernels_are_assigned_through_launch_correlation_ids():
    """A hand-written trace in Kineto's chrome-trace layout: two op ranges on one thread, launches inside them,
    kernels (on the GPU's own timeline, later) carrying the launches' correlation ids."""
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    kernel_args = {"grid": [80, 1, 1], "block": [256, 1, 1], "registers per thread": 32, "shared memory": 0}
    trace = {"traceEvents": [
        x("user_annotation", "opweave::conv", 100, 50),
        x("cuda_runtime", "cudaLaunchKernel", 110, 5, correlation=7),
        x("cuda_runtime", "cudaLaunchKernel", 130, 5, correlation=8),
        x("user_annotation", "opweave::relu", 200, 20),
        x("cuda_runtime", "cudaLaunchKernel", 205, 5, correlation=9),
        x("cuda_runtime", "cudaLaunchKernel", 400, 5, correlation=10),  # outside every op range
        x("kernel", "implicit_gemm", 300, 12, tid=7, correlation=7, **kernel_args),
        x("kernel", "bias_add", 313, 2, tid=7, correlation=8, **kernel_args),
        x("kernel", "relu_kernel", 320, 3, tid=7, correlation=9, **{**kernel_args, "grid": [4, 1, 1]}),
        x("kernel", "stray", 500, 3, tid=7, correlation=10, **kernel_args),
    ]}
    by_op = kernels_by_op(trace, ["conv", "relu", "idle"])
    assert [k["name"] for k in by_op["conv"]] == ["implicit_gemm", "bias_add"]
    assert [k["name"] for k in by_op["relu"]] == ["relu_kernel"] and by_op["idle"] == []
    assert by_op["relu"][0]["grid"] == [4, 1, 1] and by_op["relu"][0]["registers_per_thread"] == 32


H100_LIKE = {"sm_count": 132, "max_threads_per_sm": 2048, "registers_per_sm": 65536,
             "shared_memory_per_sm": 233472, "max_blocks_per_sm": 32, "warp_size": 32}


@pytest.mark.parametrize(("block", "regs", "smem", "blocks_per_sm", "occ"), [
    (256, 32, 0, 8, 1.0),          # limited by threads: 2048 / 256
    (256, 128, 0, 2, 0.25),        # 128 regs x 32 = 4096 per warp -> 16 warps -> 2 blocks of 8 warps
    (128, 16, 48 * 1024, 4, 0.25),  # 228 KiB / (48 + 1 KiB) -> 4 blocks of 4 warps
    (32, 16, 0, 32, 0.5),          # limited by the 32 resident blocks
])
def test_occupancy_from_launch_configuration(block, regs, smem, blocks_per_sm, occ):
    got = occupancy({"grid": [1000, 1, 1], "block": [block, 1, 1], "registers_per_thread": regs,
                     "shared_memory_bytes": smem}, H100_LIKE)
    assert got == {"blocks_per_sm": blocks_per_sm, "occupancy": occ}


def test_utilization_is_the_share_of_block_slots_filled():
    small = {"grid": [66, 1, 1], "block": [256, 1, 1], "registers_per_thread": 32, "shared_memory_bytes": 0,
             "duration_us": 10.0}
    small |= occupancy(small, H100_LIKE)  # 8 blocks per SM x 132 SMs = 1056 slots
    demand, util = op_demand([small], H100_LIKE)
    assert util == pytest.approx(66 / 1056)
    assert demand["threads"] == 66 * 256 and demand["registers"] == 66 * 256 * 32
    big = {**small, "grid": [5000, 1, 1], "duration_us": 30.0}
    assert op_demand([small, big], H100_LIKE)[1] == pytest.approx((66 / 1056 * 10 + 30) / 40)


# ---- per-op GPU time from Kineto traces ------------------------------------------------------------------------------

DATA = Path(__file__).resolve().parent / "data"
# tests/data/kineto_cuda_trace.json: what torch 2.x's export_chrome_trace writes for five ops run 3 times each under
# the profiler, each run in an opweave::<op> range (metadata events, cpu_op and user_annotation ranges, cuda_runtime
# launches, kernels / gpu_memcpy / gpu_memset on stream 7 with their correlation ids, ac2g flows,
# gpu_user_annotation projections, a fill kernel launched before any range, a final cudaDeviceSynchronize), with a
# few categories in other letter cases. Per run, GPU time (us): conv 22.528 / 23.104 / 37.184 (two kernels),
# relu 1.504 / 1.6 / 1.408, view none (no launch), copy 3.008 / 3.2 / 2.912 (memcpy), zero 1.024 / 1.088 / 1.216
# (memset).
FIXTURE_OPS = {"conv": 2e6, "relu": 4096.0, "view": 0.0, "copy": 0.0, "zero": 0.0}


def fixture_trace() -> dict:
    return json.loads((DATA / "kineto_cuda_trace.json").read_text())


def fixture_graph(**flops) -> OpGraph:
    return OpGraph([Op(op, target=f"t.{op}", flops=flops.get(op, f)) for op, f in FIXTURE_OPS.items()])


def test_gpu_time_per_op_is_the_median_run_of_its_kernels_memcpys_and_memsets():
    runs = range_runs(fixture_trace())
    assert [r.op for r in runs] == [op for op in FIXTURE_OPS for _ in range(3)]
    assert [len(r.work) for r in runs] == [2] * 3 + [1] * 3 + [0] * 3 + [1] * 6  # the stray fill kernel: no op's
    latency, kernels = latencies_from_runs(fixture_graph(), runs)
    assert latency == pytest.approx({"conv": 0.023104, "relu": 0.001504, "view": 0.0, "copy": 0.003008,
                                     "zero": 0.001088})
    assert [k["name"].split("<")[0] for k in kernels["conv"]] == ["void cutlass::Kernel2",
                                                                  "void at::native::elementwise_kernel"]
    assert sum(k["duration_us"] for k in kernels["conv"]) == pytest.approx(23.104)  # the median run's own kernels
    gemm = kernels["conv"][0]
    assert (gemm["grid"], gemm["block"], gemm["registers_per_thread"], gemm["shared_memory_bytes"]) == (
        [64, 1, 1], [128, 1, 1], 128, 81920)
    assert kernels["view"] == [] and kernels["copy"] == []  # a memcpy is GPU time, not a kernel
    assert kernels_by_op(fixture_trace(), ["relu"])["relu"] == [k for r in runs if r.op == "relu" for k in r.kernels]


def test_trace_categories_are_compared_case_insensitively():
    trace = fixture_trace()
    cats = {e["cat"] for e in trace["traceEvents"] if "cat" in e}
    assert any(c != c.lower() for c in cats)  # the fixture does mix letter cases
    expected = [(r.op, r.duration_us) for r in range_runs(trace)]
    for case in (str.lower, str.upper):
        for e in trace["traceEvents"]:
            if "cat" in e:
                e["cat"] = case(e["cat"])
        assert [(r.op, r.duration_us) for r in range_runs(trace)] == expected
    old_names = {"cuda_runtime": "Runtime", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset"}  # older Kineto's names
    for e in trace["traceEvents"]:
        e["cat"] = old_names.get(str(e.get("cat", "")).lower(), e.get("cat"))
    assert [(r.op, r.duration_us) for r in range_runs(trace)] == expected


def test_launches_recorded_under_another_thread_number_are_still_attributed():
    trace = fixture_trace()
    for e in trace["traceEvents"]:
        if str(e.get("cat", "")).lower() == "cuda_runtime":
            e["tid"] = 99  # no op range on that thread: every thread's ranges are searched
    latency, _ = latencies_from_runs(fixture_graph(), range_runs(trace))
    assert latency["conv"] == pytest.approx(0.023104) and latency["copy"] == pytest.approx(0.003008)


def test_an_op_with_flops_but_no_gpu_work_fails_loudly():
    runs = range_runs(fixture_trace())
    with pytest.raises(ProfileError, match=r"op 'view' \(t\.view, 1e\+03 FLOPs\) launched no GPU kernel.* 3 profiled"):
        latencies_from_runs(fixture_graph(view=1000.0), runs)
    graph = OpGraph([*fixture_graph().ops, Op("ghost")])
    with pytest.raises(ProfileError, match="no opweave::ghost range"):
        latencies_from_runs(graph, runs)


def test_profiler_ranges_on_a_real_cpu_trace():
    """torch.profiler on this machine (CPU only): every run of every op is one range, in order, with no GPU work,
    so the ops with FLOPs are refused as having launched nothing."""
    _, x, cap = branchy()
    with torch.no_grad():
        env = full_env(cap, x)
        runs = range_runs(trace_ops(cap, env, cap.graph.topo_order, 2, "cpu"))
    assert [r.op for r in runs] == [op for op in cap.graph.topo_order for _ in range(2)]
    assert all(r.work == [] for r in runs)
    with pytest.raises(ProfileError, match="launched no GPU kernel"):
        latencies_from_runs(cap.graph, runs)


REAL_TRACE = DATA / "googlenet-trace.json.gz"  # scripts/dump_trace.py on an H200, 2026-11-27 (docs/gpu.md)


def real_trace() -> tuple[dict, OpGraph]:
    with gzip.open(REAL_TRACE, "rt") as f:
        trace = json.load(f)
    meta = trace["opweave"]
    return trace, OpGraph([Op(op, target=meta["targets"][op], flops=meta["flops"][op]) for op in meta["ops"]])


def test_profiler_parsing_on_a_real_cuda_trace():
    """The H200's trace of GoogLeNet's 195 ops x 3 runs: as that run reported it, 269 kernels in the median runs,
    every op with GPU work, their GPU times summing to 0.714 ms; the largest a 3x3 convolution."""
    trace, graph = real_trace()
    runs = range_runs(trace)
    assert len(runs) == len(graph) * trace["opweave"]["repeats"] == 585
    latency, kernels = latencies_from_runs(graph, runs)
    assert all(latency[o.id] > 0 and kernels[o.id] for o in graph.ops if o.flops > 0)
    assert all(k["grid"] and k["block"] and k["duration_us"] > 0 for ks in kernels.values() for k in ks)
    assert sum(v > 0 for v in latency.values()) == 195 and sum(map(len, kernels.values())) == 269
    assert sum(latency.values()) == pytest.approx(0.714, abs=5e-4)
    assert max(latency, key=latency.get) == "inception4_4_branch2_1_conv"


@pytest.mark.parametrize("source", ["synthetic", "real"])
def test_categories_and_thread_numbers_do_not_change_what_is_attributed(source):
    """Kineto's category names in other letter cases or older spellings, and launches recorded under another thread
    number than their op's range, give the same per-op GPU times: on the synthetic fixture and on the real trace."""
    trace, graph = (fixture_trace(), fixture_graph()) if source == "synthetic" else real_trace()
    expected = latencies_from_runs(graph, range_runs(trace))[0]
    old_names = {"cuda_runtime": "Runtime", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset"}
    for e in trace["traceEvents"]:
        if "cat" in e:
            e["cat"] = old_names.get(str(e["cat"]).lower(), str(e["cat"]).upper())
        if str(e.get("cat", "")).lower() == "runtime":
            e["tid"] = 99  # no op range on that thread: every thread's ranges are searched
    assert latencies_from_runs(graph, range_runs(trace))[0] == pytest.approx(expected)


# ---- CUDA backend helpers --------------------------------------------------------------------------------------------


def test_lanes_must_get_distinct_cuda_streams():
    check_distinct_streams([("lane (0, 1)", 0x10), ("lane (0, 2)", 0x20), ("the capture stream", 0x30)])
    with pytest.raises(DeviceError, match=r"^lane \(0, 1\) and the capture stream got the same CUDA stream 0x10 "
                                          r".*streams=8\)$"):
        check_distinct_streams([("lane (0, 1)", 0x10), ("lane (0, 2)", 0x20), ("the capture stream", 0x10)])


def test_default_stream_cap_follows_cuda_device_max_connections(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert default_streams() == 8
    for value, expected in (("32", 32), ("4", 4), ("0", 8), ("many", 8), ("", 8)):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        assert default_streams() == expected


def test_input_signatures_need_no_pytree_walk_for_flat_arguments():
    cpu = torch.device("cpu")
    x, weight = torch.randn(2, 3), nn.Parameter(torch.randn(3))
    args = (x, weight, 4)
    key, leaves = input_signature(args, True, cpu)
    assert leaves is args  # flat: the arguments are the leaves
    assert key == ((None, (x.shape, x.dtype, cpu), (weight.shape, weight.dtype, cpu, weight.data_ptr()),
                    ("value", "4")))
    assert input_signature((torch.randn(2, 3), weight, 4), True, cpu)[0] == key  # new values, same signature
    assert input_signature((x, nn.Parameter(torch.randn(3)), 4), True, cpu)[0] != key  # another parameter
    assert input_signature((x, weight, 5), True, cpu)[0] != key
    # without graphs inputs are used in place: strides count
    t = torch.randn(3, 2).t()
    assert input_signature((t,), False, cpu)[0] != input_signature((t.contiguous(),), False, cpu)[0]
    assert input_signature((t,), True, cpu)[0] == input_signature((t.contiguous(),), True, cpu)[0]
    nested_key, nested = input_signature(([x], {"w": weight}), True, cpu)
    assert nested == [x, weight] and nested_key[0] is not None and nested_key[1:] == key[1:3]


def test_one_signature_serves_segments_too_strides_and_nesting_included():
    x = torch.randn(3, 2)
    key, leaves = signature([x, (x, 2), 1.5], strides=True)
    assert leaves == [x, x, 2, 1.5] and key[0] is not None
    assert key[1] == (x.shape, x.dtype, x.device, x.stride()) and key[3:] == (("value", "2"), ("value", "1.5"))
    assert signature([x.t().contiguous().t(), (x, 2), 1.5], strides=True)[0] != key  # same shape, other strides
    assert signature([x, [x, 2], 1.5], strides=True)[0] != key  # a list is not a tuple
    assert signature([x, (x, 3), 1.5], strides=True)[0] != key
    assert signature([torch.randn(3, 2), (x, 2), 1.5], strides=True)[0] == key  # values do not count


def test_bounded_cache_is_lru_and_calls_back_for_each_eviction():
    dropped = []
    cache = BoundedCache(2, lambda key, value: dropped.append((key, value)))
    cache["a"], cache["b"] = 1, 2
    assert cache["a"] == 1  # a read makes "a" the most recent
    cache["c"] = 3
    assert dropped == [("b", 2)] and set(cache) == {"a", "c"}
    assert "b" not in cache and cache.get("b", False) is False
    cache["c"] = 30  # a new value for a key it holds: nothing evicted
    assert dropped == [("b", 2)] and cache["c"] == 30
    cache.clear()  # dropping everything on purpose is no eviction
    assert dropped == [("b", 2)] and len(cache) == 0

    class Owner:
        def __init__(self):
            self.cache, self.evictions = BoundedCache(1, self.evicted), 0

        def evicted(self, key, value):
            self.evictions += 1

    owner = Owner()
    owner.cache["a"], owner.cache["b"] = 1, 2
    assert owner.evictions == 1
    gone = weakref.ref(owner)
    del owner
    assert gone() is None  # no cycle through the callback: freed without waiting for the garbage collector


def test_the_walker_dispatches_each_kind_and_releases_after_the_step():
    seen = []

    class Record(Walker):
        def launch(self, lane, op):
            seen.append(("launch", lane, op))

        def signal(self, lane, number):
            seen.append(("signal", lane, number))

        def wait(self, lane, number):
            seen.append(("wait", lane, number))

        def release(self, lane, keys):
            seen.append(("release", lane, keys))

    a, b = (0, 0), (0, 1)
    Record().run([(a, Step("launch", op="x", release=("k",))), (a, Step("signal", signal=0)),
                  (b, Step("wait", signal=0)), (b, Step("launch", op="y"))])
    assert seen == [("launch", a, "x"), ("release", a, ("k",)), ("signal", a, 0), ("wait", b, 0), ("launch", b, "y")]
    with pytest.raises(ValueError, match="unknown step kind 'jump'"):
        Record().run([(a, Step("jump"))])


def test_inputs_are_copied_into_the_static_buffers_and_parameters_used_in_place():
    cpu = torch.device("cpu")
    x, weight = torch.randn(2, 3), nn.Parameter(torch.randn(3))
    leaves = (x, weight, 4)
    static = [_static_copy(v, cpu) for v in leaves]
    assert static[0] is not x and static[1] is weight and static[2] == 4
    copies = InputCopies.plan(leaves, static, cpu)
    assert copies.device_positions == [0] and copies.host_positions == []
    new = torch.randn(2, 3)
    copies.copy_in((new, weight, 4))
    assert torch.equal(static[0], new)
    on_other_device = InputCopies.plan(leaves, static, torch.device("meta"))
    # a backend on another device: one copy_ each, the parameter too (it is not on the backend's device)
    assert on_other_device.host_positions == [0, 1] and on_other_device.device_positions == []


def test_capture_errors_name_the_op_in_one_line():
    _, _, cap = branchy()
    op = cap.graph.topo_order[1]
    err = str(capture_error(cap, op, CaptureError("branchy: op failed: RuntimeError: boom")))
    assert err.startswith(f"cannot record branchy into a CUDA graph: op {op!r} (")
    assert "failed: CaptureError: branchy: op failed: RuntimeError: boom" in err and "\n" not in err
    inner = RuntimeError("called a synchronizing CUDA operation")
    wrapped = CaptureError("branchy: op 'x' failed")
    wrapped.__cause__ = inner
    assert "synchronizes the CPU with the GPU" in str(capture_error(cap, op, wrapped, sync=True))
    assert "a step outside the ops" in str(capture_error(cap, None, ValueError("bad input")))
    assert err.endswith("pass capture_fallback='eager' or cudagraphs=False to run it without a graph")
    during = str(capture_error(cap, None, RuntimeError("CUDA error: operation failed due to a previous error"),
                               where="ending the capture", during_capture=True))
    assert "ending the capture failed: RuntimeError: CUDA error: operation failed due to a previous error" in during
    assert "capture_fallback='eager'" not in during and "is never run eagerly" in during


# ---- the GPU benchmark's parts that need no GPU ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert_base", "deepfm", "squeezenet"])
def test_fresh_benchmark_inputs_differ_and_stay_valid(name):
    from opweave import zoo

    gl = gpu_latency()
    model, inputs = zoo.create(name, **({"num_layers": 1} if name == "bert_base" else {}))
    fresh = gl.fresh_inputs(inputs, seed=1)
    assert [(f.shape, f.dtype, f.device) for f in fresh] == [(x.shape, x.dtype, x.device) for x in inputs]
    assert all(not torch.equal(f, x) for f, x in zip(fresh, inputs, strict=True))
    for f, x in zip(fresh, inputs, strict=True):
        if not x.is_floating_point():  # token ids, embedding indices: within the example's range
            assert x.min() <= f.min() and f.max() <= x.max()
    with torch.no_grad():
        out = model(*fresh)  # an index out of range would raise here
    assert torch.isfinite(out).all()
    assert all(torch.equal(a, b) for a, b in zip(gl.fresh_inputs(inputs, seed=1), fresh, strict=True))
    half = gl.fresh_inputs(tuple(x.half() if x.is_floating_point() else x for x in inputs), seed=2)
    assert all(f.dtype == (torch.float16 if x.is_floating_point() else x.dtype) for f, x in zip(half, inputs,
                                                                                                  strict=True))


def test_benchmark_keeps_why_a_max_autotune_candidate_was_left_out():
    """A candidate that failed to build or differed from the model has no median; its row keeps the reason (an
    H200 run timed no torch.compile candidate and the figures said nothing of why)."""
    from types import SimpleNamespace

    choice = {"label": "heft x4", "cached": False, "candidates": {
        "torch.compile": {"error": "RuntimeError: boom"},
        "opara x8": {"build_s": 0.3, "ok": False, "wrong": "output 0 differs by up to 1"},
        "heft x4": {"build_s": 0.2, "ok": True, "median_ms": 1.0}}}
    fast = SimpleNamespace(choice=choice, schedule=SimpleNamespace(scheduler="heft", streams_used=4),
                           plan=SimpleNamespace(syncs=3), graph=[1, 2])
    figures = gpu_latency().chosen_figures(fast)
    assert figures["candidates_ms"] == {"heft x4": 1.0} and figures["choice"] == "heft x4"
    assert figures["candidates"]["torch.compile"] == {"error": "RuntimeError: boom"}
    assert figures["candidates"]["opara x8"]["wrong"] == "output 0 differs by up to 1"


def test_benchmark_measures_the_configurations_named_or_every_combination():
    gl = gpu_latency()
    every = gl.configurations(gl.parse_args([]), ["a", "b"], [1, 8], ["fp32"])
    assert every == [("a", 1, "fp32"), ("a", 8, "fp32"), ("b", 1, "fp32"), ("b", 8, "fp32")]
    named = gl.parse_args(["--configs", "randwire:8:fp16, nasnet_a_mobile:1:fp32"])
    assert gl.configurations(named, ["a"], [1], ["fp32"]) == [("randwire", 8, "fp16"), ("nasnet_a_mobile", 1, "fp32")]
    with pytest.raises(SystemExit, match="model:batch:dtype"):
        gl.configurations(gl.parse_args(["--configs", "randwire:8:bf16"]), [], [], [])


def test_benchmark_fuses_two_schedulers_when_quick_and_those_named_otherwise():
    gl = gpu_latency()
    scheds = ["sequential", "lios", "opara", "nimble"]
    assert gl.fuse_schedulers(gl.parse_args(["--quick"]), scheds) == ["lios", "opara"]
    assert gl.fuse_schedulers(gl.parse_args([]), scheds) == scheds
    assert gl.fuse_schedulers(gl.parse_args(["--quick", "--fuse-schedulers", "nimble"]), scheds) == ["nimble"]
    assert gl.fuse_schedulers(gl.parse_args(["--fuse-schedulers", "none"]), scheds) == []


def test_benchmark_summary_table_and_json(tmp_path):
    from rich.console import Console

    gl = gpu_latency()
    import _common as common

    base = {"model": "googlenet", "batch_size": 1, "dtype": "fp32"}

    def row(mode, ms, ok=True, peak=100.0, **extra):
        return {**base, "mode": mode, "median_ms": ms, "ok": ok, "peak_memory_mb": peak, "max_abs_diff": 0.0 if ok
                else 0.5, **extra}

    rows = [row("eager", 3.0), row("cuda-graph", 1.5, peak=80.0), row("torch.compile", 1.2),
            row("opweave lios", 1.0, peak=120.0, scheduler="lios", streams=4, syncs=9, costs="profile"),
            row("opweave opara", 0.5, ok=False, scheduler="opara", streams=8, syncs=20, costs="profile"),
            {**base, "mode": "opweave ios", "scheduler": "ios", "error": "scheduling timed out", "costs": "profile"},
            row("opweave lios+inductor", 0.8, peak=90.0, scheduler="lios", fuse="inductor", kernels_per_call=41.0),
            row("opweave opara+inductor", 0.4, ok=False, scheduler="opara", fuse="inductor")]
    summary = gl.summarize(rows)
    assert summary["best_scheduler"] == "lios"  # unfused: opara is faster but wrong, lios+inductor is fused
    assert summary["best_ms"] == 1.0
    assert summary["speedup_vs_cuda_graph"] == pytest.approx(1.5)
    assert summary["speedup_vs_torch_compile"] == pytest.approx(1.2)
    assert summary["peak_memory_vs_cuda_graph"] == pytest.approx(1.5)
    assert summary["inductor_scheduler"] == "lios" and summary["inductor_ms"] == 0.8  # opara+inductor is wrong
    assert summary["inductor_speedup_vs_cuda_graph"] == pytest.approx(1.875)
    assert summary["inductor_speedup_vs_torch_compile"] == pytest.approx(1.5)
    assert summary["inductor_peak_memory_vs_cuda_graph"] == pytest.approx(90 / 80)
    assert not summary["all_outputs_ok"] and summary["failed_modes"] == ["opweave ios"]
    assert gl.summarize(rows[:6])["inductor_scheduler"] is None  # no +inductor mode measured
    date = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    data = gl.results_document("NVIDIA H100 80GB HBM3", "2.11.0", "12.8", date, {"python": "3.11"}, {"replays": 200})
    gl.add_configuration(data, rows)
    gl.add_configuration(data, [{**base, "mode": "build", "error": "MissingPackageError: torchvision"}])
    path = gl.result_path(tmp_path, data["device"], date)
    assert path.name == "nvidia-h100-80gb-hbm3-2025-01-02.json"
    common.write_json(path, data)
    assert json.loads(path.read_text()) == data and len(data["summaries"]) == 1 and len(data["results"]) == 9
    console = Console(record=True, width=200)
    console.print(gl.speedup_table("googlenet", 1, "fp32", rows, common))
    text = console.export_text()
    assert "WRONG (5.0e-01)" in text and "1.50x" in text and "scheduling timed out" in text and "profile" in text
    fused_line = next(line for line in text.splitlines() if "opweave lios+inductor" in line)
    assert [c.strip() for c in fused_line.strip().strip("│").split("│")][4] == "41"  # kernels/call


def test_docs_gpu_shows_the_committed_results_as_they_are():
    """docs/gpu.md carries the committed GPU results' tables as gpu_latency.markdown renders them, and it and the
    README the batch 1 fp32 run's summary as gpu_latency.summary_markdown renders it."""
    doc = (BENCHMARKS.parent / "docs" / "gpu.md").read_text()
    second = ("gpu_latency_h200_2026-11-28_b1_fp32.json", "gpu_latency_h200_2026-11-28_lease3.json",
              "gpu_latency_h200_2026-11-28_b1_fp16.json", "gpu_latency_h200_2026-11-28_b8_fp16.json",
              "gpu_latency_h200_2026-11-28_b8_fp32.json")
    for name in ("gpu_latency_h200_b1_fp32.json", "gpu_latency_h200_googlenet_fused.json", *second):
        data = json.loads((BENCHMARKS / "results" / name).read_text())
        assert gpu_latency().markdown(data) in doc, f"docs/gpu.md: the tables of {name} are out of date"
    chosen = gpu_latency().chosen_markdown([json.loads((BENCHMARKS / "results" / n).read_text()) for n in second])
    for doc_name in ("docs/gpu.md", "README.md"):
        assert chosen in (BENCHMARKS.parent / doc_name).read_text(), f"{doc_name}: what opweave chose is out of date"
    data = json.loads((BENCHMARKS / "results" / "gpu_latency_h200_b1_fp32.json").read_text())
    summary = gpu_latency().summary_markdown(data)
    assert summary.count("\n") == 2 + len(data["summaries"]) == 6
    for doc_name in ("docs/gpu.md", "README.md"):
        text = (BENCHMARKS.parent / doc_name).read_text()
        assert summary in text, f"{doc_name}: the summary of the H200 run is out of date"


def test_benchmark_counts_the_weights_a_compiled_model_copies():
    """The default's memory on an H200, less the 66 MB of cuBLAS workspaces, was GoogLeNet's and Inception-v3's
    folded weights (28 and 94 MB held at batch 8 fp32, against 23 and 83 MB of copies counted here at full size):
    coarsening folds each BatchNorm into a copy of its convolution, which the benchmark's memory figures counted
    against modes that read the model's own weights. Each mode's copies are now a figure of their own."""
    from opweave.testing.fakecuda import FakeCuda

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(1, 3, 8, 8)
    runtime = FakeCuda(seed=9)
    folded = opweave.compile(model, (x,), device="cuda", runtime=runtime)
    conv = model[0]
    copied = (conv.weight.numel() + conv.out_channels) * 4  # the folded weight and its new bias
    assert gpu_latency().weight_copies_mb(folded, model) == copied / 2**20
    unfolded = opweave.compile(model, (x,), device="cuda", runtime=runtime, coarsen=False)
    assert gpu_latency().weight_copies_mb(unfolded, model) == 0.0
    assert gpu_latency().weight_copies_mb(lambda *args: args, model) is None  # no captured module: not known


def test_benchmark_tables_show_the_weight_copies_where_they_were_measured():
    gl = gpu_latency()
    base = {"model": "googlenet", "batch_size": 8, "dtype": "fp32", "ok": True, "p10_ms": 1.0, "p90_ms": 1.0}
    rows = [{**base, "mode": "cuda-graph", "median_ms": 1.0, "peak_memory_mb": 10.0},
            {**base, "mode": "opweave default", "median_ms": 0.5, "peak_memory_mb": 40.0, "weight_copies_mb": 22.8}]
    text = gl.markdown({"results": rows})
    assert "| peak MB | of it weight copies MB | output |" in text
    assert "| cuda-graph | 1.000 (1.000-1.000) | 1.00x | - |  |  |  | 10.0 |  | ok |" in text
    assert "| 40.0 | 22.8 | ok |" in text
    assert "weight copies" not in gl.markdown({"results": [{k: v for k, v in r.items() if k != "weight_copies_mb"}
                                                          for r in rows]})  # results from before: as they were


def test_every_capture_moved_to_a_device_shares_its_copies_of_the_weights():
    """A model compiled for another device than its own is copied there; each new input signature (captured again)
    made a copy of its own (a CPU model compiled for CUDA that met four shapes held four copies on the GPU). The
    copies there are now shared, made again only when the model's weights change. (The meta device stands in for a
    GPU.)"""
    from opweave.capture import capture

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    meta = torch.device("meta")
    first, second = (on_device(capture(model, (torch.randn(b, 4),)), meta) for b in (1, 3))
    weights = [dict(c.gm.named_parameters()) for c in (first, second)]
    assert weights[0].keys() == weights[1].keys() and all(p.device == meta for p in weights[0].values())
    assert all(weights[0][k] is weights[1][k] for k in weights[0])  # one copy on the device
    assert all(isinstance(p, nn.Parameter) for p in weights[0].values())
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model itself left where it is
    with torch.no_grad():
        model[0].weight.add_(1)  # changed in place: moved again
    third = on_device(capture(model, (torch.randn(2, 4),)), meta)
    assert dict(third.gm.named_parameters())["0.weight"] is not weights[0]["0.weight"]
    assert dict(third.gm.named_parameters())["2.weight"] is weights[0]["2.weight"]
    model.half().float()  # new storages (of rounded values): moved again
    fourth = on_device(capture(model, (torch.randn(2, 4),)), meta)
    assert dict(fourth.gm.named_parameters())["2.weight"] is not weights[0]["2.weight"]


def test_moving_a_captured_model_leaves_its_parameters_swappable():
    """Module.to swaps parameters where torch.__future__ says so (torch.utils.swap_tensors), which refuses a tensor
    that has weak references: the copies moved to a device are known by state, not by weak references to the
    model's parameters."""
    from opweave.capture import capture

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval()
    on_device(capture(model, (torch.randn(1, 4),)), torch.device("meta"))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert model[0].weight.dtype == torch.float64


def test_a_tensor_without_a_storage_of_its_own_is_moved_every_time_not_refused():
    from opweave.backends.cuda import moved
    from opweave.capture.runtime import tensor_state

    sparse = torch.randn(3, 3).to_sparse()
    assert tensor_state(sparse) is None
    first, second = moved(sparse, torch.device("meta")), moved(sparse, torch.device("meta"))
    assert first is not second and first.device.type == "meta" and first.is_sparse
