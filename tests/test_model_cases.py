"""What real models bring that the zoo does not: layouts that depend on the kernel a lane picks, half precision,
channels_last, several and keyword inputs, structured outputs, in-place ops, state the forward mutates, integer and
boolean tensors, zero-size dimensions, scalar outputs; compiling leaves the model unchanged; errors name the cause.

Every case runs under every scheduler of the coverage suite, called with autograd on (as a user calls a model) and
under ``no_grad``, and must equal eager.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave.api import compile_captured
from opweave.capture import CaptureError, capture
from opweave.evaluate.coverage import SCHEDULERS
from opweave.outputs import compare


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in {**dict(model.named_parameters()),
                                                 **dict(model.named_buffers())}.items()}


def assert_bit_identical(before: dict, model: nn.Module) -> None:
    after = state(model)
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert tensor.dtype == after[key].dtype and torch.equal(tensor, after[key]), key


def assert_compiles_equal(model: nn.Module, args: tuple, kwargs: dict | None = None, *, tol: float = 1e-5,
                          schedulers=SCHEDULERS):
    """Every scheduler, called with grad on and under no_grad, equals eager; the model is unchanged."""
    kwargs = kwargs or {}
    before = state(model)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    captured = capture(model, args, example_kwargs=kwargs)
    for scheduler in schedulers:
        compiled = compile_captured(captured, captured.example_inputs, scheduler=scheduler, streams=4)
        for mode in (contextlib.nullcontext(), torch.no_grad()):
            with mode:
                got = compiled(*args, **kwargs)
            assert compare(expected, got).relative <= tol, (scheduler, compare(expected, got).relative)
    assert_bit_identical(before, model)
    return captured


# ---- item 1: a layout that depends on the lane -------------------------------------------------------------------
class BiasedAttention(nn.Module):
    """T5's pattern in small: attention with a bias computed in the graph, ``transpose().contiguous().view()`` after
    it, and a shape-dependent branch that sends capture through torch.export.

    CPU ``scaled_dot_product_attention`` takes its flash kernel (output in (B, L, H, E) memory order) when no input
    requires grad, its math kernel (contiguous) otherwise; the bias requires grad exactly when autograd is on. Export
    traced the flash layout and dropped the ``contiguous()``, so the ``view`` failed on the worker-thread lanes, which
    ran with autograd on, but not in the caller's thread under ``no_grad``."""

    def __init__(self, d: int = 32, heads: int = 4, length: int = 16):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(1, heads, length, length))

    def forward(self, x):
        b, n, d = x.shape
        if x.shape[1] > 4:  # symbolic_trace cannot take this: capture goes through torch.export
            x = x * 2
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 0.5)
        return self.out(o.transpose(1, 2).contiguous().view(b, n, d))


def test_attention_whose_layout_depends_on_autograd_equals_eager_on_every_lane():
    torch.manual_seed(0)
    cap = assert_compiles_equal(BiasedAttention().eval(), (torch.randn(1, 16, 32),))
    assert any(o.target == "aten.scaled_dot_product_attention" for o in cap.graph.ops)


def test_every_lane_runs_without_autograd_whatever_the_caller_and_the_schedule():
    # Autograd mode is thread-local: worker-thread lanes used to run with it on while a single lane ran in the
    # caller's mode, so the same call built autograd graphs (and took other kernels) depending on the schedule.
    torch.manual_seed(0)
    model, x = BiasedAttention().eval(), torch.randn(1, 16, 32)
    captured = capture(model, (x,))
    for scheduler in SCHEDULERS:
        compiled = compile_captured(captured, (x,), scheduler=scheduler, streams=4)
        for mode in (contextlib.nullcontext(), torch.no_grad()):
            with mode:
                assert not compiled(x).requires_grad, scheduler


def test_exported_views_accept_another_layout_of_the_same_shape():
    class Flatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

        def forward(self, x):
            if x.shape[2] > 2:  # through torch.export, which writes flatten as a view of the traced strides
                x = x + 1
            return self.fc(self.conv(x).flatten(1))

    torch.manual_seed(0)
    model, x = Flatten().eval(), torch.randn(1, 3, 8, 8)
    compiled = opweave.compile(model, (x,), scheduler="lios")
    other = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        assert compare(model(other), compiled(other)).relative <= 1e-5


