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
2. **Fold BN** (``fold_bn=True``, fx route, eval models only): ``torch.fx.experimental.optimization.fuse``.
3. **In-place → out-of-place** (DESIGN.md §4). ``nn.ReLU(inplace=True)``-style modules get a copy with
   ``inplace=False``; ``F.relu(x, inplace=True)`` gets ``inplace=False``; ``x.add_()`` → ``x.add()``,
   ``torch.relu_`` → ``torch.relu``, ``operator.iadd`` → ``operator.add``, ``aten.relu_`` → ``aten.relu``; an
   in-place op without a twin (``x[i] = v``, ``x.copy_()``, ``x.fill_()``) becomes :func:`apply_on_clone`. Every
   later reader of the overwritten tensor then reads the new node instead (that is what it saw in eager). The
   rewrite is impossible when another *alias* (a view, its base) of the tensor is read later, or the tensor is
   module state (``get_attr``): then the op stays in place and the graph gets a ``war`` edge from every earlier
   reader of any alias to the writer, and a data edge from the writer to every later reader. (``x += y`` on a traced
   tensor is already recorded by fx as ``operator.add`` and a rebinding; if eager's result depended on the mutation
   through another name, step 5 catches the difference and export, which functionalizes, is used instead.)
   Mutations of the model's *inputs* are not reproduced (outputs are).
