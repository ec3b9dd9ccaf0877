"""Combined blocks (TOP's sub-blocks run together): what one is, its signature, and its graph.

A **combined block** is a list of :class:`Part` s: one block of one model for a stack of ``batch`` samples. Its
*signature* (the sorted ``(model, block, batch)`` triples) determines its graph, so an executor compiles each
signature once. Every part's ops get the prefix ``p{k}_`` (k = the part's position in the signature), so the parts
of one combined block are one graph with no edges between them: a scheduler puts them side by side on streams.

* :func:`union_graph` and :func:`union_costs` — the parts' op graphs and costs side by side (the simulator's);
* :func:`captured` — the parts' blocks as one :class:`~opweave.capture.Captured`, from the blocks' cached captures
  (TOP's own combined op graphs: the CPU without a segment compiler, CUDA);
* :func:`parts_captured` — a graph whose ops are the parts, each one call of its compiled block (the CPU with a
  segment compiler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from opweave.capture.runtime import Captured
from opweave.costs.model import Costs
from opweave.ir.graph import Edge, Op, OpGraph
from opweave.serve.engine.blocks import BlockedModel, combined_module

Signature = tuple[tuple[str, int, int], ...]


@dataclass(eq=False)
class Part:
    """One sub-block of a combined block: block ``block`` of ``model`` for ``batch`` stacked samples. ``state`` holds
    the block's inputs (real executors: a tuple of tensors; simulation: None) and, after the run, its outputs."""

    model: str
    block: int
    batch: int
    state: Any = None


def signature(parts: list[Part], bucket: Callable[[int], int] = lambda n: n) -> Signature:
    """The sorted ``(model, block, batch)`` triples, each batch rounded up by ``bucket``."""
    return tuple(sorted((p.model, p.block, bucket(p.batch)) for p in parts))


def name_of(sig: Signature) -> str:
    """A signature as a graph's name: ``model.bBLOCKxBATCH+...``."""
    return "+".join(f"{m}.b{b}x{n}" for m, b, n in sig)


@dataclass
class UnionGraph(OpGraph):
    """Graphs side by side (:func:`union_graph`). Each part is a validated :class:`OpGraph` and no edge joins two
    parts, so the union is a valid DAG and is not checked again; its topological order is the parts' orders one after
    another, which is exactly the capture-order-tie-broken order :attr:`OpGraph.topo_order` defines (every op of part
    k precedes every op of part k+1 in capture order). Both save most of the cost of timing a combined block."""

    def validate(self) -> None:
        pass


def union_graph(graphs: list[OpGraph], name: str = "combined") -> OpGraph:
    """The graphs side by side: op ``o`` of graph ``k`` becomes ``p{k}_o``; no edges between graphs."""
    ops, edges, order = [], [], []
    for k, g in enumerate(graphs):
        ops += [replace(o, id=f"p{k}_{o.id}", name=f"p{k}_{o.name or o.id}") for o in g.ops]
        edges += [Edge(f"p{k}_{e.src}", f"p{k}_{e.dst}", e.bytes, e.transfer_ms, e.kind) for e in g.edges]
        order += [f"p{k}_{o}" for o in g.topo_order]
    union = UnionGraph(ops, edges, name)
    union.__dict__["topo_order"] = order  # the cached_property's value, known without sorting
    return union


def union_costs(costs: list[Costs], model: str) -> Costs:
    """Per-part costs merged with the ``p{k}_`` prefixes of :func:`union_graph`."""
    def merged(field: str) -> dict:
        return {f"p{k}_{op}": v for k, c in enumerate(costs) for op, v in getattr(c, field).items()}

    return Costs(latency_ms=merged("latency_ms"), utilization=merged("utilization"), category=merged("category"),
                 model=model, source=",".join(sorted({c.source for c in costs})))


def captured(models: dict[str, BlockedModel], sig: Signature) -> tuple[Captured, tuple]:
    """The blocks of ``sig`` side by side as one :class:`Captured` (op ``o`` of part ``k`` is ``p{k}_o``, as in
    :func:`union_graph`) and example inputs for it (every part's, in order). Assembled from the parts' cached
    captures (:meth:`BlockedModel.captured_block`): the module is :func:`opweave.serve.engine.blocks.combined_module` of
    their graphs, the op graph the :func:`union_graph` of theirs, so no signature runs a forward pass to be compiled
    (a shape propagation of the combination was a third of a CPU server's time under load)."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    parts = [models[m].captured_block(b, n) for m, b, n in sig]
    example = tuple(x for m, b, n in sig for x in models[m].example(b, n))
    module = combined_module([p.gm for p in parts], name_of(sig))
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example, strict=True):  # a part module's metas are its last batch's
        if isinstance(x, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(x)
    by_name = {n.name: n for n in module.graph.nodes}
    nodes = {f"p{k}_{op}": [by_name[f"p{k}_{n.name}"] for n in group]
             for k, part in enumerate(parts) for op, group in part.nodes.items()}
    return Captured(union_graph([p.graph for p in parts], name_of(sig)), module, nodes), example


def parts_captured(models: dict[str, BlockedModel], sig: Signature,
                   call: Callable[[str, int, int], Callable]) -> Captured:
    """``sig`` as a graph whose ops are its parts, each one call of ``call(model, block, batch)`` (a compiled
    block); an op's FLOPs and bytes are its block's."""
    from torch import fx, nn

    graph, calls, ops = fx.Graph(), [], []
    for k, (model, index, batch) in enumerate(sig):
        inputs = [graph.placeholder(f"p{k}_in{i}") for i in range(models[model].input_count(index))]
        calls.append(graph.create_node("call_function", call(model, index, batch), tuple(inputs), name=f"p{k}"))
        part_graph = models[model].graph_at(index, batch)
        ops.append(Op(f"p{k}", target=f"{model}.block{index}", flops=sum(o.flops for o in part_graph.ops),
                      bytes=sum(o.bytes for o in part_graph.ops)))
    graph.output(tuple(calls))
    module = fx.GraphModule(nn.Module(), graph, class_name=name_of(sig).replace(".", "_").replace("+", "_"))
    by_name = {n.name: n for n in module.graph.nodes}
    return Captured(OpGraph(ops, [], name_of(sig)), module, {f"p{k}": [by_name[f"p{k}"]] for k in range(len(sig))})


__all__ = ["Part", "Signature", "UnionGraph", "captured", "name_of", "parts_captured", "signature", "union_costs",
           "union_graph"]
