"""Tiers: a compiled model answers at once, on its first tier, and moves to a faster one once it is built and measured.

The CPU default's race (:func:`opweave.pipeline.search.default_race`) is short; the builds that make a model fastest
take far longer (Inductor with freezing over the whole model, its compile CPU-bound and holding the GIL;
docs/design.md, §3.8). So, as tiered JIT compilers and TensorRT-RTX's lazy kernels do, the first tier serves while
the others are built off the caller's path:

* :class:`Tiered` is the backend a compiled model calls: one attribute read per call (``current``), replaced in one
  assignment when a tier lands, so a call never waits for a build and never sees half a tier. A call whose inputs are
  not the example's signature (another size the first tier was made to take, or the example's sizes in another
  layout: a transposed or channels-last tensor) goes to the first tier, which a tier built for the example's shapes
  and strides cannot serve. Once a tier lands, a first tier that holds a copy of the weights (ONNX
  Runtime's session) is let go and the model itself takes those other sizes, so that the first tier's copy of the
  weights is not held beside the landed tier's (what is held is measured: benchmarks/tier_memory.py).
* :class:`TierBuilder`, a daemon thread, builds each kind of :data:`KINDS` in turn: it looks in the disk cache (keyed
  by :func:`key`: the captured graph, the model's weights, the inputs' signature, the threads, the machine and torch's
  version, so a changed model or torch never loads a stale tier), else saves the captured graph and hands it to a
  **build process** (``python -m opweave.pipeline.tiers``, at the lowest priority, :data:`BUILD_NICE`, so the caller's
  calls keep the cores first; it exits when its parent does) that exports it (``torch.export``: seconds of Python that
  would hold the caller's interpreter lock), compiles it and writes the tier into the cache. The thread then loads the
  tier and checks it against the model (:class:`~opweave.pipeline.search.OutputCheck`); the caller's next calls race
  it against the tier in use (:class:`LiveRace`, on the caller's own thread, where its kernels run as they will) and
  move every call over only where it is measured faster: one log line says what landed and how much faster
  (``opweave.pipeline.tiers``, INFO), or what was kept. One tier is raced at a time, each against the winner of the
  race before it, and the next build waits for a race while calls come (:data:`RACE_IDLE_S`). A build that fails, or a
  build process that crashes or is killed, leaves the tier in use serving, with one warning.

Kinds (:data:`KINDS`, in the order they are built: the quick first): ``onnxruntime-fixed``, the model's ONNX
Runtime session exported at the example's sizes (the first tier's session leaves every dimension free, so that a
new size runs on it, and ONNX Runtime then neither folds shapes nor rewrites what needs them, which made that
session slower at the example's sizes on a quiet 2-core machine: benchmarks/results/cpu_free_dims.json; a few
seconds' build; :func:`default_kinds`); ``inductor``, the model compiled by Inductor with freezing as an
AOTInductor package (``torch._inductor.aoti_compile_and_package``: parameters folded in as constants,
convolution and linear weights prepacked; loaded with ``aoti_load_package`` in about a second, on the caller's
intra-op threads); ``exported``, the exported program run as it is (a check of the tier machinery, as
``compiler="eager"`` is of the segments': not in the default list). ``Compiled.choice["tiers"]`` lists each tier's
outcome; :meth:`Tiered.wait` waits for the builds (``mode="max-autotune"`` builds its Inductor tier before it
returns; its own candidates hold ONNX Runtime sessions at the example's sizes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import key_of
from opweave.backends.compilers import graph_tensors
from opweave.backends.cpu import EagerBackend
from opweave.backends.segments import whole_module
from opweave.backends.threads import total_threads
from opweave.cores import intra_op_threads
from opweave.costs.timing import call_ms
from opweave.errors import first_line
from opweave.pipeline import search
from opweave.zoo import ensure_torchvision_importable

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("onnxruntime-fixed", "inductor")  # what the default builds after its first tier, in order
SUFFIX = {"onnxruntime-fixed": ".onnx"}  # a tier's file, by kind (else an AOTInductor or exported package, .pt2)
VERSION = 2  # of what a tier is built from and how (in every tier's key)
BUILD_TIMEOUT_S = 1800.0  # a build process past this is stopped (its tier is not built)
RACE_IDLE_S = 1.0  # the next build waits for a race until no call has come for this long
BUILD_NICE = 19  # the build process's niceness: the lowest priority (benchmarks/tier_build.py measured 10 and 19)


class Tiered:
    """The backend of a compiled model with tiers (module docstring): calls go to ``current``, the tier in use
    (``label`` names it); ``tiers`` lists what each tier build came to."""

    def __init__(self, first: Any, label: str, example: tuple[Any, ...], model: Any = None):
        self.first, self.current, self.label = first, first, label
        self.model = model  # what takes the first tier's other sizes once that tier's copy of the weights is let go
        self.released: list[Any] = []  # called when the first tier is let go (the compiled model's record of it)
        self.example_key = key_of(example, strides=True)  # a tier is built for the example's layout too
        self.tiers: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {"calls": 0, "landed": 0}
        self.builder: TierBuilder | None = None
        self.race: LiveRace | None = None  # a tier built, raced on the calls it takes before it takes them all
        self.pending: list[tuple[str, Any, dict[str, Any]]] = []  # tiers built, waiting for the race before theirs
        self.lock = threading.Lock()  # over race, pending, current: a race starts against the tier then in use
        self._closed = threading.Event()

    def __call__(self, *args: Any) -> Any:
        current, race = self.current, self.race
        if (current is not self.first or race is not None) and key_of(args, strides=True) != self.example_key:
            return self.first(*args)  # another size: the first tier takes it, a landed tier was built for one
        if race is not None:
            return race(self, args)
        return current(*args)

    def propose(self, label: str, tier: Any, outcome: dict[str, Any]) -> None:
        """Race ``tier`` against the tier in use on the caller's calls (:class:`LiveRace`), then land it where it is
        faster; ``outcome``, its record in :attr:`tiers`, says how it went. A tier built while another is raced
        waits for that race's end, then races the tier in use then (one race at a time, each against the winner of
        the last)."""
        with self.lock:
            self.pending.append((label, tier, outcome))
            if self.race is None:
                self._next_race()

    def _next_race(self) -> None:
        """Start the race of the first tier waiting (under :attr:`lock`)."""
        if self.pending and not self._closed.is_set():
            label, tier, outcome = self.pending.pop(0)
            self.race = LiveRace(self.label, self.current, label, tier, outcome)

    def decided(self, race: LiveRace) -> None:
        """``race`` has its times: it lands its tier or lets it go, then the next tier waiting is raced."""
        with self.lock:
            race.decide(self)
            self.race = None
            self._next_race()

    @property
    def racing(self) -> bool:
        """Whether a tier built is being raced on the calls."""
        return self.race is not None

    def free(self, args: tuple[Any, ...]) -> bool:
        """Whether the first tier takes inputs shaped like ``args`` (:mod:`opweave.pipeline.sizes`)."""
        take = getattr(self.first, "free", None)
        return bool(take(args)) if take is not None else False

    def land(self, label: str, tier: Any) -> None:
        """Calls go to ``tier`` from now on (one assignment: a call in flight finishes on the tier it started on)."""
        previous = self.current
        self.current, self.label = tier, label
        self.stats["landed"] += 1
        self.stats["landed_at"] = time.perf_counter()  # on the clock of time.perf_counter
        if previous is not self.first:
            _close(previous)
        elif self.model is not None and not isinstance(self.first, EagerBackend):
            # dropped, not closed: a call of another size may be running on it (its threads end when it is collected)
            self.first = EagerBackend(self.model)
            for release in self.released:
                release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every tier build has ended (landed, kept out or failed); False if ``timeout`` passed first."""
        builder = self.builder
        if builder is None:
            return True
        builder.join(timeout)
        return not builder.is_alive()

    @property
    def building(self) -> bool:
        return self.builder is not None and self.builder.is_alive()

    def close(self) -> None:
        """Stop the builds (the build process is ended) and release every tier."""
        self._closed.set()
        if self.builder is not None:
            self.builder.stop()
        with self.lock:
            waiting = [tier for _, tier, _ in self.pending] + ([self.race.tiers[1]] if self.race is not None else [])
            self.pending, self.race = [], None
        for tier in waiting:
            _close(tier)
        if self.current is not self.first:
            _close(self.current)
        _close(self.first)


