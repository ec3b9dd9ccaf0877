"""The statistics extension (KServe v2's and Triton's ``statistics``): per served model and version, how many
requests the engine answered and how their time went, in Triton's ``ModelStatistics`` fields, which
``tritonclient``'s ``get_inference_statistics`` and ``perf_analyzer`` read. Collected through the engine's
:class:`~opweave.serve.engine.Observer` hooks (no HTTP here); both front ends answer from the same collector
(:meth:`Statistics.of`).

=================  =================================================================================================
field              what it counts (``count`` requests, ``ns`` their summed nanoseconds)
=================  =================================================================================================
inference_count    samples answered (a request of batch 4 counts 4)
execution_count    batches run through the model: an inference instance (stacked requests) passing its last block
last_inference     when the last request was answered (milliseconds since the epoch; 0: none yet)
success            requests answered, from arrival to answer
fail               requests refused by a full queue (0 ns), timed out or failed (from arrival to the end)
queue              answered requests, from arrival to dequeue
compute_input      answered requests, the dequeue's preparing of the inputs (stacking them into an instance)
compute_infer      answered requests, from then to the end of the last block (the blocks, and the waits between)
compute_output     answered requests, the splitting of the outputs into the requests' answers
=================  =================================================================================================

As in Triton, a batch's compute time counts once for every request in it, and ``success`` is the sum of the four
parts of a request. A request refused before it reaches the engine (malformed: 400; unknown model: 404) is in no
model's statistics. A model's statistics start when it is loaded and go when it is unloaded (a reload starts
afresh). ``cache_hit`` and ``cache_miss`` (Triton's response cache) are always zero: opweave caches no responses.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from opweave.serve.engine.combined import Part
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.executors import StepCost
from opweave.serve.engine.requests import Observer, Request
from opweave.serve.frontend import Refused
from opweave.serve.models import ServedModel
from opweave.serve.protocol import shown

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
             "cache_miss")


@dataclass
class Duration:
    """Triton's ``StatisticDuration``: a count and the nanoseconds they took together."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(0, round(seconds * 1e9))


@dataclass
class ModelStats:
    """One model's counters (module table)."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference: int = 0
    durations: dict[str, Duration] = field(default_factory=lambda: {k: Duration() for k in DURATIONS})

    def to_json(self, name: str, version: str) -> dict:
        """Triton's ``ModelStatistics`` in its JSON form (what ``GET /v2/models/stats`` lists)."""
        return {"name": name, "version": version, "last_inference": self.last_inference,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {k: {"count": d.count, "ns": d.ns} for k, d in self.durations.items()},
                "batch_stats": [], "memory_usage": []}


class Statistics(Observer):
    """The statistics of one engine's models (module docstring). Attach it with :meth:`of`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.models: dict[str, ModelStats] = {m: ModelStats() for m in engine.models}

    @classmethod
    def of(cls, engine: Engine) -> Statistics:
        """The engine's collector, attached to it on first use: one per engine, however many front ends ask."""
        with engine.lock:
            for observer in engine.observers:
                if isinstance(observer, cls):
                    return observer
            stats = cls(engine)
            engine.observers.append(stats)
            return stats

    # ---- the engine's hooks (called under the engine's lock) ----------------------------------------------------
    def on_add(self, model: str) -> None:
        with self.lock:
            self.models[model] = ModelStats()

    def on_remove(self, model: str) -> None:
        with self.lock:
            self.models.pop(model, None)

    def on_reject(self, model: str) -> None:
        with self.lock:
            self._stats(model).durations["fail"].add(0.0)

    def on_step(self, parts: list[Part], cost: StepCost) -> None:
        last = {p.model for p in parts if p.block == self.engine.models[p.model].blocks - 1}
        with self.lock:
            for p in parts:
                if p.model in last:
                    self._stats(p.model).execution_count += 1

    def on_done(self, request: Request) -> None:
        with self.lock:
            stats = self._stats(request.model)
            stats.last_inference = int(time.time() * 1000)
            d = stats.durations
            if request.status != "done":
                d["fail"].add(request.latency_s)
                return
            stats.inference_count += request.batch
            d["success"].add(request.latency_s)
            d["queue"].add(request.queue_s)
            d["compute_input"].add(request.input_s)
            d["compute_infer"].add(request.infer_s)
            d["compute_output"].add(request.output_s)

    def _stats(self, model: str) -> ModelStats:
        return self.models.setdefault(model, ModelStats())

    # ---- the answers ----------------------------------------------------------------------------------------------
    def report(self, served: dict[str, ServedModel], name: str = "", version: str = "") -> dict:
        """``{"model_stats": [...]}`` for every served model, or for ``name`` (at ``version``, if given);
        :class:`~opweave.serve.frontend.Refused` ``not_found`` for a model or version not served."""
        if name:
            model = served.get(name)
            if model is None:
                raise Refused("not_found", f"unknown model {shown(name)}")
            if version not in ("", model.version):
                raise Refused("not_found", f"model {name!r} has no version {shown(version)} (only {model.version})")
            chosen = [model]
        elif version:
            raise Refused("invalid", "a version needs a model name")
        else:
            chosen = [served[n] for n in sorted(served)]
        with self.lock:
            return {"model_stats": [self.models.get(m.name, ModelStats()).to_json(m.name, m.version)
                                    for m in chosen]}


__all__ = ["DURATIONS", "Duration", "ModelStats", "Statistics"]
