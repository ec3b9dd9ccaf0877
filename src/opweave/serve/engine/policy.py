"""What a serving policy sees and decides (TOP §IV, §V-B): the interface between the engine
(:mod:`opweave.serve.engine.engine`) and a policy (:mod:`opweave.serve.engine.policies`: the built-in ones and TOP's).

A policy sees an :class:`Observation` at every engine step and answers two questions, the two halves of TOP's
action (§V-B "A"):

* :meth:`Policy.launch` — per model a :class:`Launch`: the dequeue interval (TOP's launcher action a⁰, seconds
  between dequeues), how many requests one dequeue stacks into a new inference instance, a cap on the model's
  instances in flight, and how long a dequeue may wait for a full batch (Triton's max queue delay);
* :meth:`Policy.combine` — candidate combined blocks: groups of ``(model, block)`` slots, at most ``H`` each (TOP's
  model-scheduler actions a¹…a^W partition the blocks into combined blocks; §V-D's threshold H). The engine runs the
  group with the highest *effective input ratio* (slots with a ready instance / slots; §VI-A), only its ready slots,
  and never a group whose ratio is 0. Instances of one model at the same block are stacked into one slot.

The observation carries what TOP's state and reward are made of (§V-B "S", "R"): per model its queue length,
arrival rate, progress (instances per block), mean latency, and the device's utilization and the variance of the
queue lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Slot = tuple[str, int]  # (model, block)


@dataclass(frozen=True)
class Launch:
    """The launcher's decision for one model (TOP's a⁰ entry, plus the batching knobs of a dynamic batcher).

    ``interval_s``: at most one dequeue per interval (0: as often as the other limits allow). ``batch``: requests
    (counted in samples) stacked into the new instance. ``max_instances``: instances of the model in flight at most
    (None: no cap). ``max_delay_s``: hold a dequeue until ``batch`` samples are queued or the oldest has waited this
    long (the engine holds none while it drains or unloads the model: no request can come to fill the batch).
    """

    interval_s: float = 0.0
    batch: int = 1
    max_instances: int | None = None
    max_delay_s: float = 0.0


@dataclass(frozen=True)
class InstanceObs:
    block: int  # the next block it runs
    batch: int
    age_s: float  # time since its oldest request arrived
    work: int = 0  # its requests' work (Request.work: their inputs' elements); 0: unknown, its batch stands for it


@dataclass(frozen=True)
class ModelObs:
    name: str
    blocks: int
    queue: int  # requests waiting
    queued_samples: int
    oldest_wait_s: float
    arrival_rate: float  # requests per second over the last window
    latency_s: float  # moving mean of end-to-end latency (0 before the first answer)
    instances: tuple[InstanceObs, ...]
    max_batch: int
    head_batch: int = 0  # samples of the request first in its queue (0: none queued)
    head_work: int = 0  # that request's work (Request.work; 0: none queued)

    @property
    def progress(self) -> tuple[int, ...]:
        """Instances at each block (TOP's inference progress P_t^w as counts)."""
        counts = [0] * self.blocks
        for inst in self.instances:
            counts[inst.block] += 1
        return tuple(counts)


@dataclass(frozen=True)
class SlotObs:
    """A ready slot: instances of ``model`` waiting to run ``block`` (stacked when the slot runs)."""

    model: str
    block: int
    batch: int
    instances: int
    age_s: float  # of its oldest request

    @property
    def key(self) -> Slot:
        return (self.model, self.block)


@dataclass(frozen=True)
class Observation:
    now: float
    models: dict[str, ModelObs]
    ready: tuple[SlotObs, ...]
    max_sub_blocks: int  # H
    utilization: float  # device share kept busy over the last window (simulation: from the cost model)
    busy: float  # share of the last window spent running combined blocks
    step_s: float  # moving mean of a combined block's duration
    queue_variance: float  # population variance of the queue lengths across models (TOP's sigma_t)


class Policy:
    """Base policy: dequeue one request at a time, run the oldest ready slot alone. Subclasses override
    :meth:`launch` and :meth:`combine`; :meth:`bind` is called once with the served models before any step.

    ``stacks``: whether the engine stacks a model's ready instances at the same block into one when their slot runs
    (TOP §VI-A). A policy that keeps them apart (False) has the slot run one of them: the one with the least work,
    the oldest among equals (the one that frees its slot soonest)."""

    name = "base"
    stacks = True

    def bind(self, blocks: dict[str, int], max_batch: dict[str, int], max_sub_blocks: int) -> None:
        self.model_blocks, self.model_max_batch, self.max_sub_blocks = blocks, max_batch, max_sub_blocks

    def launch(self, obs: Observation) -> dict[str, Launch]:
        return {m: Launch() for m in obs.models}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        return [(s.key,) for s in oldest_first(obs.ready)]

    def wake(self) -> float:
        """When the policy wants a step (and so a :meth:`launch` call) while requests are queued, even if nothing
        else is due then (clock seconds; inf: never). A policy that decides on a period says when its next
        decision is."""
        return math.inf

    def describe(self) -> dict:
        """The policy's name and options, for reports."""
        return {"policy": self.name}


def oldest_first(ready: tuple[SlotObs, ...]) -> list[SlotObs]:
    return sorted(ready, key=lambda s: (-s.age_s, s.model, s.block))


__all__ = ["InstanceObs", "Launch", "ModelObs", "Observation", "Policy", "Slot", "SlotObs", "oldest_first"]
