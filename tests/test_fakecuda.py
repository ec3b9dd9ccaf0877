"""The fake CUDA runtime (:mod:`opweave.testing.fakecuda`): what it models, and that the CUDA backend's ordering
bugs give wrong outputs on it.

The runtime: work runs only when observed, in an order that respects each stream's FIFO order and the waits (a wait
pairs with the latest record issued before it), different per seed and the same for one seed; streams from a
round-robin pool of 32 per priority; memory statistics; a dropped block reused by its own stream's later work; CUDA
graphs (recorded not run, replayed into the same tensors, refused when a side stream is not joined back, invalidated
by a sync); sync-debug mode; the seed from the environment.

The backend on it: a valid plan gives the right output in every interleaving tried, and the same plan with one
``wait`` skipped by the lanes (every wait of three schedules of a small branchy model, and one of squeezenet's) or
with one buffer released too early (right after the op that made it, or after the record its reader waits for but
before that reader is done) gives a wrong output for some of a fixed list of seeds, with and without CUDA graphs.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from opweave import zoo
from opweave.backends import cuda as cuda_backend
from opweave.backends.cuda import CudaBackend
from opweave.backends.program import Program
from opweave.backends.streams import TORCH_POOL, CudaLanes
from opweave.capture import capture, coarsen
from opweave.costs.roofline import estimate
from opweave.errors import PlanError
from opweave.outputs import compare
from opweave.pipeline import plan_for
from opweave.plan import lifetimes
from opweave.testing.fakecuda import SEED_ENV, FakeCuda, default_seed

SEEDS = range(32)  # where a bug may or may not show in one interleaving: the seeds tried, in order


def issue(fake: FakeCuda, stream, fn, *args):
    """``fn(*args)`` issued on ``stream`` (made current for it)."""
    with fake.stream(stream):
        return fake.launch(stream, fn, *args)


def outcomes(run) -> set:
    """What ``run(fake)`` returns over :data:`SEEDS`, each on a new runtime."""
    return {run(FakeCuda(seed)) for seed in SEEDS}


def unordered_read(fake: FakeCuda) -> str:
    """A producer on one stream and a reader on another with no wait between them."""
    a, b = fake.Stream(), fake.Stream()
    y = issue(fake, a, lambda: torch.arange(4.0) + 1)
    z = issue(fake, b, lambda: y * 2)
    fake.synchronize()
    return "garbage" if torch.isnan(z).any() else "right" if torch.equal(z, torch.arange(4.0) * 2 + 2) else "?"


# ---- the runtime ---------------------------------------------------------------------------------------------------


def test_work_runs_when_observed_and_a_wait_orders_it_after_its_record():
    fake = FakeCuda(seed=0)
    a, b = fake.Stream(), fake.Stream()
    x = torch.arange(4.0)
    y = issue(fake, a, lambda: x + 1)
    assert torch.isnan(y).all() and fake.stats["kernels"] == 0  # allocated now, computed later
    b.wait_event(a.record_event())
    z = issue(fake, b, lambda: y * 2)
    b.synchronize()
    assert torch.equal(z, (x + 1) * 2) and a.query() and b.query()


def test_without_a_wait_the_order_differs_between_seeds_and_not_within_one():
    assert outcomes(unordered_read) == {"right", "garbage"}
    assert {unordered_read(FakeCuda(seed=5)) for _ in range(3)} == {unordered_read(FakeCuda(seed=5))}


def test_a_wait_pairs_with_the_latest_record_issued_before_it():
    def run(fake: FakeCuda) -> float:
        a, b = fake.Stream(), fake.Stream()
        x = torch.zeros(1)
        event = fake.Event()
        issue(fake, a, x.fill_, 1.0)
        event.record(a)
        b.wait_event(event)  # pairs with this record, not the next one
        issue(fake, a, x.fill_, 2.0)
        event.record(a)
        seen = issue(fake, b, x.clone)
        fake.synchronize()
        return seen.item()

    assert outcomes(run) == {1.0, 2.0}  # never 0: the wait held b until the first fill


def test_streams_come_round_robin_from_a_pool_of_32_per_priority():
    fake = FakeCuda(seed=0)
    streams = [fake.Stream() for _ in range(TORCH_POOL + 1)]
    assert len({s.cuda_stream for s in streams}) == TORCH_POOL and streams[TORCH_POOL] == streams[0]
    assert fake.Stream(priority=-1) not in streams
    assert fake.current_stream().cuda_stream == 0 and fake.current_stream() not in streams
    with fake.stream(streams[3]):
        assert fake.current_stream() == streams[3]
    assert fake.current_stream().cuda_stream == 0
    with pytest.raises(RuntimeError, match="while .* is current"):
        fake.launch(streams[1], torch.ones, 2)


def test_memory_statistics_count_the_live_blocks_it_allocated():
    fake = FakeCuda(seed=0)
    stream = fake.current_stream()
    t = fake.launch(stream, torch.ones, 256)  # float32: 1 KiB
    u = fake.launch(stream, torch.ones, 512)
    assert fake.memory_allocated() == fake.max_memory_allocated() == 3072
    fake.dropped([t, None, "not a tensor"])
    assert fake.memory_allocated() == 2048 and fake.max_memory_allocated() == 3072
    fake.reset_peak_memory_stats()
    assert fake.max_memory_allocated() == 2048
    v = fake.launch(stream, torch.Tensor.view, u, 2, 256)  # a view: the host holds u's block through it
    del u
    gc.collect()
    assert fake.memory_allocated() == 2048
    del v  # the host holds no tensor on it: free, though its queued kernel has not run (it holds an alias)
    gc.collect()
    assert fake.memory_allocated() == 0
    fake.synchronize()
    assert fake.memory_allocated() == 0


def test_a_dropped_block_is_reused_by_later_work_on_its_own_stream_only():
    def run(fake: FakeCuda, reader_done_first: bool) -> str:
        a, b = fake.Stream(), fake.Stream()
        y = issue(fake, a, lambda: torch.ones(4) * 3)
        b.wait_event(a.record_event())
        z = issue(fake, b, lambda: y + 1)
        if reader_done_first:
            a.wait_event(b.record_event())
        fake.dropped([y])  # a's later work may reuse y's block now
        issue(fake, a, lambda: torch.zeros(4) + 5)
        fake.synchronize()
        return "garbage" if torch.isnan(z).any() else "right"

    assert outcomes(lambda fake: run(fake, reader_done_first=True)) == {"right"}
    assert outcomes(lambda fake: run(fake, reader_done_first=False)) == {"right", "garbage"}


def test_a_graph_records_instead_of_running_and_replays_into_the_same_tensors():
    fake = FakeCuda(seed=0)
    capture_stream, side = fake.Stream(), fake.Stream()
    static_in = issue(fake, fake.current_stream(), lambda: torch.arange(4.0))
    capture_stream.wait_stream(fake.current_stream())
    graph = fake.CUDAGraph()
    with fake.stream(capture_stream):
        graph.capture_begin(capture_error_mode="thread_local")
        assert fake.is_current_stream_capturing()
        side.wait_stream(capture_stream)  # side joins the capture
        left = fake.launch(capture_stream, lambda: static_in * 2)
        right = issue(fake, side, lambda: static_in + 1)
        capture_stream.wait_stream(side)  # and is joined back
        out = fake.launch(capture_stream, lambda: left + right)
        graph.capture_end()
    fake.synchronize()
    assert torch.isnan(out).all()  # captured, never run
    graph.replay()
    fake.synchronize()
    assert torch.equal(out, torch.arange(4.0) * 3 + 1) and fake.stats["replays"] == 1
    issue(fake, fake.current_stream(), static_in.copy_, torch.ones(4))
    graph.replay()
    fake.synchronize()
    assert torch.equal(out, torch.full((4,), 4.0))  # the same tensor, the new input's result


def test_a_capture_is_refused_with_an_unjoined_stream_on_the_default_stream_or_after_a_sync():
    fake = FakeCuda(seed=0)
    capture_stream, side = fake.Stream(), fake.Stream()
    x = torch.ones(4)
    graph = fake.CUDAGraph()
    with fake.stream(capture_stream):
        graph.capture_begin()
        side.wait_stream(capture_stream)
        issue(fake, side, lambda: x + 1)  # never joined back
        with pytest.raises(RuntimeError, match="unjoined work"):
            graph.capture_end()
    assert not side.query() or side.query()  # the stream left the capture either way
    with pytest.raises(RuntimeError, match="non-default stream"):
        fake.CUDAGraph().capture_begin()
    with fake.stream(capture_stream):
        graph = fake.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            fake.launch(capture_stream, lambda: float(x.sum()))
        with pytest.raises(RuntimeError, match="previous error during capture"):
            graph.capture_end()
    assert not fake.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="not captured"):
        graph.replay()


def test_a_synchronizing_op_runs_its_stream_first_or_raises_in_sync_debug_error_mode():
    fake = FakeCuda(seed=0)
    stream = fake.current_stream()
    y = fake.launch(stream, lambda: torch.full((3,), 2.0))
    assert fake.launch(stream, lambda: float(y.sum())) == 6.0 and fake.stats["syncs"] == 1
    fake.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        fake.launch(stream, lambda: y.tolist())
    fake.set_sync_debug_mode(0)
    assert fake.get_sync_debug_mode() == 0


def test_the_seed_comes_from_the_environment_else_is_new(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "1234")
    assert FakeCuda().seed == 1234 == default_seed()
    monkeypatch.delenv(SEED_ENV)
    assert len({default_seed() for _ in range(4)}) > 1


# ---- ordering bugs in the backend give wrong outputs -------------------------------------------------------------


class Branches(nn.Module):
    """Three branches read across lanes, then joined."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 5, padding=2)
        self.d = nn.Conv2d(24, 8, 1)

    def forward(self, x):
        a, b, c = self.a(x).relu(), self.b(x).sigmoid(), self.c(x).tanh()
        return self.d(torch.cat([a * b, b + c, c], 1))


