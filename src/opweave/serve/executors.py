"""Clocks and executors: what the serving engine runs its combined blocks on, for real or in simulation.

The engine (:mod:`opweave.serve.engine`) decides *what* runs; an executor runs it and says how long it took, and a
clock says what time it is. Two pairs, one engine and one policy code path for both (TOP §V-A: policies are trained
offline against a model of the device and then run online):

* **real** — :class:`RealClock` (``time.monotonic``) with :class:`CpuExecutor` (the threaded CPU backend, one worker
  per stream) or :class:`CudaExecutor` (one CUDA Graph recorded per combination signature);
* **simulated** — :class:`SimClock` (virtual time that only moves when told) with :class:`SimExecutor`: a combined
  block takes the makespan :func:`opweave.backends.simulate.simulate` gives for its plan under the cost model
  (roofline estimates for a device preset, or a measured profile), plus a fixed per-step overhead.

A **combined block** is a list of :class:`Part` s (TOP's sub-blocks): one block of one model for a stack of
``batch`` samples. Its *signature* (the sorted ``(model, block, batch)`` triples) determines its graph, so every
executor compiles a signature once — union graph, costs, scheduler (``lios`` by default, any other as an option),
lowering, validation, backend, through the pipeline (:func:`opweave.pipeline.build`) with the executor's one resolved
:class:`~opweave.pipeline.Options` — and keeps it in a bounded LRU cache (:class:`opweave.backends.cache.BoundedCache`).

Every part's ops get the prefix ``p{k}_`` (k = the part's position in the signature), so the parts of one combined
block are one graph with no edges between them: the scheduler puts them side by side on streams.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache
from opweave.capture.runtime import Captured
from opweave.costs.model import Costs
from opweave.errors import UsageError
from opweave.ir.graph import Edge, OpGraph
from opweave.pipeline import Options, build, plan_for, resolve
from opweave.serve.blocks import BlockedModel, combined_module

Signature = tuple[tuple[str, int, int], ...]


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
@dataclass(eq=False)
class Part:
    """One sub-block of a combined block: block ``block`` of ``model`` for ``batch`` stacked samples. ``state`` holds
    the block's inputs (real executors: a tuple of tensors; simulation: None) and, after the run, its outputs."""

    model: str
    block: int
    batch: int
    state: Any = None


@dataclass(frozen=True)
class StepCost:
    """What running a combined block cost: seconds, and (simulation) the share of the device its ops kept busy on
    average (sum of latency x utilization over makespan, capped at 1; None where unknown)."""

    seconds: float
    utilization: float | None = None


def signature(parts: list[Part], bucket=lambda n: n) -> Signature:
    """The sorted ``(model, block, batch)`` triples, each batch rounded up by ``bucket``."""
    return tuple(sorted((p.model, p.block, bucket(p.batch)) for p in parts))


@dataclass
class UnionGraph(OpGraph):
    """Graphs side by side (:func:`union_graph`). Each part is a validated :class:`OpGraph` and no edge joins two
    parts, so the union is a valid DAG and is not checked again; its topological order is the parts' orders one after
    another, which is exactly the capture-order-tie-broken order :attr:`OpGraph.topo_order` defines (every op of part
    k precedes every op of part k+1 in capture order). Both save most of the cost of timing a combined block."""

    def validate(self) -> None:
        pass


def union_graph(graphs: list[OpGraph], name: str = "combined") -> OpGraph:
    """The graphs side by side: op ``o`` of graph ``k`` becomes ``p{k}_o``; no edges between graphs."""
    ops, edges, order = [], [], []
    for k, g in enumerate(graphs):
        ops += [replace(o, id=f"p{k}_{o.id}", name=f"p{k}_{o.name or o.id}") for o in g.ops]
        edges += [Edge(f"p{k}_{e.src}", f"p{k}_{e.dst}", e.bytes, e.transfer_ms, e.kind) for e in g.edges]
        order += [f"p{k}_{o}" for o in g.topo_order]
    union = UnionGraph(ops, edges, name)
    union.__dict__["topo_order"] = order  # the cached_property's value, known without sorting
    return union


def union_costs(costs: list[Costs], model: str) -> Costs:
    """Per-part costs merged with the ``p{k}_`` prefixes of :func:`union_graph`."""
    def merged(field: str) -> dict:
        return {f"p{k}_{op}": v for k, c in enumerate(costs) for op, v in getattr(c, field).items()}

    return Costs(latency_ms=merged("latency_ms"), utilization=merged("utilization"), category=merged("category"),
                 model=model, source=",".join(sorted({c.source for c in costs})))


