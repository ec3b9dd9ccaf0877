"""The serving engine (TOP §IV, §VI-A): per-model bounded queues, a task launcher, inference instances that advance
block by block, and combined blocks chosen by a policy and run by an executor against a clock. No HTTP here.

One **step** (:meth:`Engine.step`):

1. queued requests past their deadline are answered ``timeout``;
2. the **task launcher** asks the policy for each model's :class:`~opweave.serve.engine.policy.Launch` and dequeues:
   a dequeue takes requests first come first served, up to ``batch`` samples of equal sizes (a model whose
   sequence length varies stacks only requests of one length: :meth:`~opweave.serve.engine.executors.Executor.sizes`),
   into one new **inference instance**
   (TOP §IV: "an instance can be a batch of inferences"), at most once per ``interval_s`` and while the model has
   fewer than ``max_instances`` instances in flight;
3. the policy proposes **combined blocks** (groups of ``(model, block)`` slots, at most H each); the engine runs the
   one with the highest effective input ratio (ready slots / slots; ties: the policy's order), and only its ready
   slots: no block waits for an input that has not arrived, and a group with ratio 0 never runs (TOP §VI-A). If no
   proposed group has a ready slot while instances are ready, the oldest ready slot runs alone (a policy may not
   stall the engine; counted in ``stats["fallbacks"]``);
4. in each chosen slot the ready instances of that model at that block are **stacked** along the batch dimension
   (oldest first, up to the model's max batch, those of the oldest's sizes) and stay one instance from then on
   (they are at the same place); under a policy that does not stack (``Policy.stacks`` false) the slot runs one of
   them alone, the one with the least work (the oldest among equals);
5. the executor runs the combined block; each instance keeps its block's output as its state (its intermediate
   between blocks, TOP §VI-A) and moves to its next block; an instance past its last block answers its requests.

Instances are one per slot when they run, so every part of a combined block is a different ``(model, block)``.

Real serving runs :meth:`Engine.run_forever` on a thread (requests come from :meth:`submit` on other threads; the
lock is released while a combined block runs); simulation runs
:func:`~opweave.serve.engine.simulation.simulate_arrivals` on a :class:`~opweave.serve.engine.simulation.SimClock`.
Both call the same :meth:`step` with the same policy. What a request is on its way through (:class:`Request`,
:class:`Instance`) and what observes it (:class:`Observer`) are :mod:`opweave.serve.engine.requests`'.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opweave.errors import OpweaveError, UsageError, did_you_mean
from opweave.serve.engine.combined import Part
from opweave.serve.engine.executors import Executor
from opweave.serve.engine.policy import InstanceObs, Launch, ModelObs, Observation, Policy, Slot, SlotObs
from opweave.serve.engine.requests import Instance, Observer, QueueFull, Request, Unavailable

WINDOW_S = 1.0  # window of the arrival-rate and utilization estimates
EWMA = 0.1  # weight of the newest sample in the moving means
DECISIONS_KEPT = 4096  # the latest steps' decision times kept for percentiles (Engine.decision_times)


@dataclass
class _ModelState:
    blocks: int
    max_batch: int
    queue: deque = field(default_factory=deque)
    instances: list[Instance] = field(default_factory=list)
    next_dequeue: float = -math.inf
    arrivals: deque = field(default_factory=deque)  # arrival times within the last WINDOW_S
    answers: deque = field(default_factory=deque)  # answer times within the last WINDOW_S
    latency_s: float = 0.0
    wake: float = math.inf  # when a held dequeue may go ahead (interval or batching delay ending)
    closing: bool = False  # being removed: takes no request, leaves once those it holds are answered


class Engine:
    """Serve ``executor.models`` under ``policy`` (see the module docstring).

    ``max_queue``: requests waiting per model (a full queue raises :class:`QueueFull`); ``max_batch``: samples per
    instance (1 for a model whose instances cannot stack); ``max_sub_blocks``: H, parts per combined block
    (TOP's server setting is 4); ``timeout_s``: default deadline of a request (None: none).
    """

    def __init__(self, executor: Executor, policy: Policy, clock, *, max_queue: int = 64, max_batch: int = 8,
                 max_sub_blocks: int = 4, timeout_s: float | None = None, observers: list[Observer] | None = None):
        if max_queue < 1 or max_batch < 1 or max_sub_blocks < 1:
            raise UsageError(f"max_queue, max_batch and max_sub_blocks must be at least 1, got {max_queue}, "
                             f"{max_batch} and {max_sub_blocks}")
        self.executor, self.policy, self.clock = executor, policy, clock
        self.max_queue, self.max_sub_blocks, self.timeout_s, self.max_batch = max_queue, max_sub_blocks, timeout_s, \
            max_batch
        self.models = {name: _ModelState(len(m.blocks), max_batch if m.stackable else 1)
                       for name, m in executor.models.items()}
        self.observers = list(observers or [])
        self.policy.bind({m: s.blocks for m, s in self.models.items()},
                         {m: s.max_batch for m, s in self.models.items()}, max_sub_blocks)
        self.lock = threading.RLock()
        self.wakeup = threading.Condition(self.lock)
        self.accepting = True
        self.stopped = False
        self._ids = 0
        self._steps: deque = deque()  # (end time, seconds, device-busy seconds) of the steps in the last window
        self._busy_s = self._used_s = 0.0
        self.step_s = 0.0
        self.stats = {"steps": 0, "fallbacks": 0, "submitted": 0, "rejected": 0, "answered": 0, "timeouts": 0,
                      "errors": 0, "parts": 0, "decision_s": 0.0, "decision_max_s": 0.0}
        self._decisions: deque = deque(maxlen=DECISIONS_KEPT)

    # ---- requests -----------------------------------------------------------------------------------------------
    def submit(self, model: str, inputs: Any = None, *, batch: int = 1, timeout_s: float | None = None,
               on_done: Callable[[Request], None] | None = None, at: float | None = None) -> Request:
        """Queue a request (``at``: its arrival time, default now; simulation passes the past arrival time).
        Raises :class:`UsageError` for an unknown model or a batch above the model's max, :class:`Unavailable`
        while draining, :class:`QueueFull` when the model's queue is full."""
        with self.lock:
            state = self.models.get(model)
            if state is None:
                raise UsageError(f"unknown model {model!r}{did_you_mean(model, self.models)}; serving "
                                 f"{', '.join(self.models)}")
            if state.closing:
                raise Unavailable(f"model {model!r} is being unloaded")
            if batch < 1 or batch > state.max_batch:
                raise UsageError(f"{model}: batch {batch} is outside 1..{state.max_batch}")
            if not self.accepting:
                raise Unavailable("the server is shutting down")
            now = self.clock.now() if at is None else at
            if len(state.queue) >= self.max_queue:
                self.stats["rejected"] += 1
                for o in self.observers:
                    o.on_reject(model)
                raise QueueFull(f"{model}: queue full ({self.max_queue} waiting)", self._retry_after(model))
            timeout = self.timeout_s if timeout_s is None else timeout_s
            self._ids += 1
            request = Request(self._ids, model, inputs, batch, now, None if timeout is None else now + timeout,
                              on_done)
            state.queue.append(request)
            state.arrivals.append(now)
            self.stats["submitted"] += 1
            for o in self.observers:
                o.on_submit(request)
            self.wakeup.notify_all()
            return request

    # ---- models come and go -------------------------------------------------------------------------------------
    def add_model(self, name: str, blocked, max_batch: int | None = None) -> None:
        """Serve ``blocked`` (a :class:`~opweave.serve.engine.blocks.BlockedModel`) as ``name`` from the next step on,
        at most ``max_batch`` samples per instance (default the engine's). Whatever is slow (capture, compiles:
        ``executor.warm_model``) is the caller's to do first, off the lock; this only links it in, atomically."""
        with self.lock:
            if name in self.models:
                raise UsageError(f"model {name!r} is already served")
            state = _ModelState(len(blocked.blocks), (max_batch or self.max_batch) if blocked.stackable else 1)
            self._bind(name, state)
            self.executor.models[name] = blocked
            self.models[name] = state
            for o in self.observers:
                o.on_add(name)
            self.wakeup.notify_all()

    def remove_model(self, name: str, timeout_s: float = 60.0) -> None:
        """Stop taking requests for ``name`` (:class:`Unavailable`), answer those it holds, then drop it between two
        steps (no block of it running). Raises :class:`OpweaveError` if it still holds requests after ``timeout_s``
        (it stays closing and leaves once they are answered)."""
        with self.lock:
            state = self.models.get(name)
            if state is None:
                raise UsageError(f"unknown model {name!r}{did_you_mean(name, self.models)}; serving "
                                 f"{', '.join(self.models)}")
            self._bind(name, None)  # a policy that cannot do without it refuses here, before anything changes
            state.closing = True
            self.wakeup.notify_all()
            end = self.clock.now() + timeout_s
            while name in self.models:
                thread = getattr(self, "thread", None)
                if thread is None or not thread.is_alive():
                    self._retire()  # no loop to step: nothing runs
                    if name not in self.models:
                        break
                if self.clock.now() >= end:
                    raise OpweaveError(f"model {name!r} still holds {len(state.queue)} queued requests and "
                                       f"{len(state.instances)} instances after {timeout_s:g} s")
                self.wakeup.wait(0.02)

    def _bind(self, name: str, state: _ModelState | None) -> None:
        """(Re)bind the policy to the models with ``name`` added (its ``state``) or, for None, taken out."""
        counts = {m: s.blocks for m, s in self.models.items() if m != name}
        batches = {m: s.max_batch for m, s in self.models.items() if m != name}
        if state is not None:
            counts[name], batches[name] = state.blocks, state.max_batch
        self.policy.bind(counts, batches, self.max_sub_blocks)

    def _retire(self) -> None:
        """Drop the closing models that hold nothing (under the lock, between steps)."""
        for m in [m for m, s in self.models.items() if s.closing and not s.queue and not s.instances]:
            self._bind(m, None)
            del self.models[m]
            self.executor.models.pop(m, None)
            drop = getattr(self.executor, "drop_model", None)
            if drop is not None:
                drop(m)
            for o in self.observers:
                o.on_remove(m)
            self.wakeup.notify_all()

    def _retry_after(self, model: str) -> float:
        """Seconds until half the queue has been answered at the recent answer rate (1 to 60 s; 1 s when unknown)."""
        state = self.models[model]
        now = self.clock.now()
        while state.answers and state.answers[0] <= now - WINDOW_S:
            state.answers.popleft()
        rate = len(state.answers) / WINDOW_S
        return min(60.0, max(1.0, len(state.queue) / 2 / rate)) if rate else 1.0

    # ---- observation --------------------------------------------------------------------------------------------
    def queue_lengths(self) -> dict[str, int]:
        with self.lock:
            return {m: len(s.queue) for m, s in self.models.items()}

    def observe(self, now: float | None = None) -> Observation:
        """What the policy sees (see :class:`~opweave.serve.engine.policy.Observation`)."""
        with self.lock:
            now = self.clock.now() if now is None else now
            models = {}
            for m, s in self.models.items():
                while s.arrivals and s.arrivals[0] <= now - WINDOW_S:
                    s.arrivals.popleft()
                span = min(WINDOW_S, max(now, 1e-3))
                models[m] = ModelObs(
                    m, s.blocks, len(s.queue), sum(r.batch for r in s.queue),
                    now - s.queue[0].arrival if s.queue else 0.0, len(s.arrivals) / span, s.latency_s,
                    tuple(InstanceObs(i.block, i.batch, now - i.oldest, i.work) for i in s.instances), s.max_batch,
                    s.queue[0].batch if s.queue else 0, s.queue[0].work if s.queue else 0)
            while self._steps and self._steps[0][0] <= now - WINDOW_S:
                _, sec, used = self._steps.popleft()
                self._busy_s -= sec
                self._used_s -= used
            span = min(WINDOW_S, max(now, 1e-3))
            busy = min(1.0, max(0.0, self._busy_s / span))
            utilization = min(1.0, max(0.0, self._used_s / span))
            lengths = [len(s.queue) for s in self.models.values()]
            mean = sum(lengths) / max(1, len(lengths))
            return Observation(now, models, tuple(self._ready(now)), self.max_sub_blocks, utilization, busy,
                               self.step_s, sum((q - mean) ** 2 for q in lengths) / max(1, len(lengths)))

    def _ready(self, now: float) -> list[SlotObs]:
        slots = []
        for m, s in self.models.items():
            at: dict[int, list[Instance]] = {}
            for inst in s.instances:
                at.setdefault(inst.block, []).append(inst)
            for block, group in at.items():
                slots.append(SlotObs(m, block, sum(i.batch for i in group), len(group),
                                     now - min(i.oldest for i in group)))
        return slots

    def busy(self) -> bool:
        """Requests queued or instances in flight."""
        with self.lock:
            return any(s.queue or s.instances for s in self.models.values())

    def next_wake(self) -> float:
        """The earliest time a step could do something no submission triggers: a dequeue interval or batching delay
        ending, a deadline passing, or, while requests are queued, the policy's own next decision
        (:meth:`~opweave.serve.engine.policy.Policy.wake`) (inf: nothing pending)."""
        with self.lock:
            times = [math.inf]
            for s in self.models.values():
                if s.queue:
                    times.append(s.wake)
                    times += [r.deadline for r in s.queue if r.deadline is not None]
            if len(times) > 1:
                times.append(self.policy.wake())
            return min(times)

    # ---- one step -----------------------------------------------------------------------------------------------
    def decision_times(self) -> list[float]:
        """The decision time (seconds, wall clock) of each of the latest steps that ran a combined block
        (:data:`DECISIONS_KEPT` at most): what the step spent observing the engine and asking the policy, before the
        executor ran (dequeues, stacking and the run not counted). ``stats`` holds their sum and maximum."""
        with self.lock:
            return list(self._decisions)

    def step(self) -> bool:
        """One engine step (module docstring); True if a combined block ran."""
        finished: list[Request] = []
        with self.lock:
            self._retire()
            now = self.clock.now()
            finished += self._expire(now)
            begin = time.perf_counter()
            launches = self.policy.launch(self.observe(now))
            deciding = time.perf_counter() - begin
            self._launch(now, launches)
            begin = time.perf_counter()
            chosen = self._choose(self.observe(now))
            deciding += time.perf_counter() - begin
            if not chosen:
                self._notify(finished)
                return False
            self._decided(deciding)
            running = [self._stack(m, b) for m, b in chosen]
            parts = [Part(i.model, i.block, i.batch, i.state) for i in running]
            for inst in running:
                self.models[inst.model].instances.remove(inst)
        try:
            cost = self.executor.run(parts)
        except Exception as exc:  # noqa: BLE001 - answered as errors; the engine keeps serving
            with self.lock:
                for inst in running:
                    for r in inst.requests:
                        r.status, r.error, r.finished = "error", f"{type(exc).__name__}: {exc}", self.clock.now()
                        finished.append(r)
            self._notify(finished)
            return True
        self.clock.spend(cost.seconds)
        with self.lock:
            now = self.clock.now()
            self.stats["steps"] += 1
            self.stats["parts"] += len(parts)
            used = cost.seconds * (cost.utilization if cost.utilization is not None else 1.0)
            self._steps.append((now, cost.seconds, used))
            self._busy_s += cost.seconds
            self._used_s += used
            self.step_s = cost.seconds if self.stats["steps"] == 1 else (1 - EWMA) * self.step_s + EWMA * cost.seconds
            for o in self.observers:
                o.on_step(parts, cost)
            for inst, part in zip(running, parts, strict=True):
                inst.state, inst.block = part.state, inst.block + 1
                for r in inst.requests:
                    r.compute_s += cost.seconds
                state = self.models[inst.model]
                if inst.block < state.blocks:
                    state.instances.append(inst)
                    continue
                split = self.clock.now()
                outputs = self.executor.outputs(inst.model, inst.state, [r.batch for r in inst.requests])
                end = self.clock.now()
                for r, out in zip(inst.requests, outputs, strict=True):
                    r.finished, r.output, r.output_s = end, out, end - split
                    late = r.deadline is not None and now > r.deadline
                    r.status = "timeout" if late else "done"
                    state.answers.append(now)
                    state.latency_s = r.latency_s if not state.latency_s else (
                        (1 - EWMA) * state.latency_s + EWMA * r.latency_s)
                    finished.append(r)
        self._notify(finished)
        return True

    def _decided(self, seconds: float) -> None:
        self._decisions.append(seconds)
        self.stats["decision_s"] += seconds
        self.stats["decision_max_s"] = max(self.stats["decision_max_s"], seconds)
        for o in self.observers:
            o.on_decision(seconds)

    def _expire(self, now: float) -> list[Request]:
        out = []
        for s in self.models.values():
            if any(r.deadline is not None and r.deadline <= now for r in s.queue):
                keep: deque[Request] = deque()
                for r in s.queue:
                    if r.deadline is not None and r.deadline <= now:
                        r.status, r.finished = "timeout", now
                        out.append(r)
                    else:
                        keep.append(r)
                s.queue = keep
        return out

    def _launch(self, now: float, launches: dict[str, Launch]) -> None:
        for m, s in self.models.items():
            launch = launches.get(m) or Launch()
            want = max(1, min(launch.batch, s.max_batch))
            fillable = self.accepting and not s.closing  # else no request can come to fill a batch: none is held
            s.wake = math.inf  # held only by the instance cap: the end of a step wakes it
            while s.queue and (launch.max_instances is None or len(s.instances) < launch.max_instances):
                if now < s.next_dequeue:
                    s.wake = s.next_dequeue
                    break
                if fillable and sum(r.batch for r in s.queue) < want and \
                        now - s.queue[0].arrival < launch.max_delay_s:
                    s.wake = s.queue[0].arrival + launch.max_delay_s  # wait for a fuller batch
                    break
                taken = [s.queue.popleft()]
                sizes = self.executor.sizes(taken[0].inputs)
                while s.queue and sum(r.batch for r in taken) + s.queue[0].batch <= want and \
                        self.executor.sizes(s.queue[0].inputs) == sizes:
                    taken.append(s.queue.popleft())
                for r in taken:
                    r.dequeued, r.status = now, "running"
                    for o in self.observers:
                        o.on_dequeue(r)
                start = self.clock.now()
                state = self.executor.prepare(m, [r.inputs for r in taken])
                for r in taken:
                    r.input_s = self.clock.now() - start
                s.instances.append(Instance(m, taken, 0, state))
                s.next_dequeue = now + launch.interval_s

    def _choose(self, obs: Observation) -> list[Slot]:
        """The ready slots of the proposed group with the highest effective input ratio (TOP §VI-A)."""
        ready = {s.key for s in obs.ready}
        best: list[Slot] = []
        best_ratio = 0.0
        for group in self.policy.combine(obs):
            slots = list(dict.fromkeys(group))
            if len(slots) > self.max_sub_blocks:
                raise UsageError(f"policy {self.policy.name!r} proposed {len(slots)} sub-blocks in one combined "
                                 f"block; H is {self.max_sub_blocks}")
            runnable = [s for s in slots if s in ready]
            ratio = len(runnable) / len(slots) if slots else 0.0
            if ratio > best_ratio:
                best, best_ratio = runnable, ratio
        if not best and obs.ready:
            self.stats["fallbacks"] += 1
            oldest = max(obs.ready, key=lambda s: s.age_s)
            best = [oldest.key]
        return best

    def _stack(self, model: str, block: int) -> Instance:
        """Merge the ready instances of ``model`` at ``block`` (oldest first, up to its max batch, of the oldest's
        sizes) into one; under a policy that does not stack, the one of them with the least work (the oldest among
        equals)."""
        state = self.models[model]
        waiting = sorted((i for i in state.instances if i.block == block), key=lambda i: i.oldest)
        if not self.policy.stacks:
            return min(waiting, key=lambda i: i.work)  # min keeps the first (oldest) of equals
        taken = [waiting[0]]
        sizes = self.executor.sizes(waiting[0].state)
        for inst in waiting[1:]:
            if sum(i.batch for i in taken) + inst.batch <= state.max_batch and \
                    self.executor.sizes(inst.state) == sizes:
                taken.append(inst)
        if len(taken) == 1:
            return taken[0]
        merged = Instance(model, [r for i in taken for r in i.requests], block,
                          self.executor.merge(model, [i.state for i in taken]))
        for inst in taken:
            state.instances.remove(inst)
        state.instances.append(merged)
        return merged

    def _notify(self, finished: list[Request]) -> None:
        for r in finished:
            key = {"done": "answered", "timeout": "timeouts", "error": "errors"}[r.status]
            self.stats[key] += 1
            for o in self.observers:
                o.on_done(r)
            if r.on_done is not None:
                r.on_done(r)

    # ---- real-time loop -----------------------------------------------------------------------------------------
    def run_forever(self, poll_s: float = 0.05) -> None:
        """Step until :meth:`stop`; idle waits end at the next wake time or at a submission."""
        while True:
            with self.lock:
                if self.stopped:
                    return
            if self.step():
                continue
            with self.lock:
                if self.stopped:
                    return
                wait = min(poll_s, self.next_wake() - self.clock.now())
                self.wakeup.wait(max(wait, 1e-3))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run_forever, name="opweave-engine", daemon=True)
        thread.start()
        self.thread = thread
        return thread

    def drain(self) -> None:
        """Take no new request; those accepted are still answered."""
        with self.lock:
            self.accepting = False
            self.wakeup.notify_all()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain, wait until every accepted request is answered (at most ``timeout_s``), then stop the loop."""
        self.drain()
        deadline = self.clock.now() + timeout_s
        with self.lock:
            while self.busy() and self.clock.now() < deadline and getattr(self, "thread", None) is not None:
                self.wakeup.wait(0.05)
            self.stopped = True
            self.wakeup.notify_all()
        thread = getattr(self, "thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)


__all__ = ["DECISIONS_KEPT", "EWMA", "WINDOW_S", "Engine"]
