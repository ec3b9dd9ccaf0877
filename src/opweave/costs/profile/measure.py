"""Model profiler: each op's latency alone, its kernels' resource demands, and its compute/memory category, measured
on the real device and saved as a JSON profile the schedulers' :class:`~opweave.costs.Costs` can be built from.

Follows Opara's model profiler (IEEE TC'24, Sec. 3.2): run the model once, then time every operator alone and read
its kernels' launch configuration (grid, block, registers per thread, shared memory) from the profiler trace, from
which the blocks that fit on one SM and the occupancy follow with the device's properties.

* **Latency alone** (CUDA): GPU time, not host time. Every op runs ``repeats`` times under ``torch.profiler``
  after ``warmup`` runs, each run inside its own ``record_function("opweave::<op>")`` range; a run's latency is the
  summed duration of the kernels, memcpys and memsets launched inside that range (:mod:`.kineto`: the launch and
  its GPU work share the trace's ``correlation`` id), and the op's latency is the median over its runs (the lower
  median, so that the kept kernels are one real run's). At batch 1 most kernels take less than one Python
  dispatch, so CUDA events around back-to-back runs would time the launch path instead. An op that launches no
  GPU work (a view, metadata) has latency 0; an op with FLOPs that launches none in any run is a broken
  attribution and raises :class:`~opweave.errors.ProfileError` naming it. Long models are traced in chunks of ops
  (at most :data:`RUNS_PER_TRACE` runs per trace) to bound the trace's size.
* **Latency alone** (CPU): ``time.perf_counter`` around each of ``repeats`` runs after ``warmup``; the median.
* **Kernels** (CUDA): those of the op's median run, each with its launch configuration (grid, block, registers
  per thread, shared memory), from which the blocks that fit on one SM and the occupancy follow.
* **Category**: the op-target table's category (the graph's ``category``) is checked against the op's arithmetic
  intensity (FLOPs / bytes) and the device's ridge point (peak FLOP/s / bandwidth); disagreements are recorded,
  the table's category is kept.
* **Utilization** of an op = its kernels' duration-weighted share of the device's block slots
  (grid blocks / (blocks per SM × SMs), capped at 1): what the contention model calls the share it fills alone.

A profile is keyed by model name, input shapes, dtype, device name and torch version; :meth:`Profile.load` refuses a
profile whose key does not match the one expected, so a stale profile is never reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opweave.cores import intra_op_threads
from opweave.costs import timing
from opweave.costs.profile.kineto import RangeRun, range_runs, trace_ops
from opweave.costs.profile.occupancy import check_categories, cuda_properties, occupancy, op_demand, ridge_point
from opweave.costs.profile.store import Profile, model_dtype, profile_key
from opweave.errors import ProfileError, UsageError
from opweave.ir.graph import OpGraph

RUNS_PER_TRACE = 4000  # op runs per profiler trace: ~10 trace events each, a few MB of JSON

# ---- measuring ------------------------------------------------------------------------------------------------------


def profile_model(captured, inputs: Sequence, *, device: str = "cuda", repeats: int = 50, warmup: int = 5,
                  ridge_flops_per_byte: float | None = None, threads: int | None = None) -> Profile:
    """Profile every op of ``captured`` (see :func:`opweave.capture.capture`) on ``inputs``.

    ``ridge_flops_per_byte`` overrides the device's ridge point (peak FLOP/s over bandwidth) used to check each op's
    category; without it the roofline preset of the device is used (none for an unknown GPU: no check).
    ``threads`` (CPU): time every op on that many intra-op threads, the budget of the lane that will run it
    (:mod:`opweave.backends.threads`: one per lane when the lanes fill the cores); default: the caller's count. The
    profile records it.
    Cost: one run of the model, then (warmup + repeats) runs of every op, on CUDA under the profiler.
    """
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if repeats < 1 or warmup < 0:
        raise UsageError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    inputs = tuple(inputs)
    graph = captured.graph
    wrong = [t.device for t in [*captured.gm.parameters(), *inputs] if isinstance(t, torch.Tensor)
             and t.device.type != device]
    if wrong:
        raise UsageError(f"profiling on {device}, but the model or its inputs are on {wrong[0]}; move them first "
                         f"(model.to({device!r}), inputs too) and capture again")
    with intra_op_threads(threads if device == "cpu" else None) as caller_threads, torch.no_grad():
        env = full_env(captured, inputs)
        if device == "cuda":
            latency, by_op = _gpu_latencies(captured, env, repeats, warmup)
        else:
            latency = {op: _cpu_median_ms(captured, op, env, repeats, warmup) for op in graph.topo_order}
            by_op = {}
    props = cuda_properties() if device == "cuda" else {}
    prof = Profile(key=profile_key(graph.name, inputs, device, model_dtype(captured, inputs)), latency_ms=latency,
                   device_properties=props, repeats=repeats, warmup=warmup,
                   threads=(threads or caller_threads) if device == "cpu" else None)
    for op, launched in by_op.items():
        prof.kernels[op] = [{**k, **occupancy(k, props)} for k in launched]
        if prof.kernels[op]:
            prof.resources[op], prof.utilization[op] = op_demand(prof.kernels[op], props)
    ridge = ridge_flops_per_byte if ridge_flops_per_byte is not None else ridge_point(device, prof.key["dtype"])
    prof.category, prof.category_disagreements = check_categories(graph, ridge)
    return prof


def full_env(captured, inputs: Sequence) -> dict:
    """Run every op once, in a topological order, so that each op's inputs are in the environment."""
    return captured.run_all(captured.bind(tuple(inputs)))


