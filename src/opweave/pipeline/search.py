"""Measured choices, in one place: each target offers candidates (:mod:`opweave.pipeline.targets`), this module builds
them, keeps those whose output equals the model's, times them and keeps the fastest, and caches what a search chose.

* :func:`default_race` — the CPU default (no scheduler, streams, compiler or graph asked for): the candidates of
  :meth:`~opweave.pipeline.targets.CpuTarget.default_candidates` (the model in one ONNX Runtime segment, lanes, one
  lane, the model itself) raced on the device.
* :func:`search` — ``mode="max-autotune"``: the target's longer list
  (:meth:`~opweave.pipeline.targets.CpuTarget.search_candidates`,
  :meth:`~opweave.pipeline.targets.CudaTarget.search_candidates`), the choice cached per model, input shapes, machine
  and versions (:func:`key`), so the next compile builds that plan alone (and searches again if it no longer equals
  the model).

Both go through :func:`race`: build every candidate through the target (its ``build_candidate``), check it against
the model (:class:`OutputCheck`), time what is left interleaved (:func:`fastest`), close the others. A
:class:`Candidate` is a label, the changes to the options it builds with and the op latencies it plans on;
``Compiled.choice`` says which won and what each measured.

The cache is a JSON file, ``autotune.json`` in ``$OPWEAVE_CACHE_DIR`` (default ``~/.cache/opweave``), mapping a key
to the chosen candidate, the latencies it was planned on and what every candidate measured. The key covers what the
choice depends on: the captured graph (its name, ops and their targets), the input shapes and dtypes, the device (the
GPU's name for CUDA), the machine (processor and the cores this process may use), the mode and every setting (not the
handles: :data:`~opweave.pipeline.options.HANDLES`), the versions of torch, CUDA and ONNX Runtime, and
:data:`SEARCH`, the version of the candidate lists (a choice made from another list is made again). A file that cannot
be read is ignored (and rewritten on the next choice); writes go through a temporary file, so a reader never sees
half a file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from opweave.backends.runtime import CUDA, CudaRuntime
from opweave.cores import cores
from opweave.costs.timing import call_ms, interleaved_ms, race_ms
from opweave.errors import UsageError, first_line
from opweave.outputs import compare, exact_outputs
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.options import HANDLES, OPTIONS, Options


@dataclass
class Candidate:
    """One build a race tries. ``kind``: ``"plan"`` (the target's build with ``changes`` to the options: scheduler,
    streams, compiler, graph, scheduler options), ``"torch.compile"`` (the model compiled whole by ``torch.compile``
    in ``changes["mode"]``), ``"tier"`` (a tier of :mod:`opweave.pipeline.tiers`, ``changes["tier"]``, built now) or
    ``"eager"`` (the model itself). ``costs``: the latencies a plan is made on
    (``"fitted"``: the target's own; ``"eager"``: eager's kernels at one thread per op; a compiler's name: that
    compiler's kernels; ``"onnxruntime-graph"``: ONNX Runtime's profiler on its own graph). ``unless``: built only
    when the candidate of that label is not (it failed, or is not offered): a fallback."""

    label: str
    changes: dict[str, Any] = field(default_factory=dict)
    costs: str = "fitted"
    kind: str = "plan"
    unless: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "changes": self.changes, "costs": self.costs, "kind": self.kind}


TIMER = None  # the clock of measured choices on the CPU: None, perf_counter around each call; tests set a script
RACE_BUDGET_MS = 500.0  # a CPU race stops after the round that spends this much (race_ms)
# untimed calls of a candidate before each of its timed ones in a CPU race: one was not enough for the model itself
# after a plan's calls (a decode step's own kernels ran several times slower for its first calls after the plan's,
# so the race kept a plan the token loop then ran slower than the model); after three it runs as a loop calls it
SETTLE = 3
# and until this long has passed since the first of them: a pool left spinning by the candidate before (ONNX Runtime's,
# OpenMP's) spins for a time, not a number of calls (race_ms)
SETTLE_MS = 20.0


def fastest(built: dict[str, Any], inputs: tuple, device: str = "cpu", rounds: int = 5, runs: int = 3,
            runtime=None, seed: dict[str, list[float]] | None = None) -> tuple[str, dict[str, float]]:
    """The label of the fastest of ``built`` by median time, and every median (ms), timed interleaved under
    ``no_grad`` as they were checked: timed under ``inference_mode``, ``torch.compile`` runs code compiled for
    another grad mode, measurably slower than in the mode it was compiled in (docs/design.md, §3.8). On the CPU a race
    (:func:`opweave.costs.timing.race_ms`, ``rounds x runs`` timed calls at most, on :data:`TIMER`, each right after
    :data:`SETTLE` untimed calls of the same candidate and :data:`SETTLE_MS`, as a loop would call it, until the
    round that spends :data:`RACE_BUDGET_MS`): a candidate that cannot win is dropped after its second timed call,
    so a choice among a few plans costs little more than timing the winner; on CUDA ``rounds`` rounds of ``runs``
    calls each with its events (on a stand-in ``runtime``, the fake one, on the host's clock with a synchronize after
    each call). ``seed``: calls timed before, taken as the race's first round (:func:`opweave.costs.timing.race_ms`)."""
    calls = {label: functools.partial(fast, *inputs) for label, fast in built.items()}
    with torch.no_grad():  # the mode candidates are checked in: torch.compile's code is compiled for it
        if device == "cpu":
            times, _ = race_ms(calls, rounds=rounds * runs, warmup=0, settle=SETTLE, settle_ms=SETTLE_MS,
                               budget_ms=RACE_BUDGET_MS,
                               timer=TIMER, seed=seed)
        else:
            sync = runtime.synchronize if runtime is not None and not isinstance(runtime, CudaRuntime) else None
            times = interleaved_ms(calls, rounds=rounds, runs=runs, device=device, sync=sync)
    medians = {label: round(statistics.median(ts), 4) for label, ts in times.items()}
    return min(medians, key=medians.__getitem__), medians


