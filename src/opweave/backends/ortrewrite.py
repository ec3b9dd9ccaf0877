"""Rewrites of a segment's graph before it is exported for ONNX Runtime: the same values, computed by the kernels
ONNX Runtime runs fast.

ONNX Runtime's CPU kernels are uneven: some ops that Inductor fuses or runs in channels-last are slow there in
the form ``torch.onnx`` exports them, and a model whose time goes to them loses to ``torch.compile`` although its
convolutions run as fast. Three forms are rewritten (:func:`rewrite`), each chosen from ONNX Runtime's profiler
(kernel time per call; the measurements: docs/design.md, §3.6, segments):

* **average pooling as a depthwise convolution.** ONNX Runtime runs ``AveragePool`` several times slower than a
  depthwise ``Conv`` with the pool's constant weights, and NASNet-A mobile's many 3x3 pools make it a large share
  of that model's time. A pool that leaves the padding out of its mean (``count_include_pad=False``) sums with
  weights of one and multiplies by one over each output position's count of real inputs, a constant of the
  output's height and width. Rewritten only with ``ceil_mode=False`` and no ``divisor_override``, and only where
  the export has fixed sizes except the batch (the weights are sized by the channels, the counts by height and
  width).
* **a sum over a stack as a sum of its parts.** RandWire's aggregation ``(torch.stack(xs) * w).sum(0)`` exports as
  ``Unsqueeze``/``Concat``/``Mul``/``ReduceSum``, a large share of the model's time, ``ReduceSum`` over the first
  axis the most of it; written ``xs[0] * w[0] + xs[1] * w[1] + ...`` (the stack never made) the whole model runs
  faster. Rewritten where the stack is read only by the product (or the sum) and the weight's rank is known
  (recorded shapes).
* **a zero pad cropped by a slice as one pad.** NASNet's factorized reduction shifts a tensor by a pixel,
  ``F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]``: a ``Pad`` and two ``Slice`` copies, where one ``Pad`` with negative
  amounts (which crop, in ONNX as in ``F.pad``) makes one copy and runs faster. Rewritten where the slice only
  crops the padded dimensions, by steps of one, and sizes are fixed.

And one form is rewritten so that the TorchScript exporter takes it at all (without it the segment goes to the
``torch.export``-based exporter, far slower per segment than the TorchScript one):

* **a dtype conversion of an exported graph** (``aten._to_copy(x, dtype=d)``, which the TorchScript exporter has no
  symbolic for) as ``aten.to(x, d)``: in an ONNX graph both are one ``Cast``.

A rewrite changes the order of a sum, nothing else; segments are checked against the model as every compiled one
is. Shapes come from the shapes capture recorded (``tensor_meta``); a node without them is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

_AVG_POOL_FUNCTIONS = (F.avg_pool2d, torch.ops.aten.avg_pool2d.default)
_STACKS = (torch.stack, torch.ops.aten.stack.default)
_MULS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
_SUMS = (torch.sum, torch.ops.aten.sum.dim_IntList)


def rewrite(gm: fx.GraphModule, *, fixed_sizes: bool = True) -> tuple[fx.GraphModule, dict[str, int]]:
    """``gm`` with the rewrites of the module docstring (a new GraphModule: ``gm`` is left as it is), and how many
    of each were made (``pools``, ``stacks``, ``crops``, ``casts``). ``fixed_sizes``: the export keeps every size
    but the batch (pools and crops are rewritten only then)."""
    new = fx.GraphModule(gm, _copy(gm.graph))
    counts = {"pools": 0, "stacks": 0, "crops": 0, "casts": 0}
    for node in list(new.graph.nodes):
        if _cast_as_to(node):
            counts["casts"] += 1
        elif fixed_sizes and _pool_as_conv(new, node):
            counts["pools"] += 1
        elif fixed_sizes and _crop_as_pad(new.graph, node):
            counts["crops"] += 1
        elif _stack_sum_as_adds(new.graph, node):
            counts["stacks"] += 1
    if any(counts.values()):  # each rewrite erased what it made dead (no graph-wide pass: in-place ops stay)
        new.graph.lint()
        new.recompile()
    return new, counts


def _copy(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def _shape(node) -> torch.Size | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(meta, "shape", None)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[-1] if len(value) > 1 else value[0]))


def _pool_parameters(gm: fx.GraphModule, node: fx.Node) -> dict | None:
    """The average pool ``node`` is, as keyword arguments of ``F.avg_pool2d`` (with its input ``x``), or None."""
    if node.op == "call_module" and isinstance(module := gm.get_submodule(str(node.target)), nn.AvgPool2d):
        if node.kwargs or len(node.args) != 1:
            return None
        return {"x": node.args[0], "kernel_size": module.kernel_size, "stride": module.stride,
                "padding": module.padding, "ceil_mode": module.ceil_mode,
                "count_include_pad": module.count_include_pad, "divisor_override": module.divisor_override}
    if node.op == "call_function" and node.target in _AVG_POOL_FUNCTIONS:
        names = ("x", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
        given = dict(zip(names, node.args, strict=False)) | {("x" if k == "input" else k): v
                                                             for k, v in node.kwargs.items()}
        if set(given) - set(names) or "kernel_size" not in given:
            return None
        defaults = {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True,
                    "divisor_override": None}
        parameters = defaults | given
        if not parameters["stride"]:
            parameters["stride"] = parameters["kernel_size"]
        return parameters
    return None


def _pool_as_conv(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Replace the average pool ``node`` by a depthwise convolution (module docstring); whether it was."""
    pool = _pool_parameters(gm, node)
    if pool is None or pool["ceil_mode"] or pool["divisor_override"] is not None:
        return False
    x, shape, out = pool["x"], _shape(pool["x"]), _shape(node)
    if not isinstance(x, fx.Node) or shape is None or out is None or len(shape) != 4 or len(out) != 4:
        return False
    meta = x.meta["tensor_meta"]
    if not meta.dtype.is_floating_point:
        return False
    (kh, kw), stride, padding = _pair(pool["kernel_size"]), _pair(pool["stride"]), _pair(pool["padding"])
    if padding[0] * 2 > kh or padding[1] * 2 > kw:
        return False
    channels = shape[1]
    exclude = not pool["count_include_pad"] and any(padding)
    weight = torch.full((channels, 1, kh, kw), 1.0 if exclude else 1.0 / (kh * kw), dtype=meta.dtype)
    prefix = f"_ortrewrite_{node.name}"
    gm.register_buffer(f"{prefix}_weight", weight)
    graph = gm.graph
    with graph.inserting_before(node):
        conv = graph.call_function(F.conv2d, (x, graph.get_attr(f"{prefix}_weight"), None, stride, padding, 1,
                                              channels))
        conv.meta = dict(node.meta)
        result = conv
        if exclude:  # one over each output position's count of real (not padded) inputs
            ones = torch.ones(1, 1, shape[2], shape[3], dtype=meta.dtype)
            counts = F.avg_pool2d(ones, (kh, kw), stride, padding, count_include_pad=True, divisor_override=1)
            gm.register_buffer(f"{prefix}_scale", (1.0 / counts).to(meta.dtype))
            result = graph.call_function(operator.mul, (conv, graph.get_attr(f"{prefix}_scale")))
            result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True


