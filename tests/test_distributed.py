"""The distributed backend (backends/distributed): one rank process per device, gloo point-to-point on CPU.

Rank processes start from a forkserver: the first test that starts ranks pays for the server's torch import, the
others start ranks in about a second. Every test that starts ranks closes them and checks none is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn

from dags import dags
from opweave import zoo
from opweave.backends.distributed import DistributedBackend, held_bytes, split, wire
from opweave.capture import capture
from opweave.costs.links import Link
from opweave.costs.roofline import estimate
from opweave.errors import PlanError, RankError, UsageError
from opweave.ir.graph import OpGraph
from opweave.outputs import compare
from opweave.pipeline import Options, build, plan_for, resolve
from opweave.pipeline.targets import RanksTarget
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule

FREE = Link("free", 0.0, 1e6)  # transfers cost nothing: HIOS spreads ops over every device it may use
SMALL = {"inception_v3": {"image_size": 75}, "googlenet": {"image_size": 64}, "squeezenet": {"image_size": 64},
         "resnet50": {"image_size": 64}, "nasnet_a_mobile": {"image_size": 64}, "randwire": {"image_size": 64},
         "bert_base": {"num_layers": 2, "seq_len": 16}, "deepfm": {}}
_CAPTURED: dict = {}


def captured_model(name: str):
    if name not in _CAPTURED:
        model, inputs = zoo.create(name, **SMALL[name])
        with torch.inference_mode():
            reference = model(*inputs)
        _CAPTURED[name] = (model, inputs, capture(model, inputs, name=name), reference)
    return _CAPTURED[name]


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], within_s: float = 15.0) -> list[int]:
    """The pids still alive after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def call_within(backend, args, seconds: float):
    """``backend(*args)`` in a thread; fails the test (after stopping the ranks) if it does not return in time."""
    result: dict = {}

    def target():
        try:
            result["value"] = backend(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        backend.close()
        pytest.fail(f"the call did not return within {seconds} s (deadlock?)")
    result["seconds"] = time.monotonic() - start
    return result


# ---- plain data: split, wire, without processes -------------------------------------------------------------------


def test_split_gives_each_rank_its_ops_messages_and_parameters():
    model, inputs, cap, _ = captured_model("googlenet")
    costs = replace(estimate(cap.graph, "cpu"), edge_transfer_ms={})
    sched, plan = plan_for(cap.graph, costs, "hios-lp", devices=3)
    parts = split(cap, plan, 3)
    assert sched.devices_used > 1
    assert sorted(op for p in parts for op in p.ops) == sorted(cap.graph.ids)
    sends = [i for i, ins in enumerate(plan.instrs) if ins.kind == "send"]
    messages = {m.index: m for p in parts for m in p.messages}
    assert sorted(messages) == sends  # one message per send instruction, both endpoints agree on it
    assert sorted(t for m in messages.values() for t in range(m.tag, m.tag + len(m.sizes))) == list(
        range(sum(len(m.sizes) for m in messages.values())))  # tags are unique
    for part in parts:
        indices = [m.index for m in part.messages]
        assert indices == sorted(indices)  # a rank posts its messages in plan order
        for m in part.messages:
            assert part.rank in (m.src, m.dst) and m.src != m.dst
            assert all(k in {n.name for n in cap.nodes[m.op]} for k in m.keys)
    # every parameter is real on exactly one rank (meta on the others): the ranks' GraphModules add up to the model
    held = [held_bytes(fx.GraphModule(p.root, p.fx_graph)) for p in parts]
    assert sum(held) == held_bytes(model) and max(held) < held_bytes(model)
    # the input goes to the ranks whose ops read it, only
    readers = {sched.device(op) for op in cap.graph.ids
               if any(a.op == "placeholder" for n in cap.nodes[op] for a in n.all_input_nodes)}
    assert {p.rank for p in parts if "x" in p.inputs} == readers


def test_split_refuses_a_device_outside_the_ranks():
    _, _, cap, _ = captured_model("squeezenet")
    sched, plan = plan_for(cap.graph, replace(estimate(cap.graph, "cpu"), edge_transfer_ms={}), "hios-lp", devices=2)
    assert sched.devices_used == 2
    with pytest.raises(PlanError, match="device 1, but there are only 1 ranks"):
        split(cap, plan, 1)


class _InPlaceAcrossViews(nn.Module):
    def forward(self, x):
        y = x * 2
        v = y.view(-1)
        y.add_(1)  # stays in place: its alias v is read later
        return v + 3, y * 5


def test_split_refuses_an_in_place_write_seen_on_another_device():
    x = torch.randn(2, 3)
    cap = capture(_InPlaceAcrossViews(), (x,))
    writer = next(op for op in cap.graph.ids if op.startswith("add_"))
    order = cap.graph.topo_order
    reader = next(op for op in order if op not in ("mul", writer))
    device_of = {op: (1 if op == reader else 0) for op in order}
    sched = Schedule("hand", order, {op: 0 for op in order}, device_of)
    plan = lower(cap.graph, sched)
    validate(cap.graph, plan, sched)
    with pytest.raises(PlanError, match="in place"):
        split(cap, plan, 2)


def test_wire_round_trip_of_values_and_operator_overloads():
    layouts = {
        "f32": (torch.randn(3, 4), None), "bool": (torch.rand(5) > 0.5, None), "half": (torch.randn(2, 2).half(), None),
        "int": (torch.arange(6).reshape(2, 3), None), "scalar0d": (torch.tensor(3.5), None),
        "empty": (torch.empty(0, 4), None),
    }
    for name, (value, _) in layouts.items():
        layout = wire.TensorLayout(tuple(value.shape), value.dtype)
        parts = wire.pack(value, layout, name)
        assert [p.numel() for p in parts] == list(wire.part_sizes([layout]))
        back = wire.unpack(iter(p.clone() for p in parts), layout)
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value), name
    nested = wire.Sequence(tuple, (wire.TensorLayout((2,), torch.float32), wire.ScalarLayout(int),
                                   wire.Mapping((("k", wire.ScalarLayout(float)),)), wire.Constant("c")))
    value = (torch.ones(2), 7, {"k": 0.25}, "c")
    assert wire.unpack(iter(wire.pack(value, nested, "nested")), nested)[1:] == (7, {"k": 0.25}, "c")
    with pytest.raises(RuntimeError, match="captured as"):
        wire.pack(torch.ones(3), wire.TensorLayout((2,), torch.float32), "op 'x'")
    assert wire.loads(wire.dumps([torch.ops.aten.linear.default, torch.ops.aten.relu])) == [
        torch.ops.aten.linear.default, torch.ops.aten.relu]


