"""Blocks (TOP §IV "Block", §VI-A): a captured model split at single-tensor cut points, each block runnable alone.

TOP pipelines requests block by block: "each residual block of ResNet is a block, each Inception module of
Inception V3 is a block, and each Fire module of SqueezeNet is a block". opweave finds the blocks itself:

1. **Cut points** (:func:`cut_points`). Walk the ops in the graph's topological order (capture order breaks ties);
   after op ``c`` the *live values* are the fx values made at or before ``c`` (model inputs included, constants and
   parameters not) that an op after ``c`` or the model's output still reads. ``c`` is a cut point when exactly one
   value is live and ``c`` made it: every path from the inputs to the outputs then crosses ``c``, and the rest of
   the model needs nothing from before ``c`` but that one tensor. Cost O(V·L + E) for at most L values live at once.
2. **Segments** are the runs of ops between consecutive cut points. In a chain every op is a cut point, so a
   segment of one op has no operator parallelism of its own. **Blocks** (:func:`blocks_from_cuts`): a run of
   one-op segments joins the segment after it (a pooling layer, the squeeze convolution of a Fire module and a
   network's stem thus join the module they feed); a trailing run joins the last block. This is our reading of
   TOP's "modules"; the paper does not say how it split its models. A manual list of cut ops (``cuts=``) overrides
   both steps: blocks end exactly there (each must be a cut point).
3. **Block modules** (:func:`block_module`): each block becomes an ``fx.GraphModule`` sharing the model's
   parameters, whose inputs are the model's inputs (block 0) or the previous block's live tensor, and whose output is
   its own live tensor (the last block: the model's output). :meth:`BlockedModel.captured` captures a block at any
   batch size, so a block of several stacked requests is scheduled, lowered and run as any model is.

Counts beside TOP Table II (Inception-v3 13, ResNet-50 5, SqueezeNet 12) are in ``docs/serving.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from opweave.capture import Captured, opinfo
from opweave.capture.partition import build_graph, partition
from opweave.capture.runtime import as_tuple
from opweave.errors import UsageError
from opweave.ir.graph import OpGraph


@dataclass(frozen=True)
class Block:
    """One block: its ops (ids of the whole model's graph, topological order), the fx values it reads from before it
    (the model's inputs for block 0, else the previous block's live tensor) and the value it hands on (None: the
    model's output)."""

    index: int
    ops: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str | None


def live_after(captured: Captured) -> list[list[str]]:
    """For each op position ``i`` of ``graph.topo_order``: the fx values live after it (see the module docstring)."""
    graph, gm = captured.graph, captured.gm
    order = graph.topo_order
    position = {op: i for i, op in enumerate(order)}
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    constant = _constants(gm, owner)
    end = len(order)
    made: dict[str, int] = {}  # value -> position of the op that makes it (-1: a model input or derived from one)
    last_read: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.name in constant:
            continue
        if node.op == "placeholder" or node.name not in owner and node.op != "output":
            made[node.name] = -1
        elif node.name in owner:
            made[node.name] = position[owner[node.name]]
        reader = end if node.op == "output" else position.get(owner.get(node.name, ""), -1)
        for arg in node.all_input_nodes:
            if arg.name in made:
                last_read[arg.name] = max(last_read.get(arg.name, -1), reader)
    live: list[list[str]] = [[] for _ in order]
    for value, at in made.items():  # live from the op that makes it up to (not including) its last reader
        for i in range(max(at, 0), min(last_read.get(value, -1), end)):
            live[i].append(value)
    return live


def cut_points(captured: Captured) -> list[str]:
    """Ops after which exactly one value, made by the op itself, is live (the last op excluded), topological order."""
    order = captured.graph.topo_order
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    return [op for op, values in zip(order[:-1], live_after(captured)[:-1], strict=True)
            if len(values) == 1 and owner.get(values[0]) == op]


def segments(order: list[str], cuts: list[str]) -> list[list[str]]:
    """``order`` cut right after each op of ``cuts``."""
    out: list[list[str]] = [[]]
    cut_set = set(cuts)
    for op in order:
        out[-1].append(op)
        if op in cut_set:
            out.append([])
    return [s for s in out if s]


def blocks_from_cuts(order: list[str], cuts: list[str]) -> list[list[str]]:
    """Segments merged into blocks: a run of one-op segments joins the next longer segment, a trailing run the last
    block (see the module docstring)."""
    blocks: list[list[str]] = []
    pending: list[str] = []
    for seg in segments(order, cuts):
        pending += seg
        if len(seg) > 1:
            blocks.append(pending)
            pending = []
    if pending:
        if blocks:
            blocks[-1] += pending
        else:
            blocks.append(pending)
    return blocks


def block_module(captured: Captured, ops: list[str], inputs: list[str], output: str | None,
                 name: str = "block") -> fx.GraphModule:
    """An ``fx.GraphModule`` that runs ``ops`` of ``captured`` (their fx nodes, in fx order) on ``inputs`` and returns
    ``output`` (None: the model's output structure). Parameters and submodules are shared with the model; constants
    and the nodes ``bind`` computes from them are copied into the block that reads them."""
    gm = captured.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    wanted = {n for op in ops for n in captured.nodes[op]}
    owner = {n.name for group in captured.nodes.values() for n in group}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[by_name[value]] = graph.placeholder(value)

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:  # a constant, or a node bind computes from constants or block 0's inputs
            if node.op == "placeholder" or node.name in owner:
                raise UsageError(f"{name}: reads {node.name!r}, which an earlier block computes (not a cut)")
            for arg in node.all_input_nodes:
                copy(arg)
            env[node] = graph.node_copy(node, env.__getitem__)
        return env[node]

    for node in gm.graph.nodes:
        if node in wanted:
            for arg in node.all_input_nodes:
                if arg not in wanted:
                    copy(arg)
            env[node] = graph.node_copy(node, env.__getitem__)
    if output is None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        graph.output(fx.node.map_arg(out.args[0], copy))
    else:
        graph.output(env[by_name[output]])
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=name)


def capture_block(gm: fx.GraphModule, example_inputs: tuple, name: str) -> Captured:
    """A :class:`Captured` of a block module for ``example_inputs``, without tracing again: shapes by ShapeProp,
    then capture's own partition (:mod:`opweave.capture.partition`). Op ids stay the whole model's (fx node names),
    so a profile measured for the model applies to its blocks. In-place nodes the model's capture kept stay kept.

    ShapeProp rewrites the module's node metadata; a Captured reads it only when built, so one module serves the
    captures at every batch (the CUDA backend re-shapes a Captured the same way)."""
    return captured_run(gm, example_inputs, name)[0]


def captured_run(gm: fx.GraphModule, example_inputs: tuple, name: str) -> tuple[Captured, Any]:
    """:func:`capture_block` and the block's output for ``example_inputs``: its one run (ShapeProp's) gives both."""
    kept = [n for n in gm.graph.nodes if opinfo.inplace_target(n, gm) and n.args and isinstance(n.args[0], fx.Node)]
    output = _shapes(gm, example_inputs)
    nodes, owner = partition(gm, kept)
    return Captured(build_graph(gm, nodes, owner, kept, name), gm, nodes), output


def _shapes(gm: fx.GraphModule, example_inputs: tuple) -> Any:
    """ShapeProp on clones of the example inputs; the module's output. (Fake tensors would skip the computation, but
    for the blocks of the zoo models at serving batch sizes they cost more than the real run.)"""
    with torch.no_grad():
        return ShapeProp(gm).propagate(*(x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs))


def _constants(gm: fx.GraphModule, owner: dict[str, str]) -> set[str]:
    """fx values that depend on parameters and constants only (``get_attr`` and the nodes ``bind`` computes from
    them)."""
    constant: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op not in ("placeholder", "output") and node.name not in owner
                                     and all(a.name in constant for a in node.all_input_nodes)):
            constant.add(node.name)
    return constant