class Executor:
    """What every executor shares: the served models, the resolved options every combined block is built with
    (:func:`opweave.serve.assemble.serving_options`: the serving preset, checked before any model loaded; the
    scheduler, TOP's ``lios`` unless told, and its stream cap among them) and the LRU cache of compiled signatures
    (``stats``: hits, misses, evictions, compile seconds), of ``cache_size`` signatures (default: the options')."""

    device = "none"
    serves = "cpu"  # the server its options are resolved for (serving_options' device)

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *,
                 cache_size: int | None = None, pad: bool = False):
        options = options if options is not None else resolve(
            "cpu" if self.serves == "cpu" else "cuda", check_device=False, serving=self.serves)
        if options.serving != self.serves:
            raise UsageError(f"the options of a server on {self.serves} are resolved with its serving preset: "
                             f"opweave.serve.assemble.serving_options({self.serves!r}, ...)")
        cache_size = options.cache_size if cache_size is None else cache_size
        if cache_size < 1:
            raise UsageError(f"cache_size must be at least 1, got {cache_size}")
        self.models, self.options = models, options
        self.scheduler, self.streams, self.cache_size = options.scheduler, options.streams, cache_size
        self.pad = pad
        self._cache = BoundedCache(cache_size, self._dropped)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "compile_s": 0.0}

    def build_options(self, costs: Costs) -> Options:
        """The options a combined block is built with: the executor's, on ``costs``."""
        return self.options.derive(costs=costs)

    def bucket(self, batch: int) -> int:
        """The batch a part of ``batch`` samples runs at: itself, or with ``pad`` the next power of two (rows of
        zeros added, their outputs dropped), so that few signatures are compiled: CUDA graphs are recorded for fixed
        shapes, and a max batch of 16 then needs 5 sizes per block instead of 16."""
        return bucket(batch) if self.pad else batch

    def compiled(self, sig: Signature) -> Any:
        """The compiled entry of ``sig`` (compiled on first use; least recently used entries dropped)."""
        if sig in self._cache:
            self.stats["hits"] += 1
            return self._cache[sig]
        self.stats["misses"] += 1
        start = time.perf_counter()
        entry = self._compile(sig)
        self.stats["compile_s"] += time.perf_counter() - start
        self._cache[sig] = entry
        return entry

    def _compile(self, sig: Signature) -> Any:
        raise NotImplementedError

    def _dropped(self, sig: Signature, entry: Any) -> None:
        self.stats["evictions"] += 1
        self._evict(entry)

    def _evict(self, entry: Any) -> None:
        pass

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int, batches: tuple[int, ...] = ()) -> None:
        """Compile ahead what serving a model about to be added needs (on any thread, while the engine runs: it
        touches nothing the engine's thread reads); ``batches``: batch sizes its config asks to have ready (Triton's
        ``model_warmup``). Nothing by default: signatures compile on first use."""

    def drop_model(self, name: str) -> None:
        """Forget a removed model's compiled signatures (on the engine's thread, between steps)."""
        for sig in [s for s in self._cache if any(m == name for m, _, _ in s)]:
            self._evict(self._cache.pop(sig))

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

    def combined(self, sig: Signature) -> tuple[Captured, tuple]:
        """The blocks of ``sig`` side by side as one :class:`Captured` (op ``o`` of part ``k`` is ``p{k}_o``, as in
        :func:`union_graph`) and example inputs for it (every part's, in order). Assembled from the parts' cached
        captures (:meth:`BlockedModel.captured_block`): the module is :func:`opweave.serve.blocks.combined_module`
        of their graphs, the op graph the :func:`union_graph` of theirs, so no signature runs a forward pass to be
        compiled (a shape propagation of the combination was a third of a CPU server's time under load)."""
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        parts = [self.models[m].captured_block(b, n) for m, b, n in sig]
        example = tuple(x for m, b, n in sig for x in self.models[m].example(b, n))
        module = combined_module([p.gm for p in parts], _name(sig))
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        for node, x in zip(placeholders, example, strict=True):  # a part module's metas are its last batch's
            if isinstance(x, torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(x)
        by_name = {n.name: n for n in module.graph.nodes}
        nodes = {f"p{k}_{op}": [by_name[f"p{k}_{n.name}"] for n in group]
                 for k, part in enumerate(parts) for op, group in part.nodes.items()}
        return Captured(union_graph([p.graph for p in parts], _name(sig)), module, nodes), example

    def _states(self, parts: list[Part]) -> tuple[list[Part], Signature, list[tuple]]:
        """Parts in signature order, the signature, and each part's inputs padded to its bucket."""
        ordered = sorted(parts, key=lambda p: (p.model, p.block, p.batch))
        inputs = [p.state if self.bucket(p.batch) == p.batch else _pad(p.state, self.bucket(p.batch) - p.batch)
                  for p in ordered]
        return ordered, signature(parts, self.bucket), inputs

    def _store(self, ordered: list[Part], outs: list[Any]) -> None:
        for part, out in zip(ordered, outs, strict=True):
            if self.bucket(part.batch) != part.batch:
                out = pytree.tree_map(lambda t, n=part.batch: t[:n] if isinstance(t, torch.Tensor) else t, out)
            last = part.block == len(self.models[part.model].blocks) - 1
            part.state = out if last else (out,)


def _pad(state: tuple, rows: int) -> tuple:
    return tuple(torch.cat([x, x.new_zeros((rows, *x.shape[1:]))]) if isinstance(x, torch.Tensor) else x
                 for x in state)


def _to_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


class CpuExecutor(TensorExecutor):
    """Combined blocks on the CPU backend, built by the pipeline with the executor's options: generated lane code,
    one worker thread per lane, each op (or part) on the intra-op threads its lane may use while it runs, out of the
    options' ``threads`` in all (:func:`opweave.backends.threads.budgets`, as for ``opweave.compile``).

    Two granularities, as the options' ``compiler`` says:

    * none (TOP's own): a signature compiles to the union of its parts' op graphs (each part's block captured at its
      batch, cached), roofline costs for the CPU, the scheduler (``streams`` lanes, default one per thread),
      lowering, validation and a ``CpuBackend``: the parts' ops interleave on the lanes.
    * ``"onnxruntime"`` (or ``"inductor"``, ``"eager"``): each block of each model is compiled whole by that segment
      compiler (:class:`CompiledBlock`), and a signature compiles to a graph of its parts as single ops, scheduled (by
      default with ``heft``) onto the lanes: parts run side by side, one part alone gets every thread. ONNX Runtime
      runs these blocks about three times faster than eager PyTorch at serving batch sizes on a CPU, and a part
      compiled whole needs no compile per combination (a combination is only its parts' placement: milliseconds).
      ONNX Runtime takes any batch (each block exported once with a free batch dimension, checked at another batch),
      so batches are not padded (up to a third of a padded batch's work was zeros). A part alone runs its compiled
      block directly, on every thread: its plan would be that one call, on one lane (and no signature of a single
      part takes a place in the cache, which a server of many models cycling through their blocks would thrash).

    **What grows with the models.** Every ONNX Runtime session of every block of every model runs on one thread pool
    for the process, ``threads`` threads (:func:`opweave.backends.compilers.shared_pool`; in a process whose pool
    another budget made, that pool at its size: ONNX Runtime then allows no session a pool of its own), with no
    memory arena of its own (what a run allocates goes back to the C heap when it ends, and
    :class:`opweave.serve.frontend.HeapTrimmer` gives freed memory back to the system), and a block that takes any
    batch is one session. So a model costs its weights, its graphs and one compiled copy of each block, whatever
    batches and combinations it is served at. Variants of a block that are compiled per batch read the model's own
    parameters (:class:`CompiledBlock`) and are built when a batch first needs them, in the background
    (:attr:`builder`), while the request runs on the variants built.
    """

    device = "cpu"

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *,
                 cache_size: int | None = None, pad: bool | None = None):
        from opweave.backends.compilers import get
        from opweave.backends.threads import total_threads

        options = options if options is not None else resolve("cpu", serving="cpu", compiler="none")
        self.compiler = options.compiler  # each block compiled whole by it (None: TOP's combined op graphs)
        super().__init__(models, options, cache_size=cache_size, pad=bool(pad))
        self.threads = options.threads  # what the lanes of a combined block may use in all
        self.total_threads = total_threads(self.threads)
        self.per_op_threads = get(self.compiler).per_op_threads if self.compiler is not None else False
        self._shared_pool: bool | None = None  # whether ONNX Runtime's sessions share the process's pool (asked once)
        self._blocks: dict[tuple[str, int], CompiledBlock] = {}
        self._warmed: dict[tuple[str, int], CompiledBlock] = {}  # a reload's blocks, built while the old ones serve
        self.builder = Builder()

    @property
    def shared_pool(self) -> bool:
        """Whether this executor's ONNX Runtime sessions run on the process's one thread pool (made, at its
        ``threads``, by the first executor that asks; :func:`opweave.backends.compilers.shared_pool`)."""
        if self._shared_pool is None:
            from opweave.backends.compilers import shared_pool

            self._shared_pool = self.compiler == "onnxruntime" and shared_pool(self.total_threads)
        return self._shared_pool

    def threads_key(self, threads: int) -> int | None:
        """The thread count a block's compiled variant is keyed by when a lane with ``threads`` intra-op threads calls
        it: None for ONNX Runtime (one session whatever the count, on the process's pool), the count itself for a
        compiler that bakes it in (Inductor's OpenMP teams)."""
        return None if self.compiler == "onnxruntime" else threads

    def _compile(self, sig: Signature) -> Any:
        from opweave.costs.roofline import estimate

        captured = self.combined(sig)[0] if self.compiler is None else self._parts_graph(sig)
        options = self.build_options(estimate(captured.graph, "cpu", model=self.options.cost_model))
        return build(captured, (), options.derive(compiler=None, per_op_threads=self.per_op_threads)).backend

    def _parts_graph(self, sig: Signature) -> Captured:
        """``sig`` as a graph whose ops are its parts, each one call of its compiled block (class docstring); an
        op's FLOPs and bytes are its block's."""
        from torch import fx, nn

        from opweave.ir.graph import Op

        graph, calls, ops = fx.Graph(), [], []
        for k, key in enumerate(sig):
            block = self.compiled_block(key[0], key[1])
            inputs = [graph.placeholder(f"p{k}_in{i}") for i in range(block.blocked.input_count(key[1]))]
            calls.append(graph.create_node("call_function", block.at(key[2]), tuple(inputs), name=f"p{k}"))
            part_graph = self.models[key[0]].graph_at(key[1], key[2])
            ops.append(Op(f"p{k}", target=f"{key[0]}.block{key[1]}", flops=sum(o.flops for o in part_graph.ops),
                          bytes=sum(o.bytes for o in part_graph.ops)))
        graph.output(tuple(calls))
        module = fx.GraphModule(nn.Module(), graph, class_name=_name(sig).replace(".", "_").replace("+", "_"))
        by_name = {n.name: n for n in module.graph.nodes}
        return Captured(OpGraph(ops, [], _name(sig)), module, {f"p{k}": [by_name[f"p{k}"]] for k in range(len(sig))})

    def compiled_block(self, model: str, block: int) -> CompiledBlock:
        """Block ``block`` of the model served as ``model``: its compiled block, the one :meth:`warm_model` built for
        it, or a new one (built on first use)."""
        key, blocked = (model, block), self.models[model]
        found = self._blocks.get(key)
        if found is None or found.blocked is not blocked:
            warmed = self._warmed.pop(key, None)
            found = warmed if warmed is not None and warmed.blocked is blocked else \
                CompiledBlock(self, model, block, blocked)
            self._blocks[key] = found
        return found

    def thread_counts(self) -> list[int]:
        """Every intra-op thread count a part may be called with (all the cores alone, their share beside others)."""
        from opweave.pipeline.thread_budgets import op_budgets

        return op_budgets(self.streams, self.threads, per_op=self.per_op_threads)

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int, batches: tuple[int, ...] = ()) -> None:
        """With ``compiler``: build, before ``name`` serves, the variants of its blocks that its first requests need
        (on the calling thread, off the engine's: the blocks go into the executor once built, and their keys name only
        this model). A block that takes any batch: its one session (per thread count where the compiler bakes the
        count in); otherwise its batch-1 variant and those of ``batches`` (a config's warm-up batch sizes, Triton's
        ``model_warmup``). Every other batch is built when first asked for (:class:`CompiledBlock`). A new version of
        a served model (a reload) gets blocks of its own, which it takes when it is served: the old version's requests
        still run on the old blocks meanwhile."""
        if self.compiler is None:
            return
        sizes = tuple(n for n in batches if 1 <= n <= max_batch) if blocked.stackable else ()
        made = {}
        for b in range(len(blocked.blocks)):
            block = self._blocks.get((name, b))
            if block is None or block.blocked is not blocked:
                block = CompiledBlock(self, name, b, blocked)
            block.warm(self.thread_counts(), sizes)
            made[(name, b)] = block
        served = self.models.get(name)
        (self._blocks if served is None or served is blocked else self._warmed).update(made)

    def warm_models(self, max_batch: int, batches: dict[str, tuple[int, ...]] | None = None,
                    say: Callable[[str], None] | None = None) -> int:
        """:meth:`warm_model` for every served model; how many compiled variants there are. ``say``: told which
        model's blocks compile, one line each (a progress bar)."""
        for i, (name, blocked) in enumerate(self.models.items(), 1):
            if say is not None:
                say(f"compiling {name}'s blocks ({i}/{len(self.models)})")
            self.warm_model(name, blocked, max_batch, (batches or {}).get(name, ()))
        return sum(len(block.compiled) for block in self._blocks.values())

    def _evict(self, entry: Any) -> None:
        entry.close()  # stops its worker threads

    def drop_model(self, name: str) -> None:
        super().drop_model(name)
        for key in [k for k in self._blocks if k[0] == name]:
            self._blocks.pop(key).closed = True  # a variant still queued for it is not built
        # a reload's new blocks stay in _warmed for the version that replaces this one

    def run(self, parts: list[Part]) -> StepCost:
        ordered, sig, inputs = self._states(parts)
        if self.compiler is not None and len(parts) == 1:  # one part alone: its plan would be this one call
            (model, block, batch), = sig
            compiled = self.compiled_block(model, block)
            call = compiled.function(batch, self.total_threads)
            start = time.perf_counter()
            with torch.no_grad():
                out = pytree.tree_unflatten(list(call(*inputs[0])), compiled.spec)
            seconds = time.perf_counter() - start
            self._store(ordered, [out])
            return StepCost(seconds)
        backend = self.compiled(sig)
        start = time.perf_counter()
        with torch.no_grad():
            outs = backend(*[x for state in inputs for x in state])
        seconds = time.perf_counter() - start
        self._store(ordered, list(outs))
        return StepCost(seconds)


