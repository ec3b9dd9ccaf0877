"""One target per device: each owns its defaults and builds its backend from a validated plan.

* :class:`CpuTarget` — lanes as threads (:class:`~opweave.backends.cpu.CpuBackend`), or lanes over ONNX Runtime's
  optimized graph (``graph="onnxruntime"``, :class:`~opweave.backends.ortgraph.OrtLanes`). Default plan: HEFT on one
  lane per core, the cross-lane edge weighed at the measured thread hand-off, one candidate of the default's race
  beside the model in one ONNX Runtime segment and the model itself (:func:`opweave.pipeline.autotune.guarded`,
  which :func:`opweave.pipeline.flow.build` asks).
* :class:`CudaTarget` — CUDA streams, recorded into a CUDA Graph (:class:`~opweave.backends.cuda.CudaBackend`).
  Default plan: the scheduler and stream cap the calibrated simulator predicts fastest.

On both, ``graph="inductor"`` plans over Inductor's kernels instead of the captured ops (:func:`inductor_ops`,
:mod:`opweave.backends.inductorgraph`): the captured ops regrouped so that what Inductor fuses in the whole model is
one op, each op's kernel count in the costs, every segment compiled by Inductor.
* :class:`RanksTarget` — one rank process per device (``devices > 1``,
  :class:`~opweave.backends.distributed.DistributedBackend`).

**Thread budgets** (CPU): lanes x intra-op threads never exceed the threads given (``options.threads``, default
every core; :mod:`opweave.backends.threads`). How they are split depends on what runs the ops, which says so
itself: a segment compiler whose thread pools sleep when idle (ONNX Runtime, ``per_op_threads``) gets per-op
budgets (an op the replayed plan runs alone gets every thread); anything else one thread per worker lane and the
rest to the caller's lane.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from opweave.costs import Costs
from opweave.errors import UsageError
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.memory_pass import PEAK_CAP, BuildBuffers, memory_pass, with_free_joins
from opweave.pipeline.options import Options
from opweave.pipeline.thread_budgets import lane_threads
from opweave.plan import LaunchPlan
from opweave.plan.make import plan_for
from opweave.schedulers.schedule import Schedule

log = logging.getLogger(__name__)

PICK_TOLERANCE = 0.01  # how much slower (predicted) than the fastest a plan under the memory cap may be to be picked


class CpuTarget:
    device = "cpu"

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        from opweave.backends import threads as cpu_threads

        if options.graph == "onnxruntime":
            return self.build_ort_graph(captured, inputs, options)
        captured, kernels = inductor_ops(captured, inputs, options)
        scheduler, streams = options.scheduler, options.streams  # default: heft, one lane per thread it may use
        sched_options = dict(options.scheduler_options or {})
        if scheduler == "heft":  # a cross-lane edge costs a thread hand-off here: weigh it
            sched_options.setdefault("sync_ms", cpu_threads.sync_cost_ms())
        costs = costs_for(captured, inputs, options, "cpu")
        if kernels is not None:
            costs = replace(costs, kernels=kernels)
        assert scheduler is not None  # the CPU's: heft unless given
        sched, plan = plan_for(captured.graph, costs, scheduler, streams=streams, **sched_options)
        return self.runnable(captured, sched, plan, inputs, options, costs)

    def runnable(self, captured, sched: Schedule, plan: LaunchPlan, inputs: tuple, options: Options,
                 costs: Costs) -> Compiled:
        """The CPU backend running the validated ``plan`` (of ``sched``) of ``captured`` (its segments compiled first
        with ``options.compiler``)."""
        from opweave.backends.cpu import CpuBackend

        per_op = per_op_threads(options)
        threads: dict[str, int] | None = lane_threads(captured.graph, plan, costs, per_op=per_op,
                                                      total=options.threads)
        runner, run_plan, fused = captured, plan, None
        if options.compiler is not None:
            from opweave.backends.segments import fuse_segments

            runner, run_plan = fuse_segments(captured, plan, options.compiler, threads=threads,
                                             compiler_options=segment_options(captured, options),
                                             dynamic=options.dynamic)
            threads, fused = runner.threads or None, runner
            runner.prepare(inputs, run_plan)  # compile now, not in the first call
        backend = CpuBackend(runner, run_plan, threads=threads, total=options.threads)
        return Compiled(captured.graph, costs, sched, plan, backend, "cpu", captured, fused=fused, options=options)

    def build_ort_graph(self, captured, inputs: tuple, options: Options, *, model=None,
                        costs: Costs | None = None) -> Compiled:
        """``graph="onnxruntime"``: ``captured`` exported whole and optimized by ONNX Runtime, the nodes of its
        optimized graph scheduled onto one lane per core (at most ``streams``) and run as sessions of each segment
        over bound buffers (:mod:`opweave.backends.ortgraph`). Costs are each node's kernel time on one thread from
        ONNX Runtime's profiler, or ``costs``' latencies when they name exactly the optimized graph's nodes (a
        cached choice). ``heft`` weighs a cross-lane edge at 10x the thread hand-off: there it also cuts a segment,
        which costs ONNX Runtime some of its whole-graph locality (max-autotune tries 3x, 10x and 30x; it picked
        10x for NASNet in both of its runs on 2026-11-26, 17.3 ms against 19.3 ms at 3x,
        ``benchmarks/results/cpu_latency.json``). ``model``: an :class:`~opweave.backends.ortgraph.OrtGraph`
        already built for these inputs (max-autotune shares one among its candidates). The result's ``graph``,
        ``schedule`` and ``plan`` are the optimized graph's."""
        import dataclasses

        from opweave.backends import threads as cpu_threads
        from opweave.backends.ortgraph import OrtGraph, OrtLanes
        from opweave.costs import from_graph

        if model is None:
            model = OrtGraph(captured, inputs, latency_ms=costs.latency_ms if costs is not None else None)
        graph = model.graph
        planned = from_graph(graph)
        if costs is not None and set(costs.latency_ms) == set(graph.ids):
            planned = dataclasses.replace(planned, latency_ms=dict(costs.latency_ms))
        sched_options = dict(options.scheduler_options or {})
        if options.scheduler == "heft":
            sched_options.setdefault("sync_ms", 10 * cpu_threads.sync_cost_ms())
        assert options.scheduler is not None  # the CPU's: heft unless given
        sched, plan = plan_for(graph, planned, options.scheduler, streams=options.streams, **sched_options)
        backend = OrtLanes(model, plan, lane_threads(graph, plan, planned, per_op=True, total=options.threads))
        return Compiled(graph, planned, sched, plan, backend, "cpu", captured, options=options)


