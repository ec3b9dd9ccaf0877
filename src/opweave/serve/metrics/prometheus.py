"""Prometheus metrics of one engine (``GET /metrics``, the Prometheus text format), collected through the engine's
:class:`~opweave.serve.engine.requests.Observer` hooks, in a registry of their own: per model queue depth, instances in
flight, queue time, compute time, end-to-end latency, requests by outcome, rejections and batch sizes; per step its
duration, sub-blocks and decision time; the plan cache; GPU utilization through NVML where it is installed and a GPU
is there."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from opweave.serve.engine.combined import Part
from opweave.serve.engine.engine import Engine
from opweave.serve.engine.executors import StepCost
from opweave.serve.engine.requests import Observer, Request

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
DECISION_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class Metrics(Observer):
    """Prometheus metrics of one engine, in their own registry: per model queue depth, queue time, compute time,
    end-to-end latency, requests by outcome, rejections, batch sizes; per step duration, sub-blocks and decision time;
    the plan cache; GPU utilization through NVML where it is installed and a GPU is there."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.engine = engine
        models = list(engine.models)
        self.queue_depth = Gauge("opweave_queue_depth", "Requests waiting in the model's queue", ["model"], registry=r)
        self.instances = Gauge("opweave_instances", "Inference instances of the model in flight", ["model"],
                               registry=r)
        self.requests = Counter("opweave_requests", "Requests by outcome (answered, timeout, error, rejected)",
                                ["model", "outcome"], registry=r)
        self.rejections = Counter("opweave_rejections", "Requests refused with 429 (queue full)", ["model"],
                                  registry=r)
        self.queue_time = Histogram("opweave_queue_time_seconds", "Time from arrival to dequeue", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.compute_time = Histogram("opweave_compute_time_seconds", "Time from dequeue to answer", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("opweave_request_latency_seconds", "End-to-end latency (arrival to answer)",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("opweave_batch_size", "Samples stacked in a sub-block run", ["model"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step = Histogram("opweave_step_seconds", "Duration of a combined block", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.parts = Histogram("opweave_step_sub_blocks", "Sub-blocks in a combined block", buckets=(1, 2, 3, 4, 6, 8),
                               registry=r)
        self.decision = Histogram("opweave_decision_seconds", "What a step spent observing the engine and asking the "
                                  "policy before its combined block ran", buckets=DECISION_BUCKETS, registry=r)
        cache = Gauge("opweave_plan_cache", "Compiled combination signatures: hits, misses, evictions", ["event"],
                      registry=r)
        def counted(event: str) -> Callable[[], float]:
            return lambda: engine.executor.stats[event]

        for event in ("hits", "misses", "evictions"):
            cache.labels(event).set_function(counted(event))
        for m in models:  # every series exists from the start, at 0
            self.on_add(m)
        handle = _nvml_handle() if getattr(engine.executor, "device", "cpu") != "cpu" else None
        if handle is not None:
            import pynvml

            Gauge("opweave_gpu_utilization_ratio", "GPU utilization (NVML, last sample period)", registry=r
                  ).set_function(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)

    def on_add(self, model: str) -> None:
        """A model's series, at 0 (at start, and when a model is loaded)."""
        models = self.engine.models

        def length(field: str):
            return lambda: len(getattr(models[model], field)) if model in models else 0

        self.queue_depth.labels(model).set_function(length("queue"))
        self.instances.labels(model).set_function(length("instances"))
        self.rejections.labels(model)
        for outcome in ("answered", "timeout", "error", "rejected"):
            self.requests.labels(model, outcome)

    def on_remove(self, model: str) -> None:
        """An unloaded model's series go (Prometheus keeps what it scraped)."""
        labels = [(m, (model,)) for m in (self.queue_depth, self.instances, self.rejections, self.queue_time,
                                          self.compute_time, self.latency, self.batch)]
        for metric, values in labels + [(self.requests, (model, o)) for o in ("answered", "timeout", "error",
                                                                            "rejected")]:
            try:
                metric.remove(*values)
            except KeyError:  # never observed
                pass

    def on_reject(self, model: str) -> None:
        self.rejections.labels(model).inc()
        self.requests.labels(model, "rejected").inc()

    def on_dequeue(self, request: Request) -> None:
        self.queue_time.labels(request.model).observe(request.queue_s)

    def on_step(self, parts: list[Part], cost: StepCost) -> None:
        self.step.observe(cost.seconds)
        self.parts.observe(len(parts))
        for p in parts:
            self.batch.labels(p.model).observe(p.batch)

    def on_decision(self, seconds: float) -> None:
        self.decision.observe(seconds)

    def on_done(self, request: Request) -> None:
        outcome = {"done": "answered"}.get(request.status, request.status)
        self.requests.labels(request.model, outcome).inc()
        if request.status == "done":
            assert request.finished is not None and request.dequeued is not None  # an answer was dequeued first
            self.latency.labels(request.model).observe(request.latency_s)
            self.compute_time.labels(request.model).observe(request.finished - request.dequeued)


def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        import torch

        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no NVML, no GPU metric
        return None


__all__ = ["DECISION_BUCKETS", "LATENCY_BUCKETS", "Metrics"]
