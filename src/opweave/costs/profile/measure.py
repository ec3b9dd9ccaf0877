"""Model profiler: each op's latency alone, its kernels' resource demands, and its compute/memory category, measured
on the real device and saved as a JSON profile the schedulers' :class:`~opweave.costs.Costs` can be built from.

Follows Opara's model profiler (IEEE TC'24, Sec. 3.2): run the model once, then time every operator alone and read
its kernels' launch configuration (grid, block, registers per thread, shared memory) from the profiler trace, from
which the blocks that fit on one SM and the occupancy follow with the device's properties.

* **Latency alone**: ``run_op`` repeated on the op's real inputs after warm-up; on CUDA, CUDA events around every
  repeat (all recorded back to back, read after one synchronize), on CPU ``time.perf_counter``; the median.
* **Kernels** (CUDA only): one pass under ``torch.profiler`` with a ``record_function("opweave::<op>")`` range around
  each op. A kernel belongs to the op whose range contains the host-side runtime call that launched it (the launch
  and the kernel share the trace's ``correlation`` id), never guessed from source lines.
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

from opweave.costs import timing
from opweave.costs.profile.kineto import trace_kernels
from opweave.costs.profile.occupancy import check_categories, cuda_properties, occupancy, op_demand, ridge_point
from opweave.costs.profile.store import Profile, model_dtype, profile_key
from opweave.errors import UsageError

# ---- measuring ------------------------------------------------------------------------------------------------------


def profile_model(captured, inputs: Sequence, *, device: str = "cuda", repeats: int = 50, warmup: int = 5,
                  kernels: bool = True, ridge_flops_per_byte: float | None = None) -> Profile:
    """Profile every op of ``captured`` (see :func:`opweave.capture.capture`) on ``inputs``.

    ``ridge_flops_per_byte`` overrides the device's ridge point (peak FLOP/s over bandwidth) used to check each op's
    category; without it the roofline preset of the device is used (none for an unknown GPU: no check).
    Cost: (warmup + repeats) runs of every op, plus one traced pass on CUDA.
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
    with torch.no_grad():
        env = full_env(captured, inputs)
        latency = {op: _median_ms(captured, op, env, device, repeats, warmup) for op in graph.topo_order}
        by_op = trace_kernels(captured, env, device) if kernels and device == "cuda" else {}
    props = cuda_properties() if device == "cuda" else {}
    prof = Profile(key=profile_key(graph.name, inputs, device, model_dtype(captured, inputs)), latency_ms=latency,
                   device_properties=props, repeats=repeats, warmup=warmup)
    for op, launched in by_op.items():
        prof.kernels[op] = [{**k, **occupancy(k, props)} for k in launched]
        if prof.kernels[op]:
            prof.resources[op], prof.utilization[op] = op_demand(prof.kernels[op], props)
    ridge = ridge_flops_per_byte if ridge_flops_per_byte is not None else ridge_point(device, prof.key["dtype"])
    prof.category, prof.category_disagreements = check_categories(graph, ridge)
    return prof


def full_env(captured, inputs: Sequence) -> dict:
    """Run every op once, in a topological order, so that each op's inputs are in the environment."""
    env = captured.bind(tuple(inputs))
    for op in captured.graph.topo_order:
        captured.run_op(op, env)
    return env


def _median_ms(captured, op: str, env: dict, device: str, repeats: int, warmup: int) -> float:
    # queued back to back: one op is microseconds, a host sync per run would time the sync
    return timing.median_ms(lambda: captured.run_op(op, env), runs=repeats, warmup=warmup, device=device,
                            sync_each_run=False)