class CudaTarget:
    device = "cuda"

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        from opweave.pipeline.choose import sync_options

        device, dtype = fitted_device(options.runtime), _dtype(captured)
        captured, kernels = inductor_ops(captured, inputs, options)
        costs = self.costs(captured, inputs, options, device, dtype, launches=kernels)
        streams = options.streams  # default: the hardware queues (more lanes add false dependencies)
        assert streams is not None  # one device
        scheduler, choice = options.scheduler, None
        # every plan's memory pass and the backend find the buffers from one run on fake tensors (segments: no pass)
        shared = BuildBuffers(captured, inputs, costs) if options.compiler is None else None

        def planned(name: str, cap: int):
            return plan_for(captured.graph, costs, name, streams=cap,
                            **{**sync_options(name, device), **(options.scheduler_options or {})})

        if scheduler is None:  # the plan the calibrated simulator predicts fastest (under the memory cap)
            ranked = self.ranking(captured.graph, costs, streams, device, dtype, set(options.scheduler_options or {}))
            picked, sched, plan, reason = self.under_cap(ranked, planned, captured, inputs, options, costs,
                                                         shared=shared)
            choice = {"label": f"{picked.scheduler} x{picked.streams}", "predicted_ms": picked.makespan_ms,
                      "reason": reason, "candidates": {
                          f"{p.scheduler} x{p.streams}": {"predicted_ms": p.makespan_ms} for p in ranked.predictions}}
            compiled = self.runnable(captured, sched, plan, inputs, options, costs, joined=True, shared=shared)
        else:
            sched, plan = planned(scheduler, streams)
            compiled = self.runnable(captured, sched, plan, inputs, options, costs, shared=shared)
        compiled.choice = choice
        if choice is not None:
            log.info("%s: %s", captured.graph.name, choice["reason"])
        return compiled

    def costs(self, captured, inputs: tuple, options: Options, device, dtype: str, launches=None) -> Costs:
        """``options``' costs or profile, else each op's time on the fitted device (:mod:`opweave.costs.calibrated`:
        the roofline calibrated per op class on real traces), as the schedulers see a profile. ``launches``: the
        kernels each op launches where Inductor decided them (``graph="inductor"``); the fitted model's floors and
        launch gaps are per kernel."""
        if options.costs is not None or options.profile is not None:
            costs = costs_for(captured, inputs, options, visible_gpu_preset(options.runtime))
            return costs if launches is None else replace(costs, kernels=launches)
        from opweave.costs import calibrated

        return replace(calibrated.costs(captured.graph, device, dtype, launches=launches), model=options.cost_model)

    def ranking(self, graph, costs: Costs, streams: int, device=None, dtype: str = "float32",
                taking: frozenset[str] | set[str] = frozenset()):
        """Every single-device scheduler (that takes the options ``taking``) at stream caps up to ``streams``,
        ranked by the fitted device's prediction (:func:`opweave.pipeline.choose.choose`): its ``predictions``,
        fastest first."""
        from opweave import schedulers
        from opweave.pipeline.choose import STREAM_CAPS, choose

        caps = sorted({c for c in STREAM_CAPS if c < streams} | {streams})
        names = [n for n in schedulers.names() if (accepted := schedulers.options_of(n)) is None
                 or taking <= accepted]
        if not names:
            raise UsageError(f"no scheduler takes the options {', '.join(sorted(taking))}")
        return choose(graph, costs, device or fitted_device(), dtype=dtype, names=names, stream_caps=caps)

    def under_cap(self, ranked, planned, captured, inputs: tuple, options: Options, costs: Costs, *,
                  shared: BuildBuffers | None = None):
        """The first plan of ``ranked`` (a :class:`~opweave.pipeline.choose.Choice`) predicted within
        ``PICK_TOLERANCE`` of the fastest whose planned peak after the memory pass
        (:func:`opweave.pipeline.memory_pass.memory_pass`, every plan's with the buffers and one-stream peak of
        ``shared``) is within its cap; the fastest when none is. ``planned(name, cap)`` makes a (schedule, plan).
        Returns the prediction, the schedule, the plan after the memory pass and the reason to give."""
        tried: list[tuple] = []
        for p in ranked.predictions:
            if p.makespan_ms > ranked.makespan_ms * (1 + PICK_TOLERANCE) and tried:
                break
            sched, plan = planned(p.scheduler, p.streams)
            if options.compiler is None:
                plan, ratio = memory_pass(captured, plan, inputs, costs, cuda_graph=options.cudagraphs,
                                          shared=shared)
            else:  # segments: the pass does not run
                ratio = None
            tried.append((p, sched, plan, ratio))
            if ratio is None or ratio <= PEAK_CAP:
                break
        p, sched, plan, ratio = next((t for t in tried if t[3] is None or t[3] <= PEAK_CAP), tried[0])
        reason = replace(ranked, scheduler=p.scheduler, streams=p.streams, makespan_ms=p.makespan_ms).reason()
        over = [f"{q.scheduler}/{q.streams} ({r:.2f}x)" for q, _, _, r in tried if r is not None and r > PEAK_CAP]
        if over and p is tried[0][0]:
            reason += (f"; planned peak {ratio:.2f}x the one-stream plan's, over the {PEAK_CAP:.2f}x cap, as is "
                       f"every plan predicted within {PICK_TOLERANCE:.0%}")
        elif over:
            reason += (f"; picked over {', '.join(over)}: planned peak over {PEAK_CAP:.2f}x the one-stream plan's "
                       f"({ratio:.2f}x here)" if ratio is not None else "")
        return p, sched, plan, reason

    def runnable(self, captured, sched: Schedule, plan: LaunchPlan, inputs: tuple, options: Options, costs: Costs, *,
                 joined: bool = False, shared: BuildBuffers | None = None) -> Compiled:
        """The CUDA backend running the validated ``plan`` (of ``sched``) of ``captured`` (its segments compiled with
        ``options.compiler`` in the backend's warm-up); the memory pass runs first unless the plan is ``joined``
        already. ``shared``: the build's buffers (:class:`~opweave.pipeline.memory_pass.BuildBuffers`), whose run on
        fake tensors the memory pass and the backend's release plan for ``inputs`` then use instead of their own."""
        from opweave.backends.cuda import CudaBackend

        if options.compiler is None and not joined:  # waits that free buffers read on other streams early
            plan = with_free_joins(captured, plan, inputs, costs, cuda_graph=options.cudagraphs, shared=shared)
        runner, run_plan, fused = captured, plan, None
        if options.compiler is not None:
            from opweave.backends.segments import fuse_segments

            runner, run_plan = fuse_segments(captured, plan, options.compiler,
                                             compiler_options=segment_options(captured, options),
                                             dynamic=options.dynamic)
            fused = runner
        backend = CudaBackend(runner, run_plan, inputs, cudagraphs=options.cudagraphs,
                              capture_fallback=options.capture_fallback, static_outputs=options.static_outputs,
                              cache_size=options.cache_size, warmup=options.warmup, runtime=options.runtime,
                              fake_run=shared.fake if shared is not None and options.compiler is None else None)
        return Compiled(captured.graph, costs, sched, plan, backend, "cuda", captured, fused=fused, options=options)


