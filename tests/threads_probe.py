"""A model whose outputs say how many intra-op threads each of two of its ops ran with: ``seen(x)`` is a custom op
(opaque to Inductor, which calls it from its compiled code) returning ``x``'s shape filled with
``torch.get_num_threads()`` of the thread that runs it. A module of its own, so that rank processes import it (and
register the op) when they unpickle the graph that calls ``seen``."""

from __future__ import annotations

import torch
from torch import fx, nn


@torch.library.custom_op("opweave_probe::threads_seen", mutates_args=())
def threads_seen(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float(torch.get_num_threads()))


@threads_seen.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def seen(x: torch.Tensor) -> torch.Tensor:
    return threads_seen(x)


fx.wrap("seen")  # one call_function node in a traced graph, called by name where the graph runs


class Probe(nn.Module):
    """Two branches, each reporting the threads it ran with, and their sum."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return seen(self.a(x)), seen(self.b(x)), torch.relu(self.a(x)) + self.b(x)


class Plain(nn.Module):
    """Two branches and their sum, nothing ONNX cannot export."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.sigmoid(self.b(x))


def probe():
    torch.manual_seed(0)
    return Probe().eval(), (torch.randn(4, 16),)


def plain():
    torch.manual_seed(0)
    return Plain().eval(), (torch.randn(4, 16),)
