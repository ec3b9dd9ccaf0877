"""The operator graph: what every later layer reads.

* :mod:`.graph` — :class:`Op`, :class:`Edge`, :class:`OpGraph` and the ``opweave.graph/1`` JSON format;
* :mod:`.kinds` — what kind of operator an op is (one table; capture sets it, the costs read it);
* :mod:`.synth` — HIOS-style random layered DAGs;
* :mod:`.examples` — the papers' example graphs, shipped as JSON.

Pure data (no torch import): schedulers, the simulator and the CLI load and save graphs on any machine.
"""

from opweave.errors import GraphError
from opweave.ir.graph import CATEGORIES, FORMAT, Edge, Op, OpGraph, chain

__all__ = ["CATEGORIES", "FORMAT", "Edge", "GraphError", "Op", "OpGraph", "chain"]