class RanksTarget:
    """``devices > 1``: the plan spans several devices, one persistent rank process each."""

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        from opweave.backends.distributed import DistributedBackend

        costs, sched, plan = self.plan(captured, inputs, options)
        backend = DistributedBackend(captured, plan, world=options.devices, device=options.device,
                                     threads=options.threads, timeout_s=options.timeout_s,
                                     start_method=options.start_method)
        return Compiled(captured.graph, costs, sched, plan, backend, options.device, captured, options=options)

    def plan(self, captured, inputs: tuple, options: Options):
        """Costs, schedule and validated plan of ``captured`` on ``options.devices`` devices. Edge transfer times
        come from ``options.link`` (a preset or a ``profile-links`` file; by default loopback for CPU ranks, NVLink 4
        for GPUs, :data:`~opweave.pipeline.options.OPTIONS`), or, where it resolved to none (costs given with
        transfer times of their own, and no link), from the costs."""
        from opweave.backends.distributed import check_devices
        from opweave.costs.links import transfer_times

        check_devices(options.devices, options.device, ops=len(captured.graph))
        preset = "cpu" if options.device == "cpu" else visible_gpu_preset(options.runtime)
        costs = costs_for(captured, inputs, options, preset)
        if options.link is not None:
            costs = replace(costs, edge_transfer_ms=transfer_times(captured.graph, options.link))
        assert options.scheduler is not None  # with devices > 1: hios-lp unless given
        sched, plan = plan_for(captured.graph, costs, options.scheduler, streams=options.streams,
                               devices=options.devices, **(options.scheduler_options or {}))
        return costs, sched, plan


