"""From a graph and its costs to a plan every backend may run: schedule, lower, validate. The one way every caller
(the build pipeline, the CUDA default's chooser, the CLI, the serving executors' simulator) makes a plan."""

from __future__ import annotations

from typing import Any

from opweave import schedulers
from opweave.costs import Costs
from opweave.ir import OpGraph
from opweave.plan.launchplan import LaunchPlan
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule


def plan_for(graph: OpGraph, costs: Costs, scheduler: str, *, streams: int | None = None, devices: int = 1,
             **options: Any) -> tuple[Schedule, LaunchPlan]:
    """Schedule ``graph`` with ``scheduler`` and lower it; the plan has passed the validator."""
    sched = schedulers.run(scheduler, graph, costs, streams=streams, devices=devices, **options)
    return sched, validated_plan(graph, sched)


def validated_plan(graph: OpGraph, schedule: Schedule) -> LaunchPlan:
    """``schedule`` lowered to a plan (:func:`~opweave.plan.lower.lower`) that has passed the validator."""
    plan = lower(graph, schedule)
    validate(graph, plan, schedule)
    return plan