# ---- item 3 ---------------------------------------------------------------------------------------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.norm, self.fc = nn.BatchNorm2d(16), nn.Linear(16, 5)

    def forward(self, x):
        y = torch.cat([self.a(x).relu(), self.b(x).sigmoid()], 1)
        return self.fc(self.norm(y).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_and_inputs(dtype):
    torch.manual_seed(0)
    model = Branchy().eval().to(dtype)
    cap = assert_compiles_equal(model, (torch.randn(2, 3, 16, 16, dtype=dtype),), tol=1e-2)
    assert {o.dtype for o in cap.graph.ops if o.dtype} == {str(dtype).removeprefix("torch.")}


def test_channels_last_weights_and_inputs():
    torch.manual_seed(0)
    model = Branchy().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    assert_compiles_equal(model, (x,))


class ManyInputs(nn.Module):
    """Float, integer and boolean inputs, a keyword argument with a default, and a dict/tuple output holding an
    integer count, a boolean and a 0-dimensional tensor."""

    def __init__(self):
        super().__init__()
        self.proj, self.embed = nn.Linear(4, 4), nn.Embedding(10, 4)

    def forward(self, x, ids, mask=None, scale: float = 1.0):
        h = self.proj(x) + self.embed(ids)
        if mask is not None:
            h = h.masked_fill(~mask[..., None], 0.0)
        return {"hidden": h * scale, "count": (ids > 3).sum(), "stats": (h.amax(), ids.argmax(-1), h.isnan().any())}


def test_several_inputs_keyword_arguments_and_structured_outputs():
    torch.manual_seed(0)
    x, ids, mask = torch.randn(2, 3, 4), torch.randint(0, 10, (2, 3)), torch.rand(2, 3) > 0.5
    assert_compiles_equal(ManyInputs().eval(), (x, ids), {"mask": mask, "scale": 2.0})
    compiled = opweave.compile(ManyInputs().eval(), (x, ids), example_kwargs={"mask": mask})
    out = compiled(x, ids, mask=mask)
    assert out["count"].dtype == torch.int64 and out["stats"][2].dtype == torch.bool and out["stats"][0].dim() == 0


def test_keyword_only_arguments_are_refused_with_their_name():
    class KeywordOnly(nn.Module):
        def forward(self, x, *, bias):
            return x + bias

    with pytest.raises(opweave.errors.UsageError, match="bias"):
        capture(KeywordOnly(), (torch.randn(2),), example_kwargs={"bias": torch.randn(2)})


def test_model_output_is_returned_as_a_model_output():
    from opweave import zoo

    model, inputs = zoo.create("hf:BertModel", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, vocab_size=100, seq_len=8)
    compiled = opweave.compile(model, inputs, scheduler="lios")
    out, expected = compiled(*inputs), model(*inputs)
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
    assert compare(expected, out).relative <= 1e-5


def test_inplace_ops_on_intermediates():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            h[:, 0] = 0.0
            h.mul_(2).add_(1)
            g = self.b(x)
            g += h
            view = g.view(-1)
            view.clamp_(min=-1.0)
            return g.relu_(), h.sigmoid_()

    torch.manual_seed(0)
    assert_compiles_equal(InPlace().eval(), (torch.randn(3, 4),))


def test_a_counter_buffer_is_refused_naming_it_and_left_unchanged():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.calls += 1
            return self.fc(x) * self.calls

    model = Counter()
    before = state(model)
    with pytest.raises(CaptureError, match=r"cannot capture Counter: its forward changes calls"):
        opweave.compile(model, (torch.randn(2, 4),))
    assert_bit_identical(before, model)


def test_a_forward_that_writes_a_parameter_is_refused_naming_it():
    class Drifts(nn.Module):  # parameters are not copied during capture: the write is detected, not undone
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc.bias.add_(1.0)
            return self.fc(x)

    with pytest.raises(CaptureError, match=r"its forward changes fc\.bias .*a parameter was written"):
        opweave.compile(Drifts(), (torch.randn(2, 4),))


def test_batchnorm_in_training_mode_is_refused_naming_its_statistics():
    model = Branchy().train()
    before = state(model)
    with pytest.raises(CaptureError, match=r"norm\.running_mean.*BatchNorm in training mode: call model\.eval\(\)"):
        opweave.compile(model, (torch.randn(2, 3, 8, 8),))
    assert_bit_identical(before, model)


def test_zero_size_dimensions():
    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            both = torch.cat([x, y], 0)
            return self.fc(x), self.fc(both).sum(0), x.new_zeros(0, 2) + 1

    torch.manual_seed(0)
    assert_compiles_equal(Empty().eval(), (torch.randn(0, 4), torch.randn(3, 4)))


def test_scalar_outputs():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).mean()

    torch.manual_seed(0)
    compiled = opweave.compile(Loss().eval(), (torch.randn(5, 4),), scheduler="nimble")
    out = compiled(torch.randn(5, 4))
    assert isinstance(out, torch.Tensor) and out.dim() == 0
    assert_compiles_equal(Loss().eval(), (torch.randn(5, 4),))


def test_compile_with_fold_bn_leaves_the_model_bit_identical():
    torch.manual_seed(0)
    model = Branchy().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    before = state(model)
    x = torch.randn(2, 3, 8, 8)
    compiled = opweave.compile(model, (x,), fold_bn=True, scheduler="lios")
    assert_bit_identical(before, model)
    with torch.no_grad():
        assert compare(model(x), compiled(x)).relative <= 1e-4


def test_a_model_that_raises_names_the_op_shapes_module_and_line():
    class Head(nn.Module):
        def forward(self, x):
            return x @ torch.ones(5, 2)  # wrong inner dimension

    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(4, 4), Head()

        def forward(self, x):
            return self.head(self.fc(x))

    with pytest.raises(CaptureError) as err:
        opweave.compile(Wrong(), (torch.randn(3, 4),))
    message = str(err.value)
    assert message.startswith("Wrong raises on the example inputs at head (Head), ")
    assert "test_model_cases.py" in message and "x @ torch.ones(5, 2)" in message
    assert "3x4 and 5x2" in message and "ShapeProp" not in message and "\n" not in message


def test_an_op_that_fails_at_run_time_names_the_op_and_the_shapes():
    class Gather(nn.Module):
        def forward(self, x, index):
            return x.relu().gather(1, index)

    x, index = torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.long)
    compiled = opweave.compile(Gather(), (x, index), scheduler="lios")
    with pytest.raises(CaptureError, match=r"op 'gather' .*float32\[2, 3\].*int64\[2, 1\].*index 7 is out of bounds"):
        compiled(x, torch.full((2, 1), 7))
