"""The GPU's executor: combined blocks recorded into CUDA Graphs (:class:`CudaExecutor`)."""

from __future__ import annotations

import time

import torch

from opweave.backends.cuda import require_cuda
from opweave.pipeline import Compiled, Options, build
from opweave.serve.engine.blocks import BlockedModel
from opweave.serve.engine.combined import Part, Signature, captured
from opweave.serve.engine.executors import StepCost, TensorExecutor


class CudaExecutor(TensorExecutor):
    """Combined blocks on one GPU, each signature recorded once into a CUDA Graph (TOP §VI-A keeps one graph per
    combined block; Nimble's ahead-of-time recording). A signature compiles, through the pipeline with the CUDA
    target, to: the parts' block modules joined side by side (:func:`opweave.serve.engine.blocks.combined_module`),
    captured for their batches, the fitted GPU's op times (:mod:`opweave.costs.calibrated`, as the CUDA default
    plans), the scheduler, lowering, validation, the memory pass and a :class:`opweave.backends.cuda.CudaBackend`
    recording CUDA graphs. ``cache_size`` (the serving preset's 64 unless told) bounds the recorded combinations
    (each holds its own memory pool).

    The models must already be on the GPU (see :func:`opweave.serve.models.load`). The options' ``runtime``: the
    CUDA runtime (:mod:`opweave.backends.runtime`; default ``torch.cuda``; the fake one runs it on the CPU, with the
    models and inputs there)."""

    serves = "cuda"
    varying_sizes = False  # one CUDA Graph per combination signature: a size of its own per recording

    def __init__(self, models: dict[str, BlockedModel], options: Options, *, pad: bool = True):
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


__all__ = ["CudaExecutor"]