def race(target, captured, inputs: tuple, options: Options, candidates: list[Candidate], *, eager=None,
         reference=None, progress: str | None = None, time_one: bool = False, check_all: bool = False) -> Compiled:
    """The fastest of ``candidates`` built through ``target`` that equals the model, the others closed. Its
    ``choice``: ``label``, the ``compiler`` its segments were compiled by (None: none), ``candidates`` (each raced
    candidate's ``median_ms``, ``build_s`` and, compiled by segments, its segments' ``stats``) and ``left_out``
    (why each other one was not raced: it failed to build, or does not equal the model). A candidate the race cannot
    run (``kind="eager"`` without the model) is not offered. ``progress``: a transient progress bar on standard error
    with that title (a search's); ``time_one``: a candidate left alone is timed too (a search says what each
    measured). A candidate that runs the captured ops as they are (a plan without compiled segments over the captured
    graph) or the model itself equals the model by construction and is not run to check it, unless ``check_all``
    (a search checks every candidate: a CUDA plan that dropped an ordering would show there)."""
    candidates = [c for c in candidates if c.kind != "eager" or eager is not None]
    agrees = OutputCheck(captured, inputs, eager, reference)
    planned = functools.partial(target.planned, captured, options)
    latencies = Latencies(planned, inputs)
    built: dict[str, Compiled] = {}
    made_from: dict[str, Candidate] = {}
    measured: dict[str, dict[str, Any]] = {}
    left_out: dict[str, str] = {}
    seed: dict[str, list[float]] = {}  # on the CPU, a compiled candidate's check, timed just after its compiling call
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True), disable=progress is None) as bar:
        task = bar.add_task(f"{progress}, building", total=len(candidates) + 1)
        for candidate in candidates:
            bar.advance(task)
            if candidate.label in built or candidate.unless is not None and candidate.unless in built:
                continue  # a fallback not needed, or one the default plan already is
            bar.update(task, description=f"{progress}, building {candidate.label}")
            start = time.perf_counter()
            fast, why, ms = _checked(lambda c=candidate: target.build_candidate(captured, inputs, options, c,
                                                                                latencies.of(c), eager),
                                     agrees, candidate.label, options,
                                     trusted=None if check_all else functools.partial(_as_captured, captured=planned(
                                         candidate), candidate=candidate))
            if fast is None:
                left_out[candidate.label] = why
                continue
            if candidate.label == "lanes" and fast.schedule.streams_used == 1 and fast.fused is None:
                candidate = dataclasses.replace(candidate, label="one lane")  # the default plan made one lane
            built[candidate.label], made_from[candidate.label] = fast, candidate
            measured[candidate.label] = {"build_s": round(time.perf_counter() - start, 2)}
            if fast.fused is not None:
                measured[candidate.label]["segments"] = dict(fast.fused.stats)
                if ms:  # its segments were compiled by a call: the check, timed, was not its first
                    seed[candidate.label] = [ms]
        if not built:
            raise UsageError(f"{captured.graph.name}: no candidate equals the model: {left_out}")
        bar.update(task, description=f"{progress}, timing {len(built)} candidates")
        medians: dict[str, float] = {}
        if len(built) == 1 and not time_one:
            best = next(iter(built))
        else:
            best, medians = fastest(built, inputs, device=options.device, runtime=options.runtime,
                                    seed=seed if options.device == "cpu" else None)
        bar.advance(task)
    for label, ms in medians.items():
        measured[label]["median_ms"] = ms
    for label, fast in built.items():
        if label != best and fast.backend is not built[best].backend:
            fast.close()
    kept = built[best]
    kept.choice = {"label": best, "compiler": _compiler_of(kept), "candidates": measured, "left_out": left_out,
                   "candidate": made_from[best].to_json(), "latency_ms": latencies.of(made_from[best])}
    return kept


