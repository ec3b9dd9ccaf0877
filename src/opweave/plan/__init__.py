"""The plan: a schedule lowered to per-stream instructions that every backend executes and the validator proves.

* :mod:`.launchplan` — :class:`LaunchPlan` and :class:`Instr` (launch, record, wait, send, recv);
* :mod:`.semantics` — what orders one instruction before another: :class:`~.semantics.PlanInterpreter`, the one
  owner of happens-before (pairing and vector clocks) that lowering, the validator and the backends build on;
* :mod:`.lower` — ``lower(graph, schedule)``: a plan with only the waits it needs;
* :mod:`.validate` — ``validate(graph, plan, schedule)``: every dependency ordered, or a :class:`PlanError`;
* :mod:`.make` — ``plan_for(graph, costs, scheduler)``: schedule, lower and validate, the one way to a plan;
* :mod:`.lifetimes` — buffer lifetimes from the plan: where each buffer may be freed, the proof, the added waits.
"""

from opweave.errors import PlanError
from opweave.plan.launchplan import KINDS, Instr, LaunchPlan

__all__ = ["KINDS", "Instr", "LaunchPlan", "PlanError"]
