"""Builds off the callers' threads: :class:`Builder`, one daemon thread per builder, and :data:`BACKGROUND`, the
process's, on which a compiled model builds what a new input size needs while the call that met it runs on what is
built (a segment compiled for the new sizes, a plan for a new signature: :mod:`opweave.backends.segments`,
:mod:`opweave.pipeline.signatures`)."""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from opweave.backends.threads import enter_budget
from opweave.cores import intra_op_threads
from opweave.errors import first_line


class Builder:
    """Builds off the callers' threads: one daemon thread, jobs in the order asked, each on one intra-op thread (the
    cores stay with the calls: :mod:`opweave.backends.threads` says why a worker's OpenMP team stays at one). A job
    asked for while it is queued or running is not queued again. ``failed``: one line per job that raised (the
    calls that asked for it ran on what was built). When the interpreter exits, the jobs queued are dropped and the
    one running is waited for: a thread that used torch's intra-op pool and is still alive at teardown aborts the
    process."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._jobs: deque[tuple[Hashable, Callable[[], Any], str]] = deque()
        self.pending: set[Hashable] = set()
        self.failed: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        atexit.register(self.stop)

    def submit(self, key: Hashable, job: Callable[[], Any], name: str = "") -> bool:
        """Queue ``job`` under ``key``; False if a job of that key is queued or running already."""
        with self._lock:
            if key in self.pending or self._stopped:
                return False
            self.pending.add(key)
            self._jobs.append((key, job, name))
            if self._thread is None:
                ready = threading.Event()
                with intra_op_threads():  # its one thread sets the process-wide default too: put it back
                    self._thread = threading.Thread(target=self._work, args=(ready,), name="opweave-builder",
                                                    daemon=True)
                    self._thread.start()
                    ready.wait()
            self._lock.notify_all()
        return True

    def stop(self) -> None:
        """Drop the jobs queued and end the thread once the job it runs is done."""
        with self._lock:
            self._stopped = True
            for key, _, _ in self._jobs:
                self.pending.discard(key)
            self._jobs.clear()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no job is queued or running (False if ``timeout_s`` passed first)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.pending, timeout_s)

    def _work(self, ready: threading.Event) -> None:
        enter_budget(1)  # an OpenMP team of one: a worker's larger team slows every kernel of the process
        ready.set()
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._jobs) or self._stopped)
                if self._stopped:
                    return
                key, job, name = self._jobs.popleft()
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - the calls keep running on what was built
                self.failed.append(f"{name or key}: {first_line(exc)}")
            finally:
                with self._lock:
                    self.pending.discard(key)
                    self._lock.notify_all()



BACKGROUND = Builder()  # the process's: what a compiled model builds for a new input size


__all__ = ["BACKGROUND", "Builder"]
