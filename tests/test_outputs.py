"""The one output check (:func:`opweave.outputs.compare`): tolerances by dtype relative to each tensor's scale, the
float64 rule for outputs that round unlike eager, structure, shapes, dtypes, integers, NaN and infinities; and
:func:`~opweave.outputs.exact_outputs`, the float64 run it is given."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from opweave.outputs import EXACT_FACTOR, TOLERANCE, compare, exact_outputs


def test_check_is_scaled_to_the_output():
    big = torch.full((4,), 100.0)
    assert compare(big, big + 0.05).ok  # 1e-3 of a scale of 100
    assert not compare(big, big + 0.2).ok
    small = torch.full((4,), 0.01)
    assert compare(small, small + 5e-4).ok and not compare(small, small + 5e-3).ok
    assert compare(small, small + 5e-3, torch.float16).ok  # scale at least 1, fp16 within 1e-2
    pair = (big, small)
    assert compare(pair, (big, small + 0.2)).max_diff == pytest.approx(0.2)


def test_tolerance_comes_from_each_tensors_dtype_unless_given():
    assert TOLERANCE[torch.float32] == 1e-3 and TOLERANCE[torch.float16] == TOLERANCE[torch.bfloat16] == 1e-2
    half = torch.ones(4, dtype=torch.float16)
    assert compare(half, half + 0.0078125).ok  # 2**-7: beyond float32's tolerance, within float16's
    assert not compare(half.float(), half.float() + 0.0078125).ok
    one = torch.ones(3)
    assert compare(one, one + 5e-4).ok and not compare(one, one + 5e-4, tolerance=1e-4).ok  # a stricter caller


def test_a_mode_as_close_to_float64_as_eager_is_right():
    """Folded BatchNorm and TF32 round differently from eager; a mode is right when it is no farther from the
    float64 result than EXACT_FACTOR times eager's distance, even beyond the tolerance around eager."""
    assert EXACT_FACTOR == 3.0
    exact = torch.zeros(4, dtype=torch.float64)
    eager = exact.float() + 0.04  # eager itself is 0.04 from the exact result
    near = compare(eager, exact.float() - 0.1, exact=exact)  # 0.14 from eager, 0.1 <= 3 x 0.04 from exact
    assert near.ok and near.max_diff == pytest.approx(0.14)
    far = compare(eager, exact.float() + 0.2, exact=exact)  # 0.2 > 3 x 0.04
    assert not far.ok and "is 0.2 from float64, more than 3 x eager's 0.04" in far.reason
    assert not compare(eager, exact.float() - 0.1).ok  # without exact: eager's tolerance only
    assert compare(eager, eager + 5e-4, exact=exact).ok  # within tolerance of eager: right


def test_exact_outputs_run_a_float64_copy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    out, twice = exact_outputs(model, (x,), (2 * x,))
    assert out.dtype == torch.float64 and next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        wide = model.double()
        torch.testing.assert_close(out, wide(x.double()))
        torch.testing.assert_close(twice, wide(2 * x.double()))


def test_a_wrong_value_an_integer_and_a_structure_are_seen():
    a = {"x": torch.ones(3), "n": torch.tensor(2)}
    assert compare(a, {"x": torch.ones(3), "n": torch.tensor(2)}).max_diff == 0.0
    assert compare(a, {"x": torch.tensor([1.0, 1.0, 1.01]), "n": torch.tensor(2)}).relative > 1e-4
    wrong_int = compare(a, {"x": torch.ones(3), "n": torch.tensor(3)})
    assert wrong_int.max_diff == math.inf and wrong_int.reason == "output 1 differs"  # leaves in order: x, n
    structure = compare(a, (torch.ones(3), torch.tensor(2)))
    assert structure.max_diff == math.inf and structure.reason.startswith("output structure")
    assert compare(torch.ones(2), torch.ones(2, dtype=torch.float64)).reason == \
        "output 0 is a float64 tensor of shape (2,) instead of a float32 tensor of shape (2,)"
    assert compare((1, "a"), (1, "b")).reason == "output 1 is 'b' instead of 'a'"


def test_each_tensor_is_held_to_its_own_scale():
    """A small output is not excused by a large one beside it; the figures are the whole output's."""
    big, small = torch.full((2,), 1000.0), torch.full((2,), 0.5)
    assert compare((big, small), (big + 0.5, small)).ok  # 0.5 <= 1e-3 x 1000
    wrong = compare((big, small), (big, small + 0.5))
    assert not wrong.ok and wrong.reason == "output 1 differs by up to 0.5 (tolerance 0.001)"
    assert wrong.max_diff == 0.5 and wrong.scale == 1000.0 and wrong.relative == 0.5
    both = compare((big, small), (big + 0.5, small + 2e-4))
    assert both.ok and both.max_diff == 0.5 and both.relative == pytest.approx(5e-4)
    assert both.max_diff <= both.tolerance * both.scale


def test_nan_and_infinities_must_stand_where_eagers_do():
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    assert compare(x, x.clone()).ok and compare(x, x.clone()).scale == 1.0  # equal_nan; scale of the finite values
    moved = torch.tensor([math.nan, 1.0, math.inf, -math.inf])
    assert not compare(x, moved).ok and compare(x, moved).max_diff == math.inf
    assert not compare(x, torch.tensor([1.0, math.nan, -math.inf, -math.inf])).ok


def test_empty_tensors_and_outputs_without_floats_are_equal():
    assert compare(torch.ones(0, 3), torch.ones(0, 3)).ok
    assert compare((torch.tensor([1, 2]), None, 3), (torch.tensor([1, 2]), None, 3)) == (True, 0.0, 1.0, 1e-3, 0.0, "")
