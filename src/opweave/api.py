"""``opweave.compile``: capture → costs → scheduler → plan → backend, in one call; and :func:`load_graph`, the
graph a command works on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opweave import schedulers
from opweave.backends.program import Backend
from opweave.costs import Costs
from opweave.errors import UsageError
from opweave.ir import OpGraph
from opweave.plan import LaunchPlan
from opweave.plan.lower import lower
from opweave.plan.validate import validate
from opweave.schedulers.schedule import Schedule

DEVICES = ("cpu", "cuda")
MODES = ("default", "max-speed")
# heft fills a few CPU lanes (schedulers/heft.py); opara was written for a GPU's streams
DEFAULT_SCHEDULER = {"cpu": "heft", "cuda": "opara"}
ORT_GRAPH = "onnxruntime-graph"  # fuse=: lanes over ONNX Runtime's optimized graph of the whole model


@dataclass
class Compiled:
    """A model compiled by opweave: call it like the model. ``schedule`` and ``plan`` say what was decided."""

    graph: OpGraph
    costs: Costs
    schedule: Schedule
    plan: LaunchPlan
    backend: Backend
    device: str
    captured: Any = None
    fused: Any = None  # with fuse=...: the Segmented model, or the OrtLanes backend (stats: segments, compiles, ...)
    choice: dict | None = None  # what a measured choice picked (mode="max-speed", or lanes vs one lane) and timed

    def __call__(self, *args, **kwargs) -> Any:
        if kwargs:  # keyword arguments bound to the model's forward(), as at capture
            from opweave.capture.runtime import positional

            args = positional(self.captured.signature, args, kwargs, self.graph.name)
        return self.backend(*args)

    def close(self) -> None:
        """Release what the backend holds (worker threads, rank processes); also done when it is collected."""
        self.backend.close()

    def __enter__(self) -> Compiled:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_for(graph: OpGraph, costs: Costs, scheduler: str, *, streams: int | None = None, devices: int = 1,
             **options) -> tuple[Schedule, LaunchPlan]:
    """Schedule and lower ``graph``; the plan has passed the validator."""
    sched = schedulers.run(scheduler, graph, costs, streams=streams, devices=devices, **options)
    return sched, validated_plan(graph, sched)


def validated_plan(graph: OpGraph, schedule: Schedule) -> LaunchPlan:
    """``schedule`` lowered to a plan (:func:`~opweave.plan.lower.lower`) that has passed the validator."""
    plan = lower(graph, schedule)
    validate(graph, plan, schedule)
    return plan


def backend_for(captured, plan: LaunchPlan, device: str, *, fuse: str | None = None, example_inputs: tuple = (),
                threads: dict[str, int] | None = None, **options) -> tuple[Any, Any]:
    """The backend that runs the validated ``plan`` of ``captured`` (a :class:`~opweave.capture.Captured`, or
    anything with its ``bind``/``run_op``/``output``) on ``device``, and the segmented model it runs with ``fuse``
    (its ``stats``; None without). ``fuse="inductor"`` compiles every stream segment of the plan
    (:mod:`opweave.backends.segments`): on the CPU now, for ``example_inputs``; on CUDA in the backend's warm-up.
    ``fuse="onnxruntime"`` runs each segment in ONNX Runtime (CPU; :mod:`opweave.backends.compilers`). ``threads``
    (CPU: op -> intra-op threads, :func:`opweave.backends.threads.lane_threads`) budgets each op's (or segment's)
    threads; without it each lane gets its :func:`~opweave.backends.threads.budgets` share. ``options`` go to the
    CUDA backend (``mode``, ``static_outputs``, ``fallback``, ...); the CPU backend takes none.
    """
    if device == "cpu" and options:
        raise UsageError(f"the cpu backend takes no options, got {', '.join(options)}")
    runner, run_plan = captured, plan
    if device == "cpu" and threads is None:
        from opweave.backends.threads import lane_threads

        threads = lane_threads(captured.graph, plan)
    if fuse is not None:
        from opweave.backends.segments import fuse_segments

        runner, run_plan = fuse_segments(captured, plan, fuse, threads=threads if device == "cpu" else None)
        threads = runner.threads or None
        if device == "cpu":  # compile now, not in the first call (the CUDA backend's warm-up runs compile there)
            runner.prepare(example_inputs, run_plan)
    if device == "cpu":
        from opweave.backends.cpu import CpuBackend

        backend = CpuBackend(runner, run_plan, threads=threads)
    else:
        from opweave.backends.cuda import CudaBackend

        backend = CudaBackend(runner, run_plan, example_inputs, **options)
    return backend, runner if fuse is not None else None


def compile(model, example_inputs=(), *, example_kwargs: dict | None = None, scheduler: str | None = None,
            device: str = "cpu", mode: str = "default", streams: int | None = None, costs: Costs | None = None,
            profile: str | Path | None = None, cost_model: str = "ideal", fold_bn: bool = False, devices: int = 1,
            link: str | Path | None = None, coarsen: bool = True, fuse: str | None = None,
            scheduler_options: dict | None = None, **backend_options) -> Compiled:
    """Compile ``model`` for ``example_inputs`` (and ``example_kwargs``, keyword arguments of its ``forward``); the
    result's outputs equal ``model(*inputs, **kwargs)`` (allclose), and compiling leaves the model unchanged.

    ``model`` is an ``nn.Module``, a ``torch.export.ExportedProgram``, or the path of a ``.pt2`` file written by
    ``torch.export.save`` (:func:`opweave.capture.load_program`); a program's own example inputs are used when none
    are given.

    Costs: ``costs`` if given, else the measured ``profile`` (a file written by ``opweave profile``, refused when it
    was measured for other shapes, dtype, device or torch, or for the other granularity), else the roofline
    estimate for the device. ``streams`` caps the streams the scheduler may use; for CUDA it defaults to
    :func:`opweave.backends.cuda.default_streams` (8, the GPU's hardware queues), on the CPU to no cap.
    ``coarsen`` schedules the papers' operators (:func:`opweave.capture.coarsen`: each op merged with its
    epilogues, BatchNorm folded) instead of one op per fx node. ``fuse="inductor"`` compiles every stream segment
    of the plan with TorchInductor (:mod:`opweave.backends.segments`; one device only), ``fuse="onnxruntime"``
    runs each in an ONNX Runtime session (CPU), and ``fuse="onnxruntime-graph"`` (CPU) has ONNX Runtime optimize
    the whole model first and schedules the nodes of its optimized graph (:func:`compile_ort_graph`).
    ``backend_options`` go to the backend (CUDA: ``mode``, ``static_outputs``, ``fallback``).

    ``devices > 1`` (with ``hios-lp`` or ``hios-mr``): the plan spans ``devices`` devices and runs on as many
    persistent rank processes (:class:`opweave.backends.distributed.DistributedBackend`; ``backend_options``:
    ``threads``, ``timeout_s``, ``start_method``); ``link`` (a preset name or a file written by ``opweave
    profile-links``) gives the edges their transfer times. ``close()`` or a ``with`` block stops the ranks.

    Two branches of a tiny model run on two CPU threads:

    >>> import torch, opweave
    >>> class Branchy(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.left, self.right = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         return torch.relu(self.left(x)) + torch.sigmoid(self.right(x))
    >>> model, x = Branchy().eval(), torch.randn(2, 8)
    >>> fast = opweave.compile(model, (x,), scheduler="lios", device="cpu")
    >>> fast.schedule.streams_used, torch.allclose(fast(x), model(x))
    (2, True)
    """
    import torch

    from opweave.capture import capture, load_program

    if isinstance(model, (str, Path)):
        model = load_program(model)
    example_inputs = _check(device, example_inputs)
    captured = capture(model, example_inputs, example_kwargs=example_kwargs, fold_bn=fold_bn)
    example_inputs = captured.example_inputs
    return compile_captured(captured, example_inputs, scheduler=scheduler, device=device, mode=mode, streams=streams,
                            costs=costs, profile=profile, cost_model=cost_model, devices=devices, link=link,
                            coarsen=coarsen, fuse=fuse, scheduler_options=scheduler_options,
                            eager=model if isinstance(model, torch.nn.Module) else None,
                            **backend_options)


def compile_captured(captured, example_inputs, *, scheduler: str | None = None, device: str = "cpu",
                     mode: str = "default", streams: int | None = None, costs: Costs | None = None,
                     profile: str | Path | None = None,
                     cost_model: str = "ideal", devices: int = 1, link: str | Path | None = None,
                     coarsen: bool = True, fuse: str | None = None, scheduler_options: dict | None = None,
                     eager=None, **backend_options) -> Compiled:
    """:func:`compile` from an already captured model (``opweave.capture``): one capture can serve many schedules.

    The default on the CPU (no ``scheduler``, ``streams``, ``fuse``, one device) is never slower than what it
    replaces: it times its plan against one lane in the model's order and against ``eager`` (the model itself,
    when given: :func:`compile` gives it), interleaved (:func:`_fastest`), and keeps the fastest; ``choice`` says
    which (``"lanes"``, ``"one lane"`` or ``"eager"``) and what each measured. A kept ``eager`` runs the model
    (:class:`~opweave.backends.cpu.EagerBackend`) and the result's ``schedule`` and ``plan`` are one lane's: on
    small models the lanes' per-call cost (binding inputs, the generated code's calls) is more than they save."""
    example_inputs = _check(device, example_inputs)
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if coarsen:
        from opweave.capture import coarsen as coarsen_ops

        captured = coarsen_ops(captured)
    if mode == "max-speed":
        given = {"scheduler": scheduler, "streams": streams, "costs": costs, "profile": profile, "fuse": fuse,
                 "devices": devices if devices != 1 else None, "scheduler_options": scheduler_options}
        given = [k for k, v in given.items() if v is not None] + list(backend_options)
        if device != "cpu" or given:
            raise UsageError("mode='max-speed' chooses the plan itself, on the CPU: give neither "
                             + ", ".join(given or ["device='cuda'"]))
        return _max_speed(captured, example_inputs)
    if fuse == ORT_GRAPH:
        if device != "cpu" or devices != 1:
            raise UsageError(f"fuse={ORT_GRAPH!r} runs on one CPU")
        return compile_ort_graph(captured, example_inputs, scheduler=scheduler or DEFAULT_SCHEDULER["cpu"],
                                 streams=streams, costs=costs, scheduler_options=scheduler_options)
    guard = device == "cpu" and scheduler is None and streams is None and fuse is None and devices == 1
    scheduler = scheduler or ("hios-lp" if devices != 1 else DEFAULT_SCHEDULER[device])
    graph = captured.graph
    if costs is None and profile is not None:
        from opweave.costs.profile import load_for

        costs = load_for(profile, captured, example_inputs, device).costs(graph, model=cost_model)
    elif costs is None:
        costs = _roofline(graph, device, cost_model)
    if devices != 1:
        if fuse is not None:
            raise UsageError(f"fuse={fuse!r} runs on one device; devices={devices} runs the plan's ops unfused")
        return compile_ranks(captured, scheduler=scheduler, device=device, devices=devices, streams=streams,
                             costs=costs, link=link, **backend_options)
    if device == "cuda" and streams is None:
        from opweave.backends.cuda import default_streams

        streams = default_streams()  # more lanes than the GPU's hardware queues only add false dependencies
    threads = None
    if device == "cpu":
        from opweave.backends import threads as cpu_threads

        streams = streams or cpu_threads.cores()  # one lane per core the lanes' threads can run on
        if scheduler == "heft":  # a cross-lane edge costs a thread hand-off here: weigh it
            scheduler_options = {"sync_ms": cpu_threads.sync_cost_ms(), **(scheduler_options or {})}
    sched, plan = plan_for(graph, costs, scheduler, streams=streams, **(scheduler_options or {}))
    if device == "cpu":
        threads = cpu_threads.lane_threads(graph, plan, costs, fuse)
    backend, fused = backend_for(captured, plan, device, fuse=fuse, example_inputs=example_inputs, threads=threads,
                                 **backend_options)
    compiled = Compiled(graph, costs, sched, plan, backend, device, captured, fused=fused)
    if guard:  # never slower than one lane in the model's order, nor than the model itself
        compiled = _guarded(compiled, captured, example_inputs, eager)
    return compiled


def compile_ort_graph(captured, example_inputs: tuple, *, scheduler: str = "heft", streams: int | None = None,
                      costs: Costs | None = None, scheduler_options: dict | None = None, model=None) -> Compiled:
    """``fuse="onnxruntime-graph"``: ``captured`` exported whole and optimized by ONNX Runtime, the nodes of its
    optimized graph scheduled onto one lane per core (at most ``streams``) and run as sessions of each segment over
    bound buffers (:mod:`opweave.backends.ortgraph`). Costs are each node's kernel time on one thread from ONNX
    Runtime's profiler, or ``costs``' latencies when they name exactly the optimized graph's nodes (a cached
    choice). ``heft`` weighs a cross-lane edge at 10x the thread hand-off (:func:`~opweave.backends.threads.
    sync_cost_ms`): there it also cuts a segment, which costs ONNX Runtime some of its whole-graph locality;
    max-speed, when it searched 1x, 3x and 10x (it now tries 3x, 10x and 30x), picked 10x for NASNet in both of its
    runs on 2026-11-26 (17.3 ms against 19.3 ms at 3x, ``benchmarks/results/cpu_latency.json``) and for
    Inception-v3 in one.
    ``model``: an :class:`~opweave.backends.ortgraph.OrtGraph` already built for these inputs (max-speed shares
    one among its candidates). The result's ``graph``, ``schedule`` and ``plan`` are the optimized graph's."""
    import dataclasses

    from opweave.backends import threads as cpu_threads
    from opweave.backends.ortgraph import OrtGraph, OrtLanes
    from opweave.costs import from_graph

    if model is None:
        model = OrtGraph(captured, example_inputs, latency_ms=costs.latency_ms if costs is not None else None)
    graph = model.graph
    planned = from_graph(graph)
    if costs is not None and set(costs.latency_ms) == set(graph.ids):
        planned = dataclasses.replace(planned, latency_ms=dict(costs.latency_ms))
    options = dict(scheduler_options or {})
    if scheduler == "heft":
        options.setdefault("sync_ms", 10 * cpu_threads.sync_cost_ms())
    sched, plan = plan_for(graph, planned, scheduler, streams=streams or cpu_threads.cores(), **options)
    backend = OrtLanes(model, plan, cpu_threads.lane_threads(graph, plan, planned, ORT_GRAPH))
    return Compiled(graph, planned, sched, plan, backend, "cpu", captured, fused=backend)


def _guarded(compiled: Compiled, captured, example_inputs: tuple, eager) -> Compiled:
    """The fastest of ``compiled`` (when it has more than one lane), one lane and ``eager`` (when given), measured;
    the others closed (:func:`compile_captured`)."""
    from opweave.backends.cpu import EagerBackend

    built = {}
    if compiled.schedule.streams_used > 1:
        built["lanes"] = compiled
        built["one lane"] = compile_captured(captured, example_inputs, scheduler="sequential", streams=1,
                                             costs=compiled.costs, coarsen=False)
    else:
        built["one lane"] = compiled
    if eager is not None:
        one = built["one lane"]
        built["eager"] = Compiled(one.graph, one.costs, one.schedule, one.plan, EagerBackend(eager), "cpu", captured)
    if len(built) == 1:
        return compiled
    best, medians = _fastest(built, example_inputs)
    for label, other in built.items():
        if label != best:
            other.close()
    kept = built[best]
    kept.choice = {"label": best, "candidates": {k: {"median_ms": v} for k, v in medians.items()}}
    return kept


def _fastest(built: dict[str, Compiled], inputs: tuple, rounds: int = 5, runs: int = 3) -> tuple[str, dict]:
    """The label of the fastest of ``built`` by median wall time, and every median (ms): two warm-up calls each,
    then ``rounds`` rounds in which each runs ``runs`` calls, interleaved so that all see the same load."""
    import statistics
    import time

    import torch

    times: dict[str, list[float]] = {label: [] for label in built}
    with torch.inference_mode():
        for fast in built.values():
            fast(*inputs)
            fast(*inputs)
        for _ in range(rounds):
            for label, fast in built.items():
                for _ in range(runs):
                    start = time.perf_counter()
                    fast(*inputs)
                    times[label].append((time.perf_counter() - start) * 1e3)
    medians = {label: round(statistics.median(ts), 4) for label, ts in times.items()}
    return min(medians, key=medians.get), medians


# ---- mode="max-speed" on the CPU: the fastest of a bounded set of plans, measured ---------------------------------
def _candidates(sync_ms: float) -> list[dict]:
    """The plans max-speed tries: one lane (the caller's threads) or one lane per core (HEFT at two sync costs),
    each unfused and with every segment compiler present; Inductor's segments compile slowly, so once per plan."""
    from opweave.backends.compilers import available

    fuses = [None, *available()]
    if "onnxruntime" in fuses:
        fuses.append(ORT_GRAPH)
    out = [{"scheduler": "sequential", "fuse": f, "sync_ms": None} for f in fuses]
    # a segment boundary costs ORT a call (and, over its whole graph, some locality)
    syncs = {None: (1, 4), "onnxruntime": (1, 4, 16), "inductor": (4,), ORT_GRAPH: (3, 10, 30)}
    for f in fuses:
        out += [{"scheduler": "heft", "fuse": f, "sync_ms": round(k * sync_ms, 4)} for k in syncs[f]]
    return out


def _label(c: dict) -> str:
    return c["scheduler"] + (f"+{c['fuse']}" if c["fuse"] else "") + (
        f" sync {c['sync_ms']}" if c["sync_ms"] is not None else "")


def _build(captured, example_inputs, candidate: dict, costs: Costs, ort_graph=None) -> Compiled:
    options = {"sync_ms": candidate["sync_ms"]} if candidate["sync_ms"] is not None else None
    if candidate["fuse"] == ORT_GRAPH:
        return compile_ort_graph(captured, example_inputs, scheduler=candidate["scheduler"],
                                 streams=1 if candidate["scheduler"] == "sequential" else None, costs=costs,
                                 scheduler_options=options, model=ort_graph)
    return compile_captured(captured, example_inputs, scheduler=candidate["scheduler"], device="cpu",
                            streams=1 if candidate["scheduler"] == "sequential" else None, costs=costs,
                            coarsen=False, fuse=candidate["fuse"], scheduler_options=options)


def _max_speed(captured, example_inputs: tuple) -> Compiled:
    """``mode="max-speed"``: build every plan of :func:`_candidates` on costs measured at one thread per op (the
    budget of a lane when the lanes fill the cores; eager's kernels, or ONNX Runtime's for its plans:
    :func:`opweave.backends.segments.op_latencies`), keep those whose output equals eager's
    (:func:`opweave.outputs.compare`), time them interleaved (:func:`_fastest`) and keep the fastest. The choice,
    with the costs it was planned on, is cached per model and machine (:mod:`opweave.choices`), so the next compile
    builds that plan alone (and searches again if it no longer equals eager). A transient progress bar on standard
    error shows the search."""
    import dataclasses
    import time

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from opweave import choices
    from opweave.backends.threads import sync_cost_ms
    from opweave.costs.profile import profile_model
    from opweave.outputs import compare

    graph = captured.graph
    with torch.no_grad():
        env = captured.bind(example_inputs)
        for op in graph.topo_order:
            captured.run_op(op, env)
        reference = captured.output(env)
    key = choices.key(captured, example_inputs)
    known = choices.load(key)
    if known is not None:
        costs = dataclasses.replace(_roofline(graph, "cpu", "ideal"), latency_ms=known["latency_ms"])
        chosen = _build(captured, example_inputs, known["candidate"], costs)
        with torch.no_grad():
            if compare(reference, chosen(*example_inputs)).ok:
                chosen.choice = {**known, "cached": True}
                return chosen
        chosen.close()
    candidates = _candidates(sync_cost_ms())
    eager_ms = profile_model(captured, example_inputs, device="cpu", repeats=5, warmup=1, threads=1).latency_ms
    latencies = {fuse: eager_ms for fuse in {c["fuse"] for c in candidates} if fuse != ORT_GRAPH}
    ort_graph = None  # built with the first of its candidates; its latencies are its own graph's nodes'
    if "onnxruntime" in latencies:  # its kernels are timed as they will run (segments.op_latencies)
        from opweave.backends.segments import op_latencies

        latencies["onnxruntime"] = op_latencies(captured, example_inputs, "onnxruntime")
    roofline = _roofline(graph, "cpu", "ideal")
    built: dict[str, Compiled] = {}
    measured: dict[str, dict] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"{graph.name}: max-speed, building", total=len(candidates) + 1)
        for candidate in candidates:
            label = _label(candidate)
            bar.update(task, description=f"{graph.name}: max-speed, building {label}")
            start = time.perf_counter()
            try:
                if candidate["fuse"] == ORT_GRAPH and ort_graph is None:  # one export for all its candidates
                    from opweave.backends.ortgraph import OrtGraph

                    try:
                        ort_graph = OrtGraph(captured, example_inputs)
                    except Exception:  # the first candidate says why; the others do not build it again
                        ort_graph = UsageError("building ONNX Runtime's graph failed (see the first of its "
                                               "candidates)")
                        raise
                    latencies[ORT_GRAPH] = ort_graph.graph.latencies()
                if candidate["fuse"] == ORT_GRAPH and isinstance(ort_graph, Exception):
                    raise ort_graph
                costs = dataclasses.replace(roofline, latency_ms=latencies[candidate["fuse"]])
                fast = _build(captured, example_inputs, candidate, costs, ort_graph)
                with torch.no_grad():
                    check = compare(reference, fast(*example_inputs))
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is left out, and said so
                text = str(exc).strip().splitlines()
                measured[label] = {"error": f"{type(exc).__name__}: {text[0][:200] if text else ''}"}
            else:
                measured[label] = {"build_s": round(time.perf_counter() - start, 2), "ok": check.ok}
                if check.ok:
                    built[label] = fast
                else:
                    measured[label]["wrong"] = check.reason
                    fast.close()
            bar.advance(task)
        if not built:
            raise UsageError(f"{graph.name}: no max-speed candidate equals eager: {measured}")
        bar.update(task, description=f"{graph.name}: max-speed, timing {len(built)} plans")
        best, medians = _fastest(built, example_inputs)
        bar.advance(task)
    for label, ms in medians.items():
        measured[label]["median_ms"] = ms
    for label, fast in built.items():
        if label != best:
            fast.close()
    candidate = next(c for c in candidates if _label(c) == best)
    choice = {"candidate": candidate, "label": best, "latency_ms": latencies[candidate["fuse"]],
              "candidates": measured}
    choices.save(key, choice)
    chosen = built[best]
    chosen.choice = {**choice, "cached": False}
    return chosen