def _crop_as_pad(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace ``F.pad(x, pads)[slices]`` (zero padding, the slices cropping only padded dimensions, steps of one)
    at the ``getitem`` ``node`` by one ``F.pad`` whose negative amounts crop (module docstring); whether it was."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return False
    pad, index = node.args[0], tuple(node.args[1])  # a tuple: checked above
    if not isinstance(pad, fx.Node) or pad.op != "call_function" or pad.target is not F.pad or len(pad.users) != 1:
        return False
    args = dict(zip(("input", "pad", "mode", "value"), pad.args, strict=False)) | dict(pad.kwargs)
    x, amounts = args.get("input"), args.get("pad")
    shape, out = _shape(pad), _shape(node)
    if (args.get("mode", "constant") != "constant" or args.get("value") not in (None, 0, 0.0) or shape is None
            or out is None or not isinstance(x, fx.Node) or not isinstance(amounts, (tuple, list))
            or not all(isinstance(a, int) for a in amounts) or len(amounts) % 2):
        return False
    if Ellipsis in index or not all(isinstance(i, slice) for i in index) or len(index) > len(shape):
        return False
    padded = len(amounts) // 2  # the last dimensions, the last first in ``amounts``
    new = list(amounts)
    for dim, cut in enumerate(index):
        start, stop, _ = cut.indices(shape[dim])
        if cut.step not in (None, 1) or stop < start:
            return False
        if start == 0 and stop == shape[dim]:
            continue
        back = len(shape) - 1 - dim  # position from the last dimension
        if back >= padded:
            return False  # a dimension that was not padded is cut: left as it is
        new[2 * back] -= start
        new[2 * back + 1] -= shape[dim] - stop
        size = shape[dim] - amounts[2 * back] - amounts[2 * back + 1]  # the input's
        if size + min(0, new[2 * back]) + min(0, new[2 * back + 1]) < 0:
            return False  # the slice lies within the padding: a pad cannot crop more than the input has
    with graph.inserting_before(node):
        crop = graph.call_function(F.pad, (x, tuple(new)))
    crop.meta = dict(node.meta)
    node.replace_all_uses_with(crop)
    graph.erase_node(node)
    graph.erase_node(pad)
    return True


def _sum_dim0(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` sums over its first dimension only (no keepdim, no dtype), or None."""
    if not (node.op == "call_method" and node.target == "sum" or node.op == "call_function" and node.target in _SUMS):
        return None
    source, rest, kwargs = node.args[0], node.args[1:], dict(node.kwargs)
    dim = rest[0] if rest else kwargs.pop("dim", None)
    keepdim = rest[1] if len(rest) > 1 else kwargs.pop("keepdim", False)
    if kwargs or len(rest) > 2 or keepdim or dim not in (0, (0,), [0]) or not isinstance(source, fx.Node):
        return None
    return source


def _stack_parts(node) -> list[fx.Node] | None:
    """The tensors the stack ``node`` stacks along a new first dimension, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _STACKS:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    parts = node.args[0]
    if dim != 0 or len(node.users) != 1 or not isinstance(parts, (list, tuple)) or not parts:
        return None
    nodes = [p for p in parts if isinstance(p, fx.Node)]
    return nodes if len(nodes) == len(parts) else None


def _stack_sum_as_adds(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace ``stack(xs).sum(0)`` or ``(stack(xs) * w).sum(0)`` (either factor first) at the sum ``node`` by a
    chain of adds (module docstring); whether it was."""
    source, out = _sum_dim0(node), node.meta.get("tensor_meta")
    if source is None or out is None or not out.dtype.is_floating_point:  # an integer sum widens: left as it is
        return False
    parts, weight, aligned, shape = _stack_parts(source), None, False, None
    if parts is None:
        if source.op != "call_function" or source.target not in _MULS or len(source.users) != 1 or source.kwargs:
            return False
        a, b = source.args
        parts, weight = (_stack_parts(a), b) if _stack_parts(a) is not None else (_stack_parts(b), a)
        if parts is None:
            return False
        stacked = _shape(a if weight is b else b)
        if isinstance(weight, fx.Node):
            shape = _shape(weight)
            if shape is None or stacked is None or len(shape) > len(stacked):
                return False
            aligned = len(shape) == len(stacked)  # its first dimension is the stack's: one row per part
            if aligned and shape[0] not in (1, len(parts)):
                return False
        elif not isinstance(weight, (int, float)):
            return False
    total: fx.Node | None = None
    with graph.inserting_before(node):
        for i, part in enumerate(parts):
            term = part
            if weight is not None:
                factor = weight
                if isinstance(weight, fx.Node) and aligned and shape is not None:
                    factor = graph.call_function(operator.getitem, (weight, i if shape[0] > 1 else 0))
                term = graph.call_function(operator.mul, (part, factor))
            total = term if total is None else graph.call_function(operator.add, (total, term))
    if total is parts[0]:  # one part, no weight: the sum is the part itself (a new tensor)
        with graph.inserting_before(node):
            total = graph.call_method("clone", (parts[0],))
    assert total is not None
    total.meta = dict(node.meta)
    node.replace_all_uses_with(total)
    graph.erase_node(node)
    for dead in (source, *[n for n in source.all_input_nodes if n.target in _STACKS]):  # the product, the stack
        if not dead.users:
            graph.erase_node(dead)
    return True


def _cast_as_to(node: fx.Node) -> bool:
    """Replace ``aten._to_copy(x, dtype=d)`` (no other argument) by ``aten.to.dtype(x, d)`` (module docstring);
    whether it was."""
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default or len(node.args) != 1:
        return False
    if set(node.kwargs) != {"dtype"}:
        return False
    node.target = torch.ops.aten.to.dtype
    node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}
    return True
