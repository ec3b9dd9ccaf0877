"""Clocks and executors: what the serving engine runs its combined blocks on, for real or in simulation.

The engine (:mod:`opweave.serve.engine`) decides *what* runs; an executor runs it and says how long it took, and a
clock says what time it is. Two pairs, one engine and one policy code path for both (TOP §V-A: policies are trained
offline against a model of the device and then run online):

* **real** — :class:`RealClock` (``time.monotonic``) with :class:`CpuExecutor` (the threaded CPU backend, one worker
  per stream) or :class:`CudaExecutor` (one CUDA Graph recorded per combination signature);
* **simulated** — :class:`SimClock` (virtual time that only moves when told) with :class:`SimExecutor`: a combined
  block takes the makespan :func:`opweave.backends.simulate.simulate` gives for its plan under the cost model
  (roofline estimates for a device preset, or a measured profile), plus a fixed per-step overhead.

A **combined block** (:mod:`opweave.serve.combined`: its parts, signature and graph) is compiled once per signature
— its graph, costs, scheduler (``lios`` by default, any other as an option), lowering, validation, backend — through
the pipeline (:func:`opweave.pipeline.build`, with the target of its device) with the executor's one resolved
:class:`~opweave.pipeline.Options` (the serving preset), and kept in a bounded LRU cache
(:class:`opweave.backends.cache.BoundedCache`). On a CPU with a segment compiler each block is a pipeline
:class:`~opweave.pipeline.Compiled` too, its batch sizes its :class:`~opweave.pipeline.signatures.Signatures`: the
server has no builder of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache
from opweave.costs.model import Costs
from opweave.costs.roofline import estimate
from opweave.costs.roofline import preset as find_preset
from opweave.errors import UsageError
from opweave.pipeline import Compiled, Options, build, resolve
from opweave.pipeline.signatures import Batched, Builder, attach, bucket, padded, rows
from opweave.pipeline.targets import SimTarget
from opweave.serve.blocks import BlockedModel
from opweave.serve.combined import (
    Part,
    Signature,
    UnionGraph,
    captured,
    name_of,
    parts_captured,
    signature,
    union_costs,
    union_graph,
)


# ---- clocks -------------------------------------------------------------------------------------------------------
class RealClock:
    """Wall time (``time.monotonic``, seconds). ``spend`` does nothing: a real run has already taken its time."""

    simulated = False

    def now(self) -> float:
        return time.monotonic()

    def spend(self, seconds: float) -> None:
        pass


class SimClock:
    """Virtual time (seconds) that moves only by ``spend`` (a combined block ran) and ``advance_to`` (idle)."""

    simulated = True

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


# ---- what runs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCost:
    """What running a combined block cost: seconds, and (simulation) the share of the device its ops kept busy on
    average (sum of latency x utilization over makespan, capped at 1; None where unknown)."""

    seconds: float
    utilization: float | None = None


class Executor:
    """What every executor shares: the served models, the resolved options every combined block is built with
    (:func:`opweave.serve.assemble.serving_options`: the serving preset, checked before any model loaded; the
    scheduler, TOP's ``lios`` unless told, and its stream cap among them) and the LRU cache of combined blocks built
    (``stats``: hits, misses, evictions, compile seconds), of the options' ``cache_size`` signatures."""

    device = "none"
    serves = "cpu"  # the server its options are resolved for (serving_options' device)

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, pad: bool = False):
        if options.serving != self.serves:
            raise UsageError(f"the options of a server on {self.serves} are resolved with its serving preset: "
                             f"opweave.serve.assemble.serving_options({self.serves!r}, ...)")
        assert options.scheduler is not None  # the serving preset's: lios unless given
        self.models, self.options = models, options
        self.scheduler: str = options.scheduler
        self.streams, self.cache_size = options.streams, options.cache_size
        self.pad = pad
        self._cache = BoundedCache(options.cache_size, self._dropped)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "compile_s": 0.0}

    def bucket(self, batch: int) -> int:
        """The batch a part of ``batch`` samples runs at: itself, or with ``pad`` the next power of two (rows of
        zeros added, their outputs dropped), so that few signatures are compiled: CUDA graphs are recorded for fixed
        shapes, and a max batch of 16 then needs 5 sizes per block instead of 16."""
        return bucket(batch) if self.pad else batch

    def combined_block(self, sig: Signature) -> Compiled:
        """The combined block of ``sig``, built by the pipeline (on first use; least recently used ones dropped)."""
        if sig in self._cache:
            self.stats["hits"] += 1
            return self._cache[sig]
        self.stats["misses"] += 1
        start = time.perf_counter()
        built = self._build(sig)
        self.stats["compile_s"] += time.perf_counter() - start
        self._cache[sig] = built
        return built

    def _build(self, sig: Signature) -> Compiled:
        raise NotImplementedError

    def _dropped(self, sig: Signature, built: Compiled) -> None:
        self.stats["evictions"] += 1
        built.close()

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int, batches: tuple[int, ...] = ()) -> None:
        """Compile ahead what serving a model about to be added needs (on any thread, while the engine runs: it
        touches nothing the engine's thread reads); ``batches``: batch sizes its config asks to have ready (Triton's
        ``model_warmup``). Nothing by default: signatures compile on first use."""

    def drop_model(self, name: str) -> None:
        """Forget a removed model's compiled signatures (on the engine's thread, between steps)."""
        for sig in [s for s in self._cache if any(m == name for m, _, _ in s)]:
            self._cache.pop(sig).close()

    # the engine's interface -------------------------------------------------------------------------------------
    def prepare(self, model: str, inputs: list[Any]) -> Any:
        """The state of a new instance holding requests with these (flat) inputs."""
        return None

    def merge(self, model: str, states: list[Any]) -> Any:
        """One state for instances stacked along the batch dimension, in order."""
        return None

    def run(self, parts: list[Part]) -> StepCost:
        """Run one combined block; each part's ``state`` becomes the block's outputs."""
        raise NotImplementedError

    def outputs(self, model: str, state: Any, batches: list[int]) -> list[Any]:
        """Per request (of these batch sizes, in stacking order), its output in the model's output structure."""
        return [None] * len(batches)