def branches():
    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(2, 3, 12, 12)
    return model, (x,), coarsen(capture(model, (x,)))


def right_on_seeds(cap, plan, inputs, expected, seeds, cudagraphs: bool) -> list[bool]:
    """For each seed: does the backend on a fresh fake runtime give ``expected``?"""
    results = []
    for seed in seeds:
        fake = FakeCuda(seed)
        backend = CudaBackend(cap, plan, inputs, cudagraphs=cudagraphs, runtime=fake)
        out = backend(*inputs)
        fake.synchronize()
        results.append(compare(expected, out).ok)
        backend.close()
    return results


def first_wrong_seed(cap, plan, inputs, expected, cudagraphs: bool) -> int | None:
    for seed in SEEDS:
        if not right_on_seeds(cap, plan, inputs, expected, [seed], cudagraphs)[0]:
            return seed
    return None


@pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "streams"])
@pytest.mark.parametrize("scheduler", ["wavefront", "lios", "opara"])
def test_skipping_any_one_wait_gives_a_wrong_output(monkeypatch, scheduler, cudagraphs):
    model, inputs, cap = branches()
    with torch.no_grad():
        expected = model(*inputs)
    sched, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), scheduler, streams=3)
    assert sched.streams_used == 3
    assert all(right_on_seeds(cap, plan, inputs, expected, range(8), cudagraphs))  # the valid plan
    real_wait = CudaLanes.wait
    missed = []
    for skipped in range(Program.from_plan(plan).num_signals):
        def wait(lanes, lane, number, skipped=skipped):
            if number != skipped:
                real_wait(lanes, lane, number)

        monkeypatch.setattr(CudaLanes, "wait", wait)
        if first_wrong_seed(cap, plan, inputs, expected, cudagraphs) is None:
            missed.append(skipped)
        monkeypatch.setattr(CudaLanes, "wait", real_wait)
    assert not missed, f"skipping the wait for signal(s) {missed} gave the right output on every seed"