@dataclass(frozen=True)
class Shaped:
    """A block input kept as its batch-1 shape and dtype rather than a tensor: the intermediate values a CNN's blocks
    read at 224 px are twice its weights, and every use of them (exports, shape propagation, the check of a compiled
    block at another batch) needs only a value of that shape (:meth:`BlockedModel.example`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def make(self, seed: int, batch: int = 1) -> torch.Tensor:
        """A value of this shape with ``batch`` times its first dimension: seeded normal values (zeros for a dtype
        that is not floating point)."""
        shape = (self.shape[0] * batch, *self.shape[1:]) if batch > 1 else self.shape
        if not self.dtype.is_floating_point:
            return torch.zeros(shape, dtype=self.dtype)
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(self.dtype)


@dataclass(eq=False)
class BlockedModel:
    """A model served block by block: its blocks, one ``fx.GraphModule`` each, and per-batch captures of them.

    ``stackable``: instances of this model may be stacked along dimension 0 (every block input and output leaf has
    the batch as its first dimension, checked at batch 1 and 2); otherwise every instance holds one request.
    ``other_sizes``: block 0's inputs at other sizes than the example's, where requests may differ in sizes other
    than the batch (a sequence length: a ``torch.export`` program exported with that dimension free; empty
    otherwise); only requests of equal sizes stack, and each block serves the other sizes with what it was built for
    (:meth:`opweave.serve.engine.cpu.CpuExecutor.build_block`), checked at load on them.
    """

    name: str
    captured: Captured
    example_inputs: tuple
    cuts: list[str]
    blocks: list[Block]
    modules: list[fx.GraphModule]
    stackable: bool = True
    other_sizes: tuple = ()  # block 0's inputs at other sizes than the example's (checked at load); () if fixed
    _captures: dict[tuple[int, int], Captured] = field(default_factory=dict, repr=False)
    _examples: list[tuple] = field(default_factory=list, repr=False)  # batch-1 inputs of each block (later: Shaped)
    _graphs: dict[tuple[int, int], OpGraph] = field(default_factory=dict, repr=False)

    @property
    def sizes_vary(self) -> bool:
        """Whether requests may differ in sizes other than the batch (``other_sizes``)."""
        return bool(self.other_sizes)

    # ---- running ------------------------------------------------------------------------------------------------
    def flat_inputs(self, args: tuple) -> tuple:
        """Request inputs (as ``model(*args)`` takes them) flattened into block 0's inputs."""
        return tuple(self.captured.gm.graph.process_inputs(*args))

    def unflatten_output(self, value: Any) -> Any:
        """The last block's output in the structure ``model(*args)`` returns."""
        return self.captured.gm.graph.process_outputs(value)

    def run(self, *args) -> Any:
        """Run a request through every block eagerly (a reference for tests)."""
        values = self.flat_inputs(args)
        with torch.no_grad():
            for module in self.modules[:-1]:
                values = (module(*values),)
            return self.unflatten_output(self.modules[-1](*values))

    def examples_at(self, values: tuple) -> list[tuple]:
        """Each block's inputs when the model runs on ``values`` (block 0's inputs), the blocks run eagerly."""
        out = []
        with torch.no_grad():
            for module in self.modules:
                out.append(tuple(values))
                values = (module(*values),)
        return out

    @property
    def input_values(self) -> list[fx.Node]:
        return [n for n in self.captured.gm.graph.nodes if n.op == "placeholder"]

    # ---- per-batch captures -------------------------------------------------------------------------------------
    def example(self, index: int, batch: int = 1) -> tuple:
        """Example inputs of block ``index`` for ``batch`` stacked samples: block 0's, the model's example repeated;
        a later block's, values of the shapes its batch-1 inputs had (:class:`Shaped`), made on each call."""
        base = self._examples[index]
        if any(isinstance(x, Shaped) for x in base):
            return tuple(x.make(index, batch) if isinstance(x, Shaped) else x for x in base)
        if batch == 1:
            return base
        return tuple(x.repeat(batch, *[1] * (x.dim() - 1)) if isinstance(x, torch.Tensor) else x for x in base)

    def input_count(self, index: int) -> int:
        """How many inputs block ``index`` takes."""
        return len(self._examples[index])

    def captured_block(self, index: int, batch: int = 1) -> Captured:
        """Block ``index`` captured for ``batch`` stacked samples (cached; parameters shared with the model).

        Batches 1 and 2 are captured (a shape propagation, one forward pass each); a larger batch reuses their
        partition (the same module and nodes) with the op graph extrapolated from them (:meth:`graph_at`) and the
        inputs' shapes set from the stacked example, so a server meeting a new batch size runs no extra forward
        pass to compile it.

        The block module is shared by its captures at every batch, and a :class:`Captured` built from it (another
        capture, or one merging its ops: a compiled segment) reads its inputs' shapes from the module's metadata:
        those are set to this batch's whenever a capture is asked for."""
        key = (index, batch)
        if key not in self._captures:
            if batch > 1 and not self.stackable:
                raise UsageError(f"{self.name}: instances cannot be stacked (batch {batch})")
            if batch <= 2:
                self._captures[key] = capture_block(self.modules[index], self.example(index, batch),
                                                    f"{self.name}.b{index}")
            else:
                base, graph = self.captured_block(index, 1), self.graph_at(index, batch)  # graph_at may propagate
                self._shape_inputs(index, batch)  # read by Captured when built: its inputs' expected shapes
                self._captures[key] = Captured(graph, base.gm, base.nodes)
        self._shape_inputs(index, batch)
        return self._captures[key]

    def _shape_inputs(self, index: int, batch: int) -> None:
        """Block ``index``'s input metadata set to ``batch`` stacked samples' (no value is made)."""
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        placeholders = [n for n in self.modules[index].graph.nodes if n.op == "placeholder"]
        for node, x in zip(placeholders, self._examples[index], strict=True):
            if isinstance(x, (torch.Tensor, Shaped)):
                shape = (x.shape[0] * batch, *x.shape[1:]) if len(x.shape) else ()
                node.meta["tensor_meta"] = _extract_tensor_metadata(torch.empty(shape, dtype=x.dtype, device="meta"))

    def graph_at(self, index: int, batch: int) -> OpGraph:
        """Block ``index``'s op graph for ``batch`` stacked samples, without running it at that batch.

        FLOPs and bytes of the ops opweave captures are affine in the batch (per-sample work plus parameters read
        once), so they are extrapolated from the captures at batch 1 and 2; the first output dimension becomes
        ``batch``. Exact for every op :mod:`opweave.capture.opinfo` counts.
        """
        key = (index, batch)
        if key not in self._graphs:
            self._graphs[key] = self._extrapolate(index, batch)
        return self._graphs[key]

    def _extrapolate(self, index: int, batch: int) -> OpGraph:
        one = self.captured_block(index, 1).graph
        if batch == 1 or not self.stackable:
            return one
        two = self.captured_block(index, 2).graph
        ops = []
        for a, b in zip(one.ops, two.ops, strict=True):
            shape = list(a.shape) if a.shape else a.shape
            if shape and b.shape and b.shape[0] == 2 * shape[0]:
                shape[0] *= batch
            ops.append(replace(a, flops=a.flops + (batch - 1) * (b.flops - a.flops),
                               bytes=a.bytes + (batch - 1) * (b.bytes - a.bytes), shape=shape))
        return OpGraph(ops, [replace(e, bytes=e.bytes * batch) for e in one.edges], f"{self.name}.b{index}x{batch}")