# ---- rank processes -----------------------------------------------------------------------------------------------


def test_two_lanes_of_a_rank_reading_one_message():
    """Regression: a gloo receive's wait() consumes its completion; two lanes waiting for one message blocked the
    second lane forever (the call then hung until the process-group timeout)."""

    class Fan(nn.Module):
        def forward(self, x):
            u = torch.tanh(x)
            return torch.sin(u), torch.cos(u)

    x = torch.randn(4, 4)
    cap = capture(Fan(), (x,))
    u, a, b = cap.graph.topo_order
    sched = Schedule("hand", [u, a, b], {u: 0, a: 0, b: 1}, {u: 0, a: 1, b: 1})
    plan = lower(cap.graph, sched)
    validate(cap.graph, plan, sched)
    recvs = [ins for ins in plan.instrs if ins.kind == "recv"]
    assert len(recvs) == 2 and {r.stream for r in recvs} == {0, 1}  # two lanes of rank 1 receive the same send
    with DistributedBackend(cap, plan, world=2, timeout_s=20) as backend:
        result = call_within(backend, (x,), 60)
        assert "error" not in result, result.get("error")
        expected = Fan()(x)
        assert all(torch.equal(e, g) for e, g in zip(expected, result["value"], strict=True))
        pids = backend.pids
        assert backend.stats == {"calls": 1}
    assert wait_gone(pids) == []
    with pytest.raises(UsageError, match="closed"):  # was an OSError ("handle is closed") from a pipe
        backend(x)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_zoo_models_on_2_and_4_ranks_equal_eager(name):
    model, inputs, cap, reference = captured_model(name)
    for world in (2, 4):
        for scheduler in ("hios-lp", "hios-mr"):
            with ranks(cap, scheduler=scheduler, devices=world, link=FREE, timeout_s=60) as fast:
                got = fast(*inputs)
                again = fast(*inputs)  # persistent ranks: a second call on the same processes
                infos, pids = fast.backend.info, fast.backend.pids
            assert torch.allclose(got, reference, rtol=1e-4, atol=1e-5) if isinstance(got, torch.Tensor) else \
                compare(reference, got).max_diff < 1e-4, (world, scheduler)
            assert compare(got, again).max_diff == 0.0
            assert fast.schedule.devices_used >= 2 and sum(i["messages"] for i in infos) > 0
            assert wait_gone(pids) == []