def test_skipping_one_wait_of_a_zoo_model_gives_a_wrong_output(monkeypatch):
    model, inputs = zoo.create("squeezenet")
    cap = coarsen(capture(model, inputs))
    with torch.no_grad():
        expected = model(*inputs)
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "lios", streams=4)
    real_wait = CudaLanes.wait
    monkeypatch.setattr(CudaLanes, "wait", lambda lanes, lane, number: number and real_wait(lanes, lane, number))
    assert first_wrong_seed(cap, plan, inputs, expected, cudagraphs=True) is not None


def early_releases(program: Program, buffers: list) -> dict:
    """The plan's release points with one buffer that another lane reads released too early: at the first
    instruction of its allocating lane issued after every op that uses it, but before the earliest point that the
    plan's waits order after those uses (the memory pass's point; none: the buffer was kept to the end)."""
    releases = lifetimes.release_points(program.plan, buffers)
    line = lifetimes.timeline(program.plan)
    safe = {name: at for at, names in releases.items() for name in names}
    for buffer in buffers:
        lane = buffer.alloc_lane
        if all(line.launched[u][0] == lane for u in buffer.users):
            continue
        last_use = max(line.index[line.launched[u][0]][line.launched[u][1] - 1] for u in buffer.users)
        end = safe[buffer.name][1] if buffer.name in safe else len(line.index[lane]) + 1
        early = [p for p in range(1, end) if line.index[lane][p - 1] > last_use]
        if early:
            releases = {at: [n for n in names if n != buffer.name] for at, names in releases.items()}
            releases.setdefault((lane, early[0]), []).append(buffer.name)
            return releases
    raise AssertionError("no buffer of this plan can be released too early")


@pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "streams"])
def test_a_buffer_released_too_early_is_refused_and_gives_a_wrong_output(monkeypatch, cudagraphs):
    """The memory validator refuses the early release, naming the buffer and the op; with the validator skipped,
    the fake runtime shows why: some interleaving reads the reused block."""
    model, inputs, cap = branches()
    with torch.no_grad():
        expected = model(*inputs)
    _, plan = plan_for(cap.graph, estimate(cap.graph, "h100"), "wavefront", streams=3)
    assert all(right_on_seeds(cap, plan, inputs, expected, range(8), cudagraphs))  # released where it is safe
    real_release_keys = cuda_backend.release_keys
    monkeypatch.setattr(cuda_backend, "release_keys", lambda program, buffers: real_release_keys(
        program, buffers, early_releases(program, buffers)))
    with pytest.raises(PlanError, match=r"buffer '\w+' is released after instruction \d+ .* before its use by op"):
        right_on_seeds(cap, plan, inputs, expected, [0], cudagraphs)
    monkeypatch.setattr(lifetimes, "validate_releases", lambda *args, **kwargs: None)
    assert first_wrong_seed(cap, plan, inputs, expected, cudagraphs) is not None
