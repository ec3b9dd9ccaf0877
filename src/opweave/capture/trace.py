"""Capture: ``nn.Module`` + example inputs → an :class:`~opweave.ir.OpGraph` and an executable fx GraphModule.

Pipeline (each step a plain function over the fx graph, as torch.fx passes are):

1. **Trace.** ``torch.fx.symbolic_trace`` first. If it fails (Python control flow on tensor values or shapes, …) or
   its graph does not reproduce eager (step 5), ``torch.export.export(strict=False)`` is tried:
   ``ep.run_decompositions({})`` functionalizes the graph (in-place and aliasing ops disappear; high-level ATen ops
   such as ``aten.conv2d``/``aten.linear`` stay) and ``ep.module()`` turns it back into a GraphModule whose
   parameters are ``get_attr`` nodes and whose inputs/outputs go through pytree specs, which :meth:`Captured.bind`
   and :meth:`Captured.output` undo with ``graph.process_inputs``/``process_outputs``. Its ``_guards_fn`` input
   guard is dropped: ``bind`` checks input shapes and dtypes itself. If both fail: :class:`CaptureError` naming the
   model class and both reasons.
2. **Fold BN** (``fold_bn=True``, fx route, eval models only): :func:`~opweave.capture.coarsen.fold_batchnorm`, every
   BatchNorm module that alone reads a Conv/Linear module's output folded into its weights.
3. **In-place → out-of-place** (:mod:`.functionalize`), where that keeps eager's meaning; otherwise the op stays
   in place and step 6 orders it with ``war`` edges. (``x += y`` on a traced tensor is already recorded by fx as
   ``operator.add`` and a rebinding; if eager's result depended on the mutation through another name, step 5
   catches the difference and export, which functionalizes, is used instead.)
4. **Shapes** by ``torch.fx.passes.shape_prop.ShapeProp`` on clones of the example inputs.
5. **Verify** (``verify=True``, models in eval mode): the captured module's output must equal eager's.
6. **Partition** (:mod:`.partition`): fx nodes grouped into ops (a real node plus the view-like nodes hanging off
   it), data edges between ops, the :class:`~opweave.ir.OpGraph`; :class:`~.runtime.Captured` runs it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from opweave.capture.coarsen import fold_batchnorm
from opweave.capture.functionalize import rewrite_inplace
from opweave.capture.partition import build_graph, partition
from opweave.capture.runtime import Captured
from opweave.errors import CaptureError


def capture(model: nn.Module, example_inputs: tuple, *, fold_bn: bool = False, name: str | None = None,
            verify: bool = True) -> Captured:
    """Capture ``model`` run on ``example_inputs`` (see the module docstring for the steps).

    ``verify`` compares the captured module's output with eager's on the example inputs (skipped for models in
    training mode, whose dropout makes outputs random); a mismatch on the fx route falls back to torch.export.
    Cost: two forward passes (ShapeProp and eager) plus tracing.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    model_name = type(model).__name__
    if fold_bn and model.training:
        raise CaptureError(f"cannot fold BatchNorm into convolutions of {model_name}: it is in training mode "
                           "(call model.eval() first)")
    check = verify and not any(m.training for m in model.modules())
    expected: list[Any] = []  # eager output, computed once when needed
    failures: list[str] = []
    for route, trace in (("torch.fx.symbolic_trace", _trace_fx), ("torch.export", _trace_export)):
        try:
            gm = trace(model, example_inputs)
            if fold_bn and route == "torch.export":
                warnings.warn(f"{model_name}: fold_bn applies to symbolic_trace graphs only; not folded", stacklevel=2)
            elif fold_bn:
                gm = fold_batchnorm(gm)
            kept = rewrite_inplace(gm)
            result = _propagate_shapes(gm, example_inputs)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means "try the next route"
            failures.append(f"{route} failed: {_first_line(exc)}")
            continue
        if check:
            if not expected:
                with torch.no_grad():
                    expected.append(model(*_clone(example_inputs)))
            problem = _compare(result, expected[0])
            if problem:
                failures.append(f"{route} gave a graph whose output differs from eager ({problem})")
                continue
        nodes, owner = partition(gm, kept)
        graph = build_graph(gm, nodes, owner, kept, name or model_name)
        return Captured(graph, gm, nodes)
    raise CaptureError(f"cannot capture {model_name}: " + "; ".join(failures))


# ---- 1. tracing ---------------------------------------------------------------------------------------------------
def _trace_fx(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    return fx.symbolic_trace(model)


def _trace_export(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    program = torch.export.export(model, example_inputs, strict=False).run_decompositions({})
    gm = program.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line[:300]}"


# ---- 4./5. shapes and verification --------------------------------------------------------------------------------
def _clone(values: tuple) -> tuple:
    return tuple(pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, values))


def _propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> Any:
    for node in gm.graph.nodes:
        node.meta.pop("tensor_meta", None)
        node.meta.pop("type", None)
    with torch.no_grad():
        return ShapeProp(gm).propagate(*_clone(example_inputs))


def _compare(actual: Any, expected: Any) -> str | None:
    """None if the two outputs have the same structure and close values, else what differs."""
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    if got_spec != want_spec:
        return f"output structure {got_spec} instead of {want_spec}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                return f"output {i} is {_describe(a)} instead of {_describe(b)}"
            if not b.is_floating_point():
                if not torch.equal(a, b):
                    return f"output {i} differs"
                continue
            tol = 1e-2 if b.dtype in (torch.float16, torch.bfloat16) else 1e-3
            scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
            if not torch.allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=True):
                return f"output {i} differs by up to {float((a.double() - b.double()).abs().max()):.3g}"
        elif a != b:
            return f"output {i} is {a!r} instead of {b!r}"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return repr(value)