class LiveRace:
    """A tier built, raced against the tier in use on the caller's own calls (on the caller's thread, as the caller
    runs them: timed from another thread, an Inductor tier's OpenMP kernels ran markedly slower than on the
    caller's, beside the caller's idle team; docs/design.md, §3.8). The calls come in blocks on one tier, then on
    the other, :data:`BLOCKS` blocks each. A block's first calls are untimed, at least one and until
    :data:`SETTLE_S` has passed since the block began: they pay for the other tier's pools left spinning (two ONNX
    Runtime sessions of SqueezeNet, called in turn on 2 cores, ran their first four or five calls after a switch
    at twice their steady time); then calls are timed on :data:`opweave.pipeline.search.TIMER`'s clock, at least
    :data:`BLOCK` - 1 and until they add up to :data:`TIMED_MS` (a model of a tenth of a millisecond a call is timed
    some 200 times a block, not 3: its calls' spread on a 2-core machine is as wide as the gap between two tiers).
    Every call returns its tier's answer, and both tiers are checked to equal the model. Then the faster median
    takes every call (the built tier lands, :meth:`Tiered.land`) or the built tier is let go; one log line says
    which."""

    def __init__(self, in_use: str, current: Any, label: str, tier: Any, outcome: dict[str, Any]):
        self.labels, self.tiers = (in_use, label), (current, tier)
        self.times: tuple[list[float], list[float]] = ([], [])
        self.outcome, self.calls, self.lock, self.finished = outcome, 0, threading.Lock(), False
        self.block, self.untimed, self.timed, self.timed_ms = 0, 0, 0, 0.0  # the block under way
        self.began: float | None = None

    def __call__(self, tiered: Tiered, args: tuple[Any, ...]) -> Any:
        with self.lock:
            self.calls += 1
            block, now = self.block, _now()
            which = block % 2
            if self.block >= 2 * BLOCKS:
                which = -1
            if self.began is None:
                self.began = now
            timed = self.untimed > 0 and now - self.began >= SETTLE_S
            self.untimed += not timed
        if which < 0:
            return tiered.current(*args)  # decided by another thread, or being decided
        if not timed:
            return self.tiers[which](*args)
        result: list[Any] = []
        ms = (search.TIMER or call_ms)(self.labels[which], lambda: result.append(self.tiers[which](*args)))
        with self.lock:
            self.times[which].append(ms)
            if self.block == block:  # a call that ends after its block did (another thread's) counts for none
                self.timed, self.timed_ms = self.timed + 1, self.timed_ms + ms
            if self.timed >= BLOCK - 1 and self.timed_ms >= TIMED_MS:  # the next block, on the other tier
                self.block, self.began, self.untimed, self.timed, self.timed_ms = self.block + 1, None, 0, 0, 0.0
            done = not self.finished and self.block >= 2 * BLOCKS
            self.finished = self.finished or done
        if done:
            tiered.decided(self)
        return result[0]

    def decide(self, tiered: Tiered) -> None:
        (in_use, label), (ms_in_use, ms) = self.labels, (statistics.median(t) for t in self.times)
        landed = ms < ms_in_use
        self.outcome.update(median_ms=round(ms, 4), against=in_use, against_ms=round(ms_in_use, 4), landed=landed)
        name = self.outcome.get("graph", "")
        if landed:
            tiered.land(label, self.tiers[1])
            log.info("%s: the %s tier landed, %.2fx faster than %s (%.3f against %.3f ms)", name, label,
                     ms_in_use / ms, in_use, ms, ms_in_use)
        else:
            _close(self.tiers[1])
            log.info("%s: the %s tier kept out, %.3f ms against %s's %.3f ms", name, label, ms, in_use, ms_in_use)