def bucket(batch: int) -> int:
    """The batch a variant compiled per batch size is built for: the next power of two (a max batch of 16 needs at
    most 5 variants)."""
    return 1 << (batch - 1).bit_length()


class Builder:
    """Builds compiled variants off the engine's thread: one daemon thread, jobs in the order asked, each on one
    intra-op thread (the cores stay with serving; :mod:`opweave.backends.threads` says why a worker's OpenMP team
    stays at one). A job asked for while it is queued or running is not queued again,
    and :meth:`CompiledBlock.build` builds a variant once whoever asks, so a variant first needed by many requests
    at once is built once."""

    def __init__(self):
        self._lock = threading.Condition()
        self._jobs: deque = deque()
        self.pending: set = set()
        self.failed: list[str] = []  # one line per job that raised (its requests ran on the variants built)
        self._thread: threading.Thread | None = None

    def submit(self, block: CompiledBlock, key: tuple) -> bool:
        """Queue the build of ``block``'s variant ``key``; False if it is queued or running already."""
        job = (block, key)
        with self._lock:
            if job in self.pending:
                return False
            self.pending.add(job)
            self._jobs.append(job)
            if self._thread is None:
                from opweave.cores import intra_op_threads

                ready = threading.Event()
                with intra_op_threads():  # its one thread sets the process-wide default too: put it back
                    self._thread = threading.Thread(target=self._work, args=(ready,), name="opweave-builder",
                                                    daemon=True)
                    self._thread.start()
                    ready.wait()
            self._lock.notify_all()
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no job is queued or running (False if ``timeout_s`` passed first)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.pending, timeout_s)

    def _work(self, ready: threading.Event) -> None:
        from opweave.backends.threads import enter_budget
        from opweave.errors import first_line

        enter_budget(1)  # an OpenMP team of one: a worker's larger team slows every kernel of the process
        ready.set()
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._jobs))
                block, key = job = self._jobs.popleft()
            try:
                if not block.closed:
                    block.build(*key)
            except Exception as exc:  # noqa: BLE001 - the requests keep running on the variants built
                self.failed.append(f"{block.name} {key}: {first_line(exc)}")
            finally:
                with self._lock:
                    self.pending.discard(job)
                    self._lock.notify_all()


