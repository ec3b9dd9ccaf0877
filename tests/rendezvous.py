"""A real operator that proves concurrency: ``torch.ops.opweave_tests.rendezvous(x)`` returns ``x + 1`` and, while
armed, first waits at a :class:`threading.Barrier` for as many callers as the barrier has parties.

If the ops holding it do not run at the same time, the barrier times out and the op raises
``threading.BrokenBarrierError``: a test that runs two of them on two lanes and gets a result has shown that they
overlapped. It is registered with ``torch.library.custom_op``, so capture sees it as any other operator (one op of
its own, in both the fx and the export route). Unarmed (the default: capture's shape propagation and eager run), it
does not wait.

    with armed(parties=2):
        backend(*inputs)      # BrokenBarrierError unless both rendezvous ops were running at once
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_barrier: threading.Barrier | None = None


@torch.library.custom_op("opweave_tests::rendezvous", mutates_args=())
def rendezvous(x: torch.Tensor) -> torch.Tensor:
    if _barrier is not None:
        _barrier.wait()
    return x + 1


@rendezvous.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@contextmanager
def armed(parties: int = 2, timeout_s: float = 120.0) -> Iterator[threading.Barrier]:
    """Make every rendezvous op wait until ``parties`` of them are waiting (at most ``timeout_s``: ops that do meet
    go on at once, so the bound is generous; a test that expects them not to meet passes a short one)."""
    global _barrier
    _barrier = threading.Barrier(parties, timeout=timeout_s)
    try:
        yield _barrier
    finally:
        _barrier = None


class TwoBranches(nn.Module):
    """x → {rendezvous(x · 2), rendezvous(x − 1)} → sum: two independent ops that must meet at the barrier."""

    def forward(self, x):
        left = torch.ops.opweave_tests.rendezvous(x * 2)
        right = torch.ops.opweave_tests.rendezvous(x - 1)
        return left + right