BLOCK = 4  # a live race's block: one call untimed at least, then BLOCK - 1 timed at least
TIMED_MS = 20.0  # and timed calls until they add up to this
BLOCKS = 4  # blocks of each tier in a live race
SETTLE_S = 0.2  # a block's calls are untimed until this long since it began
_now = time.perf_counter  # the clock a block's settling is read on


def _close(tier: Any) -> None:
    close = getattr(tier, "close", None)
    if close is not None:
        close()


def start(compiled: Any, model: Any, inputs: tuple[Any, ...], options: Any, reference: Any = None,
          kinds: tuple[str, ...] | None = None) -> Any:
    """``compiled`` (its first tier, just raced) with its backend made a :class:`Tiered` and the builds of the
    other tiers started (``kinds``, default :data:`KINDS`); returns ``compiled``."""
    tiered = Tiered(compiled.backend, (compiled.choice or {}).get("label", "first"), inputs,
                    model if isinstance(model, torch.nn.Module) else None)
    held = weakref.ref(compiled)
    tiered.released.append(lambda: setattr(held(), "fused", None) if held() is not None else None)
    compiled.backend = tiered
    compiled.choice = {**(compiled.choice or {}), "tiers": tiered.tiers}
    tiered.builder = TierBuilder(tiered, compiled.captured, model, inputs, options, reference,
                                 default_kinds(options) if kinds is None else kinds)
    tiered.builder.start()
    return compiled


