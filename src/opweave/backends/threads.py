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
  own), so the caller's thread starts its workers inside :func:`opweave.cores.intra_op_threads`, which sets its
  own count (and with it the default) back as it was once they are set.

**Only the caller's thread ever runs more than one OpenMP thread.** The first lane of a plan runs in the caller's
thread; every other lane's worker runs its ops on one thread. libgomp keeps a thread's team once it has run a
parallel region with it, and once the threads held in teams outnumber the cores it throttles its spin-wait for the
whole process (``GOMP_SPINCOUNT``'s 300000 iterations drop to the throttled 1000: every team's threads then sleep
between parallel regions and are woken by futex). So one worker that ever ran a two-thread kernel slowed every
OpenMP kernel in the process from then on, the lanes' own and the user's: eager GoogLeNet ran markedly slower while
two idle threads held two-thread teams than when they held one-thread teams (``benchmarks/omp_teams.py``, figures in
docs/design.md, §3.6, cpu). Within the caller's thread the count changes from op to op as the budgets say.

:func:`budgets` gives a plan's lanes their threads when no per-op budgets are given: one to each lane but the first, the
rest of the cores to the first (a single lane keeps every core), so the lanes never hold more threads than there are
cores. Per-op budgets (:func:`opweave.pipeline.thread_budgets.op_threads`, from the replayed plan: an op of the first
lane that runs alone gets every core) are given only to ONNX Runtime segments (``compiler="onnxruntime"``,
``graph="onnxruntime"``; :func:`opweave.pipeline.thread_budgets.lane_threads`): ONNX Runtime's pools sleep when idle
there. An OpenMP team does not: after a two-thread kernel the caller's second thread spins on, and a worker lane that
starts its next op meanwhile finds both cores taken: timed on 2 cores, HEFT's two lanes with per-op budgets were
no faster than with every op on one thread (docs/design.md, §3.6, cpu). ``cores`` is the number of CPUs this
process may run on (:func:`opweave.cores.cores`).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Sequence

import torch

from opweave.cores import cores


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


def plan_budgets(plan, total: int | None = None) -> dict[str, int]:
    """Each launched op's intra-op threads on ``plan``'s lanes, out of ``total``: its lane's :func:`budgets`, the
    same for every op of a lane (per-op budgets from the replayed plan are the pipeline's:
    :func:`opweave.pipeline.thread_budgets.lane_threads`)."""
    lane_of = {i.op: (i.device, i.stream) for i in plan.instrs if i.kind == "launch"}
    share = budgets(sorted(set(lane_of.values())), total=total)
    return {op: share[lane] for op, lane in lane_of.items()}
