"""Sequential baseline: every op on stream 0 of device 0, in capture order (what the framework does eagerly).

Complexity O(V + E) for the topological order. ``predicted_ms`` is ``math.fsum`` of the op latencies: correctly
rounded, so the same on every Python (3.12's ``sum`` of floats compensates, 3.11's does not).
"""

from __future__ import annotations

import math

from opweave.costs.model import Costs
from opweave.ir.graph import OpGraph
from opweave.schedulers.schedule import Schedule


def schedule(graph: OpGraph, costs: Costs, *, streams: int | None = None, devices: int = 1) -> Schedule:
    order = graph.topo_order
    return Schedule("sequential", list(order), {o: 0 for o in order}, {o: 0 for o in order},
                    predicted_ms=math.fsum(costs.latency_ms[o] for o in order))