def default_kinds(options: Any) -> tuple[str, ...]:
    """The kinds of :data:`KINDS` the default builds after its first tier: ``onnxruntime-fixed`` (its session exported
    at the example's sizes) only where ONNX Runtime imports and the first tier's session left its sizes free (with
    ``dynamic=False`` it is that tier already)."""
    from opweave.backends.compilers import available

    fixed = options.dynamic is False or "onnxruntime" not in available()
    return tuple(kind for kind in KINDS if not (kind == "onnxruntime-fixed" and fixed))


class TierBuilder(threading.Thread):
    """Builds, checks and races each kind of tier in turn, off the caller's path (module docstring)."""

    def __init__(self, tiered: Tiered, captured: Any, model: Any, inputs: tuple[Any, ...], options: Any,
                 reference: Any, kinds: tuple[str, ...]):
        super().__init__(name=f"opweave-tiers-{captured.graph.name}", daemon=True)
        self.tiered = weakref.proxy(tiered)
        self.closed = tiered._closed
        self.captured, self.model, self.inputs, self.options = captured, model, inputs, options
        self.reference, self.kinds = reference, kinds
        self.process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        self.closed.set()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def run(self) -> None:
        try:
            weights = weights_digest(self.captured.gm)
            for kind in self.kinds:
                self._await_race()
                if self.closed.is_set():
                    return
                start = time.perf_counter()
                try:
                    outcome = self._tier(kind, weights)
                except ReferenceError:  # the compiled model was collected: nothing to build for
                    return
                except Exception as exc:  # noqa: BLE001 - a tier that cannot be built: the one in use serves on
                    if self.closed.is_set():
                        return
                    outcome = {"kind": kind, "failed": first_line(exc)}
                    warnings.warn(f"{self.captured.graph.name}: the {kind} tier could not be built "
                                  f"({first_line(exc)}); the {self.tiered.label} tier serves on", stacklevel=1)
                outcome["seconds"] = round(time.perf_counter() - start, 2)
                self.tiered.tiers.append(outcome)
        except ReferenceError:
            return

    def _tier(self, kind: str, weights: str) -> dict[str, Any]:
        """Build (or find in the cache), load, check and race one tier; land it where it wins."""
        path = tier_path(key(self.captured, self.inputs, self.options, kind, weights), kind)
        cached = path.exists()
        whole = _whole(kind, self.captured, self.inputs)
        if not cached:
            export_and_build(kind, *_handed(whole, (self.model, self.captured.gm), self.inputs), self.options.threads,
                             path, self)
        tier = load(kind, path, self.options.threads, whole)
        with torch.no_grad():
            check = search.OutputCheck(self.captured, self.inputs, self.model, self.reference)(tier(*self.inputs))
        if not check.ok:
            return {"kind": kind, "cached": cached, "wrong": check.reason}
        if self.closed.is_set():
            return {"kind": kind, "cached": cached, "stopped": True}
        outcome: dict[str, Any] = {"kind": kind, "cached": cached, "graph": self.captured.graph.name}
        self.tiered.propose(kind, tier, outcome)  # raced on the caller's calls (LiveRace), which decide
        return outcome

    def _await_race(self) -> None:
        """Before the next build: wait while a tier is raced and calls keep coming (a build beside a race would slow
        both tiers' calls unevenly: the race would measure the build), or until nobody has called for
        :data:`RACE_IDLE_S` (a build then disturbs no call)."""
        seen, since = -1, time.monotonic()
        while not self.closed.is_set():
            race = self.tiered.race
            if race is None and not self.tiered.pending:
                return
            calls = race.calls if race is not None else seen
            if calls != seen:
                seen, since = calls, time.monotonic()
            elif time.monotonic() - since > RACE_IDLE_S:
                return
            time.sleep(0.02)


