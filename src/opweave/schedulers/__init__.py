"""Schedulers: pure functions ``(graph, costs, options) -> Schedule``, one module per algorithm.

Every module exposes ``schedule(graph, costs, *, streams=None, devices=1, **options) -> Schedule``.
:func:`run` looks one up by name, times it and checks the result fits the graph. It logs what was decided (streams
and devices used, predicted makespan against the critical path, scheduling time) at DEBUG level on the
``opweave.schedulers`` logger, silent unless an application turns it on (``logging.basicConfig(level="DEBUG")``).
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import time
from collections.abc import Iterable
from typing import Any

from opweave.costs.model import Costs
from opweave.errors import UsageError, did_you_mean
from opweave.ir.graph import OpGraph
from opweave.schedulers.schedule import Schedule

# name -> module under opweave.schedulers (several names may share a module, told apart by the "variant" option)
_MODULES: dict[str, tuple[str, dict[str, Any]]] = {
    "sequential": ("sequential", {}),
    "wavefront": ("wavefront", {}),
    "nimble": ("nimble", {}),
    "opara": ("opara", {}),
    "lios": ("lios", {}),
    "ios": ("ios", {}),
    "top-gpg": ("top_gpg", {}),
    "hios-lp": ("hios", {"variant": "lp"}),
    "hios-mr": ("hios", {"variant": "mr"}),
    "heft": ("heft", {}),
}
MULTI_DEVICE = ("hios-lp", "hios-mr")

log = logging.getLogger(__name__)


def names() -> list[str]:
    """Names of every scheduler, in the order tables list them."""
    return list(_MODULES)


def options_of(name: str) -> set[str] | None:
    """The keyword options scheduler ``name`` takes (None: any)."""
    module_name, fixed = _MODULES[name]
    takes = inspect.signature(importlib.import_module(f"opweave.schedulers.{module_name}").schedule).parameters
    if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return None
    return {k for k, p in takes.items() if p.kind is p.KEYWORD_ONLY} - {"streams", "devices"} - set(fixed)


def check_options(name: str, options: Iterable[str]) -> None:
    """A :class:`~opweave.errors.UsageError` naming the first of ``options`` that scheduler ``name`` does not take
    (:func:`options_of`), before anything is scheduled."""
    known = options_of(name)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        raise UsageError(f"scheduler {name!r} takes no option {unknown[0]!r}{did_you_mean(unknown[0], known or ())} "
                         f"(its options: {', '.join(sorted(known or ())) or 'none'})")


def run(name: str, graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1,
        **options: Any) -> Schedule:
    """Schedule ``graph`` with the scheduler called ``name``; fills in ``scheduling_time_s``.

    ``scheduling_time_s`` is the wall time of the scheduler call, the graph's cached structure (topological order,
    reachability) included when the call builds it. As :mod:`timeit` does, the cyclic garbage collector is paused
    for that call: otherwise the scheduler's first few thousand allocations set off whatever full collection the
    caller had made due, and after a model capture (hundreds of thousands of tracked objects) that one pass costs
    more than any polynomial scheduler takes on a 906-op graph (docs/design.md, §3.4). The schedulers build no
    reference cycles of note, so their memory is freed by reference counting as usual; a due collection runs
    after the call.

    LIOS on the running example of its paper (Fig. 3, Table III), three streams:

    >>> from opweave import examples, schedulers
    >>> from opweave.costs.model import from_graph
    >>> graph = examples.load("lios-fig3")
    >>> sched = schedulers.run("lios", graph, from_graph(graph), streams=3)
    >>> sched.predicted_ms, sched.streams_used
    (38.0, 3)
    """
    if name not in _MODULES:
        raise UsageError(f"unknown scheduler {name!r}{did_you_mean(name, names())}; choose one of "
                         f"{', '.join(names())}")
    if streams is not None and streams < 1:
        raise UsageError(f"streams must be at least 1, got {streams}")
    if devices < 1:
        raise UsageError(f"devices must be at least 1, got {devices}")
    module_name, fixed = _MODULES[name]
    module = importlib.import_module(f"opweave.schedulers.{module_name}")
    check_options(name, options)
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        sched: Schedule = module.schedule(graph, costs, streams=streams, devices=devices, **fixed, **options)
        sched.scheduling_time_s = time.perf_counter() - start
    finally:
        if collecting:
            gc.enable()
    sched.scheduler = name
    sched.check(graph)
    if log.isEnabledFor(logging.DEBUG):
        predicted = "-" if sched.predicted_ms is None else f"{sched.predicted_ms:.4f} ms"
        log.debug("%s on %s (%d ops): %d streams on %d devices, predicted %s, critical path %.4f ms, "
                  "scheduled in %.1f ms", name, graph.name, len(graph), sched.streams_used, sched.devices_used,
                  predicted, graph.critical_path_ms(costs.latency_ms), sched.scheduling_time_s * 1e3)
    return sched