def _as_captured(fast: Compiled, *, candidate: Candidate, captured) -> bool:
    """Whether ``fast`` runs the captured ops as they are (no compiled segment, the captured graph) or the model."""
    return candidate.kind == "eager" or (candidate.kind == "plan" and fast.fused is None
                                         and fast.graph is captured.graph)


def _compiler_of(compiled: Compiled) -> str | None:
    """The segment compiler of what ``compiled`` runs (None: none)."""
    return compiled.fused.compiler if compiled.fused is not None else None


def default_race(target, captured, inputs: tuple, options: Options, *, eager=None, reference=None) -> Compiled:
    """The CPU default: the fastest of the target's default candidates
    (:meth:`~opweave.pipeline.targets.CpuTarget.default_candidates`), measured by :func:`race`."""
    return race(target, captured, inputs, options, target.default_candidates(options), eager=eager,
                reference=reference)


def search(target, captured, inputs: tuple, options: Options, *, eager=None, candidates=None,
           reference=None) -> Compiled:
    """``mode="max-autotune"``: the choice cached for this model, machine and versions when it still equals the
    model, else :func:`race` over the target's search candidates (``candidates`` replaces them: tests), with a
    progress bar, and the choice cached."""
    graph = captured.graph
    entry_key = key(captured, inputs, options)
    known = load(entry_key)
    if known is not None:
        try:
            candidate = Candidate(**{k: v for k, v in known["candidate"].items()})
            chosen = target.build_candidate(captured, inputs, options, candidate, known.get("latency_ms"),
                                            eager)
        except Exception:  # noqa: BLE001 - a stale or unreadable entry: searched again
            chosen = None
        if chosen is not None:
            with torch.no_grad():
                if OutputCheck(captured, inputs, eager, reference)(_output(chosen, inputs, options)).ok:
                    chosen.choice = {**known, "cached": True}
                    return chosen
            chosen.close()
    if candidates is None:
        candidates = target.search_candidates(target.planned(captured, options), inputs, options)
    chosen = race(target, captured, inputs, options, candidates, eager=eager, reference=reference,
                  progress=f"{graph.name}: max-autotune", time_one=True, check_all=True)
    assert chosen.choice is not None
    save(entry_key, chosen.choice)
    chosen.choice = {**chosen.choice, "cached": False}
    return chosen


def _checked(make, agrees: OutputCheck, label: str, options: Options,
             trusted=None) -> tuple[Compiled | None, str, float]:
    """``make()`` and whether its output equals the model's: the candidate, or None and why not, and the
    milliseconds of the call checked (on :data:`TIMER` as ``label``; building ran the candidate once, so this call is
    timed as the race times one: :func:`fastest`'s ``seed``). The segment compiler's own warnings (a segment it could
    not compile runs op by op) are the candidate's, not the caller's: the choice's timing decides what they cost.
    ``trusted(fast)``: it needs no check (its call is not made then, and its time is 0)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = make()
        if trusted is not None and trusted(fast):
            return fast, "", 0.0
        with torch.no_grad():
            result: list[Any] = []
            ms = (TIMER or call_ms)(label, lambda: result.append(_output(fast, agrees.inputs, options)))
            check = agrees(result[0])
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built is left out, and said so
        return None, first_line(exc), 0.0
    if not check.ok:
        fast.close()
        return None, check.reason, ms
    return fast, "", ms


class OutputCheck:
    """Whether a candidate's output equals the model's, by :func:`opweave.outputs.compare`'s rule: within the dtype's
    tolerance of the captured graph's output, or no farther from the model run in float64 than a few times the
    captured graph's own distance (made only when a candidate needs it). Without the second clause, a candidate that
    rounds otherwise (``torch.compile`` of the unfolded model against the captured graph's folded BatchNorm, with
    TF32 convolutions on a GPU) is left out though it is as right as the captured graph. ``reference``: the output
    capture has just checked, for these inputs (a build then skips one run of the captured graph, which counts for a
    large model; docs/design.md, §3.8); None: the captured graph is run for it."""

    def __init__(self, captured, inputs: tuple, eager, reference=None):
        self.captured, self.inputs, self.eager = captured, inputs, eager
        self._reference = reference
        self._exact: Any = None

    @property
    def reference(self) -> Any:
        """The captured graph's output (run for it the first time a candidate is checked, where none was given)."""
        if self._reference is None:
            self._reference = self.captured.run(self.inputs)
        return self._reference

    def __call__(self, out):
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
        (options.runtime or CUDA).synchronize()
    return out


