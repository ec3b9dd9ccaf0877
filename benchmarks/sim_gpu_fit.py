"""The fitted GPU model against what the GPU measured: predicted against measured, per model and scheduler.

    .venv/bin/python benchmarks/sim_gpu_fit.py [--quick] [--results F.json,...] [--report R.json] [--out DIR]
                                               [--name NAME]

Every unfused ``opweave <scheduler>`` row of the GPU benchmark's result files (default
``results/gpu_latency_h200_b1_fp32.json``) is predicted by the shipped device (:mod:`opweave.costs.calibrated`,
what ``opweave simulate --preset h200 --cost-model gpu`` replays): the model captured one op per fx node, scheduled
on the fitted op times, replayed as one CUDA Graph call (:func:`opweave.costs.calibrate.predict`). With
``--report`` (the file ``opweave calibrate --report`` writes) the leave-one-model-out predictions are plotted too.
``--quick``: googlenet's rows only.

The modes where opweave chose its plan (``opweave default``: the CUDA default, which ranks plans by this same
device) carry the prediction their build made; ``chosen`` lists them against what they measured (run with the
device file as it was when they ran, these are predictions made without them).

Writes ``DIR/NAME.json`` (default name ``sim_gpu_fit``; every row: measured, predicted, left out; per panel the mean
and worst ``|predicted / measured - 1|`` and per model whether the scheduler predicted fastest measured within 5%
of the fastest; the chosen modes) and ``DIR/NAME.png`` (one panel per fit, log axes, the line y = x, a color per
model and a marker per scheduler).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _common as common

from opweave.costs import calibrate as fit
from opweave.costs import calibrated
from opweave.pipeline.choose import replay

DEFAULT_RESULTS = common.RESULTS_DIR / "gpu_latency_h200_b1_fp32.json"
MARKERS = "osD^v<>pXh*"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="googlenet's rows only")
    p.add_argument("--results", help=f"comma list of result files (default {DEFAULT_RESULTS.name})")
    p.add_argument("--report", type=Path, help="opweave calibrate --report file: plot its leave-one-model-out rows")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="directory (default %(default)s)")
    p.add_argument("--name", default="sim_gpu_fit", help="file name without suffix (default %(default)s)")
    return p.parse_args(argv)


def panel(rows: list[dict], key: str) -> dict:
    """Mean and worst error of ``key`` against the measurement, and per configuration the pick's loss."""
    errs = [abs(r[key] / r["measured_ms"] - 1) for r in rows]
    picks = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        members = [r for r in rows if r["config"] == config]
        chosen = min(members, key=lambda r: r[key])
        fastest = min(members, key=lambda r: r["measured_ms"])
        loss = chosen["measured_ms"] / fastest["measured_ms"] - 1
        picks[config] = {"predicted_fastest": chosen["scheduler"], "measured_fastest": fastest["scheduler"],
                         "loss": loss, "within_5_percent": loss <= 0.05}
    return {"rows": len(errs), "mean_error": sum(errs) / len(errs), "max_error": max(errs), "picks": picks}


def chosen_rows(paths: list[Path]) -> list[dict]:
    """The rows of modes that chose their own plan with the prediction their build made (``predicted_ms``), against
    what they measured."""
    out = []
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            if "choice" in r and r.get("predicted_ms") and r.get("median_ms") and r.get("ok", True):
                out.append({"model": r["model"], "batch": r["batch_size"], "dtype": r["dtype"], "mode": r["mode"],
                            "choice": r["choice"], "measured_ms": r["median_ms"], "predicted_ms": r["predicted_ms"],
                            "error": r["predicted_ms"] / r["median_ms"] - 1})
    return out


