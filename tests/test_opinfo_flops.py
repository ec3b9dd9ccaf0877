"""The FLOPs capture records (``capture/opinfo.py``) against ``torch.utils.flop_counter.FlopCounterMode``.

Each case is a small model of compute ops only (conv, linear, matmul/mm/bmm/addmm/baddbmm, einsum, attention), in
the spellings a user writes (modules, functionals, methods, operators), captured both by ``torch.fx`` and, behind
a shape-dependent branch that symbolic tracing cannot follow, by ``torch.export`` (ATen names). The sum of the
captured ops' FLOPs must equal FlopCounterMode's total for one forward of the same model.

Conventions, the same on both sides: a multiply-add is 2 FLOPs; the bias of conv/linear/addmm/baddbmm and every
epilogue (scale, softmax, activation) are not counted; attention counts Q·Kᵀ and P·V (plus the four projections
of ``nn.MultiheadAttention``). Where FlopCounterMode cannot count, the comparison runs it on the path it can:

* ``F.scaled_dot_product_attention`` on CPU dispatches to a fused kernel FlopCounterMode has no formula for (it
  counts 0), so it counts under ``sdpa_kernel(SDPBackend.MATH)``, where attention runs as two batched matmuls;
* ``nn.MultiheadAttention`` under ``no_grad`` takes the fused fast path (also counted as 0), so FlopCounterMode
  runs with autograd on, which takes the composite path (linear projections and ``bmm``).

Differences left out on purpose: ``torch.mv``/``addmv`` and ``dot`` (capture counts 2·M·K; FlopCounterMode has no
formula and counts 0) and RNNs (FlopCounterMode counts 0 for the CPU LSTM kernel), so there is no oracle for them.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from opweave.capture import capture


class Call(nn.Module):
    """``fn(*inputs, *parameters)``: a functional or operator spelling as a module (parameters are fixed)."""

    def __init__(self, fn, *params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(params)

    def forward(self, *inputs):
        return self.fn(*inputs, *self.params)


class Wrapper(nn.Module):
    """The model as a submodule, so that symbolic tracing records its module spelling (one ``call_module``); with
    ``export_only`` behind a branch on a shape, which ``symbolic_trace`` cannot follow: capture takes torch.export."""

    def __init__(self, inner: nn.Module, export_only: bool) -> None:
        super().__init__()
        self.inner, self.export_only = inner, export_only

    def run(self, *inputs):
        if self.export_only and inputs[0].shape[0] == 0:
            return inputs[0]
        return self.inner(*inputs)


class One(Wrapper):  # symbolic_trace needs a fixed number of inputs, not *inputs
    def forward(self, a):
        return self.run(a)


class Two(Wrapper):
    def forward(self, a, b):
        return self.run(a, b)


class Three(Wrapper):
    def forward(self, a, b, c):
        return self.run(a, b, c)


def t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


def self_attention(batch_first: bool) -> tuple[nn.Module, tuple]:
    x = t(2, 7, 16) if batch_first else t(7, 2, 16)
    return nn.MultiheadAttention(16, 4, batch_first=batch_first), (x, x, x)


CASES = {
    "Conv2d": lambda: (nn.Conv2d(4, 8, 3, stride=2, padding=1), (t(2, 4, 9, 9),)),
    "Conv2d-grouped-dilated": lambda: (nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=4), (t(1, 8, 7, 7),)),
    "Conv1d": lambda: (nn.Conv1d(3, 6, 5, bias=False), (t(2, 3, 20),)),
    "Conv3d": lambda: (nn.Conv3d(2, 4, 3), (t(1, 2, 5, 5, 5),)),
    "ConvTranspose2d": lambda: (nn.ConvTranspose2d(8, 4, 3, stride=2, groups=2), (t(1, 8, 5, 5),)),
    "ConvTranspose1d": lambda: (nn.ConvTranspose1d(4, 6, 4, stride=3), (t(2, 4, 9),)),
    "F.conv2d": lambda: (Call(F.conv2d, p(6, 3, 3, 3), p(6)), (t(2, 3, 8, 8),)),
    "F.conv2d-keywords": lambda: (Call(lambda x, w, b: F.conv2d(x, weight=w, bias=b, padding=1), p(6, 3, 3, 3), p(6)),
                                  (t(2, 3, 8, 8),)),
    "Linear-3d": lambda: (nn.Linear(16, 32), (t(2, 5, 16),)),
    "F.linear": lambda: (Call(F.linear, p(12, 16)), (t(3, 16),)),
    "F.linear-keywords": lambda: (Call(lambda x, w, b: F.linear(input=x, weight=w, bias=b), p(12, 16), p(12)),
                                  (t(3, 16),)),  # as timm's EVA attention writes it
    "torch.matmul-2d": lambda: (Call(torch.matmul), (t(5, 7), t(7, 3))),
    "torch.matmul-4d": lambda: (Call(torch.matmul), (t(2, 3, 5, 7), t(2, 3, 7, 4))),
    "torch.matmul-broadcast": lambda: (Call(torch.matmul), (t(4, 5, 7), t(7, 3))),
    "torch.matmul-vector": lambda: (Call(torch.matmul), (t(7), t(7, 3))),
    "operator.matmul": lambda: (Call(operator.matmul), (t(3, 6, 5), t(3, 5, 2))),
    "Tensor.matmul": lambda: (Call(lambda a, b: a.matmul(b)), (t(6, 5), t(5, 2))),
    "torch.mm": lambda: (Call(torch.mm), (t(6, 5), t(5, 2))),
    "torch.bmm": lambda: (Call(torch.bmm), (t(3, 6, 5), t(3, 5, 2))),
    "torch.addmm": lambda: (Call(torch.addmm), (t(6, 2), t(6, 5), t(5, 2))),
    "torch.baddbmm": lambda: (Call(torch.baddbmm), (t(3, 6, 2), t(3, 6, 5), t(3, 5, 2))),
    "torch.einsum": lambda: (Call(lambda a, b: torch.einsum("bij,bjk->bik", a, b)), (t(2, 3, 4), t(2, 4, 5))),
    "sdpa": lambda: (Call(F.scaled_dot_product_attention), (t(2, 4, 8, 16), t(2, 4, 10, 16), t(2, 4, 10, 16))),
    "sdpa-value-dim": lambda: (Call(F.scaled_dot_product_attention), (t(2, 4, 8, 16), t(2, 4, 10, 16),
                                                                       t(2, 4, 10, 24))),
    "MultiheadAttention-self-batch-first": lambda: self_attention(batch_first=True),
    "MultiheadAttention-self": lambda: self_attention(batch_first=False),
    "MultiheadAttention-cross": lambda: (nn.MultiheadAttention(16, 4), (t(8, 2, 16), t(10, 2, 16), t(10, 2, 16))),
    "MultiheadAttention-kdim": lambda: (nn.MultiheadAttention(16, 2, kdim=6, vdim=6, batch_first=True),
                                        (t(2, 8, 16), t(2, 5, 6), t(2, 5, 6))),
}


def flop_counter_total(model: nn.Module, inputs: tuple) -> int:
    """FlopCounterMode's FLOPs for one forward, on the paths it has formulas for (see the module docstring)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("case", list(CASES))
def test_captured_flops_equal_flop_counter_mode(case, route):
    torch.manual_seed(0)
    inner, inputs = CASES[case]()
    model = (One, Two, Three)[len(inputs) - 1](inner, export_only=route == "export").eval()
    cap = capture(model, inputs)
    targets = [o.target for o in cap.graph.ops]
    assert all(target.startswith("aten.") == (route == "export") for target in targets), targets
    compute = [o for o in cap.graph.ops if o.category == "compute"]
    assert compute, targets
    expected = flop_counter_total(model, inputs)
    assert expected > 0
    assert sum(o.flops for o in compute) == expected, {o.target: o.flops for o in cap.graph.ops}