4. **Shapes** by ``torch.fx.passes.shape_prop.ShapeProp`` on clones of the example inputs.
5. **Verify** (``verify=True``, models in eval mode): the captured module's output must equal eager's.
6. **Partition.** An op = one real node + the *trivial* nodes hanging off it. Trivial = metadata-only (views,
   ``getitem``, ``size``, ``flatten``, ``reshape``, ``contiguous``, ``permute``/``transpose``, ``unsqueeze``,
   ``expand``, identity, eval-mode dropout — :data:`opweave.opinfo.TRIVIAL`) or holding no tensor (shape arithmetic).
   A trivial node whose inputs all come from one op is absorbed into that op: it runs right after it, on its stream,
   so the scheduler never sees kernel-less "ops". One depending only on inputs/parameters runs in ``bind``; one
   reading several ops' outputs becomes an op of its own (0 FLOPs, 0 bytes). ``cat``, ``add`` etc. are real ops.
   Edges are data dependencies between ops (bytes = the consumed tensors' bytes) plus the ``war`` edges of step 3.
   Op ids are fx node names; ops keep fx (= eager) order.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from opweave import opinfo
from opweave.ir import Edge, Op, OpGraph


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the model class and why."""


Step = Callable[[dict[str, Any]], Any]


@dataclass(eq=False)
class Captured:
    """A captured model: its OpGraph and everything needed to run it op by op.

    Execution contract (what the CPU and CUDA backends rely on)::

        env = captured.bind(args)              # inputs, parameters, input-only views
        for op in captured.graph.topo_order:   # or any order/streams that respect graph.edges
            captured.run_op(op, env)
        out = captured.output(env)             # same structure and values as model(*args)

    ``run_op`` writes only the env keys of its own fx nodes, so distinct ops may run on different threads.
    Parameters live in ``gm``; move them with ``captured.gm.to(device)`` (in place: ``run_op`` holds ``gm``'s
    submodules, and ``bind`` re-reads ``get_attr`` constants on every call).
    """

    graph: OpGraph
    gm: fx.GraphModule
    nodes: dict[str, list[fx.Node]]
    _inputs: list[tuple[fx.Node, tuple | None]] = field(init=False, repr=False)
    _constants: list[tuple[str, list[str]]] = field(init=False, repr=False)
    _prelude: list[tuple[str, Step]] = field(init=False, repr=False)
    _steps: dict[str, list[tuple[str, Step]]] = field(init=False, repr=False)
    _output: Step = field(init=False, repr=False)

    def __post_init__(self) -> None:
        owned = {n for group in self.nodes.values() for n in group}
        self._inputs, self._constants, self._prelude = [], [], []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                metas = opinfo.node_metas(node)
                self._inputs.append((node, (tuple(metas[0].shape), metas[0].dtype) if metas else None))
            elif node.op == "get_attr":
                self._constants.append((node.name, node.target.split(".")))
            elif node.op == "output":
                self._output = _loader(node.args[0])
            elif node not in owned:
                self._prelude.append((node.name, _compile(node, self.gm)))
        self._steps = {op: [(n.name, _compile(n, self.gm)) for n in group] for op, group in self.nodes.items()}

    def bind(self, args: tuple) -> dict[str, Any]:
        """The environment for one run: placeholders ← ``args`` (checked against the captured shapes and dtypes),
        ``get_attr`` constants, and the trivial nodes that depend only on those."""
        flat = list(self.gm.graph.process_inputs(*args))
        if len(flat) > len(self._inputs):
            raise ValueError(f"{self.graph.name}: expected {len(self._inputs)} inputs, got {len(flat)}")
        env: dict[str, Any] = {}
        for i, (node, expected) in enumerate(self._inputs):
            if i < len(flat):
                value = flat[i]
            elif node.args:  # a forward() default
                value = node.args[0]
            else:
                raise ValueError(f"{self.graph.name}: missing input {i} ({node.name!r})")
            signature = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
            if expected is not None and signature is not None and signature != expected:
                raise ValueError(f"{self.graph.name}: input {i} ({node.name!r}) has shape {tuple(value.shape)} and "
                                 f"dtype {value.dtype}; it was captured with {expected[0]} and {expected[1]} "
                                 "(capture again for this signature)")
            env[node.name] = value
        for name, path in self._constants:
            value = self.gm
            for part in path:
                value = getattr(value, part)
            env[name] = value
        for name, step in self._prelude:
            env[name] = step(env)
        return env

    def run_op(self, op_id: str, env: dict[str, Any]) -> None:
        """Run op ``op_id``'s fx nodes in order (main node, then absorbed trivial nodes), reading/writing ``env``."""
        for name, step in self._steps[op_id]:
            env[name] = step(env)

    def output(self, env: dict[str, Any]) -> Any:
        """The model's output, in the structure ``model(*args)`` returns, rebuilt from ``env``."""
        return self.gm.graph.process_outputs(self._output(env))

    def readers(self) -> dict[str, list[str]]:
        """fx node name → ids of the ops that read its value (a value may be freed once all of them finished)."""
        out: dict[str, list[str]] = {}
        for op, group in self.nodes.items():
            for node in group:
                for arg in node.all_input_nodes:
                    if op not in out.setdefault(arg.name, []):
                        out[arg.name].append(op)
        return out

    def last_use(self) -> dict[str, str]:
        """fx node name → the op, in ``graph.topo_order``, after which a sequential run no longer needs its value.

        Covers values computed by ops (an unread one maps to its own op); omits inputs, parameters, values computed
        in ``bind`` and anything the output returns.
        """
        position = {op: i for i, op in enumerate(self.graph.topo_order)}
        owner = {n.name: op for op, group in self.nodes.items() for n in group}
        last = dict(owner)
        for name, ops in self.readers().items():
            if name in owner:
                last[name] = max([owner[name], *ops], key=position.__getitem__)
        output_node = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        for node in output_node.all_input_nodes:
            last.pop(node.name, None)
        return last


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
                from torch.fx.experimental.optimization import fuse

                gm = fuse(gm, inplace=False, no_trace=True)
            kept = _rewrite_inplace(gm)
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
        nodes, owner = _partition(gm, kept)
        graph = _build_graph(gm, nodes, owner, kept, name or model_name)
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


# ---- 3. in-place ops ----------------------------------------------------------------------------------------------
def apply_on_clone(target: str, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Out-of-place form of an in-place op that has no out-of-place twin: update a copy and return it.

    ``target`` is the dotted path of the in-place callable (``operator.setitem``, ``torch.Tensor.fill_``,
    ``torch.ops.aten.copy_.default``), called as ``target(copy, *args, **kwargs)``.
    """
    out = tensor.clone()
    _resolve(target)(out, *args, **kwargs)
    return out


@functools.cache
def _resolve(path: str) -> Callable:
    head, *rest = path.split(".")
    obj = __import__(head)
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _aliases(tensor: fx.Node, gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value may share storage with ``tensor``'s: its bases and views, transitively."""
    seen, todo = {tensor}, [tensor]
    while todo:
        node = todo.pop()
        linked = [u for u in node.users if opinfo.is_alias(u, gm) and u.args and u.args[0] is node]
        if opinfo.is_alias(node, gm) and node.args and isinstance(node.args[0], fx.Node):
            linked.append(node.args[0])
        for other in linked:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def _rewrite_inplace(gm: fx.GraphModule) -> list[fx.Node]:
    """Rewrite in-place nodes out of place where that is safe (module docstring, step 3); return the kept ones."""
    graph = gm.graph
    candidates = [n for n in graph.nodes if opinfo.inplace_target(n, gm) and n.args and isinstance(n.args[0], fx.Node)]
    kept: list[fx.Node] = []
    module_sites: dict[str, list[fx.Node]] = {}
    for node in candidates:
        order = {n: i for i, n in enumerate(graph.nodes)}
        tensor = node.args[0]
        aliases = _aliases(tensor, gm)
        read_later = any(order[u] > order[node] for a in aliases if a is not tensor for u in a.users)
        if read_later or any(a.op == "get_attr" for a in aliases):
            kept.append(node)
            continue
        new = _out_of_place(node, gm, module_sites)
        for user in list(tensor.users):
            if user is not new and order.get(user, -1) > order[node]:
                user.replace_input_with(tensor, new)
    kept_targets = {n.target for n in kept if n.op == "call_module"}
    for target, sites in module_sites.items():
        module = copy.copy(gm.get_submodule(target))
        module.inplace = False
        path = target if target not in kept_targets else f"{target}_out_of_place"
        _set_submodule(gm, path, module)
        for site in sites:
            site.target = path
    graph.lint()
    gm.recompile()
    return kept


def _out_of_place(node: fx.Node, gm: fx.GraphModule, module_sites: dict[str, list[fx.Node]]) -> fx.Node:
    """Turn ``node`` into its out-of-place form; returns the node that now holds the result."""
    if node.op == "call_module":
        module_sites.setdefault(node.target, []).append(node)  # the module is swapped once all sites are known
        return node
    twin = opinfo.out_of_place(node)
    if twin is not None:
        how, where = twin
        if how == "kwarg":
            node.kwargs = {**node.kwargs, "inplace": False}
        elif how == "arg":
            node.args = (*node.args[:where], False, *node.args[where + 1:])
        else:
            node.target = where
        return node
    if node.op == "call_method":
        path = f"torch.Tensor.{node.target}"
    elif isinstance(node.target, torch._ops.OpOverload):
        path = f"torch.ops.{node.target.namespace}.{node.target.overloadpacket.__name__}.{node.target._overloadname}"
    else:
        path = opinfo.target_name(node, gm)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(apply_on_clone, (path, *node.args), dict(node.kwargs))
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _set_submodule(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent, _, field_name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, field_name, module)


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


# ---- 6. partition and graph -----------------------------------------------------------------------------------------
def _partition(gm: fx.GraphModule, kept: list[fx.Node]) -> tuple[dict[str, list[fx.Node]], dict[str, str | None]]:
    """Op id → its fx nodes (main node first), and fx node name → owning op (None: computed in ``bind``)."""
    nodes: dict[str, list[fx.Node]] = {}
    owner: dict[str, str | None] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            owner[node.name] = None
        elif node.op != "output":
            sources = {owner[a.name] for a in node.all_input_nodes} - {None}
            if len(sources) <= 1 and node not in kept and opinfo.is_trivial(node, gm):
                op = next(iter(sources), None)
                owner[node.name] = op
                if op is not None:
                    nodes[op].append(node)
            else:
                owner[node.name] = node.name
                nodes[node.name] = [node]
    return nodes, owner


def _build_graph(gm: fx.GraphModule, nodes: dict[str, list[fx.Node]], owner: dict[str, str | None],
                 kept: list[fx.Node], name: str) -> OpGraph:
    ops = [_op(group[0], gm) for group in nodes.values()]
    edges: list[Edge] = []
    for op, group in nodes.items():
        consumed: dict[str, dict[str, int]] = {}
        for node in group:
            for arg in node.all_input_nodes:
                source = owner[arg.name]
                if source is not None and source != op:
                    consumed.setdefault(source, {})[arg.name] = opinfo.nbytes(arg)
        edges += [Edge(src, op, bytes=float(sum(sizes.values()))) for src, sizes in consumed.items()]
    edges += _inplace_edges(gm, owner, kept, {(e.src, e.dst) for e in edges})
    return OpGraph(ops, edges, name)


def _op(node: fx.Node, gm: fx.GraphModule) -> Op:
    target = opinfo.target_name(node, gm)
    metas = opinfo.node_metas(node)
    free = opinfo.is_trivial(node, gm)  # a metadata-only node that reads several ops: no kernel of its own
    return Op(
        id=node.name,
        name=node.name,
        target=target,
        category=opinfo.category(target),
        shape=list(metas[0].shape) if metas else None,
        dtype=str(metas[0].dtype).removeprefix("torch.") if metas else None,
        flops=0.0 if free else opinfo.flops(node, gm),
        bytes=0.0 if free else opinfo.bytes_moved(node, gm),
    )


def _inplace_edges(gm: fx.GraphModule, owner: dict[str, str | None], kept: list[fx.Node],
                   existing: set[tuple[str, str]]) -> list[Edge]:
    """Order every reader of a kept in-place op's tensor (or of an alias of it) around the write: earlier readers
    before it (``war``), later readers after it (a data edge: they read what it wrote)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    edges: list[Edge] = []
    for writer in kept:
        for alias in _aliases(writer.args[0], gm):
            for reader in alias.users:
                op = owner.get(reader.name)
                if reader is writer or op is None or op == writer.name or opinfo.is_trivial(reader, gm):
                    continue  # views and sizes read no data; readers inside the writer's op are already ordered
                before = order[reader] < order[writer]
                pair, kind = ((op, writer.name), "war") if before else ((writer.name, op), "data")
                if pair not in existing:
                    existing.add(pair)
                    edges.append(Edge(*pair, bytes=0.0 if kind == "war" else float(opinfo.nbytes(alias)), kind=kind))
    return edges


# ---- 7. node closures ---------------------------------------------------------------------------------------------
def _compile(node: fx.Node, gm: fx.GraphModule) -> Step:
    """A closure ``env -> value`` that runs one node as torch.fx.Interpreter would."""
    if node.op == "call_function":
        fn = node.target
    elif node.op == "call_method":
        method = node.target

        def fn(self, *args, **kwargs):
            return getattr(self, method)(*args, **kwargs)
    elif node.op == "call_module":
        fn = gm.get_submodule(node.target)
    else:
        raise CaptureError(f"cannot run fx node {node.name!r} of kind {node.op!r}")
    args = _loader(tuple(node.args))
    if not node.kwargs:
        return lambda env: fn(*args(env))
    kwargs = _loader(dict(node.kwargs))
    return lambda env: fn(*args(env), **kwargs(env))


def _has_node(arg: Any) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return bool(found)


def _loader(arg: Any) -> Step:
    """A closure ``env -> arg`` with every fx Node in ``arg`` replaced by its value in ``env``."""
    if isinstance(arg, fx.Node):
        return itemgetter(arg.name)
    if not _has_node(arg):
        return lambda env: arg
    if isinstance(arg, tuple) and not hasattr(arg, "_fields") and all(isinstance(a, fx.Node) for a in arg):
        getter = itemgetter(*(a.name for a in arg))
        return (lambda env: (getter(env),)) if len(arg) == 1 else getter
    if isinstance(arg, (tuple, list)):
        parts = [_loader(a) for a in arg]
        if hasattr(arg, "_fields"):  # a namedtuple
            return lambda env: type(arg)(*(p(env) for p in parts))
        build = tuple if isinstance(arg, tuple) else list
        return lambda env: build([p(env) for p in parts])
    if isinstance(arg, dict):
        parts_by_key = {k: _loader(v) for k, v in arg.items()}
        return lambda env: {k: p(env) for k, p in parts_by_key.items()}
    if isinstance(arg, slice):
        start, stop, step = _loader(arg.start), _loader(arg.stop), _loader(arg.step)
        return lambda env: slice(start(env), stop(env), step(env))
    raise CaptureError(f"cannot load fx argument {arg!r}")


__all__ = ["Captured", "CaptureError", "apply_on_clone", "capture"]
