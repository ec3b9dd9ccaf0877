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

import json
import math
import platform
import statistics
import tempfile
import threading
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from opweave import timing
from opweave.costs import Costs, from_graph
from opweave.ir import OpGraph

FORMAT = "opweave.profile/1"
RANGE_PREFIX = "opweave::"
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


class ProfileKeyError(ValueError):
    """A profile measured for another model, input, dtype, device or torch version."""


# ---- key ------------------------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}"


def profile_key(model: str, inputs: Sequence, device: str, dtype: torch.dtype | str | None = None) -> dict:
    """What a profile is valid for. ``dtype`` defaults to the first floating-point input's (else the first's)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if dtype is None:
        floating = [x for x in tensors if x.is_floating_point()] or tensors
        dtype = floating[0].dtype if floating else "none"
    return {"model": model,
            "input_shapes": [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in inputs],
            "dtype": str(dtype).removeprefix("torch."),
            "device": device_name(device),
            "torch": torch.__version__}


def _model_dtype(captured, inputs: Sequence) -> torch.dtype | None:
    """The parameters' floating dtype (fp16 model with int64 token ids is an fp16 profile)."""
    for p in captured.gm.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


# ---- the profile ----------------------------------------------------------------------------------------------------


@dataclass
class Profile:
    key: dict
    latency_ms: dict[str, float]
    kernels: dict[str, list[dict]] = field(default_factory=dict)
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    utilization: dict[str, float] = field(default_factory=dict)
    category: dict[str, str] = field(default_factory=dict)
    category_disagreements: list[dict] = field(default_factory=list)
    device_properties: dict = field(default_factory=dict)
    repeats: int = 0
    warmup: int = 0

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not an opweave profile (format {found!r}, expected {FORMAT!r})")
        fields = {k: v for k, v in data.items() if k != "format"}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"profile has unknown field(s) {', '.join(unknown)}")
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, expect: dict | None = None) -> Profile:
        """Read a profile; with ``expect`` (see :func:`profile_key`), refuse one measured for something else."""
        try:
            prof = cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if expect is not None:
            prof.check_key(expect, source=str(path))
        return prof

    def check_key(self, expect: dict, source: str = "profile") -> None:
        wrong = [k for k in sorted(set(expect) | set(self.key)) if self.key.get(k) != expect.get(k)]
        if wrong:
            k = wrong[0]
            raise ProfileKeyError(f"{source} was measured for {k} {self.key.get(k)!r}, not {expect.get(k)!r}; "
                                  "profile again (`opweave profile`)")

    def apply(self, graph: OpGraph) -> OpGraph:
        """A copy of ``graph`` whose ops carry this profile's measurements (latency, and utilization, resources and
        category where measured); every op of the graph must have been measured."""
        missing = [o for o in graph.ids if o not in self.latency_ms]
        if missing:
            raise ProfileKeyError(f"profile has no latency for op {missing[0]!r} of graph {graph.name!r}; "
                                  "it was measured for another graph")
        ops = [replace(o, latency_ms=self.latency_ms[o.id], utilization=self.utilization.get(o.id, o.utilization),
                       resources=self.resources.get(o.id, o.resources), category=self.category.get(o.id, o.category))
               for o in graph.ops]
        return OpGraph(ops, [replace(e) for e in graph.edges], graph.name)

    def costs(self, graph: OpGraph, model: str = "ideal") -> Costs:
        """Costs for ``graph`` from this profile (see :meth:`apply`)."""
        costs = from_graph(self.apply(graph), model=model)
        costs.source = "profile"
        return costs


def load_for(path: str | Path, captured, inputs: Sequence, device: str) -> Profile:
    """The profile at ``path``, refused unless it was measured for these input shapes and dtype, this device and
    this torch (the model is identified by its op ids, which :meth:`Profile.apply` checks)."""
    prof = Profile.load(path)
    expect = profile_key(prof.key.get("model", ""), tuple(inputs), device, _model_dtype(captured, inputs))
    prof.check_key(expect, source=str(path))
    return prof


# ---- measuring ------------------------------------------------------------------------------------------------------


