"""Facts about single fx nodes that capture needs: a canonical target name, the operator kind and its category
(compute/memory), FLOPs, bytes moved, whether the node is a metadata-only ("trivial") op, and whether it writes one of
its inputs in place (and what its out-of-place twin is).

Every rule is keyed by the *short name* of a target: the last component of its canonical name, lower-cased
(``torch.nn.Conv2d`` → ``conv2d``, ``aten.convolution`` → ``convolution``, ``torch.Tensor.add`` → ``add``), so the
module, functional, method and ATen spellings of one operator share one table entry.

FLOP conventions (multiply-add = 2 FLOPs, bias and activation epilogues ignored):

* conv: 2·N·Cout·Hout·Wout·(Cin/groups)·kh·kw (= 2 · output numel · weight numel / Cout; transposed convs use the
  input numel instead of the output's);
* linear / matmul / mm / bmm / addmm / baddbmm: 2·M·N·K (= 2 · output numel · K); einsum: 2 · product of all index
  sizes; LSTM/GRU/RNN: 2·T·B·gates·H·(I+H) per layer and direction; attention: Q·Kᵀ and P·V, 2·L·S·(E + Ev) per
  batch and head, plus the four projections of ``nn.MultiheadAttention`` (k and v from its ``kdim``/``vdim``);
* pooling: output numel × kernel area; norms and softmax: 5 · numel; reductions: input numel;
* data movement (cat, stack, pad, clone, embedding, gather, …): 0; everything else (elementwise): output numel.

Bytes = bytes read (distinct tensor inputs, plus a module's parameters and buffers) + bytes written (every output
tensor). Embeddings read only the gathered rows, not the whole table.
"""

from __future__ import annotations

import inspect
import math
import operator
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from opweave.ir.kinds import category_of, kind_of, short_name

# Metadata-only ops (a view, a tuple element, a size): no kernel of their own. ``contiguous`` and ``reshape`` may
# copy a non-contiguous input; they are still treated as free (they run right after their producer either way).
TRIVIAL = frozenset(
    "getitem getattr view view_as _unsafe_view reshape reshape_as flatten unflatten size sym_size dim numel "
    "contiguous permute transpose t swapaxes swapdims movedim unsqueeze squeeze expand expand_as chunk split "
    "split_with_sizes tensor_split unbind narrow select slice detach alias identity as_strided "
    "_assert_tensor_metadata _assert_scalar".split()
)
_ASSERTIONS = frozenset({"_assert_tensor_metadata", "_assert_scalar"})
_NON_TENSOR = frozenset({"size", "sym_size", "dim", "numel"}) | _ASSERTIONS
_DROPOUTS = frozenset("dropout dropout1d dropout2d dropout3d alphadropout featurealphadropout alpha_dropout "
                      "feature_alpha_dropout feature_dropout".split())
# Elementwise ops that fuse into the op producing their input (coarsening's epilogues): activations, bias/residual
# adds, scales, clamps. Eval-mode BatchNorm (an affine map per channel) is one too, see :func:`is_epilogue`.
EPILOGUES = frozenset(
    "relu relu6 gelu silu sigmoid tanh hardswish hardsigmoid hardtanh leaky_relu leakyrelu elu selu celu mish "
    "softplus softsign logsigmoid prelu add sub rsub mul div truediv neg clamp clip clamp_min clamp_max".split()
)
_BATCHNORMS = frozenset("batchnorm1d batchnorm2d batchnorm3d batch_norm _native_batch_norm_legit_no_training".split())
# operator.iadd -> operator.add, ...
_INPLACE_OPERATORS = {
    getattr(operator, f"i{n}"): getattr(operator, n)
    for n in "add sub mul truediv floordiv mod pow matmul lshift rshift xor".split()
} | {operator.iand: operator.and_, operator.ior: operator.or_}