class CompiledBlock:
    """One block of one model compiled whole by the executor's segment compiler, called like the block (its inputs
    in, its output in the block's structure out) at any batch: :meth:`at` gives the callable a parts graph calls.

    **Variants**, keyed ``(threads, batch)``. With ONNX Runtime the block is exported once with a free batch
    dimension and checked against the block at another batch: one session then takes every batch and every thread
    count (``(None, None)``). Where that check fails (a graph that baked its batch in), and with another compiler, a
    variant is compiled per padded batch (:func:`bucket`; and per thread count where the compiler bakes it in:
    Inductor), each reading the model's own parameters: ONNX Runtime's shared initializers (``share_weights``,
    which forgoes the optimizations that copy weights: a model that cannot take any batch pays them for its memory),
    Inductor unfrozen (its parameters the module's, not constants of its own). ``builds`` counts compiles per key.

    **Built when first needed.** A batch whose variant is not built is queued for the executor's :class:`Builder`
    and runs meanwhile on the variants built: padded up to the smallest larger one, or in pieces of the largest
    (outputs concatenated). :meth:`warm` builds what a model's first requests need before it serves."""

    def __init__(self, executor: CpuExecutor, model: str, block: int, blocked: BlockedModel):
        self.executor, self.blocked, self.block, self.compiler = executor, blocked, block, executor.compiler
        self.name = f"{model}.b{block}"
        self.module, self.spec = _flat_outputs(blocked.modules[block])
        self.dynamic: bool | None = None if self.compiler == "onnxruntime" and blocked.stackable else False
        self.compiled: dict[tuple[int | None, int | None], Any] = {}  # (threads, batch; None: any) -> function
        self.builds: dict[tuple[int | None, int | None], int] = {}
        self.closed = False  # its model was dropped: nothing more is built
        self._lock = threading.Lock()
        self._building: dict[tuple[int | None, int | None], threading.Event] = {}
        self._errors: dict[tuple[int | None, int | None], BaseException] = {}

    def at(self, batch: int) -> Callable:
        def run(*inputs):
            return pytree.tree_unflatten(list(self.function(batch)(*inputs)), self.spec)

        run.__name__ = f"{self.name}x{batch}".replace(".", "_")  # fx's code generator names the call after it
        return run

    def function(self, batch: int, threads: int | None = None) -> Callable[..., tuple]:
        """What runs ``batch`` samples now on a lane of ``threads`` intra-op threads (default: the calling thread's):
        the variant for any batch or for this one, else the variants built (class docstring), the one wanted queued."""
        t = self.executor.threads_key(threads or torch.get_num_threads())
        fn = self.compiled.get((t, None)) or self.compiled.get((t, batch))
        if fn is not None:
            return fn
        if self.dynamic is not False:
            fn = self.build(t, None)  # warm built it for any thread count that matters; here only if it did not
            if fn is not None:
                return fn
        want = bucket(batch) if self.blocked.stackable else batch
        built = self._static(t)
        if want not in built:
            if not built:
                built = {want: self.build(t, want)}  # nothing to run on: built now, on this thread
            else:
                self.executor.builder.submit(self, (t, want))
        return functools.partial(_run_on, built, batch)

    def _static(self, t: int | None) -> dict[int, Any]:
        """The per-batch variants built for thread key ``t`` (any thread count's if none is), by batch."""
        mine = {b: fn for (k, b), fn in list(self.compiled.items()) if b is not None and k == t}
        return mine or {b: fn for (k, b), fn in list(self.compiled.items()) if b is not None}

    def warm(self, thread_counts: list[int], batches: tuple[int, ...] = ()) -> None:
        """Build what serving needs first: for each thread key of ``thread_counts``, the variant for any batch, or
        the batch-1 variant and those of ``batches`` (padded)."""
        for t in dict.fromkeys(self.executor.threads_key(n) for n in thread_counts):
            if self.dynamic is not False and self.build(t, None) is not None:
                continue
            for n in sorted({1} | {bucket(n) for n in batches}):
                self.build(t, n)

    def build(self, threads: int | None, batch: int | None) -> Any:
        """The variant ``(threads, batch)`` (None for a batch the block does not take as any batch), compiled once:
        the first caller compiles it, callers meanwhile wait for that compile."""
        key = (threads, batch)
        with self._lock:
            if key in self.compiled:
                return self.compiled[key]
            if batch is None and self.dynamic is False:
                return None
            waiting = self._building.get(key)
            if waiting is None:
                event = self._building[key] = threading.Event()
                self._errors.pop(key, None)
        if waiting is not None:
            waiting.wait()
            if key in self._errors:
                raise self._errors[key]
            return self.compiled.get(key)
        try:
            from opweave.backends.segments import COMPILE_LOCK

            with COMPILE_LOCK, torch.no_grad():
                fn = self._compile(threads, batch)
            with self._lock:
                self.builds[key] = self.builds.get(key, 0) + 1
                if fn is not None:
                    self.compiled[key] = fn
            return fn
        except BaseException as exc:
            self._errors[key] = exc
            raise
        finally:
            with self._lock:
                del self._building[key]
            event.set()

    def _compile(self, threads: int | None, batch: int | None) -> Any:
        from opweave.backends.compilers import OnnxRuntime, get
        from opweave.outputs import compare

        count = self.executor.total_threads if threads is None else threads
        if self.compiler == "onnxruntime":
            ort = OnnxRuntime()
            session = {"shared_pool": self.executor.shared_pool, "arena": False}
            if batch is None:
                fn = ort(self.module, list(self.blocked.example(self.block, 2)), count, dynamic_batch=True, **session)
                if self.dynamic is None:  # checked once, at a batch it was not exported at
                    probe = [torch.randn_like(x) if x.is_floating_point() else x
                             for x in self.blocked.example(self.block, 3)]
                    self.dynamic = compare(tuple(self.module(*probe)), tuple(fn(*probe)), tolerance=1e-4).ok
                return fn if self.dynamic else None
            return ort(self.module, list(self.blocked.example(self.block, batch)), count,
                       share_weights=self.blocked.stackable, **session)  # one variant per batch: the weights shared
        compiler = get("inductor", freeze=False) if self.compiler == "inductor" else get(self.compiler)
        return compiler(self.module, list(self.blocked.example(self.block, batch or 1)), count)


