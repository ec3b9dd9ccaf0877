"""One target per device: each owns its defaults, builds its backend from a validated plan, and offers the candidates
a measured choice races (:mod:`opweave.pipeline.search` builds, checks, times and caches them).

* :class:`CpuTarget` — lanes as threads (:class:`~opweave.backends.cpu.CpuBackend`), or lanes over ONNX Runtime's
  optimized graph (``graph="onnxruntime"``, :class:`~opweave.backends.ortgraph.OrtLanes`). Default plan: HEFT on one
  lane per core, the cross-lane edge weighed at the measured thread hand-off, one candidate of the default's race
  (:meth:`CpuTarget.default_candidates`) beside the model in one ONNX Runtime segment and the model itself.
* :class:`CudaTarget` — CUDA streams, recorded into a CUDA Graph (:class:`~opweave.backends.cuda.CudaBackend`).
  Default plan: the scheduler and stream cap the calibrated simulator predicts fastest.

On both, ``graph="inductor"`` plans over Inductor's kernels instead of the captured ops (:func:`inductor_ops`,
:mod:`opweave.backends.inductorgraph`): the captured ops regrouped so that what Inductor fuses in the whole model is
one op, each op's kernel count in the costs, every segment compiled by Inductor.
* :class:`RanksTarget` — one rank process per device (``devices > 1``,
  :class:`~opweave.backends.distributed.DistributedBackend`).
* :class:`SimTarget` — a server in simulation: a combined block's plan replayed by the simulator
  (:class:`~opweave.backends.simulate.Replay`), which runs no op.

**Thread budgets** (CPU): lanes x intra-op threads never exceed the threads given (``options.threads``, default
every core; :mod:`opweave.backends.threads`). How they are split depends on what runs the ops, which says so
itself: a segment compiler whose thread pools sleep when idle (ONNX Runtime, ``per_op_threads``) gets per-op
budgets (an op the replayed plan runs alone gets every thread); anything else one thread per worker lane and the
rest to the caller's lane.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from dataclasses import replace

import torch
from torch.utils import _pytree as pytree

from opweave import schedulers
from opweave.backends import compilers
from opweave.backends import threads as cpu_threads
from opweave.backends.cpu import CpuBackend, EagerBackend
from opweave.backends.cuda import CudaBackend
from opweave.backends.distributed import DistributedBackend, check_devices
from opweave.backends.runtime import CUDA
from opweave.backends.segments import fuse_segments
from opweave.backends.simulate import Replay
from opweave.costs import Costs, calibrated, from_graph
from opweave.costs.links import transfer_times
from opweave.costs.profile import load_for
from opweave.costs.roofline import estimate, preset_for_gpu
from opweave.errors import UsageError
from opweave.ir import OpGraph
from opweave.pipeline import tiers
from opweave.pipeline.choose import STREAM_CAPS, choose, sync_options
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.memory_pass import PEAK_CAP, BuildBuffers, memory_pass, with_free_joins
from opweave.pipeline.options import Options
from opweave.pipeline.search import Candidate
from opweave.pipeline.thread_budgets import lane_threads
from opweave.plan import LaunchPlan
from opweave.plan.make import plan_for, validated_plan
from opweave.schedulers.schedule import Schedule

log = logging.getLogger(__name__)

PICK_TOLERANCE = 0.01  # how much slower (predicted) than the fastest a plan under the memory cap may be to be picked
LANE_CORES = 4  # the CPU default tries lanes of compiled segments only with at least this many threads
DEFAULT_LABELS = ("onnxruntime", "onnxruntime lanes", "lanes", "one lane", "eager")  # what the CPU default may keep
SEGMENTED_SYNCS = 128  # a plan with more syncs has too many segments for Inductor to compile in a search


# a captured model -> it coarsened, held by weak reference at both ends: what plans on the coarse graph holds it
_COARSENED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def coarsened(captured, options: Options):
    """``captured`` as ``options`` plan it: coarsened (the papers' operators, :func:`~opweave.capture.coarsen`)
    unless ``coarsen=False``, once per captured model while something holds the coarse graph (a measured choice's
    candidates share it). The coarse graph folds BatchNorm into a copy of the convolutions' weights; a candidate
    that runs the captured model as one compiled segment gains nothing by it (ONNX Runtime and Inductor fold
    BatchNorm themselves) and says ``coarsen=False``: it then reads the model's own weights and holds no folded copy
    of them. The cache holds the coarse graph by weak reference, so that once a race is over its folded copy lives
    only where the candidate that won plans on it (held from the captured model, it outlived the race: a compiled
    ResNet-50 whose one ONNX Runtime segment won held a third copy of the weights)."""
    if not options.coarsen:
        return captured
    known = _COARSENED.get(captured)
    done = known() if known is not None else None
    if done is None:
        from opweave.capture import coarsen

        done = coarsen(captured)
        _COARSENED[captured] = weakref.ref(done)
    return done


class Target:
    """What the CPU and CUDA targets share: the build of a candidate of a measured choice (the captured model as
    it was captured, :func:`coarsened` as the candidate plans it)."""

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        raise NotImplementedError

    def planning_costs(self, captured, inputs: tuple, options: Options) -> Costs:
        raise NotImplementedError

    def planned(self, captured, options: Options, candidate: Candidate | None = None):
        """The captured model as ``candidate`` plans it: :func:`coarsened` as a plan's changes to ``options`` say, a
        model-whole kind's metadata (or, with no candidate, the list of candidates) as ``options`` do."""
        if candidate is not None and candidate.kind == "plan":
            options = options.derive(autotune=False, tiers=None, **candidate.changes)
        return coarsened(captured, options)

    def build_candidate(self, captured, inputs: tuple, options: Options, candidate: Candidate,
                        latency_ms: dict | None, eager) -> Compiled:
        """``candidate`` (:class:`~opweave.pipeline.search.Candidate`) built: a plan with its changes to ``options``
        made on ``latency_ms`` (None: the target's own costs), or the model whole (``torch.compile``'s, or itself).
        ``captured`` is the model as captured; the candidate plans on it as :meth:`planned` says."""
        captured = self.planned(captured, options, candidate)  # the graph its latencies were measured on
        if candidate.kind != "plan":  # the model whole: its plan's metadata on the costs this target plans on
            model = eager if eager is not None else captured.gm
            costs = self.planning_costs(captured, inputs, options)
            if candidate.kind == "torch.compile":
                return whole(captured, options, _Cloned(torch.compile(model, mode=candidate.changes.get(
                    "mode", "reduce-overhead"))), costs)
            if candidate.kind == "tier":  # built in a build process (or found in the disk cache), waited for
                return whole(captured, options, tiers.built_now(candidate.changes["tier"], captured, inputs, options),
                             costs)
            return whole(captured, options, eager, costs, threads=options.threads)  # the model itself
        changed = options.derive(autotune=False, tiers=None, **candidate.changes)
        if candidate.costs == "onnxruntime-graph":
            assert isinstance(self, CpuTarget)  # ONNX Runtime's graph runs on the CPU
            return self.build_ort_graph(captured, inputs, changed,
                                        costs=Costs(latency_ms) if latency_ms is not None else None)
        if latency_ms is not None:
            roofline = estimate(captured.graph, device="cpu", model="ideal")
            changed = changed.derive(costs=dataclasses.replace(roofline, latency_ms=latency_ms), profile=None)
        return self.build(captured, inputs, changed)


class CpuTarget(Target):
    device = "cpu"

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        if options.graph == "onnxruntime":
            return self.build_ort_graph(captured, inputs, options)
        captured, kernels = inductor_ops(captured, inputs, options)
        scheduler, streams = options.scheduler, options.streams  # default: heft, one lane per thread it may use
        sched_options = dict(options.scheduler_options or {})
        if scheduler == "heft":  # a cross-lane edge costs a thread hand-off here: weigh it
            sched_options.setdefault("sync_ms", cpu_threads.sync_cost_ms())
        costs = self.planning_costs(captured, inputs, options)
        if kernels is not None:
            costs = replace(costs, kernels=kernels)
        assert scheduler is not None  # the CPU's: heft unless given
        sched, plan = plan_for(captured.graph, costs, scheduler, streams=streams, **sched_options)
        return self.runnable(captured, sched, plan, inputs, options, costs)

    def planning_costs(self, captured, inputs: tuple, options: Options) -> Costs:
        """What the CPU's schedulers plan ``captured`` on (:func:`costs_for`, the CPU's roofline by default)."""
        return costs_for(captured, inputs, options, "cpu")

    def runnable(self, captured, sched: Schedule, plan: LaunchPlan, inputs: tuple, options: Options,
                 costs: Costs) -> Compiled:
        """The CPU backend running the validated ``plan`` (of ``sched``) of ``captured`` (its segments compiled first
        with ``options.compiler``)."""
        per_op = per_op_threads(options)
        threads: dict[str, int] | None = lane_threads(captured.graph, plan, costs, per_op=per_op,
                                                      total=options.threads)
        runner, run_plan, fused = captured, plan, None
        if options.compiler is not None:
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
        which costs ONNX Runtime some of its whole-graph locality (max-autotune tries 3x, 10x and 30x). ``model``:
        an :class:`~opweave.backends.ortgraph.OrtGraph` already built for these inputs. The result's ``graph``,
        ``schedule`` and ``plan`` are the optimized graph's."""
        from opweave.backends.ortgraph import OrtGraph, OrtLanes  # ONNX Runtime, an optional package

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

    def default_candidates(self, options: Options) -> list[Candidate]:
        """What the CPU default races (:func:`opweave.pipeline.search.default_race`), in the order they are built:

        * ``onnxruntime``: the model in the order it was captured, its one segment compiled by ONNX Runtime with every
          dimension of its inputs free (as ``dynamic=True``: a call of another size runs on the same session, nothing
          is exported again; the example's sizes get their own session later, and an Inductor build, as tiers:
          :mod:`opweave.pipeline.tiers`), where ONNX Runtime imports (else one line says so, once:
          :func:`default_compiler`);
          ``onnxruntime lanes``: the lanes of the default plan, each segment compiled by it, only with at least
          :data:`LANE_CORES` threads: below that ONNX Runtime's own intra-op threads take the cores the lanes
          would run on (docs/design.md, "The CPU default");
        * ``lanes``: the default plan (HEFT, one lane per thread), each lane the captured ops: raced without ONNX
          Runtime or with :data:`LANE_CORES` threads, else only if ONNX Runtime's candidate fails; a plan of one
          lane is ``one lane``;
        * ``one lane``: the captured ops in the model's order, when no compiled candidate is built;
        * ``eager``: the model itself (when known), so the default is never slower than the model."""
        compiler = default_compiler()
        few = (options.threads or 1) < LANE_CORES
        # one segment plans on the model as captured (no BatchNorm folded into a copy of the weights: ONNX Runtime
        # folds it), unless costs measured for the coarse graph were given
        one = {"scheduler": "sequential", "streams": 1, "scheduler_options": None,
               "coarsen": options.coarsen and (options.profile is not None or options.costs is not None)}
        out = []
        if compiler is not None:
            free = {"dynamic": True} if options.dynamic is not False else {}  # every size on one session
            out.append(Candidate("onnxruntime", {**one, "compiler": compiler, **free}))
            if not few:
                out.append(Candidate("onnxruntime lanes", {"scheduler": options.scheduler, "compiler": compiler}))
        out.append(Candidate("lanes", {"scheduler": options.scheduler},
                             unless="onnxruntime" if compiler is not None and few else None))
        out.append(Candidate("one lane", one, unless="onnxruntime"))
        out.append(Candidate("eager", kind="eager"))
        return out

    def search_candidates(self, captured, inputs: tuple, options: Options) -> list[Candidate]:
        """``mode="max-autotune"``'s list on the CPU (:func:`cpu_candidates`), and the tiers the default builds
        later (:data:`opweave.pipeline.tiers.KINDS`, where ``tiers`` is on), built before it returns."""
        out = cpu_candidates(cpu_threads.sync_cost_ms(), threads=options.threads or 1)
        if options.tiers:
            out += [Candidate(f"{kind} tier", {"tier": kind}, kind="tier") for kind in tiers.KINDS
                    if kind != "onnxruntime-fixed"]  # the session at the example's sizes: sequential+onnxruntime above
        return out


class CudaTarget(Target):
    device = "cuda"

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
        device = fitted_device(options.runtime)
        captured, kernels = inductor_ops(captured, inputs, options)
        costs = self.planning_costs(captured, inputs, options, launches=kernels)
        streams = options.streams  # default: the hardware queues (more lanes add false dependencies)
        assert streams is not None  # one device
        scheduler, choice = options.scheduler, None
        # every plan's memory pass and the backend find the buffers from one run on fake tensors (segments: no pass)
        shared = BuildBuffers(captured, inputs, costs) if options.compiler is None else None

        def planned(name: str, cap: int):
            return plan_for(captured.graph, costs, name, streams=cap,
                            **{**sync_options(name, device), **(options.scheduler_options or {})})

        if scheduler is None:  # the plan the calibrated simulator predicts fastest (under the memory cap)
            ranked = self.ranking(captured.graph, costs, streams, device, dtype_of(captured),
                                  set(options.scheduler_options or {}))
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

    def planning_costs(self, captured, inputs: tuple, options: Options, launches=None) -> Costs:
        """``options``' costs or profile, else each op's time on the fitted device (:mod:`opweave.costs.calibrated`:
        the roofline calibrated per op class on real traces, in the dtype the model computes in), as the schedulers
        see a profile. ``launches``: the kernels each op launches where Inductor decided them (``graph="inductor"``);
        the fitted model's floors and launch gaps are per kernel."""
        if options.costs is not None or options.profile is not None:
            costs = costs_for(captured, inputs, options, visible_gpu_preset(options.runtime))
            return costs if launches is None else replace(costs, kernels=launches)
        return replace(calibrated.costs(captured.graph, fitted_device(options.runtime), dtype_of(captured),
                                        launches=launches), model=options.cost_model)

    def ranking(self, graph, costs: Costs, streams: int, device=None, dtype: str = "float32",
                taking: frozenset[str] | set[str] = frozenset()):
        """Every single-device scheduler (that takes the options ``taking``) at stream caps up to ``streams``,
        ranked by the fitted device's prediction (:func:`opweave.pipeline.choose.choose`): its ``predictions``,
        fastest first."""
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
        if options.compiler is None and not joined:  # waits that free buffers read on other streams early
            plan = with_free_joins(captured, plan, inputs, costs, cuda_graph=options.cudagraphs, shared=shared)
        runner, run_plan, fused = captured, plan, None
        if options.compiler is not None:
            runner, run_plan = fuse_segments(captured, plan, options.compiler,
                                             compiler_options=segment_options(captured, options),
                                             dynamic=options.dynamic)
            fused = runner
        backend = CudaBackend(runner, run_plan, inputs, cudagraphs=options.cudagraphs,
                              capture_fallback=options.capture_fallback, static_outputs=options.static_outputs,
                              cache_size=options.cache_size, warmup=options.warmup, runtime=options.runtime,
                              fake_run=shared.fake if shared is not None and options.compiler is None else None)
        return Compiled(captured.graph, costs, sched, plan, backend, "cuda", captured, fused=fused, options=options)

    def search_candidates(self, captured, inputs: tuple, options: Options) -> list[Candidate]:
        """``mode="max-autotune"``'s list on CUDA (:func:`cuda_candidates`), ranked on the fitted device."""
        costs = self.planning_costs(captured, (), options)
        assert options.streams is not None  # one device: at most its hardware queues
        return cuda_candidates(captured.graph, costs, options.streams, device=fitted_device(options.runtime),
                               dtype=dtype_of(captured), cudagraphs=options.cudagraphs)


class RanksTarget:
    """``devices > 1``: the plan spans several devices, one persistent rank process each."""

    def build(self, captured, inputs: tuple, options: Options) -> Compiled:
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
        check_devices(options.devices, options.device, ops=len(captured.graph))
        preset = "cpu" if options.device == "cpu" else visible_gpu_preset(options.runtime)
        costs = costs_for(captured, inputs, options, preset)
        if options.link is not None:
            costs = replace(costs, edge_transfer_ms=transfer_times(captured.graph, options.link))
        assert options.scheduler is not None  # with devices > 1: hios-lp unless given
        sched, plan = plan_for(captured.graph, costs, options.scheduler, streams=options.streams,
                               devices=options.devices, **(options.scheduler_options or {}))
        return costs, sched, plan

    def planning_costs(self, captured, inputs: tuple, options: Options) -> Costs:
        return self.plan(captured, inputs, options)[0]


class SimTarget:
    """A server in simulation (``serving="sim"``): a combined block's op graph planned on the costs the server gives
    for it, validated, and replayed by the simulator as its backend (:class:`~opweave.backends.simulate.Replay`: the
    makespan, and the share of the device the ops keep busy). The simulator runs no op: nothing is captured."""

    device = "sim"

    def build(self, graph: OpGraph, costs: Costs, options: Options) -> Compiled:
        assert options.scheduler is not None  # the serving preset's: lios unless given
        sched, plan = plan_for(graph, costs, options.scheduler, streams=options.streams,
                               **(options.scheduler_options or {}))
        return Compiled(graph, costs, sched, plan, Replay(graph, plan, costs), self.device, options=options)


def whole(captured, options: Options, model, costs: Costs, *, threads: int | None = None) -> Compiled:
    """``model`` (the model itself, or compiled whole) run as one call (:class:`~opweave.backends.cpu.EagerBackend`),
    with the metadata of the captured graph's sequential plan on ``costs``: a candidate beside the plans."""
    sched = schedulers.run("sequential", captured.graph, costs)
    return Compiled(captured.graph, costs, sched, validated_plan(captured.graph, sched),
                    EagerBackend(model, threads=threads), options.device, captured, options=options)


class _Cloned:
    """A callable whose tensor outputs are cloned (CUDA Graph outputs are overwritten by the next replay)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.fn(*args))


def costs_for(captured, inputs: tuple, options: Options, preset: str) -> Costs:
    """What the scheduler plans on: ``options.costs``, else the measured ``options.profile`` (refused when it was
    measured for other shapes, dtype, device, torch or granularity), else the roofline estimate for ``preset``."""
    if options.costs is not None:
        return options.costs
    if options.profile is not None:
        return load_for(options.profile, captured, inputs, options.device).costs(captured.graph,
                                                                                 model=options.cost_model)
    return estimate(captured.graph, device=preset, model=options.cost_model)


def inductor_ops(captured, inputs: tuple, options: Options):
    """``graph="inductor"``: ``captured`` regrouped into one op per group of ops that share a kernel when Inductor
    compiles the whole model (:mod:`opweave.backends.inductorgraph`), and per op the kernels it launches; else
    ``captured`` as it is and None."""
    if options.graph != "inductor":
        return captured, None
    from opweave.backends.inductorgraph import inductor_graph  # Inductor's lowering, loaded only when asked

    regrouped = inductor_graph(captured, inputs, threads=options.threads)
    log.info("%s: %d ops as Inductor's kernels (%s)", captured.graph.name, len(regrouped.graph), regrouped.stats)
    return regrouped.captured, regrouped.kernels


def segment_options(captured, options: Options) -> dict | None:
    """How the segment compiler is made:

    * with ``graph="inductor"``, segments hand each other values in the layouts Inductor chose (a convolution's
      channels-last output goes on as it is) wherever the model reads no layout
      (:func:`opweave.backends.inductorgraph.free_layouts`): eager's layout at every segment boundary costs a copy
      kernel on each side of it;
    * ``dynamic=True`` with ONNX Runtime on one stream (the whole model one session): its batch dimension is left
      free (checked at another batch by :func:`opweave.pipeline.flow.build`);
    * in a process many models share (``options.shared``: a server's): ONNX Runtime's sessions run on the
      process's one thread pool with no memory arena of their own, and a model's variants built per batch
      (``dynamic`` unset) read its own weights (ONNX Runtime's shared initializers); Inductor compiles unfrozen
      (its parameters the model's, not constants of its own)."""
    out: dict = {}
    if options.graph == "inductor":
        from opweave.backends.inductorgraph import free_layouts  # Inductor's lowering, loaded only when asked

        if free_layouts(captured):
            out["eager_strides"] = False
    if options.compiler == "onnxruntime" and options.dynamic is True and options.streams == 1:
        out["dynamic_batch"] = True
    if options.shared and options.compiler == "onnxruntime":
        assert options.threads is not None  # a CPU's: every core unless given
        out.update(shared_pool=compilers.shared_pool(options.threads), arena=False,
                   share_weights=options.dynamic is None)
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
    preset = visible_gpu_preset(runtime)
    return calibrated.device(preset if preset in calibrated.FITTED else "h100")


def dtype_of(captured) -> str:
    """The floating dtype the model computes in (its parameters'), as the cost model names it."""
    for p in captured.gm.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def visible_gpu_preset(runtime=None) -> str:
    """The roofline preset of the visible GPU, as ``runtime`` (default ``torch.cuda``) names it (H100 when
    unknown)."""
    return preset_for_gpu((runtime or CUDA).device_name()) or "h100"


def per_op_threads(options: Options) -> bool:
    """Whether what runs the ops sleeps when idle, so an op the plan runs alone may take every thread (ONNX
    Runtime's sessions; the options may say so for ops that are such calls: a server's blocks)."""
    if options.per_op_threads is not None:
        return options.per_op_threads
    if options.compiler is None:
        return False
    return compilers.get(options.compiler).per_op_threads


def default_compiler() -> str | None:
    """The segment compiler the CPU default tries: ONNX Runtime when installed, else None, said once
    (:func:`_say_missing`)."""
    if "onnxruntime" in compilers.available():
        return "onnxruntime"
    _say_missing()
    return None


@functools.cache
def _say_missing() -> None:
    warnings.warn("ONNX Runtime does not import: opweave's CPU default runs the model's own kernels, without the "
                  "segments ONNX Runtime compiles; pip install onnxruntime (a dependency of opweave, where the "
                  "platform has a wheel of it) brings it", stacklevel=2)


def cpu_candidates(sync_ms: float, compilers_present: list[str] | None = None,
                   threads: int = LANE_CORES) -> list[Candidate]:
    """One lane (the caller's threads) or one lane per core (HEFT at several sync costs), unfused and with each
    segment compiler present (``compilers_present``, default :func:`opweave.backends.compilers.available`), and
    lanes over ONNX Runtime's graph. A segment boundary costs ONNX Runtime a call (and, over its whole graph, some
    locality), hence higher weights there. Inductor's segments (one lane) are tried only where ONNX Runtime is not
    installed (their compiles were the search's cold build, and lost to one ONNX Runtime segment); with ONNX Runtime
    and fewer than :data:`LANE_CORES` ``threads``, the search is ONNX Runtime in one lane: the model in one session,
    and ONNX Runtime's own graph in one lane, no op timed alone (the figures behind both: docs/design.md, "The CPU
    default")."""
    present = compilers.available() if compilers_present is None else compilers_present
    if "onnxruntime" in present:
        present = [c for c in present if c != "inductor"]
        if threads < LANE_CORES:
            one = {"scheduler": "sequential", "streams": 1}
            return [Candidate("sequential+onnxruntime", {**one, "compiler": "onnxruntime"}, "fitted"),
                    Candidate("sequential+onnxruntime-graph", {**one, "graph": "onnxruntime"}, "onnxruntime-graph")]
    out = []
    for compiler in [None, *present]:
        base = {"compiler": compiler} if compiler else {}
        costs = "onnxruntime" if compiler == "onnxruntime" else "eager"  # Inductor plans on eager's kernels
        name = f"+{compiler}" if compiler else ""
        out.append(Candidate(f"sequential{name}", {**base, "scheduler": "sequential", "streams": 1}, costs))
        for k in {None: (1, 4), "onnxruntime": (1, 4, 16), "inductor": ()}[compiler]:
            sync = round(k * sync_ms, 4)
            out.append(Candidate(f"heft{name} sync {sync}", {**base, "scheduler": "heft",
                                                             "scheduler_options": {"sync_ms": sync}}, costs))
    if "onnxruntime" in present:
        graph = {"graph": "onnxruntime"}
        out.append(Candidate("sequential+onnxruntime-graph", {**graph, "scheduler": "sequential", "streams": 1},
                             "onnxruntime-graph"))
        for k in (3, 10, 30):
            sync = round(k * sync_ms, 4)
            out.append(Candidate(f"heft+onnxruntime-graph sync {sync}", {
                **graph, "scheduler": "heft", "scheduler_options": {"sync_ms": sync}}, "onnxruntime-graph"))
    return out


def cuda_candidates(graph, costs, streams: int, *, device=None, dtype: str = "float32", plans: int = 3,
                    segmented: int = 1, fused: int = 1, torch_compile: bool = True,
                    cudagraphs: bool = True) -> list[Candidate]:
    """``torch.compile`` of the whole model (with CUDA Graphs, ``mode="reduce-overhead"``, only where the search
    records them: ``cudagraphs``), the ``plans`` plans the calibrated simulator ranks first (scheduler and stream
    cap), the first ``segmented`` of them with every stream segment compiled by Inductor (``compiler="inductor"``:
    Inductor fuses inside each segment; only for a plan of at most :data:`SEGMENTED_SYNCS` syncs, which bound its
    segments, each one compile), and the first ``fused`` of them over Inductor's own kernels
    (``graph="inductor"``). The measurements behind the list: docs/gpu.md."""
    ranked = CudaTarget().ranking(graph, costs, streams, device, dtype).predictions
    firsts = [p for i, p in enumerate(ranked) if p.scheduler not in {q.scheduler for q in ranked[:i]}][:plans]
    whole_mode = "reduce-overhead" if cudagraphs else "default"  # *-no-cudagraphs never times a CUDA Graph
    out = [Candidate("torch.compile", {"mode": whole_mode}, kind="torch.compile")] if torch_compile else []
    for p in firsts:  # the best stream cap of each of the schedulers predicted fastest
        out.append(Candidate(f"{p.scheduler} x{p.streams}", {"scheduler": p.scheduler, "streams": p.streams}))
    for p in firsts[:segmented]:  # each segment fused by Inductor, the plan's streams kept
        if p.syncs <= SEGMENTED_SYNCS:
            out.append(Candidate(f"{p.scheduler} x{p.streams}+inductor", {
                "scheduler": p.scheduler, "streams": p.streams, "compiler": "inductor"}))
    for p in firsts[:fused]:  # over Inductor's own kernels, so each segment re-fuses what the whole model fuses
        out.append(Candidate(f"{p.scheduler} x{p.streams}+inductor-graph", {
            "scheduler": p.scheduler, "streams": p.streams, "graph": "inductor"}))
    return out


__all__ = ["DEFAULT_LABELS", "LANE_CORES", "SEGMENTED_SYNCS", "CpuTarget", "CudaTarget", "RanksTarget", "Target",
           "costs_for", "cpu_candidates", "cuda_candidates", "default_compiler", "dtype_of", "fitted_device",
           "for_options", "inductor_ops", "per_op_threads", "segment_options", "visible_gpu_preset", "whole"]