# ---- names --------------------------------------------------------------------------------------------------------
def submodule(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The module a ``call_module`` node calls (its attributes read as the module's class has them)."""
    assert isinstance(node.target, str), node.target
    return gm.get_submodule(node.target)


def target_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """Canonical name of what ``node`` runs: ``torch.nn.Conv2d``, ``aten.convolution``, ``torch.cat``,
    ``torch.nn.functional.relu``, ``torch.Tensor.add``, ``operator.add`` (never the node's own name)."""
    if node.op == "call_module":
        cls = type(submodule(gm, node))
        if getattr(nn, cls.__name__, None) is cls:
            return f"torch.nn.{cls.__name__}"
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"torch.Tensor.{node.target}"
    fn = node.target
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = fn.overloadpacket if isinstance(fn, torch._ops.OpOverload) else fn
        return str(packet)
    name = getattr(fn, "__name__", repr(fn))
    module = getattr(fn, "__module__", None)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    for prefix, namespace in (("torch.nn.functional", F), ("torch", torch)):
        if getattr(namespace, name, None) is fn:
            return f"{prefix}.{name}"
    return f"{module}.{getattr(fn, '__qualname__', name)}"


def kind(target: str) -> str:
    """The kind of an op running ``target`` (:func:`opweave.ir.kinds.kind_of`): what capture sets on the op."""
    return kind_of(target)


def category(target: str) -> str:
    """``compute`` or ``memory``, by the op's kind (:func:`opweave.ir.kinds.category_of`)."""
    return category_of(kind_of(target))


# ---- tensor metadata (as ShapeProp leaves it in node.meta["tensor_meta"]) -------------------------------------------
def tensor_metas(meta) -> list:
    """Every TensorMetadata in a (possibly nested) meta value."""
    if meta is None:
        return []
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return [meta]
    if isinstance(meta, dict):
        meta = list(meta.values())
    if isinstance(meta, (list, tuple)):
        return [m for item in meta for m in tensor_metas(item)]
    return []


def node_metas(arg) -> list:
    return tensor_metas(arg.meta.get("tensor_meta")) if isinstance(arg, fx.Node) else []


def nbytes(arg) -> int:
    """Bytes of every tensor the node's value holds (0 for non-tensors)."""
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in node_metas(arg))


def _shape(arg) -> tuple[int, ...] | None:
    metas = node_metas(arg)
    return tuple(metas[0].shape) if metas else None


def _arg(node: fx.Node, index: int, name: str):
    """Argument ``index`` of ``node``'s call, given by position or as the keyword ``name`` (``F.linear(x,
    weight=w)``); None when absent."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _numel(arg) -> int:
    shape = _shape(arg)
    return math.prod(shape) if shape is not None else 0


# ---- trivial ops and in-place ops ---------------------------------------------------------------------------------
def is_trivial(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A metadata-only op (view, tuple element, size, identity, eval-mode dropout) or one whose value holds no tensor
    (shape arithmetic): it launches no kernel of its own."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if "type" in node.meta and not node_metas(node):
        return True  # ShapeProp ran and found no tensor in the value: sizes, shape arithmetic, assertions
    short = short_name(target_name(node, gm))
    if short in _DROPOUTS:
        return _dropout_is_identity(node, gm)
    if short == "getitem":  # x[idx] with a tensor index is a gather (a real op); a slice or tuple element is a view
        return not any(node_metas(index) for index in _flat_nodes(node.args[1:]))
    return short in TRIVIAL


def is_assertion(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A check ``torch.export`` left in the graph (a tensor's dtype and device, a size's range): no value, no
    kernel."""
    return node.op == "call_function" and short_name(target_name(node, gm)) in _ASSERTIONS


def is_alias(node: fx.Node, gm: fx.GraphModule) -> bool:
    """True if the node's value may share storage with its (first) input: the view-like trivial ops."""
    return is_trivial(node, gm) and short_name(target_name(node, gm)) not in _NON_TENSOR and not (
        node.target is getattr and node.args[1] in ("shape", "dtype", "device", "ndim"))


def is_epilogue(node: fx.Node, gm: fx.GraphModule) -> bool:
    """An elementwise op that may run as the epilogue of the op producing its input (:data:`EPILOGUES`), or an
    eval-mode BatchNorm with running statistics (an affine map per channel). In-place ops are never epilogues."""
    if node.op not in ("call_function", "call_method", "call_module") or inplace_target(node, gm):
        return False
    short = short_name(target_name(node, gm))
    if short in EPILOGUES:
        return True
    if short not in _BATCHNORMS:
        return False
    if node.op == "call_module":
        module = submodule(gm, node)
        return not module.training and bool(module.track_running_stats)
    if short == "_native_batch_norm_legit_no_training":
        return True
    train = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
    return train is False


def _dropout_is_identity(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return not submodule(gm, node).training
    train = node.kwargs.get("training", node.kwargs.get("train"))
    if train is None and len(node.args) > 2:
        train = node.args[2]
    return train is False  # F.dropout defaults to training=True


def _flat_nodes(arg) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(arg, out.append)
    return out


def inplace_target(node: fx.Node, gm: fx.GraphModule) -> bool:
    """True if ``node`` overwrites its first argument (or a module's input) in place."""
    if node.op == "call_module":
        return bool(getattr(submodule(gm, node), "inplace", False))
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    if node.op != "call_function":
        return False
    fn = node.target
    if fn in _INPLACE_OPERATORS or fn is operator.setitem:
        return True
    if isinstance(fn, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write for a in fn._schema.arguments)
    return _inplace_flag(node) is not None or _function_twin(fn) is not None


def _function_twin(fn) -> object | None:
    """``torch.relu_`` -> ``torch.relu``, ``F.leaky_relu_`` -> ``F.leaky_relu``; None for other functions."""
    name = getattr(fn, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    for namespace in (torch, F):
        if getattr(namespace, name, None) is fn:
            twin = getattr(namespace, name[:-1], None)
            return twin if callable(twin) else fn  # fn itself: in place, but without an out-of-place twin
    return None


def _inplace_flag(node: fx.Node) -> tuple[str, int | None] | None:
    """Where a functional's ``inplace=True`` sits: ("kwarg", None) or ("arg", index); None when it is not set."""
    if node.kwargs.get("inplace") is True:
        return ("kwarg", None)
    fn = node.target
    if getattr(fn, "__module__", None) == "torch.nn.functional" and callable(fn):
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None
        if "inplace" in params:
            index = params.index("inplace")
            if index < len(node.args) and node.args[index] is True:
                return ("arg", index)
    return None


def out_of_place(node: fx.Node) -> tuple[str, Any] | None:
    """The out-of-place twin of an in-place call: ("kwarg"|"arg", index) to clear an ``inplace`` flag, or
    ("target", new_target) for a call_function/call_method; None when there is none (then clone and mutate)."""
    flag = _inplace_flag(node) if node.op == "call_function" else None
    if flag is not None:
        return flag
    fn = node.target
    if node.op == "call_method" and isinstance(fn, str):
        twin = getattr(torch.Tensor, fn[:-1], None)
        return ("target", fn[:-1]) if callable(twin) else None
    if fn in _INPLACE_OPERATORS:
        return ("target", _INPLACE_OPERATORS[fn])
    if isinstance(fn, torch._ops.OpOverload):
        name = fn.overloadpacket.__name__
        packet = getattr(getattr(torch.ops, fn.namespace), name[:-1], None) if name.endswith("_") else None
        twin = getattr(packet, fn._overloadname, None) if packet is not None else None
        return ("target", twin) if twin is not None else None
    twin = _function_twin(fn)
    return ("target", twin) if twin is not None and twin is not fn else None


# ---- FLOPs and bytes ----------------------------------------------------------------------------------------------
def flops(node: fx.Node, gm: fx.GraphModule) -> float:
    """FLOPs of one real node (see the module docstring for the conventions)."""
    target = target_name(node, gm)
    short, op_kind = short_name(target), kind(target)
    module = submodule(gm, node) if node.op == "call_module" else None
    args = node.args
    out = _numel(node)
    if op_kind == "conv":
        weight = tuple(module.weight.shape) if module is not None else _shape(_arg(node, 1, "weight"))
        transposed = "transpose" in short or (short == "convolution" and bool(_arg(node, 6, "transposed")))
        return 2.0 * (_numel(_arg(node, 0, "input")) if transposed else out) * math.prod((weight or (1,))[1:])
    if op_kind == "linear":
        k = module.in_features if module is not None else (_shape(_arg(node, 1, "weight")) or (1,))[-1]
        return 2.0 * out * k
    if op_kind == "matmul":
        a = args[1] if short in ("addmm", "baddbmm", "addbmm", "addmv") else args[0]
        return 2.0 * out * (_shape(a) or (1,))[-1]
    if op_kind == "einsum":
        return _einsum_flops(node, out)
    if op_kind == "rnn" and module is not None:
        return _rnn_flops(module, short, _numel(args[0]))
    if op_kind == "attention":
        return _attention_flops(node, module)
    if op_kind == "pool":
        return float(out * _kernel_area(node, module, short))
    if op_kind == "adaptive_pool":
        return float(_numel(args[0]))  # each input element is read into exactly one window (up to overlap)
    if op_kind in ("norm", "softmax"):
        return 5.0 * out
    if op_kind == "reduce":
        return float(_numel(args[0]) if args else out)
    if op_kind == "data":
        return 0.0
    return float(out)


def bytes_moved(node: fx.Node, gm: fx.GraphModule) -> float:
    """Bytes read (distinct tensor inputs + module parameters/buffers) + bytes written (all outputs)."""
    written = nbytes(node)
    inputs = node.all_input_nodes
    if short_name(target_name(node, gm)) in ("embedding", "embedding_bag"):
        # gathers rows: reads the indices and as many table bytes as it writes
        indices = sum(nbytes(a) for a in inputs if any(not m.dtype.is_floating_point for m in node_metas(a)))
        return float(indices + 2 * written)
    read = sum(nbytes(a) for a in inputs)
    if node.op == "call_module":
        module = submodule(gm, node)
        read += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return float(read + written)


def _kernel_area(node: fx.Node, module: Any, short: str) -> int:
    dims = int(m.group(1)) if (m := re.search(r"([123])d", short)) else 2
    kernel: Any = module.kernel_size if module is not None else node.kwargs.get(
        "kernel_size", node.args[1] if len(node.args) > 1 else 1)
    if isinstance(kernel, int):
        return kernel ** dims
    return math.prod(kernel) if len(kernel) == dims else kernel[0] ** dims


def _einsum_flops(node: fx.Node, out: int) -> float:
    equation: Any
    operands: list[Any]
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    if "..." in equation or len(lhs) != len(operands):
        return float(out)
    sizes: dict[str, int] = {}
    for letters, operand in zip(lhs, operands, strict=True):
        for letter, size in zip(letters, _shape(operand) or (), strict=False):
            sizes[letter] = size
    return 2.0 * math.prod(sizes.values())


def _rnn_flops(module: Any, short: str, input_numel: int) -> float:
    gates = {"lstm": 4, "gru": 3}.get(short.removesuffix("cell"), 1)
    hidden, first_input = module.hidden_size, module.input_size
    steps = input_numel // max(first_input, 1)  # time steps × batch
    directions = 2 if getattr(module, "bidirectional", False) else 1
    total = 0.0
    for layer in range(getattr(module, "num_layers", 1)):
        layer_input = first_input if layer == 0 else hidden * directions
        total += 2.0 * steps * gates * hidden * (layer_input + hidden) * directions
    return total


def _attention_flops(node: fx.Node, module: Any) -> float:
    q, k, v = (_shape(arg) for arg in node.args[:3])
    if q is None or k is None or v is None:
        return float(_numel(node))
    if module is None:  # scaled_dot_product_attention: Q·Kᵀ and P·V, (..., L, E) x (..., S, E) x (..., S, Ev)
        return 2.0 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    embed = module.embed_dim
    queries, keys = math.prod(q) // embed, math.prod(k) // module.kdim  # L·B and S·B
    batch = 1 if len(q) < 3 else (q[0] if module.batch_first else q[1])
    # q and out projections over L·B, k and v projections (from kdim and vdim) over S·B
    projections = 2.0 * embed * (2 * embed * queries + (module.kdim + module.vdim) * keys)
    return projections + 4.0 * queries * (keys // batch) * embed