# ---- real executors -----------------------------------------------------------------------------------------------
class TensorExecutor(Executor):
    """Real executors: instance states are tuples of tensors on ``self.device``, stacked with ``torch.cat`` and split
    back per request after the last block."""

    device = "cpu"

    def prepare(self, model: str, inputs: list[Any]) -> Any:
        parts = [tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in flat) for flat in inputs]
        return parts[0] if len(parts) == 1 else self.merge(model, parts)

    def merge(self, model: str, states: list[Any]) -> Any:
        if len(states) == 1:
            return states[0]
        return tuple(torch.cat(column) for column in zip(*states, strict=True))

    def outputs(self, model: str, state: Any, batches: list[int]) -> list[Any]:
        result = self.models[model].unflatten_output(state)
        if len(batches) == 1:
            return [pytree.tree_map(_to_cpu, result)]
        leaves, spec = pytree.tree_flatten(result)
        pieces = [torch.split(_to_cpu(leaf), batches) for leaf in leaves]
        return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(len(batches))]

    def _states(self, parts: list[Part]) -> tuple[list[Part], Signature, list[tuple]]:
        """Parts in signature order, the signature, and each part's inputs padded to its bucket."""
        ordered = sorted(parts, key=lambda p: (p.model, p.block, p.batch))
        inputs = [p.state if self.bucket(p.batch) == p.batch else padded(p.state, self.bucket(p.batch) - p.batch)
                  for p in ordered]
        return ordered, signature(parts, self.bucket), inputs

    def _store(self, ordered: list[Part], outs: list[Any]) -> None:
        for part, out in zip(ordered, outs, strict=True):
            if self.bucket(part.batch) != part.batch:
                out = pytree.tree_map(lambda t, n=part.batch: t[:n] if isinstance(t, torch.Tensor) else t, out)
            last = part.block == len(self.models[part.model].blocks) - 1
            part.state = out if last else (out,)


def _to_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