def _gpu_latencies(captured, env: dict, repeats: int, warmup: int) -> tuple[dict[str, float], dict[str, list]]:
    order = captured.graph.topo_order
    for op in order:
        for _ in range(warmup):
            captured.run_op(op, env)
    torch.cuda.synchronize()
    per_trace = max(1, RUNS_PER_TRACE // repeats)
    runs: list[RangeRun] = []
    for start in range(0, len(order), per_trace):
        runs += range_runs(trace_ops(captured, env, order[start:start + per_trace], repeats, "cuda"))
    return latencies_from_runs(captured.graph, runs)


def latencies_from_runs(graph: OpGraph, runs: Sequence[RangeRun]) -> tuple[dict[str, float], dict[str, list]]:
    """Each op's latency (ms; the lower median of its runs' GPU time) and the kernels of that median run.

    Raises :class:`ProfileError` for an op with no run in the trace, and for an op with FLOPs whose runs launched
    no GPU work at all (the trace's launches were not attributed to it: its latency would be a false 0).
    """
    by_op: dict[str, list[RangeRun]] = {op: [] for op in graph.ids}
    for run in runs:
        if run.op in by_op:
            by_op[run.op].append(run)
    missing = [op for op, found in by_op.items() if not found]
    if missing:
        raise ProfileError(f"the profiler trace has no opweave::{missing[0]} range ({len(missing)} op(s) missing); "
                           "was the trace cut short?")
    silent = [o for o in graph.ops if o.flops > 0 and not any(run.work for run in by_op[o.id])]
    if silent:
        o = silent[0]
        more = f" (and {len(silent) - 1} more op(s))" if len(silent) > 1 else ""
        raise ProfileError(f"op {o.id!r} ({o.target}, {o.flops:.3g} FLOPs) launched no GPU kernel, memcpy or memset "
                           f"in any of its {len(by_op[o.id])} profiled runs{more}: its GPU work was not found in "
                           "the profiler trace")
    latency, kernels = {}, {}
    for op, found in by_op.items():
        median = sorted(found, key=lambda r: r.duration_us)[(len(found) - 1) // 2]
        latency[op] = median.duration_us / 1e3
        kernels[op] = median.kernels
    return latency, kernels


def _cpu_median_ms(captured, op: str, env: dict, repeats: int, warmup: int) -> float:
    return timing.median_ms(lambda: captured.run_op(op, env), runs=repeats, warmup=warmup, device="cpu")
