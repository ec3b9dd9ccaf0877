"""Real-run latency measurement shared by ``opweave bench`` and the benchmark scripts.

Every mode is timed the same way: the whole call (input copy included), on CUDA from CUDA events around the call
(and a synchronize per run), on CPU from perf_counter (:mod:`opweave.costs.timing`). ``opweave bench`` builds
every mode first, then times them **interleaved** (:func:`interleaved_times_ms`): in rounds, each round running
every mode a few calls, so that all modes see the same load. Each mode gets its median and its spread, p10 to p90
(:func:`summarize`), and a speed-up counts only where it is larger than that spread (:func:`versus`: the rule of
README's "How to read a benchmark"). What else ran on the machine meanwhile is measured too (:class:`OtherWork`):
other work slows the modes unequally (eager's intra-op threads most), so a busy machine gets a warning.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from opweave.cores import cores
from opweave.costs import timing
from opweave.errors import UsageError
from opweave.outputs import compare

ROUNDS = 10  # rounds of an interleaved timing (fewer when there are fewer runs)
BUSY_SHARE = 0.25  # other processes' share of the machine's CPU time above which a timing is called busy


def median_ms(fn: Callable, args: Sequence, *, runs: int = 20, warmup: int = 3, device: str = "cpu") -> float:
    """Median wall time of ``fn(*args)`` in milliseconds (:mod:`opweave.costs.timing`), under inference mode."""
    with torch.inference_mode():
        return timing.median_ms(lambda: fn(*args), runs=runs, warmup=warmup, device=device)


def interleaved_times_ms(fns: dict[str, Callable[[], object]], *, runs: int, warmup: int, rounds: int = ROUNDS,
                         device: str = "cpu", settle: int = 0, settle_ms: float = 0.0) -> dict[str, list[float]]:
    """``runs`` timed calls of each of ``fns`` (milliseconds, :func:`opweave.costs.timing.times_ms`), after
    ``warmup`` untimed calls of each: in ``rounds`` rounds (at most ``runs``), each running every function its
    share of the calls in a row, the first function of a round one further than the last round's (none always goes
    first). A load that comes and goes then falls on every function alike, as in ``torch.utils.benchmark``'s
    interleaved comparisons and ``opweave.compile``'s choice between plans. ``settle`` and ``settle_ms``: untimed
    calls of each function right before its share in every round, a number and a time
    (:func:`opweave.costs.timing.interleaved_ms`)."""
    if runs < 1 or warmup < 0:
        raise UsageError(f"runs must be at least 1 and warmup at least 0, got {runs} and {warmup}")
    rounds = max(1, min(rounds, runs))
    per_round = [runs // rounds + (i < runs % rounds) for i in range(rounds)]
    return timing.interleaved_ms(fns, runs=per_round, warmup=warmup, device=device, settle=settle,
                                 settle_ms=settle_ms)


def summarize(times_ms: Sequence[float]) -> dict:
    """Median, p10 and p90 of a mode's times (ms) and the spread, p90 - p10 as a percentage of the median."""
    ordered = sorted(times_ms)
    median = statistics.median(ordered)
    if len(ordered) > 1:
        cuts = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = cuts[0], cuts[-1]
    else:
        p10 = p90 = median
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90, "spread_pct": 100 * (p90 - p10) / median}


