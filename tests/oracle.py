"""What a schedule does, as the tests judge it: lowered, validated and replayed by the simulator.

A scheduler's ``predicted_ms`` is compared with :func:`replay_ms`, never with the helper the scheduler computed it
with (``schedulers/_listsched.ideal_finish_times``, ``schedulers/hios/stages.evaluate``): a bug shared by a
scheduler and its own helper would otherwise be invisible.
"""

from __future__ import annotations

from opweave.backends.simulate import SimResult, simulate
from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule


def replay(graph: OpGraph, sched: Schedule, costs: Costs) -> SimResult:
    """The simulator's replay of ``sched``'s lowered plan (which must pass the validator) under ``costs``."""
    plan = lower(graph, sched)
    validate(graph, plan, sched)
    return simulate(graph, plan, costs)


def replay_ms(graph: OpGraph, sched: Schedule, costs: Costs) -> float:
    return replay(graph, sched, costs).makespan_ms
