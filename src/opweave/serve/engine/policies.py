"""The serving policies a server runs, by name (``opweave serve --policy``, ``opweave loadgen --simulate
--policy``): :data:`POLICIES`, one table, and :func:`create`. Each implements
:class:`~opweave.serve.engine.policy.Policy` (what it sees and decides, TOP §IV, §V-B).

* ``static`` — a plain server: one request at a time per model, one block per step, oldest first; a request smaller
  than what is left of those in flight starts beside them and runs first (shortest remaining work first).
* ``batch`` — Triton's dynamic batcher per model (max batch size, max queue delay), one instance per model at a
  time; the models' current blocks run side by side as Triton runs different models concurrently.
* ``heuristic`` — ours: the H slots of a combined block shared among the models in proportion to their arrival rate
  and backlog (times their block counts), each model keeping that many instances in flight, and greedy combination
  of the oldest ready slots up to H.
* ``top`` — TOP's learned MADDPG agents (:class:`~opweave.serve.engine.top.TopPolicy`).

A policy of one's own implements the same two methods and runs on an engine as these do
(``Engine(executor, Mine(), clock)``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from opweave.errors import UsageError, did_you_mean
from opweave.serve.engine.policy import Launch, Observation, Policy, Slot, oldest_first
from opweave.serve.engine.top import TopPolicy

ONE = Launch(batch=1, max_instances=1)  # one request per instance, one instance in flight


class Static(Policy):
    """A plain server, the baseline: one request per instance, one block per step, no stacking and no combination;
    per model one request at a time, oldest first, except that a smaller request does not wait behind a larger one.

    **Launcher.** A model dequeues its next request while no instance of it is in flight, or when that request's work
    is less than what is left of every instance in flight: its work
    (:attr:`~opweave.serve.engine.requests.Request.work`: its inputs' elements, so samples times their sizes, a longer
    sequence more) times the blocks it has left (a request's blocks are its model's; instances in flight: their work
    times the blocks they have to go).
    Requests of one size thus run one at a time in arrival order, as before; a batch-1 request that arrives while a
    batch-13 one is in flight starts at once.

    **Which block runs.** The model whose oldest ready request is oldest (across models, oldest first as before), and
    within it the instance with the least work left (work times blocks to go; the oldest among equals): shortest
    remaining work first, block by block. Why: one step runs one block, so without it each of the small request's
    blocks waited for the large one to finish, and its latency was the large one's; with it the small one waits for
    at most the block that was running when it came. A request's own blocks are never stacked with another's (a
    stacked instance would move at the pace of the larger one).

    **No starvation.** The model's oldest instance is passed over at most ``patience`` steps of its model in a row
    (default: the model's block count, so one smaller request runs from its first block to its last); then it runs
    one block (if a smaller instance waits at the same block, that one runs first, then the oldest). So a large
    request advances at least one block every ``patience`` + 2 of its model's steps, however many small ones come.
    """

    name = "static"
    stacks = False

    def __init__(self, patience: int | None = None):
        if patience is not None and patience < 0:
            raise UsageError(f"patience must be at least 0, got {patience}")
        self.patience = patience
        self.passed: dict[str, tuple[float, int, int]] = {}  # model -> its oldest instance (arrival, block), passes

    def launch(self, obs: Observation) -> dict[str, Launch]:
        out = {}
        for m, o in obs.models.items():
            out[m] = ONE
            if o.instances and o.head_batch and (o.head_work or o.head_batch) * o.blocks < min(
                    (i.work or i.batch) * (o.blocks - i.block) for i in o.instances):
                out[m] = Launch(batch=1, max_instances=len(o.instances) + 1)
        return out

    def combine(self, obs: Observation) -> list[tuple[Slot, ...]]:
        order = [s.key for s in oldest_first(obs.ready)]
        if not order:
            return []
        m = order[0][0]
        o = obs.models[m]
        if len(o.instances) == 1:  # it runs: nothing is passed over
            self.passed.pop(m, None)
            return [(s,) for s in order]
        oldest = max(o.instances, key=lambda i: i.age_s)
        shortest = min(o.instances, key=lambda i: ((i.work or i.batch) * (o.blocks - i.block), -i.age_s))
        arrival, block, passed = self.passed.get(m, (math.nan, -1, 0))
        if block != oldest.block or not abs(arrival - (obs.now - oldest.age_s)) < 1e-6:
            passed = 0  # the oldest moved on, or another instance is now the oldest
        chosen = oldest if passed >= (o.blocks if self.patience is None else self.patience) else shortest
        self.passed[m] = (obs.now - oldest.age_s, oldest.block, passed + (chosen is not oldest))
        first = (m, chosen.block)
        return [(s,) for s in [first, *(s for s in order if s != first)]]

    def describe(self) -> dict:
        return {"policy": self.name, "patience": self.patience}


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
        slots = [s.key for s in oldest_first(obs.ready)]
        h = obs.max_sub_blocks
        return [tuple(slots[i:i + h]) for i in range(0, len(slots), h)]

    def describe(self) -> dict:
        return {"policy": self.name, "max_batch": self.max_batch, "max_queue_delay_ms": self.max_queue_delay_ms}


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
    lost to ``batch`` on latency (docs/serving.md, Policies).
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


POLICIES: dict[str, Callable[..., Policy]] = {"static": Static, "batch": Batch, "heuristic": Heuristic,
                                              "top": TopPolicy}


def names() -> list[str]:
    """The policies' names (:data:`POLICIES`), in its order."""
    return list(POLICIES)


def create(name: str, **options) -> Policy:
    """Policy ``name`` (:data:`POLICIES`) made with ``options``; :class:`~opweave.errors.UsageError` for a name it
    does not hold, or options its policy does not take (:func:`check`)."""
    check(name, options)
    try:
        return POLICIES[name](**options)
    except TypeError as exc:
        raise UsageError(f"policy {name!r}: {exc}") from None


def check(name: str, options: dict | None = None) -> None:
    """A :class:`~opweave.errors.UsageError` for a policy name :data:`POLICIES` does not hold, or an option its
    policy does not take, with the name it was likely meant to be: what a server checks before any model loads."""
    if name not in POLICIES:
        raise UsageError(f"unknown policy {name!r}{did_you_mean(name, names())}; choose one of {', '.join(names())}")
    params = inspect.signature(POLICIES[name]).parameters.values()
    taken = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(options or ()) - taken)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise UsageError(f"policy {name!r} takes no option {unknown[0]!r}{did_you_mean(unknown[0], taken)}; it takes "
                         f"{', '.join(sorted(taken)) or 'none'}")


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


__all__ = ["POLICIES", "Batch", "Heuristic", "Static", "check", "create", "names", "parse_options"]
