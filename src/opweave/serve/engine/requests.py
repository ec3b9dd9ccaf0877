"""A request's life in the engine (:mod:`opweave.serve.engine.engine`): the :class:`Request` a front end submits,
the inference :class:`Instance` it joins once dequeued (requests stacked along the batch dimension, advancing block by
block), the refusals of a submission (:class:`QueueFull`, :class:`Unavailable`), and the hooks an :class:`Observer`
(metrics, statistics, reports) gets at each event."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opweave.errors import OpweaveError
from opweave.serve.engine.combined import Part
from opweave.serve.engine.executors import StepCost


class QueueFull(OpweaveError, RuntimeError):
    """The model's queue is full; ``retry_after_s`` estimates when it will have room."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(OpweaveError, RuntimeError):
    """The engine is draining or stopped and takes no new request."""


@dataclass(eq=False)
class Request:
    """One inference request: ``batch`` samples for ``model``. The engine fills in the times (clock seconds), the
    status (``queued``, ``running``, ``done``, ``timeout``, ``error``) and the output, then calls ``on_done``.
    ``input_s``: the dequeue's preparing of the inputs of the instance it joined; ``output_s``: the splitting of its
    instance's outputs into answers (both shared with the requests stacked with it); ``compute_s``: the combined
    blocks it was part of."""

    id: int
    model: str
    inputs: Any
    batch: int
    arrival: float
    deadline: float | None = None
    on_done: Callable[[Request], None] | None = None
    dequeued: float | None = None
    finished: float | None = None
    compute_s: float = 0.0
    input_s: float = 0.0
    output_s: float = 0.0
    status: str = "queued"
    output: Any = None
    error: str | None = None

    @functools.cached_property
    def work(self) -> int:
        """What it asks of its model, beside the model's other requests: the elements of its inputs (samples times
        their sizes: a longer sequence is more work), its samples where its inputs hold no tensor. Read once: the
        policies read it at every engine step."""
        flat = self.inputs if isinstance(self.inputs, (list, tuple)) else ()
        elements = sum(int(x.numel()) for x in flat if callable(getattr(x, "numel", None)))
        return elements or self.batch

    @property
    def latency_s(self) -> float:
        return (self.finished or self.arrival) - self.arrival

    @property
    def queue_s(self) -> float:
        return (self.dequeued if self.dequeued is not None else self.finished or self.arrival) - self.arrival

    @property
    def infer_s(self) -> float:
        """From its inputs' preparing to the end of its last block: its blocks, and the waits between them."""
        if self.dequeued is None or self.finished is None:
            return 0.0
        return max(0.0, self.finished - self.dequeued - self.input_s - self.output_s)


@dataclass(eq=False)
class Instance:
    """An inference instance: requests stacked along the batch dimension, the next block to run, its state."""

    model: str
    requests: list[Request]
    block: int = 0
    state: Any = None

    @property
    def batch(self) -> int:
        return sum(r.batch for r in self.requests)

    @property
    def work(self) -> int:
        return sum(r.work for r in self.requests)

    @property
    def oldest(self) -> float:
        return min(r.arrival for r in self.requests)


class Observer:
    """Hooks the engine calls (metrics, reports); every method is optional to override."""

    def on_submit(self, request: Request) -> None: ...
    def on_reject(self, model: str) -> None: ...
    def on_dequeue(self, request: Request) -> None: ...
    def on_step(self, parts: list[Part], cost: StepCost) -> None: ...
    def on_decision(self, seconds: float) -> None: ...
    def on_done(self, request: Request) -> None: ...
    def on_add(self, model: str) -> None: ...
    def on_remove(self, model: str) -> None: ...


__all__ = ["Instance", "Observer", "QueueFull", "Request", "Unavailable"]
