"""In-place ops rewritten out of place, where that keeps eager's meaning (capture step 3).

``nn.ReLU(inplace=True)``-style modules get a copy with ``inplace=False``; ``F.relu(x, inplace=True)`` gets
``inplace=False``; ``x.add_()`` → ``x.add()``, ``torch.relu_`` → ``torch.relu``, ``operator.iadd`` →
``operator.add``, ``aten.relu_`` → ``aten.relu``; an in-place op without a twin (``x[i] = v``, ``x.copy_()``,
``x.fill_()``) becomes :func:`apply_on_clone`. Every later reader of the overwritten tensor then reads the new node
instead (that is what it saw in eager). The rewrite is impossible when another *alias* (a view, its base) of the
tensor is read later, or the tensor is module state (``get_attr``): then the op stays in place and
:mod:`opweave.capture.partition` orders it with ``war`` edges. Mutations of the model's *inputs* are not
reproduced (outputs are).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import fx, nn

from opweave.capture import opinfo


def apply_on_clone(target: str, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Out-of-place form of an in-place op that has no out-of-place twin: update a copy and return it.

    ``target`` is the dotted path of the in-place callable (``operator.setitem``, ``torch.Tensor.fill_``,
    ``torch.ops.aten.copy_.default``), called as ``target(copy, *args, **kwargs)``.
    """
    out = tensor.clone()
    _resolve(target)(out, *args, **kwargs)
    return out


@functools.cache
def _resolve(path: str) -> Any:
    head, *rest = path.split(".")
    obj = __import__(head)
    for part in rest:
        obj = getattr(obj, part)
    return obj


def aliases(tensor: fx.Node, gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value may share storage with ``tensor``'s: its bases and views, transitively, and every
    ``get_attr`` of the same attribute (``symbolic_trace`` makes one per read of a buffer)."""
    seen, todo = {tensor}, [tensor]
    attributes: dict[Any, list[fx.Node]] | None = None
    while todo:
        node = todo.pop()
        linked = [u for u in node.users if opinfo.is_alias(u, gm) and u.args and u.args[0] is node]
        if opinfo.is_alias(node, gm) and node.args and isinstance(node.args[0], fx.Node):
            linked.append(node.args[0])
        if node.op == "get_attr":
            if attributes is None:
                attributes = {}
                for other in gm.graph.nodes:
                    if other.op == "get_attr":
                        attributes.setdefault(other.target, []).append(other)
            linked += attributes[node.target]
        for other in linked:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def rewrite_inplace(gm: fx.GraphModule) -> list[fx.Node]:
    """Rewrite in-place nodes out of place where that is safe (see the module docstring); return the kept ones."""
    graph = gm.graph
    candidates = [n for n in graph.nodes if opinfo.inplace_target(n, gm) and n.args and isinstance(n.args[0], fx.Node)]
    kept: list[fx.Node] = []
    module_sites: dict[str, list[fx.Node]] = {}
    for node in candidates:
        order = {n: i for i, n in enumerate(graph.nodes)}
        tensor = node.args[0]
        linked = aliases(tensor, gm)
        read_later = any(order[u] > order[node] for a in linked if a is not tensor for u in a.users)
        if read_later or any(a.op == "get_attr" for a in linked):
            kept.append(node)
            continue
        new = _out_of_place(node, gm, module_sites)
        for user in list(tensor.users):
            if user is not new and order.get(user, -1) > order[node]:
                user.replace_input_with(tensor, new)
    kept_targets = {n.target for n in kept if n.op == "call_module"}
    for target, sites in module_sites.items():
        module: Any = copy.copy(gm.get_submodule(target))
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
        assert isinstance(node.target, str)
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




def writes_state(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` writes module state in place: an in-place op on a parameter or buffer (a ``get_attr``) or
    on a view of one, as a static KV cache's update is."""
    if not opinfo.inplace_target(node, gm) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    return any(a.op == "get_attr" for a in aliases(node.args[0], gm))


def reinplace_state(gm: fx.GraphModule) -> int:
    """An exported update of module state turned back into the in-place op the model ran; returns how many.

    ``torch.export`` functionalizes ``buffer.index_copy_(dim, index, value)`` into ``new = index_copy(buffer, ...)``
    and writes ``new`` back into the buffer at the end of the graph (``copy_(buffer, new)``): a copy of the whole
    buffer per call, twice, where the model wrote a few rows. Where the functional op has an in-place twin whose first
    argument it writes, and nothing but the write-back reads the buffer (or a view of it) after the functional op,
    the op becomes the twin on the buffer itself, its readers read the buffer, and the write-back goes: the same
    values, the buffer updated where the model updated it. Capture then keeps the op in place
    (:func:`rewrite_inplace`) and orders it as any in-place op on module state.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for back in list(graph.nodes):
        if back.target is not torch.ops.aten.copy_.default or back.users or len(back.args) != 2:
            continue
        buffer, new = back.args
        if not isinstance(buffer, fx.Node) or buffer.op != "get_attr" or not isinstance(new, fx.Node):
            continue
        twin = _inplace_twin(new.target)
        if twin is None or not new.args or new.args[0] is not buffer:
            continue
        later = [u for a in aliases(buffer, gm) for u in a.users if u not in (new, back) and order[u] > order[new]]
        if later:
            continue
        new.target = twin
        graph.erase_node(back)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _inplace_twin(target: Any) -> Any:
    """``aten.index_copy.default`` -> ``aten.index_copy_.default`` (an ATen overload whose in-place twin writes its
    first argument); None otherwise."""
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__.endswith("_"):
        return None
    packet = getattr(getattr(torch.ops, target.namespace), target.overloadpacket.__name__ + "_", None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload):
        return None
    first = twin._schema.arguments[0] if twin._schema.arguments else None
    return twin if first is not None and first.alias_info is not None and first.alias_info.is_write else None
