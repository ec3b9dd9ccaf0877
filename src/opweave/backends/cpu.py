"""CPU backend: the LaunchPlan on the caller's thread and one worker thread per other lane, each lane generated code.

:class:`CpuBackend` generates every lane's code once (:class:`~opweave.backends.lanecode.LaneCode`: the lane's ops with
the plan's signals and waits between them, values in slots, every intermediate dropped at its last use) and runs the
first lane in the caller's thread and each other lane on a long-lived worker thread of a :class:`LanePool`; a plan's
record becomes ``threading.Event.set`` and its wait ``Event.wait``. The first lane's ops run on the budgets they are
given (per op, the caller's count restored after the call); a worker's on one intra-op thread
(:mod:`opweave.backends.threads` says why: a worker holding a bigger OpenMP team slowed every kernel of the process). A
plan with a single lane runs in the caller's thread, on its budget (every thread it may use). PyTorch (and ONNX Runtime)
release the GIL inside their kernels, so independent ops overlap on a multi-core CPU.

A lane that raises records the error and releases every signal; the other lanes stop at their next wait, and the
first error is re-raised in the caller, naming the op and its fx node.

Every lane runs its ops with autograd off, whichever thread it is and whatever the caller's mode. Autograd mode is
thread-local, and some kernels pick their algorithm, hence their output's strides, by it: CPU
``scaled_dot_product_attention`` takes its flash kernel ((B, L, H, E) memory order) when no input requires grad and
its math kernel (contiguous) otherwise. A graph captured through torch.export has turned the model's
``transpose().contiguous()`` into nothing where the traced tensor was already contiguous, so its next ``view`` then
failed on the lanes that ran with grad on (worker threads start with it on) and not in the caller's ``no_grad``
thread: the layout depended on the schedule. Capture propagates shapes and verifies under ``no_grad``, so that is
the mode every lane uses.

:class:`LanePool` (the workers, the fan-out of a :class:`Call` and its join), :class:`Call` and :class:`LaneWorker` (a
:class:`~opweave.backends.program.Walker` that interprets a lane's steps) are what the lanes over ONNX Runtime's graph
(``backends/ortgraph.py``) and a rank of the distributed backend (``backends/distributed``) run their lanes with: in a
rank some signals stand for messages from other ranks, which write into the call's environment dict.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import torch

from opweave.backends.lanecode import LaneCode, Stopped
from opweave.backends.program import Lane, Program, Step, Walker
from opweave.backends.threads import budgets, enter_budget
from opweave.cores import intra_op_threads
from opweave.errors import UsageError
from opweave.plan.launchplan import LaunchPlan


class CpuBackend:
    """A plan on the caller's thread (its first lane) and worker threads (one per other lane), each running its
    lane's generated code (module docstring). ``stats``: ``calls``. ``close()`` stops the workers (also done when the
    backend is collected or the interpreter exits); a closed backend refuses calls. ``threads`` (op -> intra-op threads,
    :func:`opweave.pipeline.thread_budgets.lane_threads`) sets the first lane's ops' budgets; every other lane's ops run
    on one thread whatever it says. Without it the first lane takes what the workers leave of ``total`` threads
    (default: every core; :func:`opweave.backends.threads.budgets`), all of them when it is the only lane.
    The caller's own thread count is put back after every call."""

    def __init__(self, runner, plan: LaunchPlan, threads: dict[str, int] | None = None, total: int | None = None):
        self.captured = runner
        self.program = Program.from_plan(plan)
        self.stats = {"calls": 0}
        lanes = sorted(self.program.lanes)
        share = budgets(lanes, total=total)
        threads = {step.op: (threads or {}).get(step.op, share[lane]) if lane == lanes[0] else 1
                   for lane, step in self.program.issue_order if step.kind == "launch"}
        self.code = LaneCode(runner, self.program, threads)
        self._lock = threading.Lock()  # one call at a time: the workers share one call's slots
        self._caller_lane = lanes[0] if lanes else None
        with intra_op_threads():  # the workers' set_num_threads also set the process-wide default: put back
            self._pool = LanePool({lane: _generated(self.code, lane) for lane in lanes[1:]}, budget=1)
        self.close = weakref.finalize(self, self._pool.close)

    def __call__(self, *args) -> Any:
        with self._lock, torch.no_grad():
            if not self.close.alive:  # its workers are gone: the call would wait for them forever
                raise UsageError(f"{self.captured.graph.name}: this CPU backend was closed")
            self.stats["calls"] += 1
            slots = self.code.bind(args)
            lane = self._caller_lane
            assert lane is not None  # a plan launches something
            function = self.code.functions[lane]
            with intra_op_threads():  # the lane's budgets change the caller's count: put back after the call
                if not self._pool.workers:  # a single lane needs no threads
                    try:
                        function(slots, Call(slots, self.program.num_signals, 0))
                    except Exception as exc:
                        raise self.code.error(lane, exc) from exc
                else:
                    self._pool.run(Call(slots, self.program.num_signals, len(self._pool.workers) + 1),
                                   _generated(self.code, lane))
            return self.code.output(slots)

    def free(self, args: tuple) -> bool:
        """Take inputs shaped like ``args`` from now on (:meth:`Captured.free`): the lanes' code reads no size."""
        return self.captured.free(args)


def _generated(code: LaneCode, lane: Lane):
    """Lane ``lane``'s generated function as a pool runs a lane: ``run(call)``, its error naming the op."""
    function = code.functions[lane]

    def run(call: Call) -> None:
        try:
            function(call.env, call)
        except Stopped:  # another lane failed first
            pass
        except Exception as exc:
            raise code.error(lane, exc) from exc

    return run