class CpuExecutor(TensorExecutor):
    """Combined blocks on the CPU backend, built by the pipeline with the executor's options: generated lane code,
    one worker thread per lane, each op (or part) on the intra-op threads its lane may use while it runs, out of the
    options' ``threads`` in all (:func:`opweave.backends.threads.budgets`, as for ``opweave.compile``).

    Two granularities, as the options' ``compiler`` says:

    * none (TOP's own): a signature compiles to the union of its parts' op graphs (each part's block captured at its
      batch, cached), the CPU's roofline costs, the scheduler (``streams`` lanes, default one per thread),
      lowering, validation and a ``CpuBackend``: the parts' ops interleave on the lanes.
    * ``"onnxruntime"`` (or ``"inductor"``, ``"eager"``): each block of each model is a pipeline
      :class:`~opweave.pipeline.Compiled` of its own, one lane compiled whole by that segment compiler
      (:meth:`block`), and a signature compiles to a graph of its parts as single ops, scheduled (by default with
      ``heft``) onto the lanes: parts run side by side, one part alone gets every thread. ONNX Runtime runs these
      blocks about three times faster than eager PyTorch at serving batch sizes on a CPU, and a part compiled whole
      needs no compile per combination (a combination is only its parts' placement: milliseconds). ONNX Runtime
      takes any batch (each block built with ``dynamic=True``: exported once with a free batch dimension, checked at
      another batch), so batches are not padded (up to a third of a padded batch's work was zeros). A part alone
      runs its block directly, on every thread: its plan would be that one call, on one lane (and no signature of a
      single part takes a place in the cache, which a server of many models cycling through their blocks would
      thrash).

    **What grows with the models.** The serving preset's segment options
    (:func:`opweave.pipeline.targets.segment_options`): every ONNX Runtime session of every block of every model
    runs on one thread pool for the process, ``threads`` threads (in a process whose pool another budget made, that
    pool at its size: ONNX Runtime then allows no session a pool of its own), with no memory arena of its own (what a
    run allocates goes back to the C heap when it ends, and :class:`opweave.serve.frontend.HeapTrimmer` gives freed
    memory back to the system), and a block that takes any batch is one session. So a model costs its weights, its
    graphs and one compiled copy of each block, whatever batches and combinations it is served at. A block's
    variants built per batch (its :class:`~opweave.pipeline.signatures.Signatures`) read the model's own parameters
    and are built when a batch first needs them, in the background (:attr:`builder`), while the request runs on the
    variants built (:class:`~opweave.pipeline.signatures.Batched`).
    """

    device = "cpu"

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, pad: bool = False):
        from opweave.backends.threads import total_threads
        from opweave.pipeline.targets import per_op_threads

        self.compiler = options.compiler  # each block compiled whole by it (None: TOP's combined op graphs)
        super().__init__(models, options, pad=pad)
        self.threads = options.threads  # what the lanes of a combined block may use in all
        self.total_threads = total_threads(self.threads)
        self.per_op_threads = per_op_threads(options)
        self._blocks: dict[tuple[str, int], ServedBlock] = {}
        self._warmed: dict[tuple[str, int], ServedBlock] = {}  # a reload's blocks, built while the old ones serve
        self.builder = Builder()

    @property
    def shared_pool(self) -> bool:
        """Whether this executor's ONNX Runtime sessions run on the process's one thread pool (made, at its
        ``threads``, by the first server's block built; :func:`opweave.backends.compilers.shared_pool`)."""
        return any(bool(b.compiled.fused.compiler_options.get("shared_pool")) for served in self._blocks.values()
                   for b in served.compiled.values() if b.compiled.fused is not None)

    def threads_key(self, threads: int) -> int | None:
        """The thread count a block's build is keyed by when a lane with ``threads`` intra-op threads calls it: None
        for ONNX Runtime (one session whatever the count, on the process's pool), the count itself for a compiler
        that bakes it in (Inductor's OpenMP teams)."""
        return None if self.compiler == "onnxruntime" else threads

    def _build(self, sig: Signature) -> Compiled:
        if self.compiler is None:
            return build(captured(self.models, sig)[0], (), self.options)
        # the parts are the blocks' calls: no segment compiler of their own, each op's threads as its block takes
        options = self.options.derive(compiler=None, per_op_threads=self.per_op_threads)
        return build(parts_captured(self.models, sig, self._caller), (), options)

    def _caller(self, model: str, index: int, batch: int) -> Callable:
        """What a parts graph calls for block ``index`` of ``model`` (``batch`` names it): the block built for the
        calling lane's thread count (:meth:`block`)."""
        def run(*inputs):
            return self.block(model, index, torch.get_num_threads())(*inputs)

        run.__name__ = f"{model}_b{index}x{batch}".replace(".", "_")  # fx's code generator names the call after it
        return run

    def served_block(self, model: str, index: int) -> ServedBlock:
        """Block ``index`` of the model served as ``model``: the one :meth:`warm_model` built for it, or a new one
        (built when first called)."""
        key, blocked = (model, index), self.models[model]
        found = self._blocks.get(key)
        if found is None or found.blocked is not blocked:
            warmed = self._warmed.pop(key, None)
            found = warmed if warmed is not None and warmed.blocked is blocked else ServedBlock(model, index, blocked)
            self._blocks[key] = found
        return found

    def block(self, model: str, index: int, threads: int | None = None) -> Batched:
        """Block ``index`` of ``model`` for a lane of ``threads`` intra-op threads (default: all of them): a pipeline
        :class:`~opweave.pipeline.Compiled` (:meth:`build_block`) called at any batch
        (:class:`~opweave.pipeline.signatures.Batched`)."""
        return self._built(self.served_block(model, index), threads or self.total_threads)

    def _built(self, served: ServedBlock, threads: int) -> Batched:
        key = self.threads_key(threads)
        found = served.compiled.get(key)
        if found is None:
            with served.lock:  # the first caller builds it, callers meanwhile wait for that build
                found = served.compiled.get(key)
                if found is None:
                    found = served.compiled[key] = self.build_block(served, key or self.total_threads)
        return found

    def build_block(self, served: ServedBlock, threads: int) -> Batched:
        """Block ``served`` built through the pipeline (:func:`opweave.pipeline.build`) with the executor's options,
        derived (:meth:`~opweave.pipeline.Options.derive`): one lane of ``threads`` threads, its one segment compiled
        whole by the executor's compiler; with ONNX Runtime, where instances stack, at batch 2 with ``dynamic=True``
        (one session for every batch, checked at batch 3), else at batch 1 (one batch only where they do not stack).
        Its other batch sizes are its :class:`~opweave.pipeline.signatures.Signatures`, built the same way."""
        blocked, index = served.blocked, served.index
        stack = blocked.stackable and self.compiler == "onnxruntime"
        batch = 2 if stack else 1
        options = self.block_options(threads, True if stack else None if blocked.stackable else False)
        example = blocked.example(index, batch)
        compiled = build(blocked.captured_block(index, batch), example, options)
        built_with = compiled.options or options  # without dynamic where the block took no other batch

        def compile_for(args: tuple):  # another batch size (padded to its bucket): built as the example was
            size = rows(args)
            return build(blocked.captured_block(index, size), blocked.example(index, size), built_with)

        attach(compiled, served.name, example, compile_for, bound=options.cache_size)
        return Batched(compiled, bucket=bucket if blocked.stackable else int, builder=self.builder, name=served.name)

    def block_options(self, threads: int, dynamic: bool | None) -> Options:
        """What one block is built with: as ``opweave.compile`` builds a model with the executor's compiler, one lane
        of ``threads`` threads, the block's graph as it is and the executor's bound on sizes, ``dynamic`` as the block
        stacks, in a process many models share (``shared``: one ONNX Runtime pool, a model's weights read in
        place)."""
        return resolve("cpu", scheduler="sequential", streams=1, threads=threads, compiler=self.compiler,
                       coarsen=False, dynamic=dynamic, cache_size=self.options.cache_size).derive(shared=True)

    def thread_counts(self) -> list[int]:
        """Every intra-op thread count a part may be called with (all the cores alone, their share beside others)."""
        from opweave.pipeline.thread_budgets import op_budgets

        return op_budgets(self.streams or 1, self.threads, per_op=self.per_op_threads)

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int, batches: tuple[int, ...] = ()) -> None:
        """With ``compiler``: build, before ``name`` serves, what its first requests need (on the calling thread,
        off the engine's: the blocks go into the executor once built, and their keys name only this model): each
        block for every thread key a lane may call it with, and there, unless it takes any batch, the sizes of
        ``batches`` (a config's warm-up batch sizes, Triton's ``model_warmup``). Every other batch is built when
        first asked for, in the background. A new version of a served model (a reload) gets blocks of its own, which
        it takes when it is served: the old version's requests still run on the old blocks meanwhile."""
        if self.compiler is None:
            return
        sizes = sorted({bucket(n) for n in batches if 1 <= n <= max_batch} | {1}) if blocked.stackable else [1]
        made = {}
        for index in range(len(blocked.blocks)):
            served = self._blocks.get((name, index))
            if served is None or served.blocked is not blocked:
                served = ServedBlock(name, index, blocked)
            for threads in dict.fromkeys(self.threads_key(n) or self.total_threads for n in self.thread_counts()):
                self._built(served, threads).warm([blocked.example(index, n) for n in sizes])
            made[(name, index)] = served
        current = self.models.get(name)
        (self._blocks if current is None or current is blocked else self._warmed).update(made)

    def warm_models(self, max_batch: int, batches: dict[str, tuple[int, ...]] | None = None,
                    say: Callable[[str], None] | None = None) -> int:
        """:meth:`warm_model` for every served model; how many builds of their blocks there are (a block's for each
        thread key and batch size). ``say``: told which model's blocks compile, one line each (a progress bar)."""
        for i, (name, blocked) in enumerate(self.models.items(), 1):
            if say is not None:
                say(f"compiling {name}'s blocks ({i}/{len(self.models)})")
            self.warm_model(name, blocked, max_batch, (batches or {}).get(name, ()))
        return sum(len(b.sizes()) for served in self._blocks.values() for b in served.compiled.values())

    def drop_model(self, name: str) -> None:
        super().drop_model(name)
        for key in [k for k in self._blocks if k[0] == name]:
            self._blocks.pop(key).close()  # a size still queued for it is not built
        # a reload's new blocks stay in _warmed for the version that replaces this one

    def run(self, parts: list[Part]) -> StepCost:
        ordered, sig, inputs = self._states(parts)
        alone = self.compiler is not None and len(parts) == 1  # one part alone: its plan would be this one call
        call = self.block(sig[0][0], sig[0][1], self.total_threads) if alone else self.combined_block(sig)
        start = time.perf_counter()
        with torch.no_grad():
            outs = call(*[x for state in inputs for x in state])
        seconds = time.perf_counter() - start
        self._store(ordered, [outs] if alone else list(outs))
        return StepCost(seconds)