def test_parameter_bytes_of_the_ranks_add_up_to_the_model():
    model, inputs, cap, reference = captured_model("googlenet")
    total = held_bytes(model)
    with ranks(cap, scheduler="hios-lp", devices=4, link=FREE, timeout_s=60) as fast:
        held = [info["param_bytes"] for info in fast.backend.info]
        assert compare(reference, fast(*inputs)).max_diff < 1e-4
        pids = fast.backend.pids
    assert fast.schedule.devices_used >= 2
    assert sum(held) == total
    assert max(held) < total and sum(h > 0 for h in held) >= 2
    assert wait_gone(pids) == []


class _DagModel(nn.Module):
    """A model shaped like an operator DAG: each op adds its predecessors' outputs (or takes the input) and applies
    a scaled tanh; the output adds the sinks."""

    def __init__(self, graph: OpGraph):
        super().__init__()
        self.order = graph.topo_order
        self.preds = {op: list(graph.preds[op]) for op in self.order}
        self.scale = {op: 0.5 + 0.01 * i for i, op in enumerate(self.order)}
        self.sinks = [op for op in self.order if not graph.succs[op]]

    def forward(self, x):
        values = {}
        for op in self.order:
            inputs = [values[p] for p in self.preds[op]] or [x]
            y = inputs[0]
            for other in inputs[1:]:
                y = y + other
            values[op] = torch.tanh(y * self.scale[op])
        out = values[self.sinks[0]]
        for op in self.sinks[1:]:
            out = out + values[op]
        return out


@st.composite
def random_placement(draw, graph: OpGraph, devices: int) -> Schedule:
    """Any device and stream per op, in a random topological order."""
    priority = {op: draw(st.integers(0, 1000)) for op in graph.ids}
    indegree = {op: len(graph.preds[op]) for op in graph.ids}
    ready = [op for op in graph.ids if not indegree[op]]
    order = []
    while ready:
        op = min(ready, key=lambda o: (priority[o], graph.index[o]))
        ready.remove(op)
        order.append(op)
        for s in graph.succs[op]:
            indegree[s] -= 1
            if not indegree[s]:
                ready.append(s)
    return Schedule("random", order, {op: draw(st.integers(0, 2)) for op in order},
                    {op: draw(st.integers(0, devices - 1)) for op in order})


@pytest.mark.slow
@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(dag=dags(max_ops=14, min_ops=2), devices=st.integers(2, 4), how=st.sampled_from(["hios-lp", "hios-mr",
                                                                                       "random"]), data=st.data())
def test_random_multi_device_plans_finish_and_equal_eager(dag, devices, how, data):
    """Deadlock-freedom on random plans: every call returns within a timeout with eager's values."""
    model = _DagModel(dag)
    x = torch.randn(8, 8)
    cap = capture(model, (x,))
    if how == "random":
        sched = data.draw(random_placement(cap.graph, devices))
        plan = lower(cap.graph, sched)
        validate(cap.graph, plan, sched)
    else:
        options = Options(scheduler=how, devices=min(devices, len(cap.graph)), link=FREE)
        _, sched, plan = RanksTarget().plan(cap, (), options)
    with DistributedBackend(cap, plan, world=devices, timeout_s=30) as backend:
        for _ in range(2):
            result = call_within(backend, (x,), 90)
            assert "error" not in result, result.get("error")
            assert torch.allclose(result["value"], model(x), rtol=1e-5, atol=1e-6)
        pids = backend.pids
    assert wait_gone(pids) == []


class _TwoHeavyBranches(nn.Module):
    def forward(self, x):
        a, b = x, x * 0.5
        for _ in range(8):
            a = torch.tanh(a @ a)
            b = torch.tanh(b @ b)
        return a + b