# ---- several devices (HIOS): one rank process per device -------------------------------------------------------
DEFAULT_LINK = {"cpu": "loopback", "cuda": "nvlink4"}


def plan_ranks(captured, *, scheduler: str = "hios-lp", device: str = "cpu", devices: int = 2,
               streams: int | None = None, costs: Costs | None = None, link: str | Path | None = None,
               cost_model: str = "ideal") -> tuple[Costs, Schedule, LaunchPlan]:
    """Costs, schedule and validated plan of ``captured`` on ``devices`` devices. Edge transfer times come from
    ``link`` (a preset or a ``profile-links`` file); when none is given, from the costs' own, else the default
    link of the device kind (loopback for CPU ranks, NVLink 4 for GPUs)."""
    from dataclasses import replace

    from opweave.backends.distributed import check_devices
    from opweave.costs.links import transfer_times

    graph = captured.graph
    if devices > 1 and scheduler not in schedulers.MULTI_DEVICE:
        raise UsageError(f"scheduler {scheduler!r} places every op on one device; use one of "
                         f"{', '.join(schedulers.MULTI_DEVICE)} with devices > 1")
    check_devices(devices, device, ops=len(graph))
    if costs is None:
        costs = _roofline(graph, device, cost_model)
    if link is not None or not costs.edge_transfer_ms:
        costs = replace(costs, edge_transfer_ms=transfer_times(graph, link or DEFAULT_LINK[device]))
    sched, plan = plan_for(graph, costs, scheduler, streams=streams, devices=devices)
    return costs, sched, plan


