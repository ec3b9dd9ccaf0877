"""Per-op thread budgets of a CPU plan, from its replay: what runs the ops says how a plan's threads are split.

:func:`opweave.backends.threads.budgets` is the one rule for a lane's threads (lanes x intra-op threads never above
``threads``, workers on one); here, where what runs the ops sleeps when idle (ONNX Runtime's sessions), an op that
the replayed plan runs alone gets every thread (:func:`op_threads`), which needs the simulator's replay of the plan,
so the policy is the pipeline's, not a backend's: the targets (:mod:`opweave.pipeline.targets`) and the server's
executor ask it, and the backends are handed its answer.
"""

from __future__ import annotations

from typing import Any

from opweave.backends.simulate import simulate
from opweave.backends.threads import budgets, plan_budgets, total_threads
from opweave.costs import Costs
from opweave.ir import OpGraph
from opweave.plan import LaunchPlan


def lane_threads(graph: OpGraph, plan: LaunchPlan, costs: Costs | None = None, *, per_op: bool = False,
                 total: int | None = None) -> dict[str, int]:
    """Each op's intra-op threads on a CPU plan's lanes, out of ``total`` (default: every core,
    :func:`opweave.backends.threads.total_threads`). With ``per_op`` (what runs the ops sleeps when idle: ONNX Runtime
    sessions), ``costs`` and several lanes, :func:`op_threads`' per-op budgets; otherwise the lanes' budgets, the same
    for every op of a lane (:func:`opweave.backends.threads.plan_budgets`: a single lane's ops get every thread; workers
    get one, for the reason :mod:`opweave.backends.threads` gives)."""
    lanes = {(i.device, i.stream) for i in plan.instrs if i.kind == "launch"}
    if per_op and costs is not None and len(lanes) > 1:
        return op_threads(simulate(graph, plan, costs), total=total)
    return plan_budgets(plan, total=total)


def op_threads(sim: Any, total: int | None = None, overlap: float = 0.1) -> dict[str, int]:
    """Intra-op threads per op of a replayed plan (:func:`opweave.backends.simulate.simulate`). The first lane (the
    smallest; it runs in the caller's thread) shares the cores with the lanes that run beside it: its op gets
    ``total // k`` threads (at least 1), where ``k`` is its own lane plus every other lane that is busy for more
    than ``overlap`` of the op's time, so an op that runs alone gets every core. Every other lane's op gets one
    thread (:mod:`opweave.backends.threads`: a worker with a bigger team slows every OpenMP kernel of the
    process). A lane changes
    its thread count between ops (``torch.set_num_threads`` costs next to nothing beside an op).

    >>> from types import SimpleNamespace
    >>> sim = SimpleNamespace(start_ms={"a": 0, "b": 0, "c": 4, "d": 6}, finish_ms={"a": 4, "b": 3, "c": 6, "d": 8},
    ...                       lane_of={"a": (0, 0), "b": (0, 1), "c": (0, 0), "d": (0, 1)})
    >>> op_threads(sim, total=2)
    {'a': 1, 'b': 1, 'c': 2, 'd': 1}
    """
    total = total_threads(total)
    busy: dict[Any, list[tuple[float, float]]] = {}
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
    :func:`~opweave.backends.threads.total_threads`): :func:`op_threads`' with ``per_op``, else
    :func:`~opweave.backends.threads.budgets`'. What to compile a call for
    ahead of time (the serving executor's whole blocks)."""
    total = total_threads(total)
    if per_op:
        return sorted({1} | {max(1, total // k) for k in range(1, max(1, lanes) + 1)})
    return sorted({1} | {budgets(range(k), total)[0] for k in range(1, max(1, lanes) + 1)})


__all__ = ["lane_threads", "op_budgets", "op_threads"]
