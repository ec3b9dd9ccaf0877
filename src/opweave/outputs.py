"""Whether an output equals eager's: the one rule every check in opweave uses (capture's verification, ``opweave
bench`` and ``run --check``, the third-party coverage, the benchmarks and the tests; docs/design.md §4.1).

Two outputs are equal when they have the same structure (tuples, lists, dicts, ``ModelOutput``), every tensor has
eager's shape and dtype, integer and boolean tensors and non-tensor leaves are equal, and every floating-point
tensor is within its dtype's tolerance (:data:`TOLERANCE`) times its own scale, max(1, its largest finite
|eager value|); NaNs and infinities must stand where eager's do. Where an output may round unlike eager (BatchNorm
folded by coarsening, TF32 convolutions, fp16, fused kernels), a tensor beyond that tolerance is still right when it
is no farther from the model run in float64 (``exact``, :func:`exact_outputs`) than :data:`EXACT_FACTOR` times
eager is.

>>> import torch
>>> compare(torch.tensor([100.0, 0.0]), torch.tensor([100.05, 0.0]))  # 0.05 <= 1e-3 x 100
Comparison(ok=True, max_diff=0.05..., scale=100.0, tolerance=0.001, relative=0.0005..., reason='')
>>> compare((torch.ones(2), torch.tensor(3)), (torch.ones(2), torch.tensor(4))).reason
'output 1 differs'
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

# Relative tolerance by dtype: what "within the dtype's tolerance" means.
TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
EXACT_FACTOR = 3.0  # a tensor may be this many times farther from the float64 run than eager is


class Comparison(NamedTuple):
    """The verdict, and over the floating-point tensors: the largest absolute difference, the scale max(1, largest
    finite |eager value|), the relative tolerance applied (the largest, where their dtypes differ; ``max_diff`` is
    within ``tolerance * scale`` whenever ``ok`` without ``exact``), and the largest difference of a tensor relative
    to its own scale. ``max_diff`` and ``relative`` are ``inf`` where the structure, a shape, a dtype or an exact
    value differs. ``reason`` is one line naming the first wrong output, empty when ``ok``."""

    ok: bool
    max_diff: float
    scale: float
    tolerance: float
    relative: float
    reason: str


def compare(expected: Any, got: Any, dtype: torch.dtype | None = None, exact: Any = None, *,
            tolerance: float | None = None) -> Comparison:
    """Whether ``got`` equals ``expected`` (eager's output) by the module's rule.

    ``tolerance`` replaces the dtype's relative tolerance (``dtype``'s when given, else each tensor's own) for a
    caller whose check is stricter than eager's dtype allows: the third-party coverage and the fused CPU benchmark
    hold float32 outputs to 1e-4. ``exact``, the float64 output of the model on the same inputs, admits a tensor as
    close to it as eager is (:data:`EXACT_FACTOR`)."""
    want, want_spec = pytree.tree_flatten(expected)
    have, have_spec = pytree.tree_flatten(got)
    if want_spec != have_spec:
        return _wrong(f"output structure {have_spec} instead of {want_spec}")
    exacts = pytree.tree_leaves(exact) if exact is not None else [None] * len(want)
    max_diff, scale, relative, tolerances, reason = 0.0, 1.0, 0.0, [], ""
    for i, (a, b, e) in enumerate(zip(want, have, exacts, strict=True)):
        if not isinstance(a, torch.Tensor):
            if a != b:
                return _wrong(f"output {i} is {b!r} instead of {a!r}")
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return _wrong(f"output {i} is {_describe(b)} instead of {_describe(a)}")
        if not a.is_floating_point():
            if not torch.equal(a, b.to(a.device)):
                return _wrong(f"output {i} differs")
            continue
        tol = tolerance or TOLERANCE.get(dtype or a.dtype, 1e-3)
        diff, own_scale = _max_diff(a, b), _scale(a)
        max_diff, scale, relative = max(max_diff, diff), max(scale, own_scale), max(relative, diff / own_scale)
        tolerances.append(tol)
        if diff <= tol * own_scale or reason:
            continue
        reason = f"output {i} differs by up to {diff:.3g} (tolerance {tol * own_scale:.3g})"
        if e is not None:
            error, eager_error = _max_diff(e, b), _max_diff(e, a)
            if error <= EXACT_FACTOR * eager_error:
                reason = ""
            else:
                reason += f" and is {error:.3g} from float64, more than {EXACT_FACTOR:g} x eager's {eager_error:.3g}"
    default = tolerance or (TOLERANCE.get(dtype, 1e-3) if dtype is not None else 1e-3)
    return Comparison(not reason, max_diff, scale, max(tolerances, default=default), relative, reason)


def exact_outputs(model: torch.nn.Module, *input_sets: tuple) -> list:
    """``model`` run in float64 (one float64 copy of it) on a float64 copy of each tuple of ``input_sets`` (integer
    inputs as they are): the ``exact`` references of :func:`compare`, one per tuple. ``model`` is left as it is."""
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        return [wide(*(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs))
                for inputs in input_sets]


def _wrong(reason: str) -> Comparison:
    return Comparison(False, math.inf, 1.0, 0.0, math.inf, reason)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in float64; NaN against NaN and an infinity against the same one count as equal."""
    if not a.numel():
        return 0.0
    a, b = a.detach().double(), b.detach().to(a.device).double()
    same = (a == b) | (a.isnan() & b.isnan())
    return float(torch.where(same, 0.0, (a - b).abs()).nan_to_num(nan=math.inf).max())


def _scale(a: torch.Tensor) -> float:
    """max(1, the largest finite |value| of ``a``)."""
    finite = a.detach()[a.detach().isfinite()]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return repr(value)


__all__ = ["EXACT_FACTOR", "TOLERANCE", "Comparison", "compare", "exact_outputs"]
