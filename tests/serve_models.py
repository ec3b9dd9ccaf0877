"""Small models for the serving tests (``from serve_models import Tiny``): two branching modules between chains,
so that it splits into blocks, and a model whose output has no batch dimension. And :class:`Gate`, which holds an
engine's work until a test lets it go."""

from __future__ import annotations

import threading

import torch
from torch import nn

from opweave.serve.engine import Observer

WAIT_S = 120.0  # the bound of every wait on a server below: generous, it is reached only when something is wrong


class Branchy(nn.Module):
    """Two parallel convolutions concatenated: a module with operator parallelism, like a Fire module."""

    def __init__(self, ch: int):
        super().__init__()
        self.a = nn.Conv2d(ch, ch, 1)
        self.b = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)


class Tiny(nn.Module):
    """stem conv -> Branchy(4) -> Branchy(8) -> pool -> linear(10). Cut points after every chain op and after each
    concatenation; two blocks once one-op segments are merged."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.m1 = Branchy(4)
        self.m2 = Branchy(8)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.m2(self.m1(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Pooled(nn.Module):
    """Sums over the batch: its output has no batch dimension, so its instances must not be stacked."""

    def __init__(self):
        super().__init__()
        self.m = Branchy(3)

    def forward(self, x):
        return self.m(x).sum(0)


class Fan(nn.Module):
    """Each value of its input (1 x 8 x 8 a sample) answered 256 times: 16,384 output values a sample, 64 KiB in
    binary data and about 330 KB in JSON, for a 256-byte input."""

    def forward(self, x):
        return torch.sigmoid(x).repeat(1, 256, 1, 1)


def tiny(batch: int = 1, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(seed)
    model = Tiny().eval()
    return model, (torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


class Gate(Observer):
    """Holds ``engine``'s combined blocks until :meth:`open` and counts the requests it accepted and refused, so that
    a test decides what the engine holds when (a queue full, a drain with requests in flight) instead of racing it:
    the first block to run waits at the gate, the requests behind it stay queued."""

    def __init__(self, engine):
        self.opened = threading.Event()
        self.changed = threading.Condition()
        self.accepted = self.refused = 0
        run = engine.executor.run

        def gated(parts):
            if not self.opened.wait(WAIT_S):
                raise RuntimeError(f"the test kept the gate shut for {WAIT_S:g} s")
            return run(parts)

        engine.executor.run = gated
        engine.observers.append(self)

    def on_submit(self, request) -> None:
        with self.changed:
            self.accepted += 1
            self.changed.notify_all()

    def on_reject(self, model: str) -> None:
        with self.changed:
            self.refused += 1
            self.changed.notify_all()

    def wait_for(self, requests: int) -> None:
        """Until the engine has accepted or refused ``requests`` requests in all (at most :data:`WAIT_S`)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.accepted + self.refused >= requests, WAIT_S):
                raise AssertionError(f"the engine accepted {self.accepted} requests and refused {self.refused} in "
                                     f"{WAIT_S:g} s; the test waited for {requests}")

    def open(self) -> None:
        self.opened.set()


class Silent:
    """A gRPC client stream that sends no message until it is released (``release()``, at most ``wait_s``): a call
    whose headers came and whose message never does."""

    def __init__(self, wait_s: float = 120.0):
        self.released, self.wait_s = threading.Event(), wait_s

    def messages(self):
        self.released.wait(self.wait_s)
        return
        yield

    def release(self) -> None:
        self.released.set()
