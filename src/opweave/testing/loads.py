"""What the serving tests and benchmarks measure of a load, and the product never needs: a model's latency alone on
the simulated executor (:func:`model_latency_ms`), and whether a load report's rate was sustained
(:func:`sustainable`)."""

from __future__ import annotations

from opweave.serve.engine.combined import Part
from opweave.serve.engine.simulation import SimExecutor


def model_latency_ms(executor: SimExecutor, model: str, batch: int = 1) -> float:
    """One request of ``batch`` samples alone through every block of ``model`` on ``executor`` (no queueing), in
    ms."""
    return sum(executor.run([Part(model, b, batch)]).seconds for b in range(len(executor.models[model].blocks))) * 1e3


def sustainable(rep: dict, slo_ms: float = 100.0) -> bool:
    """True if the 99th percentile of every sent request of a load report (:mod:`opweave.serve.loadgen`: rejections,
    timeouts and errors infinitely late) is under ``slo_ms``: a server that sheds load does not count as sustaining
    it."""
    return rep["total"]["sent"] > 0 and rep["total"]["p99_all_ms"] < slo_ms


__all__ = ["model_latency_ms", "sustainable"]
