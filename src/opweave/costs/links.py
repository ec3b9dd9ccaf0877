"""Links between devices: what moving a tensor from one device to another costs, for HIOS's edge transfer times.

A :class:`Link` is the linear model ``transfer_ms(bytes) = latency_ms + bytes / bandwidth``, the model HIOS's
§III gives an edge its weight t(u, v) with ("the data transfer time between operators u and v on two different
GPUs"); the paper measures it per edge on its A40 + NVLink bridge server, opweave derives it from the edge's bytes.

Where a link comes from:

* a preset (:data:`PRESETS`): datasheet bandwidths (cited beside each), latencies stated as assumptions (no
  datasheet gives a point-to-point latency);
* a file written by ``opweave profile-links``: point-to-point times measured between two ranks of the distributed
  backend over a range of message sizes, fitted by least squares (:func:`fit`).

:func:`transfer_times` gives every edge of a graph its time (``war`` edges carry no bytes: the latency alone, the
cost of the synchronizing message the distributed backend sends for them); :func:`with_link` writes them into a
copy of the graph, so the schedulers (through :class:`~opweave.costs.Costs`) and the simulator see them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opweave.errors import UsageError, did_you_mean
from opweave.ir.graph import Edge, Op, OpGraph

FORMAT = "opweave.link/1"


@dataclass(frozen=True)
class Link:
    """``latency_ms + bytes / (bandwidth_gbs · 10⁹ B/s)``, one direction, one pair of devices."""

    name: str
    latency_ms: float
    bandwidth_gbs: float  # GB/s, decimal (10^9 bytes), as datasheets count
    source: str = ""
    samples: list[dict] = field(default_factory=list)  # measured {"bytes", "ms"} points (profile-links only)

    def __post_init__(self) -> None:
        if not (self.latency_ms >= 0 and self.bandwidth_gbs > 0):
            raise UsageError(f"link {self.name!r}: latency must be >= 0 and bandwidth > 0, got "
                             f"{self.latency_ms} ms and {self.bandwidth_gbs} GB/s")

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / (self.bandwidth_gbs * 1e9) * 1e3

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n")


PRESETS: dict[str, Link] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 900 GB/s per GPU, both directions together -> 450 GB/s
    # one way (pairs talk through NVSwitch at the full per-GPU rate). Latency: an assumption of ~10 us for an NCCL
    # point-to-point message between two GPUs of one node (kernel launch plus protocol), not a datasheet figure.
    "nvlink4": Link("nvlink4", 0.010, 450.0, "H100 SXM5 datasheet NVLink 900 GB/s bidirectional; latency assumed"),
    # PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b encoding -> 1.969 GB/s per lane per direction,
    # x16 = 31.5 GB/s one way. Latency: an assumption of ~15 us (GPU-to-GPU copies through the root complex).
    "pcie4": Link("pcie4", 0.015, 31.5, "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 / 8; latency assumed"),
    # PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b -> 3.938 GB/s per lane, x16 = 63.0 GB/s.
    "pcie5": Link("pcie5", 0.015, 63.0, "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 / 8; latency assumed"),
    # CPU ranks on one machine: gloo over TCP on the loopback interface. No datasheet: fits of `opweave profile-links
    # --device cpu` on the shared 2-core development machine, rounded (the fits: docs/distributed.md, "Links"). The
    # latency is mostly the operating system scheduling busy processes on two shared cores, and should be far lower
    # on an idle machine with spare cores (not measured here). Measure yours with profile-links.
    "loopback": Link("loopback", 1.9, 2.0, "gloo over TCP loopback, fitted by opweave profile-links on a loaded "
                                           "2-core machine"),
}


def names() -> list[str]:
    return list(PRESETS)


def load(spec: str | Path | Link) -> Link:
    """A preset by name, or a link file written by ``opweave profile-links`` (or :meth:`Link.save`)."""
    if isinstance(spec, Link):
        return spec
    if str(spec).lower() in PRESETS:
        return PRESETS[str(spec).lower()]
    path = Path(spec)
    if not path.exists():
        raise UsageError(f"unknown link {str(spec)!r}{did_you_mean(str(spec).lower(), PRESETS)}: not a preset "
                         f"({', '.join(PRESETS)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{path}: not an {FORMAT} file (write one with opweave profile-links)")
    try:
        return Link(str(data["name"]), float(data["latency_ms"]), float(data["bandwidth_gbs"]),
                    str(data.get("source", path)), list(data.get("samples", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: bad link file ({type(exc).__name__}: {exc})") from None


def fit(samples: Sequence[tuple[float, float]], name: str = "measured", source: str = "") -> Link:
    """Least-squares fit of ``ms = latency + bytes / bandwidth`` to ``(bytes, ms)`` samples (numpy ``lstsq``).

    Plain (absolute) residuals: the largest messages dominate, so the bandwidth is robust to the noise of small
    messages on a busy machine and the latency is what the large messages leave over (relative residuals were
    tried: on a loaded 2-core machine the noise of small messages then decides the slope, sometimes negative). A
    fitted latency below 0 (noise on a fast link) is clamped to 0. Raises :class:`UsageError` when the samples
    cannot determine a positive bandwidth (fewer than two sizes, or time not growing with size)."""
    import numpy as np

    if len({b for b, _ in samples}) < 2:
        raise UsageError("fitting a link needs samples at two message sizes at least")
    x = np.array([[1.0, float(b)] for b, _ in samples])
    y = np.array([float(ms) for _, ms in samples])
    (latency_ms, ms_per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    if ms_per_byte <= 0:
        raise UsageError("the measured times do not grow with message size; cannot fit a bandwidth")
    return Link(name, max(0.0, float(latency_ms)), 1e-6 / float(ms_per_byte), source,
                [{"bytes": float(b), "ms": float(ms)} for b, ms in samples])


def transfer_times(graph: OpGraph, link: str | Path | Link) -> dict[tuple[str, str], float]:
    """Every edge's transfer time over ``link`` (from the edge's bytes)."""
    link = load(link)
    return {(e.src, e.dst): link.transfer_ms(e.bytes) for e in graph.edges}


def with_link(graph: OpGraph, link: str | Path | Link) -> OpGraph:
    """A copy of ``graph`` whose edges carry their transfer time over ``link``."""
    times = transfer_times(graph, link)
    edges = [Edge(**{**asdict(e), "transfer_ms": times[(e.src, e.dst)]}) for e in graph.edges]
    return OpGraph([Op(**asdict(o)) for o in graph.ops], edges, graph.name)