def split(captured: Captured, example_inputs: tuple, *, cuts: list[str] | None = None,
          name: str | None = None) -> BlockedModel:
    """Split ``captured`` into blocks (automatic cut points, or exactly at ``cuts``; see the module docstring)."""
    name = name or captured.graph.name
    example_inputs = as_tuple(example_inputs)
    order = captured.graph.topo_order
    found = cut_points(captured)
    if cuts is None:
        groups = blocks_from_cuts(order, found)
    else:
        position = {op: i for i, op in enumerate(order)}
        live = live_after(captured)
        for op in cuts:
            if op not in position:
                raise UsageError(f"{name}: cut {op!r} is not an op of the model")
            if op not in found:
                values = live[position[op]]
                raise UsageError(f"{name}: op {op!r} is not a single-tensor cut point ({len(values)} values live "
                                 f"after it: {', '.join(values[:4])})")
        groups = segments(order, sorted(set(cuts), key=position.__getitem__))
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    live = live_after(captured)
    position = {op: i for i, op in enumerate(order)}
    blocks: list[Block] = []
    inputs = tuple(n.name for n in captured.gm.graph.nodes if n.op == "placeholder")
    for i, ops in enumerate(groups):
        last = i == len(groups) - 1
        output = None if last else live[position[ops[-1]]][0]
        assert output is None or owner[output] == ops[-1]
        blocks.append(Block(i, tuple(ops), inputs, output))
        inputs = (output,)
    modules = [block_module(captured, list(b.ops), list(b.inputs), b.output, f"{name}_block{b.index}")
               for b in blocks]
    model = BlockedModel(name, captured, tuple(example_inputs), found, blocks, modules)
    _examples(model)
    return model


