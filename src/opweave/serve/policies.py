"""Serving policies: what the task launcher dequeues and which blocks run together (TOP §IV, §V-B), pluggable.

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
queue lengths. A learned policy (TOP's MADDPG agents) implements the same two methods; :func:`register` adds it to
the registry that ``opweave serve --policy`` and ``opweave loadgen --simulate --policy`` read.

Built in:

* ``static`` — a plain server: one single-request instance per model at a time, one block per step, oldest first.
* ``batch`` — Triton's dynamic batcher per model (max batch size, max queue delay), one instance per model at a
  time; the models' current blocks run side by side as Triton runs different models concurrently.
* ``heuristic`` — ours: the H slots of a combined block shared among the models in proportion to their arrival rate
  and backlog (times their block counts), each model keeping that many instances in flight, and greedy combination
  of the oldest ready slots up to H.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from opweave.errors import UsageError

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
    :meth:`launch` and :meth:`combine`; :meth:`bind` is called once with the served models before any step."""

    name = "base"

    def bind(self, blocks: dict[str, int], max_batch: dict[str, int], max_sub_blocks: int) -> None:
        self.model_blocks, self.model_max_batch, self.max_sub_blocks = blocks, max_batch, max_sub_blocks

    def launch(self, obs: Observation) -> dict[str, Launch]:
        return {m: Launch() for m in obs.models}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        return [(s.key,) for s in _oldest_first(obs.ready)]

    def wake(self) -> float:
        """When the policy wants a step (and so a :meth:`launch` call) while requests are queued, even if nothing
        else is due then (clock seconds; inf: never). A policy that decides on a period says when its next
        decision is."""
        return math.inf

    def describe(self) -> dict:
        """The policy's name and options, for reports."""
        return {"policy": self.name}


def _oldest_first(ready: tuple[SlotObs, ...]) -> list[SlotObs]:
    return sorted(ready, key=lambda s: (-s.age_s, s.model, s.block))


# ---- registry -------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str) -> Callable:
    """Class decorator: make a policy available as ``create(name, **options)``."""
    def add(factory: Callable[..., Policy]) -> Callable[..., Policy]:
        _REGISTRY[name] = factory
        return factory

    return add


def names() -> list[str]:
    return list(_REGISTRY)


