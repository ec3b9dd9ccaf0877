"""Thread budgets on the CPU: the cores are split among the lanes that run at once, so lanes x intra-op threads
never exceed the cores.

**How the installed torch scopes ``torch.set_num_threads``** (ATen's OpenMP backend, which the PyPI CPU wheels
use; ``torch.__config__.parallel_info()`` names it). The call sets the *calling thread's* OpenMP thread count
(``omp_set_num_threads`` sets a per-thread ICV; MKL's is set with ``mkl_set_num_threads_local``, also per thread;
oneDNN reads OpenMP's), and also a process-wide default. A thread's first parallel kernel initialises its count
from that process-wide default, once (``at::internal::lazy_init_num_threads``, thread-local). So:

* a lane worker first runs one parallel kernel (its lazy initialisation happens now, not later over its budget),
  then calls ``torch.set_num_threads(budget)``: from then on its kernels use ``budget`` threads, whatever other
  threads do (:func:`enter_budget`);
* the process-wide default that the last call left behind would leak into threads created later (the caller's
  own), so the backend restores it from the caller's thread once its workers are set (:func:`restore_default`),
  which does not change the caller's own count.

**Only the caller's thread ever runs more than one OpenMP thread.** The first lane of a plan runs in the caller's
thread; every other lane's worker runs its ops on one thread. libgomp keeps a thread's team once it has run a
parallel region with it, and once the threads held in teams outnumber the cores it throttles its spin-wait for the
whole process (``GOMP_SPINCOUNT``'s 300000 iterations drop to the throttled 1000: every team's threads then sleep
between parallel regions and are woken by futex). So one worker that ever ran a two-thread kernel slowed every
OpenMP kernel in the process from then on, the lanes' own and the user's: eager GoogLeNet took 64 ms against 40 ms
while two idle threads held two-thread teams, and 40 ms when they held one-thread teams
(``benchmarks/omp_teams.py``). Within the caller's thread the count changes from op to op as the budgets say.

:func:`budgets` gives a plan's lanes their threads when no per-op budgets are given: one to each lane but the first,
the rest of the cores to the first (a single lane keeps every core), so the lanes never hold more threads than there
are cores. Per-op budgets (:func:`op_threads`: an op of the first lane that runs alone gets every core) are given
only to ONNX Runtime segments (``compiler="onnxruntime"``, ``graph="onnxruntime"``; :func:`lane_threads`): ONNX
Runtime's pools sleep when idle there. An OpenMP team does not: after a two-thread kernel the caller's second
thread spins on, and a worker lane that starts its next op meanwhile finds both cores taken. On the 2-core machine
(2026-11-25, batch 1, medians of 20 calls interleaved in one process whose workers never held a team above one
thread), HEFT's two lanes with per-op budgets
against every op on one thread: GoogLeNet 56.7 / 51.2 ms, NASNet 48.2 / 45.9, RandWire 46.8 / 35.6, Inception-v3
100.7 / 100.6. ``cores`` is the number of CPUs this process may run on.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Sequence

import torch


def cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def budgets(lanes: Sequence, total: int | None = None, *, ranks: int = 1) -> dict:
    """The one rule for CPU threads, which every path that runs ops on the CPU takes (one lane or several, segments
    compiled by Inductor or ONNX Runtime, the lanes over ONNX Runtime's graph, a rank's lanes, the server's
    executor): each of ``lanes``' intra-op threads out of ``total`` in all (default: every core this process may
    use, :func:`cores`, split evenly among ``ranks`` rank processes; at least 1). One lane gets them all; with
    several, every lane but the first gets one and the first, which runs in the caller's thread, the rest (at least
    1). Module docstring: why the workers get one.

    >>> budgets(["a", "b"], total=2), budgets(["a", "b", "c"], total=8), budgets(["a"], total=4)
    ({'a': 1, 'b': 1}, {'a': 6, 'b': 1, 'c': 1}, {'a': 4})
    """
    total = max(1, cores() // max(1, ranks)) if total is None else total
    lanes = list(lanes)
    return {lane: max(1, total - len(lanes) + 1) if i == 0 else 1 for i, lane in enumerate(lanes)}


def total_threads(total: int | None = None, *, ranks: int = 1) -> int:
    """The threads one device's lanes may use in all: ``total``, else :func:`budgets`' share of the cores for one
    of ``ranks`` processes (the budget of a single lane)."""
    return budgets([0], total, ranks=ranks)[0]


@functools.cache
def sync_cost_ms(rounds: int = 200) -> float:
    """What one cross-lane synchronisation costs here (ms): half the median round trip of a signal from one thread
    to another and back (``threading.Event``, as the CPU lanes signal). Measured once per process; the CPU lanes'
    scheduler weighs an edge between lanes with it (``heft``'s ``sync_ms``)."""
    ping, pong = threading.Event(), threading.Event()

    def echo() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    other = threading.Thread(target=echo, daemon=True)
    other.start()
    trips = []
    for _ in range(rounds):
        start = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        trips.append(time.perf_counter() - start)
    other.join()
    return statistics.median(trips) * 1e3 / 2


def enter_budget(threads: int) -> None:
    """Make the calling (worker) thread run its kernels on ``threads`` intra-op threads (module docstring)."""
    torch.ones(64).sum()  # this thread's lazy OpenMP initialisation happens now, not after the budget is set
    torch.set_num_threads(threads)


def restore_default(threads: int) -> None:
    """Put back the process-wide default after workers set theirs (call from the caller's thread)."""
    torch.set_num_threads(threads)


def lane_threads(graph, plan, costs=None, *, per_op: bool = False, total: int | None = None) -> dict[str, int]:
    """Each op's intra-op threads on a CPU plan's lanes, out of ``total`` (default :func:`total_threads`). With
    ``per_op`` (what runs the ops sleeps when idle: ONNX Runtime sessions), ``costs`` and several lanes,
    :func:`op_threads`' per-op budgets; otherwise the lanes' :func:`budgets`, the same for every op of a lane (a
    single lane's ops get every thread; module docstring says why workers get one)."""
    lane_of = {i.op: (i.device, i.stream) for i in plan.instrs if i.kind == "launch"}
    lanes = sorted(set(lane_of.values()))
    if per_op and costs is not None and len(lanes) > 1:
        from opweave.backends.simulate import simulate

        return op_threads(simulate(graph, plan, costs), total=total)
    share = budgets(lanes, total=total)
    return {op: share[lane] for op, lane in lane_of.items()}


def op_threads(sim, total: int | None = None, overlap: float = 0.1) -> dict[str, int]:
    """Intra-op threads per op of a replayed plan (:func:`opweave.backends.simulate.simulate`). The first lane (the
    smallest; it runs in the caller's thread) shares the cores with the lanes that run beside it: its op gets
    ``total // k`` threads (at least 1), where ``k`` is its own lane plus every other lane that is busy for more
    than ``overlap`` of the op's time, so an op that runs alone gets every core. Every other lane's op gets one
    thread (module docstring: a worker with a bigger team slows every OpenMP kernel of the process). A lane changes
    its thread count between ops (``torch.set_num_threads`` costs about 0.1 µs).

    >>> from types import SimpleNamespace
    >>> sim = SimpleNamespace(start_ms={"a": 0, "b": 0, "c": 4, "d": 6}, finish_ms={"a": 4, "b": 3, "c": 6, "d": 8},
    ...                       lane_of={"a": (0, 0), "b": (0, 1), "c": (0, 0), "d": (0, 1)})
    >>> op_threads(sim, total=2)
    {'a': 1, 'b': 1, 'c': 2, 'd': 1}
    """
    total = total_threads(total)
    busy: dict = {}
    for op, lane in sim.lane_of.items():
        busy.setdefault(lane, []).append((sim.start_ms[op], sim.finish_ms[op]))
    first = min(busy, default=None)
    out = {}
    for op, lane in sim.lane_of.items():
        if lane != first:
            out[op] = 1
            continue
        start, finish = sim.start_ms[op], sim.finish_ms[op]
        length = finish - start
        sharing = 1
        for other, spans in busy.items():
            if other == lane:
                continue
            shared = sum(max(0.0, min(finish, b) - max(start, a)) for a, b in spans)
            if shared > overlap * length or (length == 0 and any(a < start < b for a, b in spans)):
                sharing += 1
        out[op] = max(1, total // sharing)
    return out


def op_budgets(lanes: int, total: int | None = None, *, per_op: bool = True) -> list[int]:
    """Every budget an op of a plan with at most ``lanes`` lanes may get out of ``total`` (default
    :func:`total_threads`): :func:`op_threads`' with ``per_op``, else :func:`budgets`'. What to compile a call for
    ahead of time (the serving executor's whole blocks)."""
    total = total_threads(total)
    if per_op:
        return sorted({1} | {max(1, total // k) for k in range(1, max(1, lanes) + 1)})
    return sorted({1} | {budgets(range(k), total)[0] for k in range(1, max(1, lanes) + 1)})
