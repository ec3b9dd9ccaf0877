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

import time
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


DEFAULT_SCHEDULER = "lios"  # TOP's: it schedules every combined block with LIOS


class Executor:
    """What every executor shares: the served models, the resolved options every combined block is built with
    (:func:`opweave.serve.assemble.serving_options`, checked before any model loaded; the scheduler, by default
    :data:`DEFAULT_SCHEDULER`, and its stream cap among them) and the LRU cache of compiled signatures (``stats``:
    hits, misses, evictions, compile seconds)."""

    device = "none"
    resolves_as = "cpu"  # the device its options are resolved for

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *, cache_size: int = 32,
                 pad: bool = False):
        if cache_size < 1:
            raise UsageError(f"cache_size must be at least 1, got {cache_size}")
        options = options if options is not None else resolve(self.resolves_as, check_device=False)
        self.models, self.options = models, options
        self.scheduler = options.scheduler if "scheduler" in options.given else self.default_scheduler()
        self.streams, self.cache_size = options.streams, cache_size
        self.pad = pad
        self._cache = BoundedCache(cache_size, self._dropped)
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "compile_s": 0.0}

    def default_scheduler(self) -> str:
        """The scheduler of every combined block unless the options name one."""
        return DEFAULT_SCHEDULER

    def build_options(self, costs: Costs) -> Options:
        """The options a combined block is built with: the executor's, with its scheduler, on ``costs``, its graph
        as it is (blocks are cut between fx nodes)."""
        return self.options.replace(scheduler=self.scheduler, costs=costs, coarsen=False,
                                    given=self.options.given | {"scheduler", "costs", "coarsen"})

    def bucket(self, batch: int) -> int:
        """The batch a part of ``batch`` samples runs at: itself, or with ``pad`` the next power of two (rows of
        zeros added, their outputs dropped), so that few signatures are compiled: CUDA graphs are recorded for fixed
        shapes, and a max batch of 16 then needs 5 sizes per block instead of 16."""
        return 1 << (batch - 1).bit_length() if self.pad else batch

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

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int) -> None:
        """Compile ahead what serving a model about to be added needs (on any thread, while the engine runs: it
        touches nothing the engine's thread reads). Nothing by default: signatures compile on first use."""

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
    * ``"onnxruntime"`` (or ``"inductor"``, ``"eager"``): each part (model, block, batch) is compiled once, whole, by
      that segment compiler (:mod:`opweave.backends.compilers`; one compiled function per intra-op thread count it is
      called with), and a signature compiles to a graph of its parts as single ops, scheduled (by default with ``heft``)
      onto the lanes: parts run side by side, one part alone gets every thread. ONNX Runtime runs these blocks about
      three times faster than eager PyTorch at serving batch sizes on a CPU, and a part compiled whole needs no compile
      per combination (a combination is only its parts' placement: milliseconds). ONNX Runtime takes any batch (each
      block exported once with a free batch dimension, checked at another batch), so batches are not padded (up to a
      third of a padded batch's work was zeros).
    """

    device = "cpu"

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *, cache_size: int = 32,
                 pad: bool | None = None):
        from opweave.backends.compilers import get

        options = options if options is not None else resolve("cpu")
        self.compiler = options.compiler  # each block compiled whole by it (None: TOP's combined op graphs)
        super().__init__(models, options, cache_size=cache_size, pad=bool(pad))
        self.threads = options.threads  # what the lanes of a combined block may use in all
        self.per_op_threads = get(self.compiler).per_op_threads if self.compiler is not None else False
        self._blocks: dict[tuple[str, int], _CompiledBlock] = {}

    def default_scheduler(self) -> str:
        return DEFAULT_SCHEDULER if self.compiler is None else "heft"  # parts side by side: one alone gets every core

    def _compile(self, sig: Signature) -> Any:
        from opweave.costs.roofline import estimate

        captured = self.combined(sig)[0] if self.compiler is None else self._parts_graph(sig)
        options = self.build_options(estimate(captured.graph, "cpu", model=self.options.cost_model))
        return build(captured, (), options.replace(compiler=None, per_op_threads=self.per_op_threads)).backend

    def _parts_graph(self, sig: Signature) -> Captured:
        """``sig`` as a graph whose ops are its parts, each one call of its compiled block (class docstring); an
        op's FLOPs and bytes are its block's."""
        from torch import fx, nn

        from opweave.ir.graph import Op

        graph, calls, ops = fx.Graph(), [], []
        for k, key in enumerate(sig):
            block = self.compiled_block(key[0], key[1])
            inputs = [graph.placeholder(f"p{k}_in{i}") for i in range(len(block.blocked.example(key[1])))]
            calls.append(graph.create_node("call_function", block.at(key[2]), tuple(inputs), name=f"p{k}"))
            part_graph = self.models[key[0]].graph_at(key[1], key[2])
            ops.append(Op(f"p{k}", target=f"{key[0]}.block{key[1]}", flops=sum(o.flops for o in part_graph.ops),
                          bytes=sum(o.bytes for o in part_graph.ops)))
        graph.output(tuple(calls))
        module = fx.GraphModule(nn.Module(), graph, class_name=_name(sig).replace(".", "_").replace("+", "_"))
        by_name = {n.name: n for n in module.graph.nodes}
        return Captured(OpGraph(ops, [], _name(sig)), module, {f"p{k}": [by_name[f"p{k}"]] for k in range(len(sig))})

    def compiled_block(self, model: str, block: int) -> _CompiledBlock:
        key = (model, block)
        return self._blocks.get(key) or self._blocks.setdefault(key, _CompiledBlock(self, model, block))

    def compile_parts(self, max_batch: int) -> int:
        """With ``compiler``: compile every block of every model for every thread count a part may be called with (all
        the cores alone, their share beside others) and, where a block cannot take any batch, every batch up to
        ``max_batch``, so that no request waits for a compile. Returns how many compiled functions there are."""
        from opweave.backends.threads import op_budgets

        counts = op_budgets(self.streams, self.threads, per_op=self.per_op_threads)
        for model, blocked in self.models.items():
            for b in range(len(blocked.blocks)):
                block = self.compiled_block(model, b)
                for threads in counts:
                    block.function(1, threads)
                    if not block.dynamic:
                        batches = {self.bucket(n) for n in range(1, (max_batch if blocked.stackable else 1) + 1)}
                        for batch in sorted(batches):
                            block.function(batch, threads)
        return sum(len(block.compiled) for block in self._blocks.values())

    def _evict(self, entry: Any) -> None:
        entry.close()  # stops its worker threads

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int) -> None:
        """With ``compiler``: every block of ``name`` compiled as :meth:`compile_parts` does, by a scratch executor of
        the same settings, its compiled blocks then handed over (their keys name only this model)."""
        if self.compiler is not None:
            scratch = CpuExecutor({name: blocked}, self.options, pad=self.pad)
            scratch.compile_parts(max_batch)  # each compile under the lock a lane compiling on first use takes
            self._blocks.update(scratch._blocks)

    def drop_model(self, name: str) -> None:
        super().drop_model(name)
        for key in [k for k in self._blocks if k[0] == name]:
            del self._blocks[key]

    def run(self, parts: list[Part]) -> StepCost:
        ordered, sig, inputs = self._states(parts)
        backend = self.compiled(sig)
        start = time.perf_counter()
        with torch.no_grad():
            outs = backend(*[x for state in inputs for x in state])
        seconds = time.perf_counter() - start
        self._store(ordered, list(outs))
        return StepCost(seconds)


class _CompiledBlock:
    """One block of one model compiled whole by the executor's segment compiler, called like the block (its inputs
    in, its output in the block's structure out) at a given batch: :meth:`at` gives the callable a parts graph
    calls. The compiled function is chosen by the calling thread's intra-op thread count (the lane code sets it per
    op), one per count, compiled on first use.

    With ONNX Runtime the block is exported once with a free batch dimension and checked against the block at
    another batch; where that check fails (a graph that baked its batch in) or with another compiler, one function
    is compiled per batch size met."""

    def __init__(self, executor: CpuExecutor, model: str, block: int):
        self.blocked, self.block, self.compiler = executor.models[model], block, executor.compiler
        self.name = f"{model}.b{block}"
        self.module, self.spec = _flat_outputs(self.blocked.modules[block])
        self.dynamic: bool | None = None if self.compiler == "onnxruntime" and self.blocked.stackable else False
        self.compiled: dict[tuple[int, int | None], Any] = {}  # (threads, batch or None when dynamic) -> function

    def at(self, batch: int) -> Callable:
        def run(*inputs):
            return pytree.tree_unflatten(list(self.function(batch)(*inputs)), self.spec)

        run.__name__ = f"{self.name}x{batch}".replace(".", "_")  # fx's code generator names the call after it
        return run

    def function(self, batch: int, threads: int | None = None) -> Any:
        threads = threads or torch.get_num_threads()
        fn = self.compiled.get((threads, None)) or self.compiled.get((threads, batch))
        if fn is None:
            from opweave.backends.segments import COMPILE_LOCK

            with COMPILE_LOCK, torch.no_grad():
                fn = self._compile(batch, threads)
        return fn

    def _compile(self, batch: int, threads: int) -> Any:
        from opweave.backends.compilers import get
        from opweave.outputs import compare

        compiler = get(self.compiler)
        if self.dynamic is not False:
            if (threads, None) in self.compiled:
                return self.compiled[(threads, None)]
            fn = compiler(self.module, list(self.blocked.example(self.block, 2)), threads, dynamic_batch=True)
            if self.dynamic is None:  # checked once, at a batch it was not exported at
                probe = [torch.randn_like(x) if x.is_floating_point() else x
                         for x in self.blocked.example(self.block, 3)]
                self.dynamic = compare(tuple(self.module(*probe)), tuple(fn(*probe)), tolerance=1e-4).ok
            if self.dynamic:
                self.compiled[(threads, None)] = fn
                return fn
        fn = compiler(self.module, list(self.blocked.example(self.block, batch)), threads)
        self.compiled[(threads, batch)] = fn
        return fn


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

    resolves_as = "cuda"

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *, cache_size: int = 64,
                 pad: bool = True):
        from opweave.backends.cuda import require_cuda

        options = options if options is not None else resolve("cuda", check_device=False)
        self.runtime = options.runtime
        require_cuda(self.runtime)
        # the option counts recorded signatures: here, combinations (each one CUDA Graph)
        cache_size = options.cache_size if "cache_size" in options.given else cache_size
        super().__init__(models, options, cache_size=cache_size, pad=pad)  # streams: the GPU's hardware queues
        self.device = self.runtime.device

    def _compile(self, sig: Signature) -> Any:
        from opweave.costs.roofline import estimate, preset_for_gpu

        captured, example = self.combined(sig)
        preset = preset_for_gpu(self.runtime.device_name()) or "h100"
        options = self.build_options(estimate(captured.graph, preset, model=self.options.cost_model))
        return build(captured, example, options.replace(cache_size=1)).backend  # one input signature each

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
    resolves_as = "cuda"  # a GPU's plans, simulated: streams capped at its hardware queues

    def __init__(self, models: dict[str, BlockedModel], options: Options | None = None, *, preset: str = "h100",
                 dtype: str = "float32", cost_model: str = "gpu", profiles: dict[str, dict[int, Any]] | None = None,
                 step_overhead_ms: float = 0.03, cache_size: int = 1 << 16, pad: bool = True):
        super().__init__(models, options, cache_size=cache_size, pad=pad)
        from opweave.costs.roofline import preset as find_preset

        find_preset(preset)
        cost_model = self.options.cost_model if "cost_model" in self.options.given else cost_model
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


__all__ = ["CpuExecutor", "CudaExecutor", "Executor", "Part", "RealClock", "SimClock", "SimExecutor", "StepCost",
           "UnionGraph", "signature", "union_costs", "union_graph"]