def create(name: str, **options) -> Policy:
    if name not in _REGISTRY:
        raise UsageError(f"unknown policy {name!r}; choose one of {', '.join(names())}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as exc:
        raise UsageError(f"policy {name!r}: {exc}") from None


def parse_options(text: str | None) -> dict:
    """``"max_batch=8,max_queue_delay_ms=1"`` as a dict of ints, floats or strings."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"policy option {item!r} must be KEY=VALUE")
        for cast in (int, float):
            try:
                out[key.strip()] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value.strip()
    return out


# ---- built-in policies ----------------------------------------------------------------------------------------------
@register("static")
class Static(Policy):
    """A plain server, the baseline: one single-request instance per model at a time, no stacking and no
    combination (one block per step; the oldest request's block first)."""

    name = "static"

    def launch(self, obs: Observation) -> dict[str, Launch]:
        return {m: Launch(batch=1, max_instances=1) for m in obs.models}


@register("batch")
@dataclass
class Batch(Policy):
    """Triton-style dynamic batching: per model one instance at a time holding up to ``max_batch`` samples (default:
    the engine's), dequeued once that many are queued or the oldest has waited ``max_queue_delay_ms`` (Triton's
    default delay is 0: take whatever is queued). Different models run side by side, one slot each, as Triton runs
    different models concurrently; a model's blocks run in order, no pipelining within a model."""

    max_batch: int | None = None
    max_queue_delay_ms: float = 0.0
    name: str = field(default="batch", init=False)

    def launch(self, obs: Observation) -> dict[str, Launch]:
        return {m: Launch(batch=min(self.max_batch or o.max_batch, o.max_batch), max_instances=1,
                          max_delay_s=self.max_queue_delay_ms / 1e3) for m, o in obs.models.items()}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        slots = [s.key for s in _oldest_first(obs.ready)]
        h = obs.max_sub_blocks
        return [tuple(slots[i:i + h]) for i in range(0, len(slots), h)]

    def describe(self) -> dict:
        return {"policy": self.name, "max_batch": self.max_batch, "max_queue_delay_ms": self.max_queue_delay_ms}


@register("heuristic")
@dataclass
class Heuristic(Policy):
    """Our policy: instances apportioned by load, greedy combination.

    **Launcher.** Each model's load is the block work it asks for: w_m = (λ_m + q_m / ``drain_s``) · B_m, its
    arrival rate plus its backlog drained over ``drain_s``, times its number of blocks. Every model with work may
    keep one instance in flight; the other H minus (models with work) slots of a combined block go, in proportion
    to the loads (largest remainders), to the models that can use them: all of them while the device is lightly
    used (utilization over the last second below ``busy_above``), else only those with more than a full batch
    queued. Model m dequeues whenever it has fewer than its k_m instances (interval 0), stacking everything queued
    up to its max batch into the new instance.

    Why: running a block beside others is nearly free while the device has room (pipelining: a light load starts
    up to H requests of one model at different blocks instead of queueing them behind the one in flight), but once
    the device is busy concurrent parts only slow each other down and full batches are what raises throughput;
    then a second instance of a model only helps when one full batch cannot take its queue. An earlier version
    that always spread the H slots over the models (pipelining at any load) split the batches at high load and
    lost to ``batch``: p50 3.0 ms against 1.7 ms for SqueezeNet at 32 x 240 FPS in simulation (H100 preset).
    The rule keeps every instance in flight running at every step: about H instances, H slots.

    **Combination.** The ready slots, oldest request first, greedily up to H (ties: the slot further along, which
    frees its instance sooner). One group, so its effective input ratio is 1.
    """

    drain_s: float = 0.05
    busy_above: float = 0.5
    name: str = field(default="heuristic", init=False)

    def shares(self, obs: Observation) -> dict[str, int]:
        """k_m: instances each model may keep in flight (see the class docstring)."""
        load = {m: (o.arrival_rate + o.queue / self.drain_s) * o.blocks for m, o in obs.models.items()}
        active = [m for m, o in obs.models.items() if load[m] > 0 or o.instances]
        if not active:
            return {m: 1 for m in obs.models}
        eligible = [m for m in active if obs.utilization < self.busy_above
                    or obs.models[m].queued_samples >= obs.models[m].max_batch]
        total = sum(load[m] for m in eligible) or 1.0
        spare = max(0, obs.max_sub_blocks - len(active))
        quota = {m: spare * load[m] / total for m in eligible}
        k = {m: 1 + int(quota.get(m, 0)) for m in active}
        left = spare - sum(k[m] - 1 for m in active) if eligible else 0
        for m in sorted(eligible, key=lambda m: (-(quota[m] - int(quota[m])), m))[:left]:
            k[m] += 1
        return {m: k.get(m, 1) for m in obs.models}

    def launch(self, obs: Observation) -> dict[str, Launch]:
        return {m: Launch(batch=obs.models[m].max_batch, max_instances=k) for m, k in self.shares(obs).items()}

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        ranked = sorted(obs.ready, key=lambda s: (-s.age_s, -s.block, s.model))
        return [tuple(s.key for s in ranked[:obs.max_sub_blocks])]

    def describe(self) -> dict:
        return {"policy": self.name, "drain_s": self.drain_s, "busy_above": self.busy_above}


__all__ = ["Batch", "Heuristic", "InstanceObs", "Launch", "ModelObs", "Observation", "Policy", "Slot", "SlotObs",
           "Static", "create", "names", "parse_options", "register"]
