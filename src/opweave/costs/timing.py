"""One way to time things, used by the profiler's CPU path, ``opweave bench`` and the GPU benchmark.

``warmup`` calls first (lazy initialization, cuDNN/cuBLAS handles, allocator growth), then ``runs`` timed calls.
On CUDA each call is bracketed by CUDA events on the current stream and the host waits for every call before
issuing the next, so each figure covers one whole call (host issue included) and nothing queued behind it; this
is how model calls are timed. (An op's GPU time is not measured this way: at batch 1 a kernel is shorter than one
Python dispatch, so back-to-back events would time the launch path; the profiler reads kernel durations instead,
see :mod:`opweave.costs.profile.measure`.) On the CPU each call is timed with ``perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch


def times_ms(fn: Callable[[], object], *, runs: int, warmup: int, device: str = "cpu",
             sync: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``runs`` calls of ``fn()`` after ``warmup`` untimed ones. ``sync``: on the host's
    clock, call this after each call (a device that is not CUDA's events, such as the fake CUDA runtime)."""
    for _ in range(warmup):
        fn()
    if device != "cuda" or sync is not None:
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
        end.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def median_ms(fn: Callable[[], object], *, runs: int, warmup: int, device: str = "cpu") -> float:
    """Median of :func:`times_ms`."""
    return statistics.median(times_ms(fn, runs=runs, warmup=warmup, device=device))


def interleaved_ms(fns: Mapping[str, Callable[[], object]], *, rounds: int = 5, runs: int | Sequence[int] = 3,
                   warmup: int = 2, device: str = "cpu", sync: Callable[[], object] | None = None,
                   settle: int = 0, settle_ms: float = 0.0) -> dict[str, list[float]]:
    """Milliseconds of every call of each of ``fns``, timed interleaved so that all see the same load (as
    ``torch.utils.benchmark``'s comparisons are): ``warmup`` untimed calls each, then ``rounds`` rounds in which
    each runs ``runs`` timed calls in a row (:func:`times_ms`; or one count per round, ``runs`` a sequence, whose
    length is then the rounds), the first function of a round one further than the last round's (none always goes
    first). ``settle``: untimed calls of a function just before its timed ones in each round, so that each is timed
    as a user calling it alone meets it, not in the wake of another (thread pools that spin after a run, ONNX
    Runtime's and Inductor's, take the cores from the next function: :func:`race_ms`); ``settle_ms``: untimed calls
    before those until that long has passed (they spin for a time, :func:`race_ms`)."""
    per_round = [runs] * rounds if isinstance(runs, int) else list(runs)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {label: [] for label in names}
    for k, calls in enumerate(per_round if names else []):
        start = k % len(names)
        for label in names[start:] + names[:start]:
            if settle_ms:
                _settle(fns[label], 0, settle_ms)
            times[label] += times_ms(fns[label], runs=calls, warmup=settle, device=device, sync=sync)
    return times


def call_ms(label: str, fn: Callable[[], object]) -> float:
    """The milliseconds of one call of ``fn`` on ``perf_counter`` (``label`` unread: the signature of
    :func:`race_ms`'s ``timer``)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def race_ms(fns: Mapping[str, Callable[[], object]], *, rounds: int = 15, margin: float = 1.25, warmup: int = 1,
            settle: int = 0, settle_ms: float = 0.0, budget_ms: float | None = None,
            timer: Callable[[str, Callable[[], object]], float] | None = None,
            seed: Mapping[str, list[float]] | None = None) -> tuple[dict[str, list[float]], set]:
    """Milliseconds of each call of ``fns``, timed interleaved one call per round (each round starting one further),
    dropping a function once it cannot be the fastest: from the second round on, one whose fastest call is more than
    ``margin`` times the leader's median (the lowest). Stops when one is left after two rounds or after ``rounds``.
    A candidate that is twice as slow costs ``warmup`` + 2 calls, not ``rounds``: a measured choice among a few
    plans then costs about what timing its winner does. ``settle``: untimed calls of a function just before each of
    its timed ones, so that each is timed as a loop calling it back to back sees it, not in the wake of another
    (thread pools that spin after a call, ONNX Runtime's or a lane's, take the cores from the next function: a
    session timed right after other candidates measured far slower than back to back, docs/design.md, §3.6, cpu);
    ``settle_ms``: and more, until that long has passed since the first of them (a pool spins for a time, not for a
    number of calls: at a tenth of a millisecond a call, three calls of an ONNX Runtime session after an Inductor
    package's measured it 3.5x slower than it runs in a loop).
    Returns every timed call's time per function and those dropped. ``budget_ms``: the race also stops after the
    first round that brings the time its calls took (the timed ones, each counted once more per untimed call made
    before it) past it; the leader then wins on the calls it had: where candidates lie within ``margin`` of each
    other, more rounds cost seconds per call of a large model and change little.
    ``timer(label, fn)``: the milliseconds of one call (default: ``perf_counter`` around it; tests give a script).
    ``seed``: calls of some functions timed before the race as its rounds would time them (right after an untimed call
    of the same function: a candidate's check, just after the call that compiled it), taken as their first round:
    the race then makes fewer calls of them (docs/design.md, §3.6, cpu)."""

    timer = timer or call_ms
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {label: [] for label in names}
    left, dropped = list(names), set()
    spent = 0.0
    seed = {label: list(ts) for label, ts in (seed or {}).items() if label in fns and ts}
    for k in range(rounds):
        start = k % len(left)
        for label in left[start:] + left[:start]:
            if k == 0 and label in seed:
                times[label] = seed[label]
                spent += sum(seed[label]) * (1 + settle)
                continue
            untimed = _settle(fns[label], settle, settle_ms)
            times[label].append(timer(label, fns[label]))
            spent += times[label][-1] * (1 + untimed)
        if budget_ms is not None and spent > budget_ms:
            break
        if k >= 1:
            lead = min(statistics.median(times[label]) for label in left)
            out = {label for label in left if min(times[label]) > margin * lead}
            dropped |= out
            left = [label for label in left if label not in out]
            if len(left) == 1:
                break
    return times, dropped


_now = time.perf_counter  # the clock a race's settling is read on


def _settle(fn: Callable[[], object], calls: int, ms: float) -> int:
    """Untimed calls of ``fn``: at least ``calls``, and until ``ms`` have passed since the first; how many."""
    start, made = _now(), 0
    while made < calls or (_now() - start) * 1e3 < ms:
        fn()
        made += 1
    return made
