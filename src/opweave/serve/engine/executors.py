"""What the serving engine runs its combined blocks on (:mod:`opweave.serve.engine.engine` decides *what* runs): an
executor runs a combined block and says how long it took (:class:`StepCost`), and a clock says what time it is. Two
pairs, one engine and one policy code path for both (TOP §V-A: policies are trained offline against a model of the
device and then run online):

* **real** — :class:`RealClock` (``time.monotonic``) with :class:`~opweave.serve.engine.cpu.CpuExecutor` (the
  threaded CPU backend, one worker per stream) or :class:`~opweave.serve.engine.cuda.CudaExecutor` (one CUDA Graph
  recorded per combination signature);
* **simulated** — :class:`~opweave.serve.engine.simulation.SimClock` (virtual time that only moves when told) with
  :class:`~opweave.serve.engine.simulation.SimExecutor`: a combined block takes the makespan the simulator replays
  for its plan under the cost model (roofline estimates for a device preset, or a measured profile), plus a fixed
  per-step overhead.

A **combined block** (:mod:`opweave.serve.engine.combined`: its parts, signature and graph) is built once per
signature — its graph, costs, scheduler (``lios`` by default, any other as an option), lowering, validation,
backend — by the pipeline (:func:`opweave.pipeline.build` with the target of its device; the simulator's
:class:`~opweave.pipeline.targets.SimTarget`) with the executor's one resolved :class:`~opweave.pipeline.Options`
(the serving preset), and kept in a bounded LRU cache (:class:`opweave.backends.cache.BoundedCache`): every
executor's :meth:`Executor.combined_block` is a pipeline :class:`~opweave.pipeline.Compiled`. On a CPU with a segment
compiler each block is a pipeline :class:`~opweave.pipeline.Compiled` too, its batch sizes its
:class:`~opweave.pipeline.signatures.Signatures`: the server has no builder of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache
from opweave.errors import UsageError
from opweave.pipeline import Compiled, Options
from opweave.pipeline.signatures import bucket, padded
from opweave.serve.engine.blocks import BlockedModel
from opweave.serve.engine.combined import Part, Signature, signature


class RealClock:
    """Wall time (``time.monotonic``, seconds). ``spend`` does nothing: a real run has already taken its time."""

    simulated = False

    def now(self) -> float:
        return time.monotonic()

    def spend(self, seconds: float) -> None:
        pass


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
    varying_sizes = True  # serves a model whose sizes vary between requests (BlockedModel.sizes_vary)

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

    def check_sizes(self, name: str, blocked: BlockedModel) -> None:
        """A :class:`~opweave.errors.UsageError` where sizes of ``blocked`` vary between requests (a sequence length)
        and this executor would build each size anew (:attr:`varying_sizes`)."""
        if blocked.sizes_vary and not self.varying_sizes:
            raise UsageError(f"model {name!r} takes sizes that vary between requests (a sequence length), which "
                             f"opweave serves on the CPU with a segment compiler (onnxruntime, inductor), not on this "
                             f"server ({self.device}, compiler {self.options.compiler}), where each size would be "
                             "built anew: export it with fixed sizes")

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

    def sizes(self, state: Any) -> Any:
        """What must be equal for two requests' inputs or instances' states to stack (:meth:`merge`): None where
        anything stacks."""
        return None

    def run(self, parts: list[Part]) -> StepCost:
        """Run one combined block; each part's ``state`` becomes the block's outputs."""
        raise NotImplementedError

    def outputs(self, model: str, state: Any, batches: list[int]) -> list[Any]:
        """Per request (of these batch sizes, in stacking order), its output in the model's output structure."""
        return [None] * len(batches)


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

    def sizes(self, state: Any) -> Any:
        """Every tensor's sizes but the batch (a sequence length differs between requests of a model whose sizes
        vary: those stack only with their own)."""
        return tuple(tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else None for x in state or ())

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


__all__ = ["Executor", "RealClock", "StepCost", "TensorExecutor"]
