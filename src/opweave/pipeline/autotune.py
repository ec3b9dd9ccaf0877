"""Measured choices: the CPU default's guard and ``mode="max-autotune"``'s search.

Both build a bounded set of candidates through the device's target, keep those whose output equals the model's
(:func:`opweave.outputs.compare`), time them interleaved on the device (:func:`opweave.costs.timing.interleaved_ms`)
and keep the fastest; ``Compiled.choice`` says which and what each measured.

* :func:`guarded` — the CPU default (no scheduler, streams, compiler or graph given) keeps the fastest of the model
  in one ONNX Runtime segment (where the ``onnx`` extra is installed), the lanes of its plan (of ONNX Runtime
  segments too where the cores allow), one lane of the captured ops and the model itself (small models, where
  binding inputs and the lane code's calls cost more than the lanes save, keep the model:
  :class:`~opweave.backends.cpu.EagerBackend`).
* :func:`search` — ``mode="max-autotune"``: on the CPU, one lane or one lane per core (HEFT at several weights of a
  cross-lane edge), unfused, with every segment compiler present, and lanes over ONNX Runtime's optimized graph; on
  CUDA, ``torch.compile`` of the whole model (Inductor and CUDA Graphs), the multi-stream CUDA Graph of the plans
  the calibrated simulator ranks first, the first of them with its segments compiled by Inductor
  (``compiler="inductor"``), and over Inductor's own fused kernels (``graph="inductor"``,
  :func:`cuda_candidates`). The choice,
  with the costs it was planned on, is cached per model, input shapes, machine and versions (:mod:`opweave.choices`),
  so the next compile builds that plan alone (and searches again if it no longer equals the model).

Each candidate is a :class:`Candidate`: a label, the options it builds with (its thread-budget policy follows from
what runs its ops: a compiler whose pools sleep when idle gets per-op budgets) and the op latencies it plans on.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from opweave.errors import UsageError, first_line
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.options import Options


@dataclass
class Candidate:
    """One plan a search tries: ``changes`` to the options (scheduler, streams, compiler, graph, scheduler
    options); ``costs`` the latencies' source (``"eager"``: eager's kernels at one thread per op; a compiler name:
    that compiler's kernels; ``"onnxruntime-graph"``: ONNX Runtime's profiler on its own graph); ``whole``: the
    model compiled whole by ``torch.compile`` instead of a plan."""

    label: str
    changes: dict = field(default_factory=dict)
    costs: str = "eager"
    whole: bool = False

    def to_json(self) -> dict:
        return {"label": self.label, "changes": self.changes, "costs": self.costs, "whole": self.whole}


TIMER = None  # the clock of measured choices on the CPU: None, perf_counter around each call; tests set a script
RACE_BUDGET_MS = 500.0  # a CPU race stops after the round that spends this much (race_ms)


def fastest(built: dict[str, Any], inputs: tuple, device: str = "cpu", rounds: int = 5, runs: int = 3,
            runtime=None, seed: dict[str, list[float]] | None = None) -> tuple[str, dict[str, float]]:
    """The label of the fastest of ``built`` by median time, and every median (ms), timed interleaved under
    ``no_grad`` as they were checked: timed under ``inference_mode``, ``torch.compile`` runs code compiled for
    another grad mode, measured 1.2-1.8x slower on an H200 than in the mode it was compiled in. On the CPU a race
    (:func:`opweave.costs.timing.race_ms`, ``rounds x runs`` timed calls at most, on :data:`TIMER`, each right after
    an untimed call of the same candidate, as a loop would call it, until the round that spends
    :data:`RACE_BUDGET_MS`): a candidate that cannot win is dropped after its second timed call, so a choice
    among a few plans costs little more than timing the winner; on CUDA ``rounds`` rounds of ``runs`` calls each
    with its events (on a stand-in ``runtime``, the fake one, on the host's clock with a synchronize after each
    call). ``seed``: calls timed before, taken as the race's first round (:func:`opweave.costs.timing.race_ms`)."""
    import torch

    from opweave.backends.runtime import CudaRuntime
    from opweave.costs.timing import interleaved_ms, race_ms

    calls = {label: functools.partial(fast, *inputs) for label, fast in built.items()}
    with torch.no_grad():  # the mode candidates are checked in: torch.compile's code is compiled for it
        if device == "cpu":
            times, _ = race_ms(calls, rounds=rounds * runs, warmup=0, settle=1, budget_ms=RACE_BUDGET_MS,
                               timer=TIMER, seed=seed)
        else:
            sync = runtime.synchronize if runtime is not None and not isinstance(runtime, CudaRuntime) else None
            times = interleaved_ms(calls, rounds=rounds, runs=runs, device=device, sync=sync)
    medians = {label: round(statistics.median(ts), 4) for label, ts in times.items()}
    return min(medians, key=medians.__getitem__), medians