def _examples(model: BlockedModel) -> None:
    """Record each block's batch-1 example inputs (by running the example through the blocks) and decide whether
    instances stack: every block input and output leaf must have the batch as dimension 0, at batch 1 and 2. Each
    run is the block's capture at that batch (:meth:`BlockedModel.captured_block`, kept), so that building a block
    later runs no forward pass of its own to find its shapes."""
    values = model.flat_inputs(model.example_inputs)
    for index, module in enumerate(model.modules):
        model._examples.append(tuple(values))
        model._captures[(index, 1)], output = captured_run(module, tuple(values), f"{model.name}.b{index}")
        values = (output,)
    model.stackable = (all(_batch_first(v, 1) for inputs in model._examples for v in inputs)
                       and all(_batch_first(t, 1) for t in pytree.tree_leaves(values[0])))
    if model.stackable:
        try:
            values = model.example(0, 2)
            for index, module in enumerate(model.modules):
                captured, output = captured_run(module, tuple(values), f"{model.name}.b{index}")
                values = (output,)
                model.stackable &= all(_batch_first(t, 2) for t in pytree.tree_leaves(output))
                if model.stackable:
                    model._captures[(index, 2)] = captured
        except Exception:  # noqa: BLE001 - a model that cannot take a batch of two is simply not stacked
            model.stackable = False
    if not model.stackable:
        model._captures = {key: c for key, c in model._captures.items() if key[1] == 1}
    model._examples[1:] = [tuple(Shaped(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                                 for x in inputs) for inputs in model._examples[1:]]


def _batch_first(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def combined_module(parts: list[fx.GraphModule], name: str = "combined") -> fx.GraphModule:
    """One ``fx.GraphModule`` running ``parts`` side by side: its inputs are every part's inputs in order, its output
    the tuple of the parts' outputs. Node names get a ``p{k}_`` prefix; parameters stay shared. (The CUDA executor
    records one CUDA graph of it per combination signature.)"""
    root = nn.Module()
    graph = fx.Graph()
    outputs = []
    for k, part in enumerate(parts):
        prefix = f"p{k}"
        setattr(root, prefix, part)
        env: dict[fx.Node, fx.Node] = {}
        for node in part.graph.nodes:
            if node.op == "output":
                outputs.append(fx.node.map_arg(node.args[0], env.__getitem__))
                continue
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            name = f"{prefix}_{node.name}"
            target = (f"{prefix}.{node.target}" if node.op in ("call_module", "get_attr")
                      else name if node.op == "placeholder" else node.target)
            new = graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
            new.meta = dict(node.meta)
            env[node] = new
    graph.output(tuple(outputs))
    graph.lint()
    return fx.GraphModule(root, graph, class_name=name)


def table_ii(model: BlockedModel) -> dict:
    """The counts to set beside TOP Table II: ops, cut points, segments and blocks."""
    return {"model": model.name, "ops": len(model.captured.graph), "cut_points": len(model.cuts),
            "segments": len(model.cuts) + 1, "blocks": len(model.blocks),
            "ops_per_block": [len(b.ops) for b in model.blocks]}


__all__ = ["Block", "BlockedModel", "Shaped", "blocks_from_cuts", "combined_module", "cut_points", "live_after",
           "split", "table_ii"]