def export_and_build(kind: str, models: tuple[Any, ...], inputs: tuple[Any, ...], in_place: tuple[str, ...],
                     threads: int | None, path: Path, owner: TierBuilder | None = None) -> None:
    """The first of ``models`` (the model, then its captured graph) that pickles, saved with the inputs and handed to
    a build process, which exports it and writes tier ``kind`` at ``path``: the export, Python work that would hold
    the caller's interpreter lock for seconds, runs there. Where none pickles (a class the build process cannot
    import), the last is exported here and its program handed over. An error naming what went wrong when no tier is
    written. ``owner``: the builder whose ``stop`` ends the process (its ``process``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="opweave-tier-") as scratch:
        program = _saved(models, tuple(inputs), in_place, Path(scratch))
        logfile = Path(scratch) / "build.log"
        with open(logfile, "wb") as sink:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # imports what we import
            process = subprocess.Popen([sys.executable, "-m", "opweave.pipeline.tiers", kind, str(program), str(path),
                                        str(threads or 1), str(os.getpid())], stdout=sink, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env)
            if owner is not None:
                owner.process = process
            try:
                code = process.wait(BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
        if owner is not None and owner.closed.is_set():
            raise RuntimeError("stopped")
        if code != 0 or not path.exists():
            tail = logfile.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"its build process exited with status {code}: {tail[0][:200]}")


def built_now(kind: str, captured: Any, inputs: tuple[Any, ...], options: Any) -> Any:
    """Tier ``kind`` of the captured model, found in the cache or built now (in a build process, waited for), loaded:
    ``mode="max-autotune"``'s candidate of it."""
    path = tier_path(key(captured, inputs, options, kind, weights_digest(captured.gm)), kind)
    whole = _whole(kind, captured, inputs)
    if not path.exists():
        export_and_build(kind, *_handed(whole, (captured.gm,), inputs), options.threads, path)
    return load(kind, path, options.threads, whole)


def _handed(whole: Any, models: tuple[Any, ...], inputs: tuple[Any, ...]) -> tuple[tuple, tuple, tuple]:
    """What a build process is given: the graph of ``whole`` (:func:`_whole`), its tensors and the names of its
    weights (its parameters and buffers, which its session reads in place) where there is one, else ``models`` (the
    first that pickles) and ``inputs``. The names, because a pickled graph is traced again when it is loaded, and
    that makes what the graph computes from buffers alone a constant of a new name (Hugging Face's sliced position
    ids and attention mask: ``_tensor_constant0``...), which the caller lacks: its data travels in the tier's file."""
    if whole is None:
        return models, inputs, ()
    return (whole.gm,), tuple(whole.inputs), tuple(graph_tensors(whole.gm))


