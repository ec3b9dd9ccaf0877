"""Fitting a device (:mod:`opweave.costs.calibrated`) to what a GPU measured, and how well it predicts.

Two steps, each on its own data:

1. **Per op class** (:func:`fit_classes`), on a profiler trace of every op alone (``scripts/dump_trace.py``, the
   trace ``profile_model`` takes): each class's kernels per op (their mean count), and the kernel floor and
   efficiency that minimize the squared log error of the op times, with one memory efficiency for all classes.
2. **Per call** (:func:`fit_call`), on the GPU benchmark's rows (``benchmarks/gpu_latency.py``: per model, batch,
   dtype and scheduler, the median of whole calls in CUDA-graph mode): every row's graph is captured as the
   benchmark captured it (one op per fx node), scheduled on the fitted op times as the benchmark scheduled on its
   profile (``ideal`` costs, its stream cap), lowered, validated, and replayed by the simulator under the fitted
   ``gpu`` model (what the layers above the costs do, handed in as a :class:`Replay`:
   :func:`opweave.pipeline.choose.replay`); the kernel gap, dispatch interval, event wait, call cost and concurrency
   minimize the mean of ``|log(predicted / measured)|`` plus a term for the measured orderings the predictions
   invert (within a configuration, two plans whose measured spreads do not overlap: :func:`ordered_pairs`,
   :func:`rank_loss`), so that the fit is also held to what a choice between plans needs (Nelder-Mead from the
   shipped values, each parameter kept within its bounds).

:func:`calibrate` gives the error fitted on every row and with each model left out (its rows predicted by a device
fitted on the other models' rows), and per configuration whether the plan predicted fastest measured fastest; it is
what ``opweave calibrate`` prints.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from opweave.costs import calibrated
from opweave.costs.calibrated import BORROW, CLASSES, Device, OpClass
from opweave.costs.model import Costs
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph

CALL_PARAMS = ("kernel_gap_us", "dispatch_us", "event_wait_us", "call_us", "concurrency")
BOUNDS = {"kernel_gap_us": (0.0, 5.0), "dispatch_us": (0.0, 3.0), "event_wait_us": (0.0, 10.0),
          "call_us": (0.0, 200.0), "concurrency": (0.05, 10.0)}
RANK_WEIGHT = 1.0  # the weight of the ordering term against the mean log error in the call's fit


# ---- the rows -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One measured opweave mode: a model at a batch and dtype, run with one scheduler at a stream cap."""

    model: str
    batch: int
    dtype: str
    scheduler: str
    streams: int | None
    measured_ms: float
    source: str = ""
    spread_ms: tuple[float, float] | None = None  # the benchmark's p10 and p90 of the call, where it wrote them

    @property
    def config(self) -> tuple[str, int, str]:
        return self.model, self.batch, self.dtype


def read_rows(paths: Sequence[str | Path]) -> list[Row]:
    """The unfused ``opweave <scheduler>`` rows with a median of the benchmark's result files, whose output was
    right; the rest (eager, CUDA graph, torch.compile, ``+inductor``, failed modes, and the modes where opweave
    chose the plan, ``opweave default`` and ``max-autotune``, which ran a coarsened graph) are not what the model
    predicts."""
    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read results {str(path)!r}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            raise UsageError(f"{path}: not a GPU benchmark result file (no 'results' list)")
        cap = (data.get("settings") or {}).get("streams", 8)
        for r in data["results"]:
            if (not str(r.get("mode", "")).startswith("opweave ") or "fuse" in r or "choice" in r
                    or "median_ms" not in r or not r.get("ok", True) or "scheduler" not in r):
                continue
            spread = (float(r["p10_ms"]), float(r["p90_ms"])) if "p10_ms" in r and "p90_ms" in r else None
            rows.append(Row(r["model"], int(r["batch_size"]), r["dtype"], r["scheduler"], cap,
                            float(r["median_ms"]), str(path), spread))
    if not rows:
        raise UsageError(f"no measured opweave rows in {', '.join(map(str, paths))}")
    return rows


# ---- step 1: op classes from a trace ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TracedOp:
    op: str
    cls: str
    kernels: int
    us: float