class EagerBackend:
    """The model itself, run as the CPU lanes run a plan (under ``no_grad``, on ``threads`` intra-op threads, else the
    caller's): what ``opweave.compile``'s default keeps when neither its lanes nor one lane beat the model
    (:func:`opweave.pipeline.search.default_race`, ``eager``). It calls the live model, so a later change to the model's
    weights shows in its outputs. ``stats``: ``calls``."""

    def __init__(self, model, threads: int | None = None):
        self.model, self.threads = model, threads
        self.stats = {"calls": 0}

    def __call__(self, *args) -> Any:
        self.stats["calls"] += 1
        if self.threads is not None and self.threads != torch.get_num_threads():
            with intra_op_threads(self.threads), torch.no_grad():
                return self.model(*args)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.model(*args)
        return self.model(*args)  # as the caller would call it: no scope to enter

    def free(self, args: tuple) -> bool:
        """The model takes whatever sizes it takes."""
        return True

    def close(self) -> None:
        pass


class LanePool:
    """Long-lived worker threads, one per lane of ``lanes`` (lane -> ``run(call)``, which runs that lane's steps for
    a :class:`Call`), the one fan-out and join that the CPU backend, the lanes over ONNX Runtime's graph and a CPU rank
    share. Each worker runs under ``no_grad`` and, with ``budget`` (one count for every worker, or lane -> its count),
    sets its own intra-op thread count once it starts (:func:`opweave.backends.threads.enter_budget`). :meth:`run` hands
    a call to every worker and runs the caller's part in the calling thread; ``close()`` stops the workers (also when
    the pool is collected or the interpreter exits: a thread that used torch's intra-op pool and is still alive at
    teardown aborts the process, "terminate called without an active exception")."""

    def __init__(self, lanes: dict, budget: int | dict | None = None):
        self.workers = [_Worker(lane, run, budget.get(lane) if isinstance(budget, dict) else budget)
                        for lane, run in lanes.items()]
        for worker in self.workers:
            worker.ready.wait()
        self._stop = weakref.finalize(self, stop_workers, list(self.workers))

    def run(self, call: Call, caller, *, caller_is_lane: bool = True) -> None:
        """Hand ``call`` to every worker and run ``caller(call)`` in this thread (an exception it raises fails the
        call; ``caller_is_lane``: it counts as one of the call's lanes), then wait until every lane has finished
        (else until the call settled: every lane finished or one failed) and raise the first error."""
        for worker in self.workers:
            worker.inbox.put(call)
        try:
            caller(call)
        except BaseException as exc:  # noqa: BLE001 - stops the other lanes, raised below
            call.fail(exc)
        finally:
            if caller_is_lane:
                call.lane_finished()
        (call.done if caller_is_lane else call.settled).wait()
        if call.errors:
            raise call.errors[0]

    def close(self) -> None:
        self._stop()


class _Worker:
    def __init__(self, lane: Lane, run, budget: int | None):
        self.lane, self.run, self.budget = lane, run, budget
        self.ready = threading.Event()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"opweave-d{lane[0]}s{lane[1]}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.budget is not None:
            enter_budget(self.budget)
        self.ready.set()
        with torch.no_grad():
            while (call := self.inbox.get()) is not None:
                try:
                    self.run(call)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    call.fail(exc)
                finally:
                    call.lane_finished()


def stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.inbox.put(None)
    for worker in workers:
        worker.thread.join(timeout=10)


class Call:
    """One run of the lanes: its environment, one signal per record/send of the plan (anything with ``set``,
    ``wait`` and ``is_set``), the errors raised. ``done`` is set when every lane finished, ``settled`` as soon as
    every lane finished or one failed."""

    def __init__(self, env: Any, num_signals: int, num_lanes: int):  # the lanes' slots, or a rank's environment
        self.env = env
        self.signals: list[Any] = [threading.Event() for _ in range(num_signals)]  # or a rank's arrivals
        self.errors: list[BaseException] = []
        self.remaining = num_lanes
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.settled = threading.Event()
        if num_lanes == 0:
            self.done.set()
            self.settled.set()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(exc)
        for s in self.signals:  # unblock every waiter; they see the error and stop
            s.set()
        self.settled.set()

    def lane_finished(self) -> None:
        with self.lock:
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()
                self.settled.set()


class LaneWorker(Walker):
    """One lane's steps as a :class:`LanePool` (or the caller's thread) runs them for a :class:`Call`: a launch runs
    the op in the call's environment (``captured.run_op``), a signal sets the call's signal, a wait waits for it.
    Once another lane has failed, the remaining steps are skipped."""

    def __init__(self, lane: Lane, steps: list[Step], captured):
        self.lane, self.steps, self.captured = lane, steps, captured
        self.call: Call | None = None

    @torch.no_grad()
    def run_call(self, call: Call) -> None:
        """Run the lane's steps for ``call`` in this thread."""
        self.call = call
        try:
            self.run((self.lane, step) for step in self.steps if not call.errors)
        finally:
            self.call = None  # keep no environment alive between calls

    def launch(self, lane: Lane, op: str) -> None:
        self.captured.run_op(op, self._running().env)

    def signal(self, lane: Lane, number: int) -> None:
        self._running().signals[number].set()

    def wait(self, lane: Lane, number: int) -> None:
        self._running().signals[number].wait()

    def _running(self) -> Call:
        """The call :meth:`run_call` runs."""
        assert self.call is not None
        return self.call