def _whole(kind: str, captured: Any, inputs: tuple[Any, ...]) -> Any:
    """For ``onnxruntime-fixed``, the captured model as one graph over its tensor inputs
    (:func:`~opweave.backends.segments.whole_module`: what the first tier's session was exported from): its build
    process exports it at the example's sizes, and its session's calls are mapped through it; None for other kinds
    (their build process gets the model itself). Its graph is rewritten for ONNX Runtime
    (:mod:`~opweave.backends.ortrewrite`) here, where the shapes capture recorded are: a pickled graph loses them, and
    the build process would export the slow forms (RandWire's stacked sums: 19 against 15.5 ms at batch 1)."""
    if kind != "onnxruntime-fixed":
        return None
    from opweave.backends import ortrewrite

    whole = whole_module(captured, inputs)
    return dataclasses.replace(whole, gm=ortrewrite.rewrite(whole.gm, fixed_sizes=True)[0])


# ---- what a tier is ---------------------------------------------------------------------------------------------
def tier_dir() -> Path:
    return search.cache_path().parent / "tiers"


def tier_path(entry_key: str, kind: str) -> Path:
    return tier_dir() / f"{entry_key}.{kind}{SUFFIX.get(kind, '.pt2')}"


def weights_digest(model: Any) -> str:
    """A digest of the model's parameters and buffers (their names, shapes, dtypes and bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    state = model.state_dict() if isinstance(model, torch.nn.Module) else getattr(model, "state_dict", {})
    for name, value in sorted(state.items()):
        if not isinstance(value, torch.Tensor):
            continue
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        data = value.detach().cpu().contiguous()
        if data.numel():
            digest.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.dtype != torch.uint8
                          else data.numpy().tobytes())
    return digest.hexdigest()


def key(captured: Any, inputs: tuple[Any, ...], options: Any, kind: str, weights: str) -> str:
    """What a built tier is valid for: the captured graph (its ops, their targets and the graph's code), the model's
    weights (:func:`weights_digest`), the inputs' signature, the threads, the machine, torch's version and
    :data:`VERSION`."""
    parts = {"kind": kind, "graph": captured.graph.name, "ops": [(op.id, op.target) for op in captured.graph.ops],
             "code": captured.gm.code, "weights": weights, "inputs": repr(key_of(inputs)),
             "threads": options.threads, "machine": search.machine(), "torch": torch.__version__, "version": VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(kind: str, path: Path, threads: int | None, whole: Any = None) -> Any:
    """A built tier, called like the model (positional inputs, the model's outputs); ``whole`` (:func:`_whole`)
    maps the calls of an ``onnxruntime-fixed`` tier to its session's inputs."""
    if kind == "onnxruntime-fixed":
        return _Session(whole, path, threads)
    if kind == "inductor":
        return _Package(torch._inductor.aoti_load_package(str(path)), threads)
    if kind == "exported":
        return _Package(torch.export.load(str(path)).module(), threads)
    raise ValueError(f"unknown tier {kind!r}")


class _Package:
    """A loaded tier run on ``threads`` intra-op threads under ``no_grad``."""

    def __init__(self, fn: Any, threads: int | None):
        self.fn, self.threads = fn, threads

    def __call__(self, *args: Any) -> Any:
        with intra_op_threads(self.threads), torch.no_grad():
            return self.fn(*args)


class _Session:
    """An ``onnxruntime-fixed`` tier: the model's session exported at the example's sizes, with as many threads as the
    first tier's (spinning between runs: nothing runs beside it), its calls mapped through ``whole``
    (:class:`~opweave.backends.segments.Whole`). Where the model takes tensors and returns what the session computes
    (:func:`_direct`), a call hands its arguments to the session and builds the output from its results without
    binding the captured model: :class:`Tiered` sends it only calls of the example's signature, and what binding
    checked, ONNX Runtime checks too (a tensor of another size is refused)."""

    def __init__(self, whole: Any, path: Path, threads: int | None):
        from opweave.backends.compilers import OrtSegment, external_initializers, import_onnxruntime, session_options

        ort = import_onnxruntime()
        options = session_options(threads or total_threads(), alone=True)
        weights = external_initializers(options, external_weights(path, whole.gm))
        self.whole = whole
        self.segment = OrtSegment(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]),
                                  ort.RunOptions(), weights)
        self.direct = _direct(whole)

    def __call__(self, *args: Any) -> Any:
        if self.direct is not None:
            positions, leaves, spec = self.direct
            results = self.segment(*(args[i] for i in positions))
            return pytree.tree_unflatten([results[i] for i in leaves], spec)
        env, tensors = self.whole.bind(args)
        if tensors is None:
            raise ValueError("the onnxruntime-fixed tier runs the example's signature only")
        return self.whole.output(env, self.segment(*tensors))


