"""Partition a traced fx graph into ops and build the :class:`~opweave.ir.OpGraph` (capture step 6).

An op = one real node + the *trivial* nodes hanging off it. Trivial = metadata-only (views, ``getitem``, ``size``,
``flatten``, ``reshape``, ``contiguous``, ``permute``/``transpose``, ``unsqueeze``, ``expand``, identity, eval-mode
dropout — :data:`opweave.capture.opinfo.TRIVIAL`) or holding no tensor (shape arithmetic). A trivial node whose
inputs all come from one op is absorbed into that op: it runs right after it, on its stream, so the scheduler never
sees kernel-less "ops". One depending only on inputs/parameters runs in ``bind``; one reading several ops' outputs
becomes an op of its own (0 FLOPs, 0 bytes). ``cat``, ``add`` etc. are real ops. Edges are data dependencies
between ops (bytes = the consumed tensors' bytes) plus ``war`` edges around in-place ops that stayed in place. Op
ids are fx node names; ops keep fx (= eager) order.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from opweave.capture import opinfo
from opweave.capture.functionalize import aliases
from opweave.ir.graph import Edge, Op, OpGraph


def partition(gm: fx.GraphModule, kept: list[fx.Node]) -> tuple[dict[str, list[fx.Node]], dict[str, str | None]]:
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


def build_graph(gm: fx.GraphModule, nodes: dict[str, list[fx.Node]], owner: dict[str, str | None],
                 kept: list[fx.Node], name: str) -> OpGraph:
    ops = [_op(group[0], gm) for group in nodes.values()]
    edges = data_edges(nodes, owner)
    edges += _inplace_edges(gm, owner, kept, {(e.src, e.dst) for e in edges})
    return OpGraph(ops, edges, name)


def data_edges(nodes: dict[str, list[fx.Node]], owner: Mapping[str, str | None]) -> list[Edge]:
    """One data edge per (producer op, consumer op) pair; its bytes are those of the distinct values consumed.
    ``owner`` maps fx node names to their op (None, or absent: computed in ``bind``)."""
    edges: list[Edge] = []
    for op, group in nodes.items():
        consumed: dict[str, dict[str, int]] = {}
        for node in group:
            for arg in node.all_input_nodes:
                source = owner.get(arg.name)
                if source is not None and source != op:
                    consumed.setdefault(source, {})[arg.name] = opinfo.nbytes(arg)
        edges += [Edge(src, op, bytes=float(sum(sizes.values()))) for src, sizes in consumed.items()]
    return edges


def _op(node: fx.Node, gm: fx.GraphModule) -> Op:
    target = opinfo.target_name(node, gm)
    metas = opinfo.node_metas(node)
    free = opinfo.is_trivial(node, gm)  # a metadata-only node that reads several ops: no kernel of its own
    return Op(
        id=node.name,
        name=node.name,
        target=target,
        category=opinfo.category(target),
        kind=opinfo.kind(target),
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
        target = writer.args[0]
        assert isinstance(target, fx.Node)  # kept: an in-place op writing a value of the graph
        for alias in aliases(target, gm):
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


