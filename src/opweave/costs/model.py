"""Costs: what a scheduler knows about each op, and the cost models that turn concurrency into time.

Two cost models:

* ``ideal`` — the papers' model: an op takes its ``latency_ms`` whatever runs beside it, streams are FIFO, a
  cross-device edge adds its ``transfer_ms``, launches and syncs are free.
* ``gpu`` — a contention model (see :class:`GpuModel`).

Schedulers read :class:`Costs` only; they never touch torch or a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from opweave.errors import GraphError, UsageError, did_you_mean
from opweave.ir.graph import OpGraph

COST_MODELS = ("ideal", "gpu")


@dataclass(frozen=True)
class GpuModel:
    """Contention model of one GPU.

    Each op alone fills ``utilization`` (0–1) of the device. While the running ops' shares sum to more than 1,
    every running op progresses at rate ``1 / sum`` (proportional slow-down, processor sharing). Without a CUDA
    Graph every launch costs the CPU ``launch_overhead_ms`` (ops on all streams of a device are issued by one CPU
    thread, so launches serialize); with one, a launch costs ``graph_launch_overhead_ms``. Either way a
    cross-stream ``wait`` is an edge that costs ``event_overhead_ms``: what waits starts that long after the
    record completes. Inside a graph, each of an op's kernels (``Costs.kernels``, 1 unless given) starts
    ``kernel_gap_ms`` after the kernel before it on its stream (the gap between back-to-back kernels of a graph),
    the first no earlier than its cross-stream edges allow, and the device starts at most one kernel every
    ``dispatch_ms`` across all its streams (a fitted device, :mod:`opweave.costs.calibrated`, sets both; 0 by
    default).
    """

    launch_overhead_ms: float = 0.005
    graph_launch_overhead_ms: float = 0.0
    event_overhead_ms: float = 0.002
    cuda_graph: bool = True
    kernel_gap_ms: float = 0.0
    dispatch_ms: float = 0.0


def file_fields(cls, data, fmt: str, what: str, error: type[Exception] = UsageError) -> dict:
    """The fields of a dataclass ``cls`` read back from its JSON form (``{"format": fmt, **fields}``): ``error``,
    one line naming ``what`` it is not, for another format or a field ``cls`` does not have."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise error(f"not an opweave {what} (format {found!r}, expected {fmt!r})")
    fields = {k: v for k, v in data.items() if k != "format"}
    unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
    if unknown:
        raise error(f"{what} has unknown field(s) {', '.join(unknown)}")
    return fields


@dataclass(frozen=True)
class Costs:
    """Per-op costs of one graph on one device kind (the same for every device of a multi-GPU run).

    Frozen: a scheduler may keep it and rely on it; derive a changed copy with :func:`dataclasses.replace`, which
    checks the cost model again.
    """

    latency_ms: dict[str, float]
    utilization: dict[str, float] = field(default_factory=dict)
    category: dict[str, str] = field(default_factory=dict)
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    edge_transfer_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    kernels: dict[str, float] = field(default_factory=dict)
    model: str = "ideal"
    gpu: GpuModel = field(default_factory=GpuModel)
    source: str = "graph"

    def __post_init__(self) -> None:
        if self.model not in COST_MODELS:
            raise UsageError(f"unknown cost model {self.model!r}{did_you_mean(self.model, COST_MODELS)}; choose one of "
                             f"{', '.join(COST_MODELS)}")

    def util(self, op: str) -> float:
        return self.utilization.get(op, 1.0)

    def kernel_count(self, op: str) -> float:
        """Kernels ``op`` launches (1 unless given; the ``gpu`` model's launch gaps are per kernel)."""
        return self.kernels.get(op, 1.0)

    def transfer_ms(self, src: str, dst: str) -> float:
        """Time to move ``src``'s output to another device for ``dst`` (0 when the graph gives none)."""
        return self.edge_transfer_ms.get((src, dst), 0.0)

    def stage_latency_ms(self, groups: Sequence[Sequence[str]]) -> float:
        """Latency of a stage: the groups run concurrently, each group's ops in sequence on its own stream.

        Under ``ideal`` this is the longest group; under ``gpu`` the groups share the device (see
        :func:`opweave.costs.contention.run_streams`), plus one event per extra group to fork/join. A group's sum is
        ``math.fsum`` (correctly rounded): Python 3.12's ``sum`` of floats differs from 3.11's in the last bit, and
        schedulers that compare stages (IOS's DP) would break ties differently on the two.
        """
        if self.model == "ideal" or len(groups) <= 1:
            return max((math.fsum(self.latency_ms[o] for o in g) for g in groups), default=0.0)
        from opweave.costs.contention import run_streams

        finish = run_streams([[(o, self.latency_ms[o], self.util(o)) for o in g] for g in groups])
        return max(finish.values()) + self.gpu.event_overhead_ms * (len(groups) - 1)


def from_graph(graph: OpGraph, model: str = "ideal", gpu: GpuModel | None = None, source: str = "graph") -> Costs:
    """Costs read off the graph's own fields (latency_ms, utilization, category, resources, edge transfer_ms)."""
    missing = [o.id for o in graph.ops if o.latency_ms is None]
    if missing:
        raise GraphError(f"op {missing[0]!r} has no latency_ms; estimate costs with "
                         "opweave.costs.roofline.estimate() first")
    return Costs(
        latency_ms=graph.latencies(),
        utilization={o.id: o.utilization for o in graph.ops if o.utilization is not None},
        category={o.id: o.category for o in graph.ops},
        resources={o.id: dict(o.resources) for o in graph.ops if o.resources},
        edge_transfer_ms={(e.src, e.dst): e.transfer_ms for e in graph.edges if e.transfer_ms is not None},
        model=model,
        gpu=gpu or GpuModel(),
        source=source,
    )
