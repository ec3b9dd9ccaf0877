"""The caller's side: rank processes started and supervised (:class:`Ranks`), the multi-device backend
(:class:`DistributedBackend`) and the link profiler (:func:`profile_link`).

**Processes.** One process per rank, started with ``torch.multiprocessing``'s ``forkserver`` method by default: a
server process imports torch and opweave once, and every rank is forked from it, clean (none of the caller's
threads or state) and in a fraction of a second instead of the seconds a ``spawn`` start costs to import torch
(``start_method="spawn"`` is accepted). Ranks rendezvous at a ``TCPStore`` the caller hosts on 127.0.0.1 (an
ephemeral port: no port is guessed), and talk over loopback.

**No process left behind.** Ranks are daemon processes (multiprocessing terminates them when the caller exits
normally); :meth:`Ranks.close` (also run by ``weakref.finalize`` when the backend is collected or the interpreter
exits) asks them to stop, then kills what is left; and every rank watches a *lifeline* pipe it only reads from
(:func:`.rank._watch`): when the caller's end closes, because the caller exited, crashed or was killed, the
rank exits at once, whatever it was doing.

**Failures.** The caller waits on every rank's control pipe and on its process sentinel together. A rank that
reports an error, or dies, is a failure: the caller waits one more second for the other ranks' news (a dead rank's
peers report lost connections; the dead rank is the cause), picks the cause (an op that raised, then a rank that
died, then a lost connection), kills every rank and raises one :class:`~opweave.errors.RankError` naming the rank
and the cause. A backend whose ranks were stopped refuses further calls with the same error.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opweave.backends.distributed import rank as rank_module
from opweave.backends.distributed import wire
from opweave.backends.distributed.split import split
from opweave.backends.threads import total_threads
from opweave.capture.runtime import Captured
from opweave.errors import DeviceError, RankError, UsageError, did_you_mean
from opweave.plan.launchplan import LaunchPlan

START_METHODS = ("forkserver", "spawn")
DEFAULT_TIMEOUT_S = 300.0
_PRIORITY = ("op", "error", "died", "comm", "silent")  # which failure is the cause when several are seen


def check_devices(world: int, device: str, ops: int | None = None) -> None:
    """One clear line when ``world`` ranks cannot be had: more ranks than ops, or than GPUs visible."""
    if world < 1:
        raise UsageError(f"devices must be at least 1, got {world}")
    if ops is not None and world > ops:
        raise UsageError(f"devices={world} is more than the graph's {ops} ops; use at most {ops}")
    if device == "cuda":
        from opweave.backends.cuda import require_cuda

        require_cuda()
        if world > torch.cuda.device_count():
            raise DeviceError(f"devices={world} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif device != "cpu":
        raise UsageError(f"device must be cpu or cuda, got {device!r}{did_you_mean(device, ('cpu', 'cuda'))}")


class Ranks:
    """``world`` rank processes running ``target(rank, world, control, lifeline, settings, *args[rank])``."""

    def __init__(self, world: int, target, args: list[tuple], *, device: str = "cpu", threads: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver"):
        if start_method not in START_METHODS:
            raise UsageError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}"
                             f"{did_you_mean(start_method, START_METHODS)}")
        if start_method not in mp.get_all_start_methods():
            start_method = "spawn"
        self.world = world
        self.failure: str | None = None
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        settings = rank_module.Settings(device, total_threads(threads, ranks=world), timeout_s,
                                        self.store.port)
        ctx: Any = mp.get_context(start_method)  # forkserver or spawn: a context that starts processes
        if start_method == "forkserver":
            ctx.set_forkserver_preload([rank_module.__name__])
        self.controls: list = []
        self.lifelines: list = []
        self.procs: list = []
        self.close = weakref.finalize(self, _shutdown, self.procs, self.controls, self.lifelines, self.store)
        try:
            for r in range(world):
                ours, theirs = ctx.Pipe(duplex=True)
                life_read, life_write = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=target, args=(r, world, theirs, life_read, settings, *args[r]),
                                   name=f"opweave-rank-{r}", daemon=True)
                proc.start()
                args[r] = ()  # the payload is in the child now
                theirs.close()
                life_read.close()
                self.controls.append(ours)
                self.lifelines.append(life_write)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, rank: int, message: Any) -> None:
        """Send to a rank; a rank that is gone shows up in the next :meth:`gather`."""
        try:
            self.controls[rank].send_bytes(wire.dumps(message))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def gather(self, timeout_s: float | None = None) -> dict[int, Any]:
        """One reply from every rank (``("ready" | "done", value)``): rank -> value. Raises :class:`RankError`
        (after stopping every rank) when a rank reports an error, dies, or ``timeout_s`` passes."""
        if self.failure:
            raise RankError(self.failure)
        replies: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}
        waiting = set(range(self.world))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting and not failures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([self.controls[r] for r in waiting] + [p.sentinel for p in self.procs], left)
            if not ready:
                for r in sorted(waiting):
                    failures[r] = ("silent", f"did not answer within {timeout_s:g} s")
            self._read(ready, replies, failures, waiting)
        if failures:
            end = time.monotonic() + 1.0  # the other ranks' news: is a lost connection due to a dead peer?
            while time.monotonic() < end:
                ready = connection.wait(list(self.controls) + [p.sentinel for p in self.procs], end - time.monotonic())
                self._read(ready, replies, failures, waiting, quiet=True)
                if len(failures) == self.world:
                    break
            self._fail(failures)
        return replies

    def _read(self, ready: list, replies: dict, failures: dict, waiting: set, quiet: bool = False) -> None:
        for obj in ready:
            if obj in self.controls:
                r = self.controls.index(obj)
                message = self._receive(r)
                if message is None:
                    failures.setdefault(r, ("died", self._death(r)))
                elif message[0] == "error":
                    failures[r] = (message[1], message[2])
                elif not quiet:
                    replies[r] = message[1]
                waiting.discard(r)
            else:
                r = next(i for i, p in enumerate(self.procs) if p.sentinel == obj)
                if r in failures:
                    continue
                message = self._receive(r) if self.controls[r].poll(0) else None
                if message is not None and message[0] == "error":
                    failures[r] = (message[1], message[2])
                else:
                    failures[r] = ("died", self._death(r))

    def _receive(self, r: int):
        try:
            return wire.loads(self.controls[r].recv_bytes())
        except (EOFError, OSError):
            return None

    def _death(self, r: int) -> str:
        proc = self.procs[r]
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"died (killed by {signal.Signals(-code).name})"
            except ValueError:
                return f"died (signal {-code})"
        return f"died (exit status {code})"

    def abort(self, reason: str) -> None:
        """Stop every rank; later calls raise :class:`RankError` with ``reason``."""
        self.failure = f"{reason} (all {self.world} ranks stopped)"
        self.close()

    def _fail(self, failures: dict[int, tuple[str, str]]) -> None:
        r, (kind, text) = min(failures.items(), key=lambda item: (_PRIORITY.index(item[1][0]), item[0]))
        what = {"op": "failed", "error": "failed", "comm": "lost contact with its peers"}.get(kind)
        cause = f"rank {r} {what}: {text}" if what else f"rank {r} {text}"
        self.failure = f"{cause} (all {self.world} ranks stopped)"
        self.close()
        raise RankError(self.failure)


def _shutdown(procs: list, controls: list, lifelines: list, store) -> None:
    """Stop the ranks: ask, close their lifelines (a rank stuck in a transfer exits too), wait a little, kill."""
    for control in controls:
        try:
            control.send_bytes(wire.dumps(("stop",)))
        except (OSError, ValueError):
            pass
    for pipe in lifelines:
        pipe.close()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for control in controls:
        control.close()
    del store


class DistributedBackend:
    """A multi-device plan run by one persistent process per device (see :mod:`opweave.backends.distributed`).

    ``threads``: the threads each rank's lanes may use in all (default: the usable cores split among the ranks,
    :func:`opweave.backends.threads.total_threads`); ``timeout_s`` is the process group's timeout (a transfer that waits
    longer fails) and the limit for starting the ranks. Call it like the model; outputs come back on the CPU.
    ``close()`` (or leaving a ``with`` block) stops the ranks; a closed backend refuses calls. ``stats``: ``calls``.
    """

    def __init__(self, captured: Captured, plan: LaunchPlan, *, world: int | None = None, device: str = "cpu",
                 threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver"):
        world = world or max(plan.devices, default=0) + 1
        check_devices(world, device)
        self.captured, self.plan, self.world, self.device = captured, plan, world, device
        parts = split(captured, plan, world)
        self.inputs = [part.inputs for part in parts]
        payloads = []
        for part in parts:
            try:
                payloads.append((wire.dumps(part),))
            except Exception as exc:  # noqa: BLE001 - named in one line
                raise UsageError(f"cannot send rank {part.rank}'s share of {captured.graph.name} to its process: "
                                 f"{type(exc).__name__}: {exc}") from exc
        del parts
        self.ranks = Ranks(world, rank_module.serve, payloads, device=device, threads=threads, timeout_s=timeout_s,
                           start_method=start_method)
        self.close = self.ranks.close
        self.stats = {"calls": 0}
        ready = self.ranks.gather(timeout_s)
        self.info = [ready[r] for r in range(world)]
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int]:
        return self.ranks.pids

    def __call__(self, *args) -> Any:
        with self._lock:
            if self.ranks.failure:
                raise RankError(self.ranks.failure)
            if not self.close.alive:
                raise UsageError(f"{self.captured.graph.name}: this distributed backend was closed (its ranks stopped)")
            self.stats["calls"] += 1
            env = self.captured.bind(args)
            for r in range(self.world):
                self.ranks.send(r, ("run", {name: _to_cpu(env[name]) for name in self.inputs[r]}))
            try:
                replies = self.ranks.gather()
            except RankError:
                raise
            except BaseException:  # interrupted (Ctrl-C): the ranks are mid-call, their next replies would not match
                self.ranks.abort("a call was interrupted")
                raise
            for outputs in replies.values():
                env.update(outputs)
            return self.captured.output(env)

    def __enter__(self) -> DistributedBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def profile_link(device: str = "cpu", sizes: list[int] | None = None, repeats: int = 20, warmup: int = 3,
                 timeout_s: float = 120.0) -> list[tuple[int, float]]:
    """Point-to-point time between two ranks: ``(bytes, median one-way ms)`` per message size (half the median
    round trip of a message bounced between rank 0 and rank 1)."""
    check_devices(2, device)
    sizes = sizes or [2 ** k for k in range(4, 25, 2)]
    ranks = Ranks(2, rank_module.pingpong, [(sizes, repeats, warmup)] * 2, device=device, threads=1,
                  timeout_s=timeout_s)
    try:
        return ranks.gather(timeout_s * len(sizes))[0]
    finally:
        ranks.close()


def _to_cpu(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value
