"""The one way from a captured model to a runnable: :func:`build`.

``opweave.compile``, ``torch.compile(backend="opweave")``, the serving executors (every block and combined block)
and the GPU benchmark all call it, so what a benchmark measures is what users run (and :func:`plan_ranks` plans
as it does for the ranks a launcher started)::

    captured ─coarsen─▶ captured ─target─▶ costs ─scheduler─▶ schedule ─lower, validate─▶ plan ─target─▶ backend

The device's :mod:`target <opweave.pipeline.targets>` owns its defaults (scheduler, stream cap, thread budgets, the
CUDA backend's options), builds its backend and offers the candidates of a measured choice (the CPU default's race,
``mode="max-autotune"``), which :mod:`opweave.pipeline.search` builds, checks, times and caches. :class:`Compiled`
is what comes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opweave.capture.runtime import as_tuple
from opweave.costs import Costs
from opweave.errors import UsageError
from opweave.pipeline import search, targets, tiers
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.options import Options
from opweave.pipeline.signatures import takes_any_batch
from opweave.plan import LaunchPlan
from opweave.schedulers.schedule import Schedule


def build(captured: Any, example_inputs: Any, options: Options, *, eager: Any = None,
          reference: Any = None) -> Compiled:
    """``captured`` (a :class:`~opweave.capture.Captured`) as a runnable for ``example_inputs``, as ``options``
    (from :func:`~opweave.pipeline.options.resolve`) say. ``eager``, the model itself when known, is one of the
    candidates a measured choice may keep (the CPU's default keeps a plan only where its timing beats it).
    ``reference``: the captured graph's output for ``example_inputs`` as capture just checked it, which a measured
    choice checks its candidates against (None: it runs the graph for one)."""
    inputs = as_tuple(example_inputs)
    target = targets.for_options(options)
    if options.autotune:  # each candidate coarsens the captured model as it plans it (targets.coarsened)
        return search.search(target, captured, inputs, options, eager=eager, reference=reference)
    if options.guard:  # the CPU default: the fastest of its candidates, measured, then the tiers built beside it
        raced: Compiled = search.default_race(target, captured, inputs, options, eager=eager, reference=reference)
        if options.tiers and not captured.state_writes():  # a tier's race would write the model's state beside
            raced = tiers.start(raced, eager if eager is not None else captured.gm, inputs, options, reference)
        return raced
    captured = targets.coarsened(captured, options)
    compiled: Compiled = target.build(captured, inputs, options)
    if compiled.fused is not None and compiled.fused.any_batch:  # dynamic=True: one session with a free batch
        if takes_any_batch(compiled, captured, inputs):
            compiled.any_batch = True
        else:  # a graph that baked its batch in: built per batch size, as with dynamic unset
            compiled.close()
            compiled = target.build(captured, inputs, options.derive(dynamic=None))
    return compiled


@dataclass
class Planned:
    """A model planned over several devices: the captured model as it was planned (coarsened where the options
    say), its costs, schedule and validated plan."""

    captured: Any
    costs: Costs
    schedule: Schedule
    plan: LaunchPlan


def plan_ranks(captured: Any, example_inputs: Any, options: Options) -> Planned:
    """What :func:`build` plans for ``options.devices`` devices, without starting rank processes: the ranks a
    launcher started (``opweave run`` under torchrun) run this plan, each its own share."""
    if options.devices < 2:
        raise UsageError(f"a plan over ranks needs devices > 1, got devices={options.devices}")
    captured = targets.coarsened(captured, options)
    costs, schedule, plan = targets.RanksTarget().plan(captured, as_tuple(example_inputs), options)
    return Planned(captured, costs, schedule, plan)


__all__ = ["Compiled", "Planned", "as_tuple", "build", "plan_ranks"]