def compile_ranks(captured, *, scheduler: str = "hios-lp", device: str = "cpu", devices: int = 2,
                  streams: int | None = None, costs: Costs | None = None, link: str | Path | None = None,
                  cost_model: str = "ideal", **backend_options) -> Compiled:
    """``captured`` planned for ``devices`` devices (:func:`plan_ranks`) and run by as many persistent rank
    processes (:class:`opweave.backends.distributed.DistributedBackend`; ``backend_options``: ``threads``,
    ``timeout_s``, ``start_method``). ``devices=1`` runs the plan in one rank process, the baseline to compare the
    others with. What :func:`compile` does for ``devices > 1``."""
    from opweave.backends.distributed import DistributedBackend

    costs, sched, plan = plan_ranks(captured, scheduler=scheduler, device=device, devices=devices, streams=streams,
                                    costs=costs, link=link, cost_model=cost_model)
    backend = DistributedBackend(captured, plan, world=devices, device=device, **backend_options)
    return Compiled(captured.graph, costs, sched, plan, backend, device, captured)


def load_graph(graph: str | Path | None = None, model: str | None = None, *, batch_size: int = 1,
               preset: str = "h100", profile: str | Path | None = None, coarsen: bool = True,
               model_file: str | Path | None = None) -> OpGraph:
    """The graph the CLI's ``schedule`` and ``simulate`` work on: a graph JSON file or a shipped example
    (``graph``, which carries its own ops), or a zoo ``model`` captured at ``batch_size`` (or the ``.pt2``
    ``model_file``; :func:`opweave.capture.load`) and coarsened, as :func:`compile` plans it, unless
    ``coarsen=False``, with roofline latencies for ``preset``, or with the latencies measured in ``profile``.

    A profile must have been measured for this model, batch (input shapes), dtype and granularity; otherwise
    :class:`~opweave.costs.profile.ProfileKeyError`. Its device and torch version are not checked: scheduling and
    simulating a GPU's profile on another machine is the point (the graph then carries that GPU's costs).
    """
    from opweave.ir import examples

    if sum(x is not None for x in (graph, model, model_file)) != 1:
        raise UsageError("give a GRAPH (file or example name), --model NAME or --model-file PATH.pt2, one of them")
    if profile is not None and model is None:
        raise UsageError("--profile goes with --model (a graph file carries its own latencies)")
    if graph is None:
        from opweave.capture import load
        from opweave.costs.roofline import with_estimates

        _, inputs, captured = load(Path(model_file) if model_file is not None else model, batch_size=batch_size,
                                   coarsen=coarsen)
        estimated = with_estimates(captured.graph, preset)
        if profile is None:
            return estimated
        from opweave.costs.profile import Profile, profile_key
        from opweave.costs.profile.store import model_dtype

        measured = Profile.load(profile)
        expect = profile_key(model, inputs, "cpu", model_dtype(captured, inputs))
        expect = {k: v for k, v in expect.items() if k not in ("device", "torch")}
        measured.check_key({**expect, "device": measured.key.get("device"), "torch": measured.key.get("torch")},
                           source=str(profile))
        return measured.apply(estimated)
    if str(graph) in examples.names():
        return examples.load(str(graph))
    if not Path(graph).exists():
        raise UsageError(f"no graph file {str(graph)!r} (examples: {', '.join(examples.names())})")
    return OpGraph.load(graph)


def _check(device: str, example_inputs) -> tuple:
    """The inputs as a tuple, once the device is known to be usable."""
    if device not in DEVICES:
        raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        from opweave.backends.cuda import require_cuda

        require_cuda()
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _roofline(graph: OpGraph, device: str, cost_model: str) -> Costs:
    """Costs estimated for ``device`` when none are given or measured: the CPU's roofline, or the visible GPU's
    preset (H100 when unknown)."""
    from opweave.costs.roofline import estimate, preset_for_gpu

    if device == "cpu":
        return estimate(graph, device="cpu", model=cost_model)
    import torch

    return estimate(graph, device=preset_for_gpu(torch.cuda.get_device_name()) or "h100", model=cost_model)
