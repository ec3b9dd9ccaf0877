"""Pictures of a simulated run: a Gantt chart (PNG) and a Chrome trace (``chrome://tracing``, Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path

from opweave.backends.simulate import SimResult


def gantt(result: SimResult, path: str | Path) -> None:
    """Write a Gantt chart PNG: one row per (device, stream), one bar per op, labelled where the label fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted(set(result.lane_of.values()))
    row = {lane: r for r, lane in enumerate(lanes)}
    width_in = 12.0
    fig, ax = plt.subplots(figsize=(width_in, 0.5 + 0.4 * max(1, len(lanes))))
    span_ms = max(result.makespan_ms, 1e-9)
    ms_per_char = span_ms / (width_in * 0.8) * 0.07  # ~0.07 inch per character at font size 7
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(cmap.N)]
    for k, (op, lane) in enumerate(result.lane_of.items()):
        begin, length = result.start_ms[op], result.finish_ms[op] - result.start_ms[op]
        ax.broken_barh([(begin, length)], (row[lane] - 0.4, 0.8), facecolors=colors[k % len(colors)],
                       edgecolors="black", linewidth=0.3)
        if length >= ms_per_char * (len(op) + 1):
            ax.text(begin + length / 2, row[lane], op, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), [f"dev {d} / stream {s}" for d, s in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{result.name}: makespan {result.makespan_ms:.3f} ms (sequential {result.sequential_ms:.3f} ms, "
                 f"{result.model} model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chrome_trace(result: SimResult, path: str | Path) -> None:
    """Write a Chrome trace (``chrome://tracing``, Perfetto): one complete event per op, pid = device, tid = stream."""
    events: list[dict] = []
    for device, stream in sorted(set(result.lane_of.values())):
        events.append({"ph": "M", "name": "process_name", "pid": device, "tid": stream,
                       "args": {"name": f"device {device}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": stream,
                       "args": {"name": f"stream {stream}"}})
    for op, (device, stream) in result.lane_of.items():
        events.append({"ph": "X", "name": op, "cat": "op", "pid": device, "tid": stream,
                       "ts": result.start_ms[op] * 1e3, "dur": (result.finish_ms[op] - result.start_ms[op]) * 1e3})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