LANE_CORES = 4  # the CPU default tries lanes of compiled segments only with at least this many threads
DEFAULT_LABELS = ("onnxruntime", "onnxruntime lanes", "lanes", "one lane", "eager")  # what the CPU default may keep


def guarded(compiled: Compiled, captured, inputs: tuple, options: Options, eager, reference=None) -> Compiled:
    """The CPU default: the fastest of a few candidates, measured (:func:`fastest`'s race), the others closed.

    * ``onnxruntime``: the model in the order it was captured, its one segment compiled by ONNX Runtime
      (``scheduler="sequential", compiler="onnxruntime"``), when ONNX Runtime is installed (the ``onnx`` extra;
      without it, one line says so, once, and the candidates are today's eager ones). ``onnxruntime lanes``: the
      lanes of ``compiled``'s plan, each segment compiled by it, only with at least :data:`LANE_CORES` threads: on 2
      cores these lanes were 1.3-2.0x slower than one ONNX Runtime segment on all four multi-branch models
      (``benchmarks/results/cpu_default_vs_torch_compile.json``), the cores being taken by ONNX Runtime's own
      intra-op threads. A compiled candidate whose output does not equal the model's is left out (said in the
      choice).
    * ``lanes``: ``compiled`` when its plan has more than one lane (each lane the captured ops), unless the
      ``onnxruntime`` candidate was built and there are fewer than :data:`LANE_CORES` threads: on 2 cores one ONNX
      Runtime segment beat these lanes in all 16 of the zoo's models and batches (1.3-2.5x in the race), and racing
      them cost a large model's build a second per round (``benchmarks/results/cpu_default.json``);
    * ``one lane``: the captured ops in the model's order, when no compiled candidate is built;
    * ``eager``: the model itself (when given), so the default is never slower than the model.

    Choice (:data:`opweave.pipeline.compiled.Compiled.choice`): ``label``, each candidate's ``median_ms`` and the
    ``compiler`` its segments were compiled by (None: none)."""
    from opweave.backends.cpu import EagerBackend
    from opweave.pipeline.targets import CpuTarget

    compiler = default_compiler()
    built: dict[str, Compiled] = {}
    lanes = compiled.schedule.streams_used > 1
    if lanes:
        built["lanes"] = compiled
    one = options.derive(scheduler="sequential", streams=1, costs=compiled.costs, profile=None, coarsen=False,
                         scheduler_options=None)
    left_out: dict[str, str] = {}
    seed: dict[str, list[float]] = {}  # a compiled candidate's check, timed just after the call that compiled it
    if compiler is not None:
        tries = {"onnxruntime": lambda: CpuTarget().build(captured, inputs, one.derive(compiler=compiler))}
        if lanes and (options.threads or 1) >= LANE_CORES:
            tries["onnxruntime lanes"] = lambda: CpuTarget().runnable(
                captured, compiled.schedule, compiled.plan, inputs, options.derive(compiler=compiler),
                compiled.costs)
        agrees = _Check(captured, inputs, eager, reference)
        for label, make in tries.items():
            fast, why, ms = _checked(make, agrees, label)
            if fast is None:
                left_out[label] = why
            else:
                built[label] = fast
                if fast.fused is not None:  # its segments were compiled by a call: the check was not its first
                    seed[label] = [ms]
    if "onnxruntime" not in built:  # no compiled candidate in one lane: the captured ops in the model's order
        built["one lane"] = CpuTarget().build(captured, inputs, one) if lanes else compiled
    elif not lanes or (options.threads or 1) < LANE_CORES:
        built.pop("lanes", None)
        compiled.close()
    if eager is not None:  # the model itself, with the metadata of a one-lane plan
        base = built.get("onnxruntime") or built["one lane"]
        built["eager"] = dataclasses.replace(base, backend=EagerBackend(eager, threads=options.threads), fused=None)
    if len(built) == 1:
        kept = next(iter(built.values()))
        if compiler is not None:
            label = next(iter(built))
            kept.choice = {"label": label, "compiler": compiler if label.startswith("onnxruntime") else None,
                           "candidates": {}, "left_out": left_out}
        return kept
    best, medians = fastest(built, inputs, seed=seed)
    for label, other in built.items():
        if label != best and other.backend is not built[best].backend:
            other.close()
    kept = built[best]
    kept.choice = {"label": best, "compiler": compiler if best.startswith("onnxruntime") else None,
                   "candidates": {k: {"median_ms": v} for k, v in medians.items()}}
    if left_out:
        kept.choice["left_out"] = left_out
    return kept