@dataclass(eq=False)
class ServedBlock:
    """One block of one served model on the CPU executor: its builds by thread key (:meth:`CpuExecutor.block`:
    pipeline :class:`~opweave.pipeline.Compiled` s called at any batch), and the model version they are of."""

    model: str
    index: int
    blocked: BlockedModel
    compiled: dict[int | None, Batched] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return f"{self.model}.b{self.index}"

    def close(self) -> None:
        """Its model was dropped: nothing more is built for it."""
        for batched in self.compiled.values():
            batched.close()


class CudaExecutor(TensorExecutor):
    """Combined blocks on one GPU, each signature recorded once into a CUDA Graph (TOP §VI-A keeps one graph per
    combined block; Nimble's ahead-of-time recording). A signature compiles, through the pipeline with the CUDA
    target, to: the parts' block modules joined side by side (:func:`opweave.serve.blocks.combined_module`),
    captured for their batches, the fitted GPU's op times (:mod:`opweave.costs.calibrated`, as the CUDA default
    plans), the scheduler, lowering, validation, the memory pass and a :class:`opweave.backends.cuda.CudaBackend`
    recording CUDA graphs. ``cache_size`` (the serving preset's 64 unless told) bounds the recorded combinations
    (each holds its own memory pool).

    The models must already be on the GPU (see :func:`opweave.serve.models.load`). The options' ``runtime``: the
    CUDA runtime (:mod:`opweave.backends.runtime`; default ``torch.cuda``; the fake one runs it on the CPU, with the
    models and inputs there)."""

    serves = "cuda"

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, pad: bool = True):
        from opweave.backends.cuda import require_cuda

        self.runtime = options.runtime
        require_cuda(self.runtime)
        super().__init__(models, options, pad=pad)  # streams: the GPU's hardware queues
        self.device = self.runtime.device

    def _build(self, sig: Signature) -> Compiled:
        combined, example = captured(self.models, sig)
        return build(combined, example, self.options.derive(cache_size=1))  # one input signature each


    def run(self, parts: list[Part]) -> StepCost:
        ordered, sig, inputs = self._states(parts)
        built = self.combined_block(sig)
        stream = self.runtime.current_stream(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            outs = built(*[x for state in inputs for x in state])
        stream.synchronize()
        seconds = time.perf_counter() - start
        self._store(ordered, list(outs))
        return StepCost(seconds)


# ---- simulation ---------------------------------------------------------------------------------------------------
class SimExecutor(Executor):
    """Combined blocks timed by the simulator: each part's block graph at its batch
    (:meth:`~opweave.serve.blocks.BlockedModel.graph_at`), costs from the roofline ``preset`` (or ``profiles``)
    under the options' ``cost_model`` (the serving preset's ``gpu``: concurrent ops share the device), planned and
    replayed through the pipeline's simulation target (:class:`~opweave.pipeline.targets.SimTarget`: the scheduler,
    lowering, validation, and the simulator's replay of the plan). A step takes the makespan plus
    ``step_overhead_ms``.

    ``step_overhead_ms`` (default 0.03 ms) stands for what a real step adds around the graph: the engine's decision,
    stacking the inputs and one CUDA Graph launch and synchronization. It is an assumption, not a measurement.

    ``profiles`` maps a model to measured profiles (:class:`opweave.costs.profile.Profile`, by the batch they were
    measured at, for the whole model: op ids are the model's): an op's latency at batch ``n`` is its measured latency
    at the nearest profiled batch ``m`` times the roofline ratio ``estimate(n) / estimate(m)``. Utilization comes from
    the profile where it was measured, else from the roofline.
    """

    device = "sim"
    serves = "sim"  # a GPU's plans, simulated: streams capped at its hardware queues

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, preset: str = "h100",
                 dtype: str = "float32", profiles: dict[str, dict[int, Any]] | None = None,
                 step_overhead_ms: float = 0.03, pad: bool = True):
        super().__init__(models, options, pad=pad)
        find_preset(preset)
        self.preset, self.dtype = preset, dtype
        self.profiles = profiles or {}
        self.step_overhead_ms = step_overhead_ms
        self._part_costs: dict[tuple[str, int, int], Costs] = {}

    def part_costs(self, model: str, block: int, batch: int) -> Costs:
        """What block ``block`` of ``model`` costs at ``batch`` on the simulated device (the class docstring)."""
        key = (model, block, batch)
        if key not in self._part_costs:
            graph = self.models[model].graph_at(block, batch)
            costs = estimate(graph, self.preset, self.dtype, model=self.options.cost_model)
            measured = self.profiles.get(model)
            if measured:
                at = min(measured, key=lambda m: (abs(m - batch), m))
                ref = estimate(self.models[model].graph_at(block, at), self.preset, self.dtype)
                prof = measured[at]
                costs = replace(costs, source=f"profile@{at}", latency_ms={
                    op: prof.latency_ms[op] * costs.latency_ms[op] / ref.latency_ms[op] for op in graph.ids},
                    utilization={op: prof.utilization.get(op, u) for op, u in costs.utilization.items()})
            self._part_costs[key] = costs
        return self._part_costs[key]

    def _build(self, sig: Signature) -> Compiled:
        graph = union_graph([self.models[m].graph_at(b, n) for m, b, n in sig], name_of(sig))
        costs = union_costs([self.part_costs(*key) for key in sig], self.options.cost_model)
        return SimTarget().build(graph, costs, self.options)

    def run(self, parts: list[Part]) -> StepCost:
        makespan_ms, utilization = self.combined_block(signature(parts, self.bucket))()
        seconds = (makespan_ms + self.step_overhead_ms) / 1e3
        return StepCost(seconds, utilization * makespan_ms / (makespan_ms + self.step_overhead_ms))

    def model_latency_ms(self, model: str, batch: int = 1) -> float:
        """One request of ``batch`` samples alone through every block of ``model`` (no queueing), in ms."""
        return sum(self.run([Part(model, b, batch)]).seconds for b in range(len(self.models[model].blocks))) * 1e3


__all__ = ["CpuExecutor", "CudaExecutor", "Executor", "Part", "RealClock", "ServedBlock", "SimClock", "SimExecutor",
           "StepCost", "UnionGraph", "bucket", "signature", "union_costs", "union_graph"]