def versus(base: dict, mode: dict) -> dict:
    """The speed-up of ``mode`` over ``base`` (two :func:`summarize` results): the ratio of their medians, and
    whether it is **within the spread** (README, "How to read a benchmark"): their p10-p90 ranges overlap, so the
    run's own noise could give that ratio, and it shows no speed-up (or slow-down) at all."""
    overlap = mode["p10_ms"] <= base["p90_ms"] and base["p10_ms"] <= mode["p90_ms"]
    return {"speedup": base["median_ms"] / mode["median_ms"], "within_spread": overlap}


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (None where the system keeps none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _machine_cpu_s() -> tuple[float, float] | None:
    """CPU seconds of the whole machine since boot, (busy, all), from Linux's /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


class OtherWork:
    """``with OtherWork() as other:`` — what the rest of the machine did while the block ran: :attr:`share`, the
    share of every CPU's time that other processes kept busy (0 to 1; None where /proc/stat is missing), and
    :attr:`busy` (a share above :data:`BUSY_SHARE`, or, without /proc/stat, a 1-minute load average above half the
    CPUs)."""

    share: float | None = None
    busy: bool = False

    def __enter__(self) -> OtherWork:
        self._machine, self._own = _machine_cpu_s(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        end, own = _machine_cpu_s(), time.process_time() - self._own
        if self._machine is not None and end is not None and end[1] > self._machine[1]:
            busy, total = end[0] - self._machine[0], end[1] - self._machine[1]
            self.share = min(1.0, max(0.0, (busy - own) / total))
            self.busy = self.share > BUSY_SHARE
        else:
            load = load_average()
            self.busy = load is not None and load[0] > cores() / 2


def busy_warning(others_cpu_share: float | None, load: list[float] | None) -> str:
    """The warning a busy machine's timing carries."""
    what = (f"other processes kept {others_cpu_share:.0%} of the CPUs busy while it timed"
            if others_cpu_share is not None else "the machine was busy")
    loads = f" (load average {load[0]:.2f} on {cores()} CPUs)" if load else ""
    return (f"{what}{loads}: other work slows the modes unequally (eager's intra-op threads most), so these ratios "
            f"are not this machine's; time again on a quiet machine")


def device_name(device: str) -> str:
    from opweave.costs.profile import device_name as measured_on

    return measured_on(device) + ("" if device == "cuda" else f" ({torch.get_num_threads()} threads)")


def bench_model(source: str | Path, *, device: str = "cpu", batch_size: int = 1,
                scheduler_names: Sequence[str] = (), runs: int = 20, warmup: int = 3, progress: bool = True,
                mode: str = "default", options: dict | None = None) -> dict:
    """Eager vs opweave with each scheduler (``"default"``: what ``opweave.compile`` picks given none) on one zoo
    model or ``.pt2`` file (``source``, as
    :func:`opweave.capture.load` takes it), with ``options`` (any option of ``opweave.compile``: ``streams``,
    ``profile``, ``coarsen``, ...) for every scheduler: every mode's options resolved and checked first, before the
    model loads (:func:`opweave.pipeline.resolve`, one :class:`~opweave.pipeline.Options` per scheduler), then every
    mode built by the pipeline and checked against eager, then all timed interleaved (module docstring); returns a
    JSON-ready dict. Each row has its median, p10, p90 and spread; the others also their speed-up over eager and
    whether it is within the spread (:func:`versus`); a mode that chose its plan (``"default"``, max-autotune) also
    ``choice``, what it chose (its scheduler and streams are then those of the plan it kept: one lane for a CPU
    default that kept the model itself). ``machine`` says what else ran meanwhile, and ``warning`` is set when the
    machine was busy."""
    from rich.progress import Progress

    from opweave.capture import load
    from opweave.pipeline import build, resolve

    modes = {name: resolve(device, mode, options) if name == "default" else  # raises first
             resolve(device, mode, options, scheduler=name) for name in scheduler_names}
    given = next(iter(modes.values())) if modes else resolve(device, mode, options)
    # captured once, as it is: every scheduler plans the same graph, coarsened by the pipeline as its options say
    model, inputs, captured = load(source, batch_size=batch_size, device=device, coarsen=False,
                                   fold_bn=given.fold_bn)
    model_name = captured.graph.name
    with torch.inference_mode():
        reference = model(*inputs)
    calls: dict[str, Callable[[], object]] = {"eager": lambda: model(*inputs)}
    rows: list[dict[str, Any]] = [{"mode": "eager"}]
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"{model_name}: building", total=len(scheduler_names) + 1)
        for name in scheduler_names:
            bar.update(task, description=f"{model_name}: building opweave {name}")
            fast = build(captured, inputs, modes[name], eager=model)
            with torch.inference_mode():
                check = compare(reference, fast(*inputs))
            calls[f"opweave {name}"] = functools.partial(fast, *inputs)
            assert fast.schedule is not None
            rows.append({"mode": f"opweave {name}", "scheduler": fast.schedule.scheduler,
                         "streams": fast.schedule.streams_used,
                         "syncs": fast.plan.syncs, "max_abs_diff": check.max_diff, "ok": check.ok,
                         "ops": len(fast.graph)})
            if fast.choice:  # what a default or max-autotune picked ("onnxruntime", "lanes", "eager", "lios x4", ...)
                rows[-1]["choice"] = fast.choice["label"]
            bar.advance(task)
        bar.update(task, description=f"{model_name}: timing {len(calls)} modes interleaved")
        with torch.inference_mode(), OtherWork() as other:
            times = interleaved_times_ms(calls, runs=runs, warmup=warmup, device=device)
        bar.advance(task)
    eager = summarize(times["eager"])
    for row in rows:
        row.update(summarize(times[row["mode"]]))
        ratio = versus(eager, row)
        row["speedup_vs_eager"] = ratio["speedup"]
        if row["mode"] != "eager":
            row["within_spread"] = ratio["within_spread"]
    averages = load_average()
    return {"model": model_name, "batch_size": batch_size, "device": device, "device_name": device_name(device),
            "costs": "profile " + str(given.profile) if given.profile else "roofline estimate",
            "coarsen": given.coarsen,
            "torch": torch.__version__, "runs": runs, "warmup": warmup, "rounds": max(1, min(ROUNDS, runs)),
            "machine": {"cpus": cores(), "load_average_1_5_15m": averages,
                        "others_cpu_share": None if other.share is None else round(other.share, 3), "busy": other.busy},
            "warning": busy_warning(other.share, averages) if other.busy else None, "rows": rows}
