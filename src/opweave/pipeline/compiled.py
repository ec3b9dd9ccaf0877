"""What the pipeline makes: :class:`Compiled`, a model compiled by opweave, called like the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opweave.backends.builder import BACKGROUND
from opweave.backends.program import Backend
from opweave.costs import Costs
from opweave.ir import OpGraph
from opweave.pipeline.options import Options
from opweave.plan import LaunchPlan
from opweave.schedulers.schedule import Schedule


@dataclass
class Compiled:
    """A model compiled by opweave: call it like the model. ``schedule`` and ``plan`` say what was decided;
    ``fused`` is the segmented model when a segment compiler ran (its ``stats``: segments, compiles, fallbacks);
    ``choice`` what a measured choice picked and timed (the CPU's guard, ``mode="max-autotune"``, the CUDA
    default's prediction); ``options`` the resolved options it was built with. ``variants``: how it meets inputs of
    another signature (:mod:`opweave.pipeline.signatures`: other sizes run its plan, others are built for; None:
    only its example's signature runs, as the backend checks); ``signatures`` lists those served. ``any_batch``: it
    takes inputs of any size in dimension 0 itself (``dynamic=True``: the whole model one ONNX Runtime session with a
    free batch dimension, checked at another batch), so no other batch size is built."""

    graph: OpGraph
    costs: Costs
    schedule: Schedule
    plan: LaunchPlan
    backend: Backend
    device: str
    captured: Any = None
    fused: Any = None
    choice: dict[str, Any] | None = None
    options: Options | None = None
    variants: Any = field(default=None, repr=False)
    any_batch: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # keyword arguments bound to the model's forward(), as at capture
            from opweave.capture.runtime import positional

            args = positional(self.captured.signature, args, kwargs, self.graph.name)
        if self.variants is not None:
            other = self.variants.for_inputs(args)
            if other is not None:
                return other(*args)
        return self.backend(*args)

    @property
    def signatures(self) -> list[tuple[Any, ...]]:
        """The input signatures served (:func:`opweave.pipeline.signatures.key_of`), the example's first."""
        if self.variants is None:
            return []
        keys: list[tuple[Any, ...]] = self.variants.keys()
        return keys

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until what the model builds and checks off the callers' threads is done (a new size's check or build,
        :mod:`opweave.pipeline.signatures`; a later tier, :mod:`opweave.pipeline.tiers`); False if ``timeout_s``
        passed first. Calls never need it: they run on what is built meanwhile."""
        waits = [getattr(self.backend, "wait", None), BACKGROUND.wait]
        return all(wait(timeout_s) for wait in waits if wait is not None)

    def close(self) -> None:
        """Release what the backend holds (worker threads, rank processes, CUDA graphs and streams); also done when
        it is collected."""
        self.backend.close()

    def __enter__(self) -> Compiled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Compiled"]
