"""The CPUs this process may use, and the calling thread's intra-op thread count: one way to read the first
(:func:`cores`, the process's CPU affinity where the OS has one, not ``os.cpu_count()``, which counts every CPU of
the machine, those a container, ``taskset`` or a Ray replica's pinning keep it off included) and one way to change
the second for a while (:func:`intra_op_threads`, a scoped setting that puts the count back).

``torch.set_num_threads`` sets the calling thread's OpenMP count and also the process-wide default that threads
started later take (:mod:`opweave.backends.threads` says why that matters): putting the caller's count back puts
the default back too. Needs only torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one; every CPU otherwise)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@contextmanager
def intra_op_threads(threads: int | None = None) -> Iterator[int]:
    """Within the block the calling thread runs its kernels on ``threads`` intra-op threads (None: leaves the count
    as it is, for code inside that changes it, such as starting worker threads or a lane with per-op budgets);
    after it, the count it had before, which the block yields.

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with intra_op_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    before = torch.get_num_threads()
    if threads is not None and threads != before:  # a change resizes OpenMP's team at the next kernel: only if asked
        torch.set_num_threads(threads)
    try:
        yield before
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


__all__ = ["cores", "intra_op_threads"]
