"""The CPU's executor: combined blocks on the CPU backend, each built by the pipeline with the server's options
(:class:`CpuExecutor`), and on a CPU with a segment compiler every block of every model a pipeline
:class:`~opweave.pipeline.Compiled` of its own (:class:`ServedBlock`), its batch sizes its
:class:`~opweave.pipeline.signatures.Signatures`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from opweave.backends.builder import BACKGROUND
from opweave.backends.threads import total_threads
from opweave.pipeline import Compiled, Options, build, resolve
from opweave.pipeline.signatures import Batched, Builder, attach, bucket, rows
from opweave.pipeline.sizes import Sizes
from opweave.pipeline.targets import per_op_threads
from opweave.pipeline.thread_budgets import op_budgets
from opweave.serve.engine.blocks import BlockedModel
from opweave.serve.engine.combined import Part, Signature, captured, parts_captured
from opweave.serve.engine.executors import StepCost, TensorExecutor


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
      blocks faster than eager PyTorch at serving batch sizes on a CPU (docs/serving.md), and a part compiled whole
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
        self.compiler = options.compiler  # each block compiled whole by it (None: TOP's combined op graphs)
        super().__init__(models, options, pad=pad)
        self.threads = options.threads  # what the lanes of a combined block may use in all
        self.total_threads = total_threads(self.threads)
        self.per_op_threads = per_op_threads(options)
        self._blocks: dict[tuple[str, int], ServedBlock] = {}
        self._warmed: dict[tuple[str, int], ServedBlock] = {}  # a reload's blocks, built while the old ones serve
        self.builder = Builder()
        self.varying_sizes = self.compiler is not None  # each block's session takes other sizes (build_block)

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
        free = stack or blocked.sizes_vary
        options = self.block_options(threads, True if free else None if blocked.stackable else False)
        example = blocked.example(index, batch)
        compiled = build(blocked.captured_block(index, batch), example, options)
        built_with = compiled.options or options  # without dynamic where the block took no other batch

        def compile_for(args: tuple):  # another batch size (padded to its bucket): built as the example was
            size = rows(args)
            return build(blocked.captured_block(index, size), blocked.example(index, size), built_with)

        # Other sizes than the batch (a sequence length): run by what is built where its backend takes them, checked
        # against the block itself once (warm_model checks it at other sizes before the model serves; a size met
        # before that check is answered by the block, the check beside it), else by the block itself; never built
        # per size.
        sizes = Sizes(compiled, blocked.modules[index], example) if blocked.sizes_vary else None
        attach(compiled, served.name, example, compile_for, bound=options.cache_size, sizes=sizes)
        return Batched(compiled, bucket=bucket if blocked.stackable else int, builder=self.builder, name=served.name)

    def block_options(self, threads: int, dynamic: bool | None) -> Options:
        """What one block is built with: as ``opweave.compile`` builds a model with the executor's compiler, one lane
        of ``threads`` threads, the block's graph as it is and the executor's bound on sizes, ``dynamic`` as the block
        stacks, in a process many models share (``shared``: one ONNX Runtime pool, a model's weights read in place);
        its later tiers off (a server's blocks keep their first)."""
        return resolve("cpu", scheduler="sequential", streams=1, threads=threads, compiler=self.compiler,
                       coarsen=False, dynamic=dynamic, cache_size=self.options.cache_size,
                       tiers=False).derive(shared=True)

    def thread_counts(self) -> list[int]:
        """Every intra-op thread count a part may be called with (all the cores alone, their share beside others)."""
        return op_budgets(self.streams or 1, self.threads, per_op=self.per_op_threads)

    def warm_model(self, name: str, blocked: BlockedModel, max_batch: int, batches: tuple[int, ...] = ()) -> None:
        """With ``compiler``: build, before ``name`` serves, what its first requests need (on the calling thread,
        off the engine's: the blocks go into the executor once built, and their keys name only this model): each
        block for every thread key a lane may call it with, and there, unless it takes any batch, the sizes of
        ``batches`` (a config's warm-up batch sizes, Triton's ``model_warmup``). Every other batch is built when
        first asked for, in the background. A new version of a served model (a reload) gets blocks of its own, which
        it takes when it is served: the old version's requests still run on the old blocks meanwhile. A model whose
        sizes vary (a sequence length) has each block's session checked at other sizes too (its ``other_sizes``), so
        that a request of a new size runs on the sessions at once."""
        if self.compiler is None:
            return
        sizes = sorted({bucket(n) for n in batches if 1 <= n <= max_batch} | {1}) if blocked.stackable else [1]
        other = blocked.examples_at(blocked.other_sizes) if blocked.sizes_vary else []
        made = {}
        for index in range(len(blocked.blocks)):
            served = self._blocks.get((name, index))
            if served is None or served.blocked is not blocked:
                served = ServedBlock(name, index, blocked)
            for threads in dict.fromkeys(self.threads_key(n) or self.total_threads for n in self.thread_counts()):
                built = self._built(served, threads)
                built.warm([blocked.example(index, n) for n in sizes])
                if other:  # checked at other sizes now, so that no request's size waits for or runs beside a check
                    built(*other[index])
            made[(name, index)] = served
        if other:
            BACKGROUND.wait()
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


__all__ = ["CpuExecutor", "ServedBlock"]
