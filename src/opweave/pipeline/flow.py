"""The one way from a captured model to a runnable: :func:`build`.

``opweave.compile``, ``torch.compile(backend="opweave")``, the serving executors and the GPU benchmark all call it,
so what a benchmark measures is what users run::

    captured ─coarsen─▶ captured ─target─▶ costs ─scheduler─▶ schedule ─lower, validate─▶ plan ─target─▶ backend

The device's :mod:`target <opweave.pipeline.targets>` owns its defaults (scheduler, stream cap, thread budgets, the
CUDA backend's options) and builds its backend; a measured choice (the CPU's guard, ``mode="max-autotune"``) is
:mod:`opweave.pipeline.autotune`'s. :class:`Compiled` is what comes out.
"""

from __future__ import annotations

from opweave.capture.runtime import as_tuple
from opweave.pipeline import autotune, targets
from opweave.pipeline.compiled import Compiled
from opweave.pipeline.options import Options


def build(captured, example_inputs, options: Options, *, eager=None) -> Compiled:
    """``captured`` (a :class:`~opweave.capture.Captured`) as a runnable for ``example_inputs``, as ``options``
    (from :func:`~opweave.pipeline.options.resolve`) say. ``eager``, the model itself when known, is one of the
    candidates a measured choice may keep (the CPU's default keeps a plan only where its timing beats it)."""
    inputs = as_tuple(example_inputs)
    if options.coarsen:
        from opweave.capture import coarsen

        captured = coarsen(captured)
    target = targets.for_options(options)
    if options.autotune:
        return autotune.search(target, captured, inputs, options, eager=eager)
    compiled = target.build(captured, inputs, options)
    if options.device == "cpu" and options.default_plan:  # kept only where timed faster than one lane and the model
        compiled = autotune.guarded(compiled, captured, inputs, options, eager)
    return compiled


__all__ = ["Compiled", "as_tuple", "build"]