def _run_on(built: dict[int, Any], batch: int, *inputs) -> tuple:
    """``batch`` samples through per-batch variants (``built``: batch -> function): the smallest variant that takes
    them all, padded with rows of zeros, else pieces of the largest; the padding's outputs dropped."""
    larger = [b for b in built if b >= batch]
    if larger:
        size = min(larger)
        out = built[size](*(_pad(inputs, size - batch) if size > batch else inputs))
        return tuple(x[:batch] for x in out) if size > batch else tuple(out)
    size, pieces = max(built), []
    for first in range(0, batch, size):
        chunk = tuple(x[first:first + size] for x in inputs)
        rows = chunk[0].shape[0]
        out = built[size](*(_pad(chunk, size - rows) if rows < size else chunk))
        pieces.append(tuple(x[:rows] for x in out))
    return tuple(torch.cat(column) for column in zip(*pieces, strict=True))


def _flat_outputs(gm):
    """``gm`` as a GraphModule returning the flat tuple of its output's leaves, and that output's pytree spec."""
    from torch import fx

    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    leaves, spec = pytree.tree_flatten(out)
    graph.output(tuple(leaves))
    return fx.GraphModule(gm, graph), spec


class CudaExecutor(TensorExecutor):
    """Combined blocks on one GPU, each signature recorded once into a CUDA Graph (TOP §VI-A keeps one graph per
    combined block; Nimble's ahead-of-time recording). A signature compiles to: the parts' block modules joined side
    by side (:func:`opweave.serve.blocks.combined_module`), captured for their batches, roofline costs for the
    visible GPU's preset, the scheduler, lowering, validation and a :class:`opweave.backends.cuda.CudaBackend`
    recording CUDA graphs. ``cache_size`` bounds the recorded graphs (each holds its own memory pool).

    The models must already be on the GPU (see :func:`opweave.serve.models.load`). The options' ``runtime``: the
    CUDA runtime (:mod:`opweave.backends.runtime`; default ``torch.cuda``; the fake one runs it on the CPU, with the
    models and inputs there); their ``cache_size``, where given, bounds the recorded combinations."""

    serves = "cuda"

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *,
                 cache_size: int | None = None, pad: bool = True):
        from opweave.backends.cuda import require_cuda

        options = options if options is not None else resolve("cuda", check_device=False, serving="cuda")
        self.runtime = options.runtime
        require_cuda(self.runtime)
        super().__init__(models, options, cache_size=cache_size, pad=pad)  # streams: the GPU's hardware queues
        self.device = self.runtime.device

    def _compile(self, sig: Signature) -> Any:
        from opweave.costs.roofline import estimate, preset_for_gpu

        captured, example = self.combined(sig)
        preset = preset_for_gpu(self.runtime.device_name()) or "h100"
        options = self.build_options(estimate(captured.graph, preset, model=self.options.cost_model))
        return build(captured, example, options.derive(cache_size=1)).backend  # one input signature each

    def _evict(self, entry: Any) -> None:
        entry.close()  # frees its graph's memory and gives its streams back to the device's pool

    def run(self, parts: list[Part]) -> StepCost:
        ordered, sig, inputs = self._states(parts)
        backend = self.compiled(sig)
        stream = self.runtime.current_stream(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            outs = backend(*[x for state in inputs for x in state])
        stream.synchronize()
        seconds = time.perf_counter() - start
        self._store(ordered, list(outs))
        return StepCost(seconds)


def _name(sig: Signature) -> str:
    return "+".join(f"{m}.b{b}x{n}" for m, b, n in sig)


# ---- simulation ---------------------------------------------------------------------------------------------------
class SimExecutor(Executor):
    """Combined blocks timed by the simulator: each part's block graph at its batch
    (:meth:`~opweave.serve.blocks.BlockedModel.graph_at`), costs from the roofline ``preset`` (or ``profiles``), the
    scheduler, lowering, validation, and :func:`~opweave.backends.simulate.simulate` under ``cost_model``
    (``gpu``: concurrent ops share the device). A step takes the makespan plus ``step_overhead_ms``.

    ``step_overhead_ms`` (default 0.03 ms) stands for what a real step adds around the graph: the engine's decision,
    stacking the inputs and one CUDA Graph launch and synchronization. It is an assumption, not a measurement.

    ``profiles`` maps a model to measured profiles (:class:`opweave.costs.profile.Profile`, by the batch they were
    measured at, for the whole model: op ids are the model's): an op's latency at batch ``n`` is its measured latency
    at the nearest profiled batch ``m`` times the roofline ratio ``estimate(n) / estimate(m)``. Utilization comes from
    the profile where it was measured, else from the roofline.
    """

    device = "sim"
    serves = "sim"  # a GPU's plans, simulated: streams capped at its hardware queues

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *, preset: str = "h100",
                 dtype: str = "float32", cost_model: str | None = None,
                 profiles: dict[str, dict[int, Any]] | None = None, step_overhead_ms: float = 0.03,
                 cache_size: int | None = None, pad: bool = True):
        super().__init__(models, options, cache_size=cache_size, pad=pad)
        from opweave.costs.roofline import preset as find_preset

        find_preset(preset)
        cost_model = self.options.cost_model if cost_model is None else cost_model
        self.preset, self.dtype, self.cost_model = preset, dtype, cost_model
        self.profiles = profiles or {}
        self.step_overhead_ms = step_overhead_ms
        self._part_costs: dict[tuple[str, int, int], Costs] = {}

    def part_costs(self, model: str, block: int, batch: int) -> Costs:
        key = (model, block, batch)
        if key not in self._part_costs:
            from opweave.costs.roofline import estimate

            graph = self.models[model].graph_at(block, batch)
            costs = estimate(graph, self.preset, self.dtype, model=self.cost_model)
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

    def _compile(self, sig: Signature) -> tuple[float, float]:
        from opweave.backends.simulate import makespan_ms

        graph = union_graph([self.models[m].graph_at(b, n) for m, b, n in sig], _name(sig))
        costs = union_costs([self.part_costs(*key) for key in sig], self.cost_model)
        sched, plan = plan_for(graph, costs, self.scheduler, streams=self.streams,
                               **(self.options.scheduler_options or {}))
        makespan = makespan_ms(graph, plan, costs)
        work = sum(costs.latency_ms[o] * costs.util(o) for o in graph.ids)
        return makespan, min(1.0, work / makespan) if makespan else 0.0

    def run(self, parts: list[Part]) -> StepCost:
        makespan_ms, utilization = self.compiled(signature(parts, self.bucket))
        seconds = (makespan_ms + self.step_overhead_ms) / 1e3
        return StepCost(seconds, utilization * makespan_ms / (makespan_ms + self.step_overhead_ms))

    def model_latency_ms(self, model: str, batch: int = 1) -> float:
        """One request of ``batch`` samples alone through every block of ``model`` (no queueing), in ms."""
        return sum(self.run([Part(model, b, batch)]).seconds for b in range(len(self.models[model].blocks))) * 1e3


__all__ = ["Builder", "CompiledBlock", "CpuExecutor", "CudaExecutor", "Executor", "Part", "RealClock", "SimClock",
           "SimExecutor", "StepCost", "UnionGraph", "bucket", "signature", "union_costs", "union_graph"]