def costs_for(captured, inputs: tuple, options: Options, preset: str) -> Costs:
    """What the scheduler plans on: ``options.costs``, else the measured ``options.profile`` (refused when it was
    measured for other shapes, dtype, device, torch or granularity), else the roofline estimate for ``preset``."""
    if options.costs is not None:
        return options.costs
    if options.profile is not None:
        from opweave.costs.profile import load_for

        return load_for(options.profile, captured, inputs, options.device).costs(captured.graph,
                                                                                 model=options.cost_model)
    from opweave.costs.roofline import estimate

    return estimate(captured.graph, device=preset, model=options.cost_model)


def inductor_ops(captured, inputs: tuple, options: Options):
    """``graph="inductor"``: ``captured`` regrouped into one op per group of ops that share a kernel when Inductor
    compiles the whole model (:mod:`opweave.backends.inductorgraph`), and per op the kernels it launches; else
    ``captured`` as it is and None."""
    if options.graph != "inductor":
        return captured, None
    from opweave.backends.inductorgraph import inductor_graph

    regrouped = inductor_graph(captured, inputs, threads=options.threads)
    log.info("%s: %d ops as Inductor's kernels (%s)", captured.graph.name, len(regrouped.graph), regrouped.stats)
    return regrouped.captured, regrouped.kernels