def _direct(whole: Any) -> tuple[list[int], list[int], Any] | None:
    """For a model called with tensors only, each of which the session takes as it is, and whose output is made of
    the session's results alone (no input, no constant returned): the positions of the arguments the session takes,
    which result each leaf of the output is, and the output's structure; else None (calls are bound, then)."""
    example = tuple(whole.segmented.example_inputs)
    if not example or not all(isinstance(a, torch.Tensor) for a in example):
        return None
    env, tensors = whole.bind(example)
    if tensors is None:
        return None
    positions = [next((i for i, a in enumerate(example) if a is t), -1) for t in tensors]
    markers = [torch.empty(0) for _ in whole.outputs]
    leaves, spec = pytree.tree_flatten(whole.output(env, markers))
    picked = [next((i for i, m in enumerate(markers) if leaf is m), -1) for leaf in leaves]
    if -1 in positions or -1 in picked:
        return None
    return positions, picked, spec


def external_weights(path: Path, gm: Any) -> dict[str, torch.Tensor]:
    """The weights an ``onnxruntime-fixed`` tier's file leaves out (exported apart, as the segments' are:
    :func:`~opweave.backends.compilers.export_onnx`'s ``weights``): ``gm``'s tensors of those names, which the
    session reads in place (:func:`~opweave.backends.compilers.external_initializers`): the tier holds no copy of
    the weights beyond what ONNX Runtime makes of them (a layout it rewrites them to). So, as with Inductor's
    freezing, the tier runs the weights the model had when it was compiled; weights changed in place afterwards call
    for a new ``opweave.compile``."""
    import onnx

    tensors = graph_tensors(gm)
    names = [init.name for init in onnx.load(str(path), load_external_data=False).graph.initializer
             if init.data_location == onnx.TensorProto.EXTERNAL]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"the onnxruntime-fixed tier reads weights the model lacks: {missing[:3]}")
    return {name: tensors[name] for name in names}


def _saved(models: tuple[Any, ...], inputs: tuple[Any, ...], in_place: tuple[str, ...], folder: Path) -> Path:
    """What :func:`export_and_build` hands its build process (module docstring), with ``in_place``
    (:func:`_handed`)."""
    for model in models:
        if isinstance(model, torch.nn.Module) and any(type(m).__module__ == "__main__" for m in model.modules()):
            continue  # a class of the caller's script, which the build process (another __main__) cannot import
        saved = folder / "model.pt"
        try:
            torch.save((model, inputs, in_place), saved)
            return saved
        except Exception:  # noqa: BLE001 - a model that does not pickle: the next, or an export here
            saved.unlink(missing_ok=True)
    program = folder / "program.pt2"
    with torch.no_grad():
        torch.export.save(torch.export.export(models[-1], inputs), program)
    return program