def profile_model(captured, inputs: Sequence, *, device: str = "cuda", repeats: int = 50, warmup: int = 5,
                  kernels: bool = True, ridge_flops_per_byte: float | None = None) -> Profile:
    """Profile every op of ``captured`` (see :func:`opweave.capture.capture`) on ``inputs``.

    ``ridge_flops_per_byte`` overrides the device's ridge point (peak FLOP/s over bandwidth) used to check each op's
    category; without it the roofline preset of the device is used (none for an unknown GPU: no check).
    Cost: (warmup + repeats) runs of every op, plus one traced pass on CUDA.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    inputs = tuple(inputs)
    graph = captured.graph
    wrong = [t.device for t in [*captured.gm.parameters(), *inputs] if isinstance(t, torch.Tensor)
             and t.device.type != device]
    if wrong:
        raise ValueError(f"profiling on {device}, but the model or its inputs are on {wrong[0]}; move them first "
                         f"(model.to({device!r}), inputs too) and capture again")
    with torch.no_grad():
        env = full_env(captured, inputs)
        latency = {op: _median_ms(captured, op, env, device, repeats, warmup) for op in graph.topo_order}
        by_op = trace_kernels(captured, env, device) if kernels and device == "cuda" else {}
    props = cuda_properties() if device == "cuda" else {}
    prof = Profile(key=profile_key(graph.name, inputs, device, _model_dtype(captured, inputs)), latency_ms=latency,
                   device_properties=props, repeats=repeats, warmup=warmup)
    for op, launched in by_op.items():
        prof.kernels[op] = [{**k, **occupancy(k, props)} for k in launched]
        if prof.kernels[op]:
            prof.resources[op], prof.utilization[op] = op_demand(prof.kernels[op], props)
    ridge = ridge_flops_per_byte if ridge_flops_per_byte is not None else _ridge(device, prof.key["dtype"])
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


def measure_stage(captured, inputs: Sequence, groups: Sequence[Sequence[str]], *, device: str = "cuda",
                  repeats: int = 20, warmup: int = 3) -> float:
    """Median latency (ms) of one stage: the groups run concurrently, each group's ops in order on its own stream
    (CUDA) or thread (CPU), forked from and joined into the caller. For the stage schedulers' measured costs."""
    inputs = tuple(inputs)
    with torch.no_grad():
        env = full_env(captured, inputs)
        if device == "cuda":
            return _stage_cuda(captured, env, groups, repeats, warmup)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lambda g=g: [captured.run_op(o, env) for o in g]) for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _stage_cuda(captured, env: dict, groups: Sequence[Sequence[str]], repeats: int, warmup: int) -> float:
    streams = [torch.cuda.Stream() for _ in groups]
    caller = torch.cuda.current_stream()
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(caller)
        for stream, group in zip(streams, groups, strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                for op in group:
                    captured.run_op(op, env)
            done = torch.cuda.Event()
            done.record(stream)
            caller.wait_event(done)
        end.record(caller)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---- kernels --------------------------------------------------------------------------------------------------------


def trace_kernels(captured, env: dict, device: str) -> dict[str, list[dict]]:
    """Run every op once under ``torch.profiler``, each inside a ``record_function`` range; the kernels by op."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for op in captured.graph.topo_order:
            with record_function(RANGE_PREFIX + op):
                captured.run_op(op, env)
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return kernels_by_op(trace, captured.graph.ids)


def kernels_by_op(trace: dict, ops: Sequence[str]) -> dict[str, list[dict]]:
    """Kernels of a Kineto (chrome-trace) export, grouped by the ``opweave::<op>`` range that launched them.

    A host-side launch (``cuda_runtime``/``cuda_driver`` event) belongs to the innermost-started op range on its
    thread that contains it; its ``correlation`` id names the kernel it launched.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    ranges: dict[object, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(RANGE_PREFIX):
            ts = float(e["ts"])
            ranges.setdefault(e.get("tid"), []).append((ts, ts + float(e.get("dur", 0)), e["name"][len(RANGE_PREFIX):]))
    for spans in ranges.values():
        spans.sort()
    op_of_launch: dict[int, str] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and corr is not None:
            spans = ranges.get(e.get("tid"), [])
            i = bisect_right(spans, (float(e["ts"]), math.inf, "")) - 1
            if i >= 0 and spans[i][0] <= float(e["ts"]) <= spans[i][1]:
                op_of_launch[corr] = spans[i][2]
    by_op: dict[str, list[dict]] = {op: [] for op in ops}
    for e in events:
        args = e.get("args") or {}
        op = op_of_launch.get(args.get("correlation"))
        if e.get("cat") == "kernel" and op in by_op:
            by_op[op].append({
                "name": e.get("name", ""),
                "grid": _dims(args.get("grid")),
                "block": _dims(args.get("block")),
                "registers_per_thread": int(args.get("registers per thread", 0)),
                "shared_memory_bytes": int(args.get("shared memory", 0)),
                "duration_us": float(e.get("dur", 0.0)),
            })
    return by_op


def _dims(value) -> list[int]:
    """A launch dimension as Kineto writes it (a list, or its string form "[x, y, z]")."""
    if isinstance(value, str):
        value = [v for v in value.strip("[]() ").split(",") if v.strip()]
    return [int(v) for v in value] if value else [1, 1, 1]


def cuda_properties() -> dict:
    """The current CUDA device's properties that occupancy needs."""
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    major, minor = p.major, p.minor
    return {
        "name": p.name,
        "capability": [major, minor],
        "sm_count": p.multi_processor_count,
        "max_threads_per_sm": getattr(p, "max_threads_per_multi_processor", 2048),
        "registers_per_sm": getattr(p, "regs_per_multiprocessor", 65536),
        "shared_memory_per_sm": getattr(p, "shared_memory_per_multiprocessor", 0) or 0,
        "max_blocks_per_sm": _max_blocks_per_sm(major, minor),
        "warp_size": getattr(p, "warp_size", 32),
    }


def _max_blocks_per_sm(major: int, minor: int) -> int:
    """Resident blocks per SM (CUDA C Programming Guide, "Compute capabilities" table)."""
    if major >= 9 or (major, minor) == (8, 0) or major < 7 or (major, minor) in ((7, 0), (7, 2)):
        return 32
    return {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}.get((major, minor), 16)


def occupancy(kernel: dict, props: dict) -> dict:
    """Blocks of ``kernel`` that fit on one SM at once (threads, registers, shared memory, block-slot limits) and
    the resulting occupancy (active warps / max warps). Registers are allocated per warp in units of 256,
    shared memory per block with 1 KiB reserved by the system (sm_80 and later)."""
    if not props:
        return {}
    warp = props.get("warp_size", 32)
    threads = math.prod(kernel["block"])
    warps_per_block = max(1, math.ceil(threads / warp))
    max_warps = props["max_threads_per_sm"] // warp
    limits = [props["max_blocks_per_sm"], max_warps // warps_per_block]
    regs = kernel.get("registers_per_thread", 0)
    if regs:
        regs_per_warp = math.ceil(regs * warp / 256) * 256
        limits.append((props["registers_per_sm"] // regs_per_warp) // warps_per_block)
    smem = kernel.get("shared_memory_bytes", 0)
    if smem and props.get("shared_memory_per_sm"):
        limits.append(props["shared_memory_per_sm"] // (smem + 1024))
    blocks_per_sm = max(0, min(limits))
    return {"blocks_per_sm": blocks_per_sm, "occupancy": blocks_per_sm * warps_per_block / max_warps}


def op_demand(kernels: list[dict], props: dict) -> tuple[dict[str, float], float]:
    """An op's resource demand (the largest of its kernels', which run one after another) and its utilization
    (the duration-weighted share of the device's block slots its kernels fill, capped at 1)."""
    demand = {"threads": 0.0, "registers": 0.0, "shared_memory": 0.0, "blocks": 0.0}
    weighted, total_us = 0.0, 0.0
    for k in kernels:
        blocks, threads = math.prod(k["grid"]), math.prod(k["block"])
        demand["blocks"] = max(demand["blocks"], blocks)
        demand["threads"] = max(demand["threads"], blocks * threads)
        demand["registers"] = max(demand["registers"], blocks * threads * k.get("registers_per_thread", 0))
        demand["shared_memory"] = max(demand["shared_memory"], blocks * k.get("shared_memory_bytes", 0))
        slots = max(1, k.get("blocks_per_sm", 1)) * props.get("sm_count", 1)
        share = min(1.0, blocks / slots)
        duration = max(k.get("duration_us", 0.0), 1e-3)
        weighted += share * duration
        total_us += duration
    return demand, min(1.0, max(0.01, weighted / total_us))


# ---- categories -----------------------------------------------------------------------------------------------------


def check_categories(graph: OpGraph, ridge_flops_per_byte: float | None) -> tuple[dict[str, str], list[dict]]:
    """The table's category per op, and the ops whose arithmetic intensity puts them on the other side of the
    device's ridge point (ops with no bytes counted are not checked)."""
    category = {o.id: o.category for o in graph.ops}
    disagreements = []
    if not ridge_flops_per_byte:
        return category, disagreements
    for o in graph.ops:
        if o.bytes <= 0:
            continue
        intensity = o.flops / o.bytes
        by_intensity = "compute" if intensity >= ridge_flops_per_byte else "memory"
        if by_intensity != o.category:
            disagreements.append({"op": o.id, "target": o.target, "table": o.category, "by_intensity": by_intensity,
                                  "flops_per_byte": intensity, "ridge_flops_per_byte": ridge_flops_per_byte})
    return category, disagreements


def _ridge(device: str, dtype: str) -> float | None:
    """Peak FLOP/s over bandwidth of the device's roofline preset (tensor-core peak for float16/bfloat16)."""
    from opweave import roofline

    name = "cpu" if device == "cpu" else roofline.preset_for_gpu(torch.cuda.get_device_name())
    if name is None:
        return None
    dev = roofline.preset(name)
    tensor_cores = dtype == "float16" or (dtype == "bfloat16" and dev.bf16)
    return (dev.fp16_tflops if tensor_cores else dev.fp32_tflops) * 1e12 / (dev.bandwidth_gbs * 1e9)