def plot(rows: list[dict], panels: dict[str, str], summaries: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    scheds = list(dict.fromkeys(r["scheduler"] for r in rows))
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 5.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels.items(), strict=True):
        values = [r["measured_ms"] for r in rows] + [r[key] for r in rows]
        lo, hi = min(values) * 0.85, max(values) * 1.15
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="y = x")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9", label="±10%")
        for r in rows:
            ax.scatter(r["measured_ms"], r[key], color=colors(models.index(r["model"]) % 10),
                       marker=MARKERS[scheds.index(r["scheduler"]) % len(MARKERS)], s=42, edgecolors="black",
                       linewidths=0.4)
        s = summaries[key]
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured median (ms)",
               ylabel="predicted (ms)", title=f"{title}: mean {s['mean_error']:.1%}, worst {s['max_error']:.1%}")
        ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], color=colors(i % 10), marker="o", ls="", label=m) for i, m in enumerate(models)]
    handles += [plt.Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], ls="", label=s)
                for i, s in enumerate(scheds)]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", ncol=2)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = [Path(p) for p in args.results.split(",")] if args.results else [DEFAULT_RESULTS]
    rows = fit.read_rows(paths)
    if args.quick:
        rows = [r for r in rows if r.model == "googlenet"]
    dev = calibrated.device("h200")
    rows_replay = replay()
    predicted = fit.predict(rows, fit.prepare(rows, dev, rows_replay), dev, rows_replay)
    held = {}
    if args.report:
        report = json.loads(args.report.read_text())
        held = {(r["model"], r["batch"], r["dtype"], r["scheduler"]): r["left_out_ms"] for r in report["rows"]
                if "left_out_ms" in r}
    out_rows = []
    for r, p in zip(rows, predicted, strict=True):
        row = {"model": r.model, "batch": r.batch, "dtype": r.dtype, "scheduler": r.scheduler, "streams": r.streams,
               "config": f"{r.model}/b{r.batch}/{r.dtype}", "measured_ms": r.measured_ms, "predicted_ms": p,
               "error": p / r.measured_ms - 1}
        if (r.model, r.batch, r.dtype, r.scheduler) in held:
            row["left_out_ms"] = held[(r.model, r.batch, r.dtype, r.scheduler)]
        out_rows.append(row)
    panels = {"predicted_ms": "fitted on all rows"}
    if out_rows and all("left_out_ms" in r for r in out_rows):
        panels["left_out_ms"] = "each model left out"
    summaries = {key: panel(out_rows, key) for key in panels}
    chosen = chosen_rows(paths)
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / f"{args.name}.json", {
        "machine": common.machine_info(), "device": dev.name, "device_fit": dev.fit,
        "settings": {"results": [str(p) for p in paths], "report": str(args.report) if args.report else None,
                     "quick": args.quick},
        "definitions": {"error": "predicted / measured - 1 of one row (median of whole calls, CUDA-graph mode)",
                        "loss": "how much slower the scheduler predicted fastest measured than the fastest"},
        "summary": {key: summaries[key] for key in panels}, "rows": out_rows, "chosen": chosen,
        "chosen_summary": {"rows": len(chosen), "mean_error": sum(abs(c["error"]) for c in chosen) / len(chosen),
                           "max_error": max(abs(c["error"]) for c in chosen)} if chosen else None})
    plot(out_rows, panels, summaries, args.out / f"{args.name}.png")
    cells = [[r["model"], r["scheduler"], f"{r['measured_ms']:.3f}", f"{r['predicted_ms']:.3f}", f"{r['error']:+.1%}",
              f"{r['left_out_ms']:.3f}" if "left_out_ms" in r else ""] for r in out_rows]
    common.console.print(common.table("fitted device against the GPU", ["model", "scheduler", "measured ms",
                                                                        "predicted ms", "error", "left out ms"], cells))
    for key, s in summaries.items():
        common.console.print(f"{panels[key]}: mean {s['mean_error']:.1%}, worst {s['max_error']:.1%}")
    for c in chosen:
        common.console.print(f"{c['model']} b{c['batch']} {c['dtype']} {c['mode']} ({c['choice']}): measured "
                             f"{c['measured_ms']:.3f} ms, its build predicted {c['predicted_ms']:.3f} "
                             f"({c['error']:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