def default_compiler() -> str | None:
    """The segment compiler the CPU default tries: ONNX Runtime when installed, else None, said once
    (:func:`_say_missing`)."""
    from opweave.backends.compilers import available

    if "onnxruntime" in available():
        return "onnxruntime"
    _say_missing()
    return None


@functools.cache
def _say_missing() -> None:
    warnings.warn("ONNX Runtime is not installed: opweave's CPU default runs the model's own kernels, without the "
                  "segments ONNX Runtime compiles (1.75-3.6x faster than eager on the zoo's multi-branch models); "
                  "pip install 'opweave[onnx]' brings it", stacklevel=2)


def _checked(make, agrees, label: str) -> tuple[Compiled | None, str, float]:
    """``make()`` and whether its output equals the model's: the candidate, or None and why not, and the
    milliseconds of the call checked (on :data:`TIMER` as ``label``; building ran the candidate once, so this call is
    timed as the race times one: :func:`fastest`'s ``seed``). The segment compiler's own warnings (a segment it could
    not compile runs op by op) are the candidate's, not the caller's: the choice's timing decides what they cost."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = make()
        with torch.no_grad():
            out, ms = _timed(label, functools.partial(fast, *agrees.inputs))
            check = agrees(out)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is left out, and said so
        return None, first_line(exc), 0.0
    if not check.ok:
        fast.close()
        return None, check.reason, ms
    return fast, "", ms


def _timed(label: str, fn) -> tuple[Any, float]:
    """``fn()`` and the milliseconds it took (on :data:`TIMER`, as ``label``, where set)."""
    from opweave.costs.timing import call_ms

    result: list = []
    ms = (TIMER or call_ms)(label, lambda: result.append(fn()))
    return result[0], ms


# ---- mode="max-autotune" ------------------------------------------------------------------------------------------
def cpu_candidates(sync_ms: float, compilers: list[str] | None = None, threads: int = LANE_CORES) -> list[Candidate]:
    """One lane (the caller's threads) or one lane per core (HEFT at several sync costs), unfused and with each
    segment compiler present (``compilers``, default :func:`opweave.backends.compilers.available`), and lanes over
    ONNX Runtime's graph. A segment boundary costs ONNX Runtime a call (and, over its whole graph, some locality),
    hence higher weights there.

    Inductor's segments (one lane) are tried only where ONNX Runtime is not installed: on the 2-core machine they
    compiled in 22-68 s, the whole search's cold build otherwise, and lost to one ONNX Runtime segment on all four
    multi-branch models but RandWire once, within its spread (16.0 against 16.7 ms on 2026-11-26; 19.7 against 18.7
    on 2026-11-28); HEFT's lanes of Inductor segments (37-163 s each) were never the fastest
    (``benchmarks/results/cpu_latency.json``, ``cpu_default_vs_torch_compile.json``).

    With ONNX Runtime and fewer than :data:`LANE_CORES` ``threads``, the search is ONNX Runtime in one lane: the
    model in one session, and ONNX Runtime's own graph in one lane, no op timed alone. On 2 cores the lanes it
    picked there ran slower than one ONNX Runtime segment once timed again apart from the other candidates
    (GoogLeNet 30.1 against 19.6 ms, RandWire 36.8 against 18.1, Inception-v3 64.6 against 57.3 at batch 1), and
    timing each op alone and building 11 candidates made its first build 2.3-4.7x ``torch.compile``'s at batch 8
    (``benchmarks/results/cpu_default.json``), as the CPU default's lanes of segments wait for the cores too."""
    from opweave.backends.compilers import available

    compilers = available() if compilers is None else compilers
    if "onnxruntime" in compilers:
        compilers = [c for c in compilers if c != "inductor"]
        if threads < LANE_CORES:
            one = {"scheduler": "sequential", "streams": 1}
            return [Candidate("sequential+onnxruntime", {**one, "compiler": "onnxruntime"}, "fitted"),
                    Candidate("sequential+onnxruntime-graph", {**one, "graph": "onnxruntime"}, "onnxruntime-graph")]
    out = []
    for compiler in [None, *compilers]:
        base = {"compiler": compiler} if compiler else {}
        costs = "onnxruntime" if compiler == "onnxruntime" else "eager"  # Inductor plans on eager's kernels
        name = f"+{compiler}" if compiler else ""
        out.append(Candidate(f"sequential{name}", {**base, "scheduler": "sequential", "streams": 1}, costs))
        for k in {None: (1, 4), "onnxruntime": (1, 4, 16), "inductor": ()}[compiler]:
            sync = round(k * sync_ms, 4)
            out.append(Candidate(f"heft{name} sync {sync}", {**base, "scheduler": "heft",
                                                             "scheduler_options": {"sync_ms": sync}}, costs))
    if "onnxruntime" in compilers:
        graph = {"graph": "onnxruntime"}
        out.append(Candidate("sequential+onnxruntime-graph", {**graph, "scheduler": "sequential", "streams": 1},
                             "onnxruntime-graph"))
        for k in (3, 10, 30):
            sync = round(k * sync_ms, 4)
            out.append(Candidate(f"heft+onnxruntime-graph sync {sync}", {
                **graph, "scheduler": "heft", "scheduler_options": {"sync_ms": sync}}, "onnxruntime-graph"))
    return out


SEGMENTED_SYNCS = 128  # a plan with more syncs has too many segments for Inductor to compile in a search


def cuda_candidates(graph, costs, streams: int, *, device=None, dtype: str = "float32", plans: int = 3,
                    segmented: int = 1, fused: int = 1, torch_compile: bool = True,
                    cudagraphs: bool = True) -> list[Candidate]:
    """``torch.compile`` of the whole model (with CUDA Graphs, ``mode="reduce-overhead"``, only where the search
    records them: ``cudagraphs``), the ``plans`` plans the calibrated simulator ranks first (scheduler and stream
    cap), the first ``segmented`` of them with every stream segment compiled by Inductor (``compiler="inductor"``:
    Inductor fuses inside each segment; only for a plan of at most :data:`SEGMENTED_SYNCS` syncs, which bound its
    segments, each one compile: GoogLeNet's plans of 54 and 46 syncs took 61 s, Inductor's caches cold, and 11 s
    on an H200), and the first ``fused`` of them over Inductor's own kernels (``graph="inductor"``). On that H200,
    GoogLeNet at batch 1 fp32 ran 1.04x (lios) and 1.23x (opara) faster with its segments compiled by Inductor
    than the same schedulers' unfused plans, while plans over Inductor's kernels ran 0.70-1.00x as fast as the same
    plans unfused in all ten configurations measured (2026-11-28)."""
    from opweave.pipeline.targets import CudaTarget

    ranked = CudaTarget().ranking(graph, costs, streams, device, dtype).predictions
    firsts = [p for i, p in enumerate(ranked) if p.scheduler not in {q.scheduler for q in ranked[:i]}][:plans]
    whole_mode = "reduce-overhead" if cudagraphs else "default"  # *-no-cudagraphs never times a CUDA Graph
    out = [Candidate("torch.compile", {"mode": whole_mode}, whole=True)] if torch_compile else []
    for p in firsts:  # the best stream cap of each of the schedulers predicted fastest
        out.append(Candidate(f"{p.scheduler} x{p.streams}", {"scheduler": p.scheduler, "streams": p.streams},
                             "fitted"))
    for p in firsts[:segmented]:  # each segment fused by Inductor, the plan's streams kept
        if p.syncs <= SEGMENTED_SYNCS:
            out.append(Candidate(f"{p.scheduler} x{p.streams}+inductor", {
                "scheduler": p.scheduler, "streams": p.streams, "compiler": "inductor"}, "fitted"))
    for p in firsts[:fused]:  # over Inductor's own kernels, so each segment re-fuses what the whole model fuses
        out.append(Candidate(f"{p.scheduler} x{p.streams}+inductor-graph", {
            "scheduler": p.scheduler, "streams": p.streams, "graph": "inductor"}, "fitted"))
    return out


def search(target, captured, inputs: tuple, options: Options, *, eager=None, candidates=None,
           reference=None) -> Compiled:
    """``mode="max-autotune"`` (module docstring): build every candidate, keep those that equal the model, time them
    interleaved, keep the fastest; the choice is cached. A transient progress bar on standard error shows the
    search. ``candidates`` replaces the device's own list (tests)."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from opweave.pipeline import choices

    graph, device = captured.graph, options.device
    agrees = _Check(captured, inputs, eager, reference)
    key = choices.key(captured, inputs, options)
    known = choices.load(key)
    if known is not None:
        chosen = _build(target, captured, inputs, options, Candidate(**known["candidate"]), known.get("latency_ms"),
                        eager)
        with torch.no_grad():
            if agrees(_output(chosen, inputs, options)).ok:
                chosen.choice = {**known, "cached": True}
                return chosen
        chosen.close()
    if candidates is None:
        candidates = _candidates(target, captured, options)
    latencies = _Latencies(captured, inputs, device)
    built: dict[str, Compiled] = {}
    measured: dict[str, dict] = {}
    seed: dict[str, list[float]] = {}  # on the CPU, each check timed just after the build's own call
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"{graph.name}: max-autotune, building", total=len(candidates) + 1)
        for candidate in candidates:
            bar.update(task, description=f"{graph.name}: max-autotune, building {candidate.label}")
            start = time.perf_counter()
            try:
                fast = _build(target, captured, inputs, options, candidate, latencies.of(candidate), eager)
                with torch.no_grad():
                    out, ms = _timed(candidate.label, functools.partial(_output, fast, inputs, options))
                    check = agrees(out)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is left out, and said so
                measured[candidate.label] = {"error": first_line(exc)}
            else:
                measured[candidate.label] = {"build_s": round(time.perf_counter() - start, 2), "ok": check.ok}
                if fast.fused is not None:  # segments compiled, and those that fell back to running op by op
                    measured[candidate.label]["segments"] = dict(fast.fused.stats)
                if check.ok:
                    built[candidate.label] = fast
                    if fast.fused is not None:  # its segments were compiled by a call: the check was not its first
                        seed[candidate.label] = [ms]
                else:
                    measured[candidate.label]["wrong"] = check.reason
                    fast.close()
            bar.advance(task)
        if not built:
            raise UsageError(f"{graph.name}: no max-autotune candidate equals the model: {measured}")
        bar.update(task, description=f"{graph.name}: max-autotune, timing {len(built)} candidates")
        best, medians = fastest(built, inputs, device=device, runtime=options.runtime,
                                seed=seed if device == "cpu" else None)
        bar.advance(task)
    for label, ms in medians.items():
        measured[label]["median_ms"] = ms
    for label, fast in built.items():
        if label != best:
            fast.close()
    candidate = next(c for c in candidates if c.label == best)
    choice = {"candidate": candidate.to_json(), "label": best, "latency_ms": latencies.of(candidate),
              "candidates": measured}
    choices.save(key, choice)
    chosen = built[best]
    chosen.choice = {**choice, "cached": False}
    return chosen


class _Check:
    """Whether a candidate's output equals the model's, by :func:`opweave.outputs.compare`'s rule: within the dtype's
    tolerance of the captured graph's output, or no farther from the model run in float64 than a few times the
    captured graph's own distance (made only when a candidate needs it). Without the second clause, a candidate that
    rounds otherwise (``torch.compile`` of the unfolded model against the captured graph's folded BatchNorm, with
    TF32 convolutions on a GPU) is left out though it is as right as the captured graph."""

    def __init__(self, captured, inputs: tuple, eager, reference=None):
        self.captured, self.inputs, self.eager = captured, inputs, eager
        # ``reference``: the output capture has just checked, for these inputs (a BERT at batch 8: 0.2 s less to
        # build than running the graph once more)
        self.reference = reference if reference is not None else captured.run(inputs)
        self._exact = None

    def __call__(self, out):
        from opweave.outputs import compare, exact_outputs

        check = compare(self.reference, out)
        if check.ok:
            return check
        if self._exact is None:
            try:
                self._exact = exact_outputs(self.eager if self.eager is not None else self.captured.gm,
                                            self.inputs)[0]
            except Exception:  # noqa: BLE001 - a model that cannot run in float64: the plain rule decides
                self._exact = False
        return compare(self.reference, out, exact=self._exact) if self._exact is not False else check


def _output(fast, inputs: tuple, options: Options):
    """``fast(*inputs)``, once the device has computed it (the fake CUDA runtime runs queued work only when told)."""
    out = fast(*inputs)
    if options.device == "cuda":
        from opweave.backends.runtime import CUDA

        (options.runtime or CUDA).synchronize()
    return out


def _candidates(target, captured, options: Options) -> list[Candidate]:
    if options.device == "cpu":
        from opweave.backends.threads import sync_cost_ms

        return cpu_candidates(sync_cost_ms(), threads=options.threads or 1)
    from opweave.pipeline.targets import CudaTarget, _dtype, fitted_device

    device, dtype = fitted_device(options.runtime), _dtype(captured)
    costs = CudaTarget().costs(captured, (), options, device, dtype)
    assert options.streams is not None  # one device: at most its hardware queues
    return cuda_candidates(captured.graph, costs, options.streams, device=device, dtype=dtype,
                           cudagraphs=options.cudagraphs)


class _Latencies:
    """The op latencies each candidate plans on, measured once per source (:class:`Candidate`)."""

    def __init__(self, captured, inputs: tuple, device: str):
        self.captured, self.inputs, self.device = captured, inputs, device
        self.known: dict[str, dict | None] = {"fitted": None}  # the target's own costs
        self.ort_graph = None  # built with the first of its candidates; its latencies are its own graph's nodes'

    def of(self, candidate: Candidate) -> dict | None:
        if candidate.whole:
            return None
        source = candidate.costs
        if source not in self.known:
            if source == "eager":
                from opweave.costs.profile import profile_model

                self.known[source] = profile_model(self.captured, self.inputs, device="cpu", repeats=5, warmup=1,
                                                   threads=1).latency_ms
            elif source == "onnxruntime-graph":
                self.known[source] = self.graph().graph.latencies()
            else:  # a compiler's kernels are timed as they will run
                from opweave.backends.segments import op_latencies

                self.known[source] = op_latencies(self.captured, self.inputs, source)
        return self.known[source]

    def graph(self):
        """ONNX Runtime's optimized graph, built once for all its candidates (a failure is said by the first)."""
        if self.ort_graph is None:
            from opweave.backends.ortgraph import OrtGraph

            try:
                self.ort_graph = OrtGraph(self.captured, self.inputs)
            except Exception:
                self.ort_graph = UsageError("building ONNX Runtime's graph failed (see the first of its candidates)")
                raise
        if isinstance(self.ort_graph, Exception):
            raise self.ort_graph
        return self.ort_graph


def _build(target, captured, inputs: tuple, options: Options, candidate: Candidate, latency_ms: dict | None,
           eager) -> Compiled:
    """``candidate`` built through ``target`` on ``latency_ms`` (None: the target's own costs)."""
    if candidate.whole:
        return _torch_compiled(captured, inputs, options, eager, candidate.changes.get("mode", "reduce-overhead"))
    changed = options.derive(autotune=False, coarsen=False, **candidate.changes)
    if latency_ms is not None and candidate.costs != "onnxruntime-graph":
        from opweave.costs.roofline import estimate

        roofline = estimate(captured.graph, device="cpu", model="ideal")
        changed = changed.derive(costs=dataclasses.replace(roofline, latency_ms=latency_ms))
    if candidate.costs == "onnxruntime-graph":
        from opweave.costs import Costs

        costs = Costs(latency_ms) if latency_ms is not None else None
        return target.build_ort_graph(captured, inputs, changed, costs=costs)
    return target.build(captured, inputs, changed)


def _torch_compiled(captured, inputs: tuple, options: Options, eager, mode: str = "reduce-overhead") -> Compiled:
    """``torch.compile`` of the whole model in ``mode`` (``"reduce-overhead"``: Inductor and CUDA Graphs;
    ``"default"``: Inductor alone), outputs cloned as opweave's are: a peer every CUDA search holds its plans
    against, so the choice is one its timing found at least as fast."""
    import torch

    from opweave.backends.cpu import EagerBackend
    from opweave.costs.roofline import estimate
    from opweave.plan.make import validated_plan
    from opweave.schedulers import run

    model = eager if eager is not None else captured.gm
    compiled_model = torch.compile(model, mode=mode)
    costs = estimate(captured.graph, "h100", model="ideal")
    sched = run("sequential", captured.graph, costs)
    backend = EagerBackend(_Cloned(compiled_model))
    return Compiled(captured.graph, costs, sched, validated_plan(captured.graph, sched), backend, options.device,
                    captured, options=options)


class _Cloned:
    """A callable whose tensor outputs are cloned (CUDA Graph outputs are overwritten by the next replay)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        import torch
        from torch.utils import _pytree as pytree

        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.fn(*args))


__all__ = ["DEFAULT_LABELS", "LANE_CORES", "SEGMENTED_SYNCS", "Candidate", "cpu_candidates", "cuda_candidates",
           "default_compiler", "fastest", "guarded", "search"]