def traced_ops(graph: OpGraph, trace: dict) -> list[TracedOp]:
    """Every op of ``graph`` with GPU work in ``trace``: its class, and its median run's kernels and time."""
    from opweave.costs.profile.kineto import range_runs

    runs = defaultdict(list)
    for run in range_runs(trace):
        if run.op in graph.op:
            runs[run.op].append(run)
    out = []
    for o in graph.ops:
        if not runs[o.id]:
            continue
        ordered = sorted(runs[o.id], key=lambda r: r.duration_us)
        median = ordered[(len(ordered) - 1) // 2]
        if median.work:
            out.append(TracedOp(o.id, calibrated.op_class(graph, o), len(median.work), median.duration_us))
    if not out:
        raise UsageError("the trace has no GPU work for any op of the graph (another model, or not a GPU trace?)")
    return out


def fit_classes(graph: OpGraph, trace: dict, base: Device) -> Device:
    """``base`` with the op classes (and memory efficiency) fitted on ``trace`` of ``graph``'s ops alone; a class
    the trace lacks borrows its nearest measured class (``calibrated.BORROW``)."""
    ops = traced_ops(graph, trace)
    sheet = base.datasheet
    batch1 = [o for o in ops if not (o.cls == "conv_pointwise" and _batch(graph, o.op) > 1)]
    floors = np.linspace(0.2, 12.0, 237)
    effs = np.geomspace(0.003, 1.0, 80)
    split = {o.op: float(o.cls == "conv_pointwise" and calibrated.split_k(sheet, graph.op[o.op])) for o in batch1}
    terms = {o.op: calibrated.terms_us(sheet, o.cls, graph.op[o.op], "float32") for o in batch1}
    best: tuple[float, float, dict] | None = None
    for mem_eff in np.linspace(0.1, 1.0, 19):
        total, fitted = 0.0, {}
        for cls in CLASSES:
            members = [o for o in batch1 if o.cls == cls]
            if not members:
                continue
            k = float(np.mean([o.kernels - split[o.op] for o in members]))  # a split-K reduction is counted apart
            comp = np.array([terms[o.op][0] for o in members])
            mem = np.array([terms[o.op][1] for o in members]) / mem_eff
            meas = np.log([o.us for o in members])
            k_op = k + np.array([split[o.op] for o in members])
            work = np.maximum(comp[None, None, :] / effs[None, :, None], mem)
            pred = k_op[None, None, :] * floors[:, None, None] + work
            err = ((np.log(pred) - meas) ** 2).sum(axis=2)
            i, j = np.unravel_index(np.argmin(err), err.shape)
            total += float(err[i, j])
            fitted[cls] = OpClass(round(k, 3), round(float(floors[i]), 3), round(float(effs[j]), 4),
                                  f"trace: {len(members)} ops")
        if best is None or total < best[0]:
            best = (total, float(mem_eff), fitted)
    assert best is not None  # at least one memory efficiency was tried
    _, mem_eff, fitted = best
    classes = dict(fitted)
    for cls in CLASSES:  # borrow, following the chain until a measured class
        seen, near = [cls], BORROW.get(cls)
        while cls not in classes and near is not None and near not in seen:
            if near in fitted:
                classes[cls] = replace(fitted[near], source=f"as {near}")
            seen.append(near)
            near = BORROW.get(near)
    classes["conv_depthwise"] = replace(classes.get("conv_depthwise", OpClass()), kernels=1.0)
    return replace(base, classes={c: classes[c] for c in CLASSES if c in classes}, mem_efficiency=round(mem_eff, 3))


def _batch(graph: OpGraph, op: str) -> int:
    shape = graph.op[op].shape
    return shape[0] if shape else 1


def class_errors(graph: OpGraph, trace: dict, dev: Device) -> dict:
    """Per class: ops, mean |predicted / measured - 1| of the op times alone, kernels measured and modelled."""
    out: dict[str, dict] = {}
    for o in traced_ops(graph, trace):
        pred = calibrated.op_time_us(dev, graph, graph.op[o.op])
        entry = out.setdefault(o.cls, {"ops": 0, "error": 0.0, "kernels_measured": 0, "kernels_model": 0.0})
        entry["ops"] += 1
        entry["error"] += abs(pred / o.us - 1)
        entry["kernels_measured"] += o.kernels
        entry["kernels_model"] += calibrated.kernels(dev, graph, graph.op[o.op], o.cls)
    for entry in out.values():
        entry["error"] /= entry["ops"]
        entry["kernels_model"] = round(entry["kernels_model"], 1)
    return out


# ---- step 2: the call, on the benchmark's rows --------------------------------------------------------------------
@dataclass
class Config:
    """One (model, batch, dtype) of the rows: its graph and the plan of each scheduler measured on it."""

    graph: OpGraph
    dtype: str
    plans: dict[tuple[str, int | None], object]
    latency_ms: dict[str, float] | None = None  # measured op times (a profile), else the fitted classes'


@dataclass(frozen=True)
class Replay:
    """What the fit needs from the layers above the costs, handed in (:func:`opweave.pipeline.choose.replay`): the
    graph the benchmark scheduled for a model at a batch, a scheduler's validated plan of a graph on costs at a
    stream cap, and a plan's simulated whole call (ms) under costs."""

    graph: Callable[[str, int], OpGraph]
    plan: Callable[[OpGraph, Costs, str, int | None], Any]
    makespan_ms: Callable[[OpGraph, Any, Costs], float]


def prepare(rows: Sequence[Row], dev: Device, replay: Replay, graphs: dict | None = None) -> dict[tuple, Config]:
    """Every configuration's graph and plans: scheduled on ``dev``'s op times, as ideal costs."""
    graphs = {} if graphs is None else graphs
    configs: dict[tuple, Config] = {}
    for row in rows:
        if row.config not in configs:
            key = (row.model, row.batch)
            if key not in graphs:
                graphs[key] = replay.graph(row.model, row.batch)
            configs[row.config] = Config(graphs[key], calibrated.DTYPES.get(row.dtype, row.dtype), {})
        cfg = configs[row.config]
        if (row.scheduler, row.streams) not in cfg.plans:
            ideal = replace(calibrated.costs(cfg.graph, dev, cfg.dtype), model="ideal")
            cfg.plans[(row.scheduler, row.streams)] = replay.plan(cfg.graph, ideal, row.scheduler, row.streams)
    return configs


def predict(rows: Sequence[Row], configs: dict[tuple, Config], dev: Device, replay: Replay) -> list[float]:
    """The simulated whole-call time (ms) of every row on ``dev``."""
    out = []
    cache: dict[tuple, Costs] = {}
    for row in rows:
        cfg = configs[row.config]
        if row.config not in cache:
            cache[row.config] = calibrated.costs(cfg.graph, dev, cfg.dtype, cfg.latency_ms)
        out.append(replay.makespan_ms(cfg.graph, cfg.plans[(row.scheduler, row.streams)], cache[row.config]))
    return out


def errors(rows: Sequence[Row], predicted: Sequence[float]) -> list[float]:
    """``predicted / measured - 1`` per row."""
    return [p / r.measured_ms - 1 for r, p in zip(rows, predicted, strict=True)]


def ordered_pairs(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """``(faster, slower)``: the indices of every two rows of one configuration that the GPU told apart, the
    slower one's p10 above the faster one's p90 (their medians where a row has no spread)."""
    def low(r: Row) -> float:
        return r.spread_ms[0] if r.spread_ms else r.measured_ms

    def high(r: Row) -> float:
        return r.spread_ms[1] if r.spread_ms else r.measured_ms

    return [(i, j) for i, a in enumerate(rows) for j, b in enumerate(rows)
            if a.config == b.config and high(a) < low(b)]


def rank_loss(rows: Sequence[Row], pairs: Sequence[tuple[int, int]], predicted: Sequence[float]) -> float:
    """How far the predictions invert the measured orderings: ``max(0, log(predicted faster / predicted
    slower))`` summed over ``pairs``, per configuration of ``rows`` (0 when every pair is predicted in its
    measured order)."""
    inverted = sum(max(0.0, math.log(predicted[i] / predicted[j])) for i, j in pairs)
    return inverted / len({r.config for r in rows})


def fit_call(rows: Sequence[Row], configs: dict[tuple, Config], dev: Device, replay: Replay, iterations: int = 60,
             rank_weight: float = RANK_WEIGHT, restarts: int = 0) -> Device:
    """``dev`` with the call's parameters (:data:`CALL_PARAMS`) fitted on ``rows`` (Nelder-Mead in the
    parameters scaled to their bounds, ``restarts`` more times from the best point; the replay's orderings make the
    loss rugged): the mean ``|log(predicted / measured)|`` plus ``rank_weight`` times
    :func:`rank_loss` over the rows' :func:`ordered_pairs`, so that among fits of equal error the one that orders
    the plans of a configuration as the GPU did wins (a fit to the rows' decisions, with no parameter per row)."""
    lo = np.array([BOUNDS[p][0] for p in CALL_PARAMS])
    hi = np.array([BOUNDS[p][1] for p in CALL_PARAMS])
    pairs = ordered_pairs(rows)

    def device_at(x: np.ndarray) -> Device:
        values = lo + np.clip(x, 0.0, 1.0) * (hi - lo)
        fitted: dict[str, Any] = {p: round(float(v), 4) for p, v in zip(CALL_PARAMS, values, strict=True)}
        return replace(dev, **fitted)

    def loss(x: np.ndarray) -> float:
        pred = predict(rows, configs, device_at(x), replay)
        error = float(np.mean([abs(math.log(p / r.measured_ms)) for r, p in zip(rows, pred, strict=True)]))
        return error + rank_weight * rank_loss(rows, pairs, pred)

    x = np.clip((np.array([getattr(dev, p) for p in CALL_PARAMS]) - lo) / (hi - lo), 0.02, 0.98)
    for _ in range(restarts + 1):  # each from the best so far, with a fresh simplex
        x = nelder_mead(loss, x, iterations)
    return device_at(x)


def nelder_mead(f, x0: np.ndarray, iterations: int, step: float = 0.1) -> np.ndarray:
    """Minimize ``f`` from ``x0`` by the Nelder-Mead simplex (reflection 1, expansion 2, contraction and shrink
    1/2), ``iterations`` steps: a few hundred evaluations of ``f`` at most."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


# ---- the whole refit, and its report ------------------------------------------------------------------------------
def summary(rows: Sequence[Row], predicted: Sequence[float]) -> dict:
    """Mean and worst |predicted / measured - 1|, the measured orderings (:func:`ordered_pairs`) predicted the
    other way round, and per configuration whether the scheduler predicted fastest is the one measured fastest
    (and how much slower it measured if not)."""
    errs = errors(rows, predicted)
    pairs = ordered_pairs(rows)
    picks = {}
    for config in dict.fromkeys(r.config for r in rows):
        members = [(r, p) for r, p in zip(rows, predicted, strict=True) if r.config == config]
        chosen = min(members, key=lambda m: m[1])[0]
        fastest = min(members, key=lambda m: m[0].measured_ms)[0]
        picks["/".join(map(str, config))] = {"predicted_fastest": chosen.scheduler,
                                             "measured_fastest": fastest.scheduler,
                                             "loss": chosen.measured_ms / fastest.measured_ms - 1}
    return {"rows": len(errs), "mean_error": float(np.mean(np.abs(errs))), "max_error": float(np.max(np.abs(errs))),
            "ordered_pairs": len(pairs), "inverted_pairs": sum(predicted[i] > predicted[j] for i, j in pairs),
            "picks": picks}


def calibrate(rows: Sequence[Row], base: Device, replay: Replay, trace: tuple[OpGraph, dict, str] | None = None,
              iterations: int = 60, leave_one_out: bool = True, log=lambda text: None,
              rank_weight: float = RANK_WEIGHT) -> tuple[Device, dict]:
    """Refit ``base`` (``replay``: the rows' graphs, plans and simulated calls): its op classes on ``trace`` (graph,
    trace, model name; kept as they are without one), its call on ``rows`` (:func:`fit_call`, ``rank_weight`` its
    ordering term). Returns the fitted device and a report: every row's prediction, the error fitted on all rows,
    and with each model left out (its rows predicted by a device whose call was fitted on the other models' rows;
    the op classes, fitted on the trace of ops alone and on no row, are the same in every fold)."""
    dev = fit_classes(trace[0], trace[1], base) if trace else base
    log(f"op classes from {'the trace of ' + trace[2] if trace else 'the base device'}; scheduling {len(rows)} rows")
    configs = prepare(rows, dev, replay)
    dev = fit_call(rows, configs, dev, replay, iterations, rank_weight)
    predicted = predict(rows, configs, dev, replay)
    report: dict[str, Any] = {"fitted": summary(rows, predicted),
              "rows": [{"model": r.model, "batch": r.batch, "dtype": r.dtype, "scheduler": r.scheduler,
                        "streams": r.streams, "measured_ms": r.measured_ms, "predicted_ms": p}
                       for r, p in zip(rows, predicted, strict=True)]}
    log(f"fitted on all rows: mean error {report['fitted']['mean_error']:.1%}")
    models = list(dict.fromkeys(r.model for r in rows))
    if leave_one_out and len(models) > 1:
        held_rows, held_pred = [], []
        for model in models:
            train = [r for r in rows if r.model != model]
            test = [r for r in rows if r.model == model]
            pred = predict(test, configs, fit_call(train, configs, dev, replay, iterations, rank_weight), replay)
            held_rows += test
            held_pred += pred
            log(f"left out {model}: mean error {np.mean(np.abs(errors(test, pred))):.1%}")
        report["leave_one_model_out"] = summary(held_rows, held_pred)
        held = {id(r): p for r, p in zip(held_rows, held_pred, strict=True)}
        for entry, r in zip(report["rows"], rows, strict=True):
            entry["left_out_ms"] = held[id(r)]
    fit = {"rows": sorted({r.source for r in rows}), "trace": trace[2] if trace else None, "rank_weight": rank_weight,
           "mean_error": report["fitted"]["mean_error"], "max_error": report["fitted"]["max_error"]}
    if "leave_one_model_out" in report:
        fit["leave_one_model_out_mean_error"] = report["leave_one_model_out"]["mean_error"]
    return replace(dev, fit=fit), report
