"""Costs: what a scheduler knows about each op, and the models that turn concurrency into time.

* :mod:`.model` — :class:`Costs` (per-op latency, utilization, resources; edge transfers) and the two cost models,
  ``ideal`` and ``gpu`` (:class:`GpuModel`);
* :mod:`.contention` — the ``gpu`` model's fluid processor sharing;
* :mod:`.roofline` — estimated costs from FLOPs and bytes, per device preset;
* :mod:`.profile` — measured costs on a real device;
* :mod:`.timing` — the one way opweave times a call.
"""

from opweave.costs.model import COST_MODELS, Costs, GpuModel, from_graph

__all__ = ["COST_MODELS", "Costs", "GpuModel", "from_graph"]
