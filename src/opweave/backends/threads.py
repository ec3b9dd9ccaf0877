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

:func:`budgets` gives each lane of a plan its share: ``cores // lanes`` (at least 1), the remainder to the first
lanes; a single lane keeps every core. ``cores`` is the number of CPUs this process may run on.
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


def budgets(lanes: Sequence, total: int | None = None) -> dict:
    """Intra-op threads per lane so that their sum is at most ``total`` (default: :func:`cores`) and each has one.

    >>> budgets(["a", "b"], total=2), budgets(["a", "b", "c"], total=8), budgets(["a"], total=4)
    ({'a': 1, 'b': 1}, {'a': 3, 'b': 3, 'c': 2}, {'a': 4})
    """
    total = cores() if total is None else total
    lanes = list(lanes)
    if not lanes:
        return {}
    share, extra = divmod(total, len(lanes))
    return {lane: max(1, share + (i < extra)) for i, lane in enumerate(lanes)}


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


def op_threads(sim, total: int | None = None, overlap: float = 0.1) -> dict[str, int]:
    """Intra-op threads per op of a replayed plan (:func:`opweave.backends.simulate.simulate`): the cores are split
    among the lanes that run at once. An op gets ``total // k`` threads (at least 1), where ``k`` is its own lane
    plus every other lane that is busy for more than ``overlap`` of the op's time; an op that runs alone gets every
    core. A lane then changes its thread count between ops (``torch.set_num_threads`` costs about 0.1 µs).

    >>> from types import SimpleNamespace
    >>> sim = SimpleNamespace(start_ms={"a": 0, "b": 0, "c": 4}, finish_ms={"a": 4, "b": 3, "c": 6},
    ...                       lane_of={"a": (0, 0), "b": (0, 1), "c": (0, 0)})
    >>> op_threads(sim, total=2)
    {'a': 1, 'b': 1, 'c': 2}
    """
    total = cores() if total is None else total
    busy: dict = {}
    for op, lane in sim.lane_of.items():
        busy.setdefault(lane, []).append((sim.start_ms[op], sim.finish_ms[op]))
    out = {}
    for op, lane in sim.lane_of.items():
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
