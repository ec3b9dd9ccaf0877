"""The CUDA backend's parts that run without a GPU: the one-line error, the join-aware liveness analysis, buffer
aliasing, and the profiler's CPU path (round trip, key check, costs)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import opweave
from dags import dags
from opweave import costs as costs_mod
from opweave import schedulers
from opweave.api import plan_for
from opweave.backends.cuda import CudaBackend, on_device, release_keys, require_cuda, storage_buffers
from opweave.backends.liveness import Buffer, launch_positions, release_points, steps_with_releases
from opweave.backends.program import Program
from opweave.capture import capture
from opweave.costs.profile import Profile, ProfileKeyError, profile_key, profile_model
from opweave.costs.profile.kineto import kernels_by_op
from opweave.costs.profile.occupancy import occupancy, op_demand
from opweave.costs.roofline import estimate
from opweave.ir import OpGraph
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


def run_with_releases(cap, plan, inputs):
    """A keep-all run, the storage groups and their release points, then a run that drops each group's env keys
    right after its release step (in issue order, as the CUDA interpreter does). Returns (output, groups, dropped)."""
    program = Program.from_plan(plan)
    with torch.no_grad():
        env = keep_all_run(cap, program, inputs)
        groups = storage_buffers(cap, env, program)
        releases = release_keys(cap, env, program)
        env, dropped = cap.bind(inputs), 0
        for _, step, released in steps_with_releases(program, releases):
            if step.kind == "launch":
                cap.run_op(step.op, env)  # a KeyError here would be a read of a released buffer
            for k in released:
                del env[k]
                dropped += 1
        return cap.output(env), groups, dropped


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
    with pytest.raises(RuntimeError, match=r"^CUDA is not available: .*use device='cpu'$") as info:
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
                            capture_output=True, text=True, timeout=120, cwd=root)
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