class Latencies:
    """The op latencies each candidate plans on, measured once per source (:class:`Candidate`) and graph:
    ``planned(candidate)`` is the captured model as the candidate plans it (coarsened or not)."""

    def __init__(self, planned: Any, inputs: tuple):
        self.planned, self.inputs = planned, inputs
        self.known: dict[tuple[str, Any], dict | None] = {}  # by (source, graph): a captured model by identity
        self.ort_graphs: dict[Any, Any] = {}  # ONNX Runtime's graph of each captured model, built with the first
        # of its candidates; its latencies are its own graph's nodes'

    def of(self, candidate: Candidate) -> dict | None:
        if candidate.kind != "plan" or candidate.costs == "fitted":  # the target's own costs
            return None
        source, captured = candidate.costs, self.planned(candidate)
        key = (source, captured)
        if key not in self.known:
            if source == "eager":
                from opweave.costs.profile import profile_model  # torch.profiler, loaded only when a search needs it

                self.known[key] = profile_model(captured, self.inputs, device="cpu", repeats=5, warmup=1,
                                                threads=1).latency_ms
            elif source == "onnxruntime-graph":
                self.known[key] = self.graph(captured).graph.latencies()
            else:  # a compiler's kernels are timed as they will run
                from opweave.backends.segments import op_latencies  # loads the compiler's package when asked

                self.known[key] = op_latencies(captured, self.inputs, source)
        return self.known[key]

    def graph(self, captured):
        """ONNX Runtime's optimized graph of ``captured``, built once for all its candidates (a failure is said by
        the first)."""
        made = self.ort_graphs.get(captured)
        if made is None:
            from opweave.backends.ortgraph import OrtGraph  # ONNX Runtime, an optional package

            try:
                made = self.ort_graphs[captured] = OrtGraph(captured, self.inputs)
            except Exception:
                self.ort_graphs[captured] = UsageError(
                    "building ONNX Runtime's graph failed (see the first of its candidates)")
                raise
        if isinstance(made, Exception):
            raise made
        return made


# ---- the cache of searches ---------------------------------------------------------------------------------------
SEARCH = 5  # raised whenever a device's candidate list changes (2: CUDA's segments compiled by Inductor; 3: the CPU
# list without Inductor where ONNX Runtime is installed; 4: ONNX Runtime in one lane below LANE_CORES threads; 5: a
# candidate's kind in place of "whole")


def cache_path() -> Path:
    return Path(os.environ.get("OPWEAVE_CACHE_DIR") or Path.home() / ".cache" / "opweave") / "autotune.json"


def machine() -> str:
    """The processor's model name and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name} x{cores()}"


def key(captured: Any, inputs: tuple[Any, ...], options: Options) -> str:
    """What a choice is valid for (module docstring), as a short hash: the graph, the inputs, the machine, the
    versions and every setting of ``options`` (the mode, CUDA Graphs, the threads, ...) but the handles and a
    profile's path (the search plans on its own)."""
    try:
        import onnxruntime  # its version, where installed

        ort = onnxruntime.__version__
    except ImportError:
        ort = None
    settings = {name: getattr(options, name) for name in OPTIONS if name not in HANDLES | {"profile"}}
    parts = {
        "graph": captured.graph.name,
        "ops": [(op.id, op.target) for op in captured.graph.ops],
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in inputs],
        "machine": machine(),
        "device": options.device if options.device == "cpu" else (options.runtime or CUDA).device_name(),
        "mode": options.mode,
        "settings": settings,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "onnxruntime": ort,
        "search": SEARCH,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(entry_key: str) -> dict[str, Any] | None:
    """The choice stored under ``entry_key``, or None."""
    try:
        found: dict[str, Any] | None = json.loads(cache_path().read_text()).get(entry_key)
        return found
    except (OSError, ValueError, AttributeError):
        return None


def save(entry_key: str, choice: dict[str, Any]) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[entry_key] = choice
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1) + "\n")
    scratch.replace(path)


__all__ = ["RACE_BUDGET_MS", "SEARCH", "Candidate", "Latencies", "OutputCheck", "cache_path", "default_race",
           "fastest", "key", "load", "race", "save", "search"]
