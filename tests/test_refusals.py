"""What whole-graph capture cannot take is refused with one ``CaptureError`` that names the module path and the source
line and suggests ``torch.compile(model, backend="opweave")``; a model that raises is refused naming where."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import opweave
from opweave.capture import CaptureError

HERE = "test_refusals.py:"


class Block(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.fc, self.inner = nn.Linear(4, 4), inner

    def forward(self, x):
        return self.inner(self.fc(x))


class Wrapper(nn.Module):
    """The refused code sits two modules deep: ``body.1.inner``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), Block(inner))

    def forward(self, x):
        return self.body(x) + 1


class DataDependentIf(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class NumpyOp(nn.Module):
    def forward(self, x):
        return torch.from_numpy(np.tanh(x.detach().numpy()))


class NumpyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(np.sinh(x.detach().numpy()))

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomFunction(nn.Module):
    def forward(self, x):
        return NumpyFunction.apply(x)


def refusal(inner: nn.Module) -> str:
    with pytest.raises(CaptureError) as err:
        opweave.compile(Wrapper(inner).eval(), (torch.randn(3, 4),))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot capture Wrapper as one graph at body.1.inner (")
    assert 'torch.compile(model, backend="opweave")' in message
    return message


def test_data_dependent_control_flow():
    message = refusal(DataDependentIf())
    assert HERE in message and "`if x.sum() > 0:`" in message
    assert "control flow" in message and "data-dependent" in message


def test_unsupported_op():
    message = refusal(NumpyOp())
    assert HERE in message and "np.tanh(x.detach().numpy())" in message and "numpy" in message


def test_custom_autograd_function_that_cannot_be_traced():
    message = refusal(CustomFunction())
    assert "(CustomFunction)" in message and "np.sinh(x.detach().numpy())" in message


def test_custom_autograd_function_whose_forward_traces_is_captured():
    class Clamp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clamp(min=0) * 3

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Uses(nn.Module):
        def forward(self, x):
            return Clamp.apply(x) + 1

    model, x = Wrapper(Uses()).eval(), torch.randn(3, 4)
    compiled = opweave.compile(model, (x,), scheduler="lios")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_a_model_that_raises():
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError(f"expected 3 channels, got {x.shape[1]}")

    with pytest.raises(CaptureError) as err:
        opweave.compile(Wrapper(Raises()), (torch.randn(3, 4),))
    message = str(err.value)
    assert message.startswith("Wrapper raises on the example inputs at body.1.inner (Raises), ")
    assert HERE in message and message.endswith("ValueError: expected 3 channels, got 4")