def build(kind: str, program: Path, out: Path, threads: int) -> None:
    """The build process's work: the model and inputs saved at ``program`` (or the program exported from them)
    exported, compiled as tier ``kind`` and written to ``out`` (through a temporary file: a reader never sees half a
    tier)."""
    torch.set_num_threads(threads)
    scratch = out.with_name(f"{out.stem}.{os.getpid()}.partial{out.suffix}")  # AOTInductor wants a .pt2 name
    if kind == "onnxruntime-fixed":  # the graph module and its tensors, exported at their sizes
        from opweave.backends.compilers import export_onnx

        gm, inputs, in_place = torch.load(program, weights_only=False)
        with torch.no_grad():
            outputs = len(gm(*inputs))
        # the caller's weights read from the model (_Session); constants the load made travel in the file
        scratch.write_bytes(export_onnx(gm, list(inputs), outputs, weights={}, apart=in_place))
        os.replace(scratch, out)
        return
    checks = vector_checks() if kind == "inductor" else []  # beside the export: the compiler runs, not Python
    if program.suffix == ".pt2":
        exported = torch.export.load(str(program))
    else:
        ensure_torchvision_importable()  # as the caller's zoo did: unpickling a timm or torchvision model imports it
        model, inputs, _ = torch.load(program, weights_only=False)
        with torch.no_grad():
            exported = torch.export.export(model.eval() if isinstance(model, torch.nn.Module) else model, inputs)
    concurrent.futures.wait(checks)
    if kind == "inductor":
        torch._inductor.aoti_compile_and_package(exported, package_path=str(scratch),
                                                 inductor_configs={"freezing": True, "cpp.threads": threads})
    elif kind == "exported":
        torch.export.save(exported, scratch)
    else:
        raise ValueError(f"unknown tier {kind!r}")
    os.replace(scratch, out)


def vector_checks(workers: int = 3) -> list[Any]:
    """Inductor's checks of the machine's vector instruction sets, started on ``workers`` threads: their futures.

    Before its first CPU kernel, Inductor compiles and loads a small program per instruction set the processor names
    (six on an AVX-512 machine with VNNI), one after another: 8.2 s on an empty Inductor cache on the 2-core machine
    the benchmarks run on, where three threads took 3.9 s (each check is a compiler run, then a loading process: the
    threads wait on both, not on the interpreter); DeepFM's Inductor tier then built in 17.7-20.8 s against
    21.3-23.5 s (three builds each, alternated). Its answers are cached in Inductor's cache directory, so the
    compile that follows finds them (an answer is kept for the process, as Inductor's own check keeps it: a set whose
    check fails is not used, here as there). A check that raises is not the build's error: the compile checks again.
    The modules the checks use are imported here, before the threads start: imported on a thread while the export
    imported them too, ``torch._dynamo`` was found half made (``KeyError: 'torch._dynamo'``) and the build failed."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        import torch.utils.cpp_extension  # noqa: F401 - what a check imports (setuptools among it)
        from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

        named = cpu_vec_isa.x86_isa_checker() if hasattr(cpu_vec_isa, "x86_isa_checker") else []
        isas = [isa for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", [])
                if all(flag in named for flag in str(isa).split())]
    except Exception:  # noqa: BLE001 - no Inductor here: the compile reports it
        return []
    pool = ThreadPoolExecutor(workers)
    futures = [pool.submit(bool, isa) for isa in isas]  # a check that raises: Inductor checks again, and reports it
    pool.shutdown(wait=False)
    return futures


def _orphaned(parent: int) -> None:
    """End this build process once its parent is gone (its tier would serve no one)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str]) -> int:
    kind, program, out, threads, parent = argv
    threading.Thread(target=_orphaned, args=(int(parent),), daemon=True).start()
    try:
        os.nice(BUILD_NICE)  # the caller's calls keep the cores first
    except OSError:
        pass
    build(kind, Path(program), Path(out), int(threads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["BUILD_NICE", "BUILD_TIMEOUT_S", "KINDS", "RACE_IDLE_S", "SUFFIX", "VERSION", "TierBuilder", "Tiered",
           "build", "built_now", "default_kinds", "export_and_build", "key", "load", "start", "tier_dir",
           "tier_path", "weights_digest"]
