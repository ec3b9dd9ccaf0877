"""Coarsening: a captured graph in, a graph of the papers' operators out (pure: the input :class:`Captured` is
left as it is).

A captured op is one real fx node (a conv, its BatchNorm, its ReLU are three ops); the papers schedule coarser
operators: IOS (MLSys'21, Sec. 6) and LIOS/HIOS take a convolution with its BatchNorm and activation as one
operator, which is also what a fusing compiler turns into one kernel (or one library call plus one epilogue).
:func:`coarsen` merges every op that launches a kernel with its *epilogue chain*:

* the chain grows one op at a time while the op at its end is read by exactly one op ``v`` (and is not a model
  output), ``v`` is an epilogue (:func:`opinfo.is_epilogue`: an activation, a bias or residual add, a scale, a
  clamp, an eval-mode BatchNorm; eval-mode dropout is already absorbed by capture), takes part in no
  write-after-read ordering, and every other input of ``v`` comes from an op that is an *ancestor of the chain's
  head* (or from the model's inputs and parameters). That last rule is our choice where the papers are silent on
  residual adds: merging ``add(conv_out, skip)`` costs no parallelism when ``skip`` had to be finished before the
  conv anyway (ResNet's identity blocks), but would make a conv wait for a sibling branch (a downsampling block's
  shortcut conv): there the add stays an operator of its own, as TOP counts it (ResNet-50: 87 operators).
  Merging along single-consumer edges never creates a cycle: a second path from the chain to ``v`` would leave the
  chain through another consumer.
* **BatchNorm folding.** When a chain starts with ``Conv{1,2,3}d`` (or ``Linear``) followed by its eval-mode
  ``BatchNorm``, the BatchNorm is folded into the convolution's weights (:func:`fold_batchnorm`, the same code as
  ``capture(fold_bn=True)``) in a copy of the module graph: the coarse op then runs one convolution with a bias and
  its activation. Only module convolutions (symbolic_trace graphs) are folded, and only those called from one
  place; on torch.export graphs the BatchNorm stays a (merged) node. Folding changes rounding only (fp32: ~1e-5
  relative over Inception-v3) and, like any folding, keeps a folded copy of those weights (Inception-v3: 83 MB, 91%
  of its weights), one per model however often it is captured (:func:`folded_layer`).

A coarse op keeps its member fx nodes in graph order; its id is its head's id and its name joins the members'
ids. FLOPs are summed over the member nodes; bytes are those a fused kernel moves: what the members read from
outside the op plus what leaves it (read by another op or returned), never the intermediates passed inside it.
Edges are recomputed from the fx nodes (bytes of the distinct values consumed) and every dependency of the fine
graph (write-after-read ones included) is kept between the coarse ops that contain its ends.

:func:`merge_ops` is the merge itself, for any grouping that keeps the graph acyclic; the backends use it too, to
turn a plan's stream segments into ops (:mod:`opweave.backends.segments`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from opweave.capture import opinfo
from opweave.capture.partition import data_edges
from opweave.capture.runtime import Captured, SharedCopies
from opweave.ir.graph import Edge, Op, OpGraph

# (layer, BatchNorm) pairs that fold, as torch.fx.experimental.optimization.fuse folds them
_FOLDABLE = ((nn.Conv1d, nn.BatchNorm1d), (nn.Conv2d, nn.BatchNorm2d), (nn.Conv3d, nn.BatchNorm3d),
             (nn.Linear, nn.BatchNorm1d))


def coarsen(captured: Captured) -> Captured:
    """The captured model with every op merged with its epilogue chain (see the module docstring)."""
    groups = epilogue_groups(captured)
    pairs = [(captured.nodes[g[0]][0], captured.nodes[g[1]][0]) for g in groups if len(g) > 1]
    folds = [(layer.name, norm.name) for layer, norm in pairs if foldable(layer, norm, captured.gm)]
    gm = fold_batchnorm(captured.gm, folds) if folds else captured.gm
    return merge_ops(captured, groups, gm)


def epilogue_groups(captured: Captured) -> list[list[str]]:
    """Op ids grouped into chains (head first, in chain order); every op is in exactly one group."""
    graph, gm = captured.graph, captured.gm
    main = {op: group[0] for op, group in captured.nodes.items()}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    returned = {owner[n.name] for n in output.all_input_nodes if n.name in owner}
    war = {end for e in graph.edges if e.kind == "war" for end in (e.src, e.dst)}
    free = {op for op in graph.ids if opinfo.is_trivial(main[op], gm)}  # multi-input views: no kernel
    ancestors: dict[str, int] = {}  # bitset over graph.index
    for op in graph.topo_order:
        bits = 0
        for p in graph.preds[op]:
            bits |= ancestors[p] | (1 << graph.index[p])
        ancestors[op] = bits

    taken: set[str] = set()
    groups: list[list[str]] = []
    for head in graph.topo_order:
        if head in taken:
            continue
        chain = [head]
        taken.add(head)
        while head not in free and head not in war:
            last = chain[-1]
            consumers = graph.succs[last]
            if last in returned or len(consumers) != 1:
                break
            v = consumers[0]
            if v in taken or v in war or v in free or not opinfo.is_epilogue(main[v], gm):
                break
            if any(not ancestors[head] >> graph.index[p] & 1 for p in graph.preds[v] if p != last):
                break
            chain.append(v)
            taken.add(v)
        groups.append(chain)
    return groups


def foldable(layer: fx.Node, norm: fx.Node, gm: fx.GraphModule) -> bool:
    """True if BatchNorm module call ``norm`` may be folded into module call ``layer``: a (conv or linear,
    BatchNorm) pair of :data:`_FOLDABLE` in eval mode with running statistics, ``norm`` reads ``layer``'s output
    and is its only user, and neither ``layer``'s module nor a module holding it is used elsewhere (folding
    replaces the module)."""
    if layer.op != "call_module" or norm.op != "call_module" or norm.args[:1] != (layer,) or len(layer.users) != 1:
        return False
    first, bn = opinfo.submodule(gm, layer), opinfo.submodule(gm, norm)
    if not any(type(first) is a and type(bn) is b for a, b in _FOLDABLE):
        return False
    if first.training or bn.training or not bn.track_running_stats:
        return False
    target = str(layer.target)
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "get_attr")
             and (n.target == target or target.startswith(f"{n.target}."))]
    return calls == [layer]


def fold_batchnorm(gm: fx.GraphModule, pairs: list[tuple[str, str]] | None = None) -> fx.GraphModule:
    """A new GraphModule with each (layer, BatchNorm) pair of node names in ``pairs`` folded (default: every
    :func:`foldable` pair): the BatchNorm node disappears and its users read the layer, whose module is replaced by
    a copy with folded weights (``torch.nn.utils.fusion``). ``gm`` is left as is and shares its other modules with
    the result. Node names and the ShapeProp metadata of the remaining nodes are kept."""
    by_name = {n.name: n for n in gm.graph.nodes}
    if pairs is None:
        pairs = [(n.args[0].name, n.name) for n in gm.graph.nodes
                 if n.args and isinstance(n.args[0], fx.Node) and foldable(n.args[0], n, gm)]
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    copies: dict[fx.Node, fx.Node] = {}
    folded = {by_name[norm]: by_name[layer] for layer, norm in pairs}
    for node in gm.graph.nodes:
        if node in folded:
            copies[node] = copies[folded[node]]
            continue
        copies[node] = graph.node_copy(node, lambda n: copies[n])
    out = fx.GraphModule(gm, graph, gm.__class__.__name__)
    for layer, norm in pairs:
        target = by_name[layer].target
        fused = folded_layer(gm.get_submodule(target), gm.get_submodule(by_name[norm].target))
        parent, _, leaf = target.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, leaf, fused)
    return out


_FOLDED = SharedCopies()


def folded_layer(layer: Any, bn: Any) -> nn.Module:
    """A copy of ``layer`` (a convolution or linear layer) with the eval-mode BatchNorm ``bn`` folded into its
    weights (``torch.nn.utils.fusion``), made once per pair while their tensors stay as they are
    (:class:`~opweave.capture.runtime.SharedCopies`: weights changed in place, replaced, moved or converted are
    folded again; writes through ``.data`` are not seen): every capture of one model (a compiled model captures it
    again for each new input signature) shares one copy of the folded weights, where each used to hold its own
    (four signatures, four copies)."""
    def fold() -> nn.Module:
        return fuse_conv_bn_eval(layer, bn) if isinstance(layer, nn.modules.conv._ConvNd) else \
            fuse_linear_bn_eval(layer, bn)

    return _FOLDED.get((bn.eps,), [*layer.parameters(), *bn.parameters(), *bn.buffers()], fold, owners=(layer, bn))


def merge_ops(captured: Captured, groups: list[list[str]], gm: fx.GraphModule | None = None,
              name: str | None = None) -> Captured:
    """A Captured whose ops are ``groups`` of ``captured``'s ops (every op in exactly one group, the groups'
    dependencies acyclic), run on ``gm`` (default: ``captured.gm``; it may lack nodes of ``captured``, e.g. folded
    BatchNorms). Each group becomes one op named after its first op (see the module docstring for its facts)."""
    gm = gm if gm is not None else captured.gm
    fine = captured.graph
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    group_of = {op: group[0] for group in groups for op in group}
    missing = [op for op in fine.ids if op not in group_of]
    if missing or len(group_of) != sum(map(len, groups)):
        raise ValueError(f"groups must hold every op once ({missing[:1] or 'an op twice'})")
    nodes = {group[0]: sorted((by_name[n.name] for op in group for n in captured.nodes[op] if n.name in by_name),
                              key=lambda n: order[n.name]) for group in groups}
    owner = {n.name: gid for gid, members in nodes.items() for n in members}
    ops = [fine.op[group[0]] if len(group) == 1 else _merged_op(group, nodes[group[0]], fine, gm)
           for group in groups]
    edges = data_edges(nodes, owner)
    seen = {(e.src, e.dst) for e in edges}
    for e in fine.edges:  # every fine dependency, write-after-read included, between the groups holding its ends
        pair = (group_of[e.src], group_of[e.dst])
        if pair[0] != pair[1] and pair not in seen:
            seen.add(pair)
            edges.append(Edge(*pair, bytes=e.bytes, kind=e.kind))
    return Captured(OpGraph(ops, edges, name or fine.name), gm, nodes, signature=captured.signature,
                    example_inputs=captured.example_inputs)


def _merged_op(group: list[str], members: list[fx.Node], fine: OpGraph, gm: fx.GraphModule) -> Op:
    head, last = fine.op[group[0]], fine.op[group[-1]]
    flops, moved = fused_facts(members, gm)
    return Op(
        id=head.id,
        name="+".join(group),
        target=head.target,
        kind=head.kind,
        category="compute" if any(fine.op[op].category == "compute" for op in group) else "memory",
        shape=last.shape,
        dtype=last.dtype,
        flops=flops,
        bytes=moved,
    )


def fused_facts(members: list[fx.Node], gm: fx.GraphModule) -> tuple[float, float]:
    """The FLOPs and bytes of one op made of ``members`` (module docstring): the real nodes' FLOPs, and the bytes
    they move less the intermediates passed inside the op. For an op of one real node (and its views), that node's
    own."""
    inside = set(members)
    real = [n for n in members if not opinfo.is_trivial(n, gm)]
    read = sum(opinfo.nbytes(a) for n in real for a in n.all_input_nodes if a in inside)

    def leaves(node: fx.Node) -> bool:  # read outside the op (or returned), directly or through a member's view
        return any(u not in inside or (opinfo.is_alias(u, gm) and leaves(u)) for u in node.users)

    written = sum(opinfo.nbytes(n) for n in real if not leaves(n))
    return (float(sum(opinfo.flops(n, gm) for n in real)),
            float(max(0.0, sum(opinfo.bytes_moved(n, gm) for n in real) - read - written)))


def at_sizes(captured: Captured, args: tuple) -> Captured:
    """``captured`` for inputs ``args`` of other sizes: the same ops over a copy of its fx graph whose shapes are
    propagated for ``args`` (one run of the graph), each op's shape, FLOPs and bytes and each edge's bytes
    recomputed there (:func:`fused_facts`; write-after-read edges kept). What a plan for another size is made from
    (:mod:`opweave.pipeline.sizes`); the graph must read its sizes from its inputs, as ``symbolic_trace``'s does.
    The parameters are ``captured``'s own."""
    import copy
    import warnings

    from torch.fx.passes.shape_prop import ShapeProp

    with warnings.catch_warnings():  # copying an exported graph's pytree specs warns of torch's own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(captured.gm.graph)
    gm = fx.GraphModule(captured.gm, graph, class_name=type(captured.gm).__name__)
    with torch.no_grad():
        ShapeProp(gm).propagate(*args)
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = {op: [by_name[n.name] for n in group] for op, group in captured.nodes.items()}
    owner = {n.name: op for op, group in nodes.items() for n in group}
    ops = []
    for old in captured.graph.ops:
        members = nodes[old.id]
        real = [n for n in members if not opinfo.is_trivial(n, gm)]
        metas = opinfo.node_metas(real[-1] if real else by_name.get(old.id, members[0]))
        flops, moved = fused_facts(members, gm) if real else (0.0, 0.0)
        ops.append(replace(old, shape=list(metas[0].shape) if metas else old.shape, flops=flops, bytes=moved,
                           latency_ms=None, utilization=None))
    edges = data_edges(nodes, owner)
    seen = {(e.src, e.dst) for e in edges}
    edges += [replace(e) for e in captured.graph.edges if (e.src, e.dst) not in seen]
    return Captured(OpGraph(ops, edges, captured.graph.name), gm, nodes, signature=captured.signature,
                    example_inputs=tuple(args))