def test_a_killed_rank_ends_the_run_with_an_error_naming_it():
    x = torch.randn(768, 768) / 30
    cap = capture(_TwoHeavyBranches(), (x,))
    _, sched, plan = RanksTarget().plan(cap, (), Options(scheduler="hios-lp", devices=2, link=FREE))
    assert sched.devices_used == 2
    backend = DistributedBackend(cap, plan, world=2, timeout_s=120)
    pids = backend.pids
    try:
        assert backend.info[1]["ops"] > 0
        backend(x)  # warm: the next call is a mid-run kill, not a start-up one
        # rank 1 is killed once rank 0 has been sent the call, before its own share is sent: the kill always lands
        # mid-call, with rank 0 working on it (a timer a third of a warm call in could come after the whole call on
        # a loaded machine)
        send = backend.ranks.send

        def kill_rank_1_then_send(rank, message):
            if rank == 1 and message[0] == "run":
                os.kill(pids[1], signal.SIGKILL)
            send(rank, message)

        backend.ranks.send = kill_rank_1_then_send
        result = call_within(backend, (x,), 60)
    finally:
        backend.close()
    assert isinstance(result.get("error"), RankError), result
    message = str(result["error"])
    assert "rank 1" in message and "SIGKILL" in message and "\n" not in message
    assert result["seconds"] < 30, f"the killed rank was reported after {result['seconds']:.1f} s, not at once"
    assert wait_gone(pids) == []
    with pytest.raises(RankError, match="rank 1"):  # the backend stays stopped
        backend(x)


def test_a_rank_that_raises_ends_the_run_with_an_error_naming_rank_and_op():
    model, inputs, cap, _ = captured_model("deepfm")
    with ranks(cap, scheduler="hios-mr", devices=2, link=FREE, timeout_s=60) as fast:
        pids = fast.backend.pids
        sparse, dense = inputs
        result = call_within(fast.backend, (sparse + 10 ** 6, dense), 60)  # ids out of every embedding's range
    error = result.get("error")
    assert isinstance(error, RankError), result
    embedding_ranks = {fast.schedule.device(op) for op in cap.graph.ids
                       if "embedding" in (cap.graph.op[op].target or "").lower()}
    assert any(f"rank {r} failed: CaptureError" in str(error) for r in embedding_ranks), str(error)
    assert "op '" in str(error) and result["seconds"] < 30
    assert wait_gone(pids) == []


def ranks(cap, device: str = "cpu", **options):
    """``cap`` built for rank processes (``devices > 1``), as ``opweave.compile(..., devices=N)`` builds it."""
    return build(cap, cap.example_inputs, resolve(device, coarsen=False, **options))


def test_too_many_devices_and_a_single_device_scheduler_fail_with_one_line():
    _, _, cap, _ = captured_model("squeezenet")
    with pytest.raises(UsageError, match=f"more than the graph's {len(cap.graph)} ops"):
        RanksTarget().plan(cap, (), Options(devices=len(cap.graph) + 1))
    with pytest.raises(UsageError, match="places every op on one device"):
        resolve("cpu", scheduler="lios", devices=2)


@pytest.mark.slow
def test_no_rank_outlives_a_caller_that_crashes(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch
        import opweave
        from opweave import zoo
        if __name__ == "__main__":
            model, inputs = zoo.create("squeezenet", image_size=64)
            fast = opweave.compile(model, inputs, scheduler="hios-lp", devices=2)
            fast(*inputs)
            print(" ".join(map(str, fast.backend.pids)), flush=True)
            os.kill(os.getpid(), int(sys.argv[1]))  # no atexit, no finalizers
    """))
    for how in (signal.SIGKILL, signal.SIGSEGV):
        proc = subprocess.run([sys.executable, str(script), str(int(how))], capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == -how, proc.stderr[-2000:]
        pids = [int(p) for p in proc.stdout.split()]
        assert len(pids) == 2
        assert wait_gone(pids) == [], f"rank processes left after the caller died of {how.name}"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("scheduler", ["hios-lp", "hios-mr"])
def test_nccl_ranks_on_two_gpus_equal_eager(scheduler):
    model, inputs, cap, reference = captured_model("googlenet")
    with ranks(cap, scheduler=scheduler, devices=2, device="cuda", link=FREE, timeout_s=120) as fast:
        got = fast(*inputs)
        pids = fast.backend.pids
    assert fast.schedule.devices_used == 2
    assert compare(reference, got).max_diff < 1e-3  # TF32 convolutions on the GPUs
    assert wait_gone(pids) == []