def segment_options(captured, options: Options) -> dict | None:
    """How the segment compiler is made:

    * with ``graph="inductor"``, segments hand each other values in the layouts Inductor chose (a convolution's
      channels-last output goes on as it is) wherever the model reads no layout
      (:func:`opweave.backends.inductorgraph.free_layouts`); eager's layout at every segment boundary costs a copy
      kernel on each side of it (GoogLeNet at 64x64 on the CPU, compiled unfrozen as on CUDA, Opara over 8 streams:
      211 of Inductor's nodes per call with eager's layouts, 153 without them, 156 for the whole model);
    * ``dynamic=True`` with ONNX Runtime on one stream (the whole model one session): its batch dimension is left
      free (checked at another batch by :func:`opweave.pipeline.flow.build`);
    * a server's (``options.shared``), where many models share one process: ONNX Runtime's sessions run on the
      process's one thread pool with no memory arena of their own, and a model's variants built per batch
      (``dynamic`` unset) read its own weights (ONNX Runtime's shared initializers); Inductor compiles unfrozen
      (its parameters the model's, not constants of its own)."""
    out: dict = {}
    if options.graph == "inductor":
        from opweave.backends.inductorgraph import free_layouts

        if free_layouts(captured):
            out["eager_strides"] = False
    if options.compiler == "onnxruntime" and options.dynamic is True and options.streams == 1:
        out["dynamic_batch"] = True
    if options.shared and options.compiler == "onnxruntime":
        from opweave.backends.compilers import shared_pool

        assert options.threads is not None  # a CPU's: every core unless given
        out.update(shared_pool=shared_pool(options.threads), arena=False, share_weights=options.dynamic is None)
    elif options.shared and options.compiler == "inductor":
        out["freeze"] = False
    return out or None


def for_options(options: Options):
    """The target that builds ``options``' plans."""
    if options.devices > 1:
        return RanksTarget()
    return CudaTarget() if options.device == "cuda" else CpuTarget()


def fitted_device(runtime=None):
    """The fitted device model of the visible GPU (:mod:`opweave.costs.calibrated`; the H100's for a GPU it does not
    know, or the fake runtime's)."""
    from opweave.costs import calibrated

    preset = visible_gpu_preset(runtime)
    return calibrated.device(preset if preset in calibrated.FITTED else "h100")


def _dtype(captured) -> str:
    """The floating dtype the model computes in (its parameters'), as the cost model names it."""

    for p in captured.gm.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def visible_gpu_preset(runtime=None) -> str:
    """The roofline preset of the visible GPU, as ``runtime`` (default ``torch.cuda``) names it (H100 when
    unknown)."""
    from opweave.backends.runtime import CUDA
    from opweave.costs.roofline import preset_for_gpu

    return preset_for_gpu((runtime or CUDA).device_name()) or "h100"


def per_op_threads(options: Options) -> bool:
    """Whether what runs the ops sleeps when idle, so an op the plan runs alone may take every thread (ONNX
    Runtime's sessions; the options may say so for ops that are such calls: a server's blocks)."""
    if options.per_op_threads is not None:
        return options.per_op_threads
    if options.compiler is None:
        return False
    from opweave.backends.compilers import get

    return get(options.compiler).per_op_threads


__all__ = ["CpuTarget", "CudaTarget", "RanksTarget", "costs_for", "for_options", "inductor_ops", "per_op_threads",
           "segment_options", "visible_gpu_preset"]
