"""Ops that are Inductor's kernels: ``opweave.compile(..., graph="inductor")``.

``compiler="inductor"`` compiles each stream segment of a plan on its own, so Inductor fuses only inside a segment:
a pointwise epilogue cut from its producer becomes a kernel of its own, and a concatenation whose inputs sit in
other segments copies them where the whole graph would have written them in place (GoogLeNet's plan so compiled ran
more kernels per call than ``torch.compile``: docs/design.md, §3.6, inductorgraph). Here the order is turned round,
as ``graph="onnxruntime"`` does for ONNX Runtime (:mod:`opweave.backends.ortgraph`):

1. **Inductor lowers and schedules the whole model once** (:func:`fused_kernels`): the captured model as one graph
   (:func:`opweave.backends.segments.whole_module`), compiled with the same settings as a segment
   (:class:`opweave.backends.compilers.Inductor`), stopped when its scheduler has fused and is about to generate
   code (nothing is compiled to machine code). Each of the scheduler's final nodes is one kernel: a fused pointwise
   or reduction kernel, a template with its epilogue, or an extern call (a convolution, a matrix product; on the
   CPU oneDNN's, with the activation or the add Inductor's freezing passes fold into it). A node that launches
   nothing (a concatenation whose inputs are written in place, a second output of an extern call) counts 0.
2. **Each kernel is mapped onto the captured fx nodes it computes.** Inductor records, for every node of the graph
   it lowered (the decomposed ATen graph), the node of the graph it was given that it came from
   (``node.meta["from_node"]``, followed back to that graph), and keeps, in its lowering's environment, what each node's
   value became. A value stored in a buffer is computed by the kernel that writes that buffer (an extern call's
   second outputs: by the extern call; a concatenation's inputs written in place: together with the
   concatenation); a value never stored (a pointwise op inlined into its consumers) by the first kernel, in
   Inductor's order, that inlines it, since the other consumers can read it once it is stored. Inductor's own
   ``origins`` of a kernel are not used to attribute a stored value: they also name the consumer whose lowering
   forced the value to be stored (a convolution storing its input), which would tie each convolution to its
   producer.
3. **Ops that share a kernel are merged** (:func:`kernel_groups`, then :func:`opweave.capture.coarsen.merge_ops`):
   a union of ops, kernel by kernel in Inductor's order, refusing any merge that would make the graph of groups
   cyclic (two ops with a path between them through a third group: the kernel is then left split across the
   groups, and its segment compiles will launch it once per part; ``stats["split"]`` counts such refusals). An op
   that no kernel computes (its nodes folded into a kernel that names only the op after it, as oneDNN's
   convolution with its activation does, or views alone) joins the group of its only successor, else of its only
   predecessor; such a merge cannot close a cycle. Independent branches share no kernel and stay separate ops,
   so the scheduler can still put them on separate streams.
4. **Segments keep Inductor's layouts** (:func:`free_layouts`, applied by the targets): compiled on its own, each
   segment would return its values in eager's layout and take them in eager's layout, so a convolution whose
   output Inductor keeps channels-last pays a copy kernel on each side of every segment boundary (GoogLeNet at
   64x64 on the CPU, compiled unfrozen as on CUDA, Opara over 8 streams: 211 of Inductor's nodes per call this way,
   153 without, 156 for the whole model; at 224x224, ``benchmarks/results/inductor_groups_unfrozen.json``).
   Where no fx node reads a layout (no view, ``as_strided``, stride or data pointer, and only modules of
   :data:`_LAYOUT_FREE`), segments are compiled with ``keep_output_stride`` off and hand their values on as Inductor
   laid them out; only what the model returns is made contiguous again where eager returns it so
   (:meth:`opweave.backends.segments.Segmented.output`). Compiled frozen on the CPU, this changed nothing: there
   the segments of GoogLeNet's plan ran as many of Inductor's nodes either way (``inductor_groups.json``).

The result, :class:`InductorGraph`, holds the merged :class:`~opweave.capture.Captured` (any scheduler plans its
graph; every stream segment compiled by Inductor then fuses again what the whole graph fused, since the nodes
Inductor fused are in one op) and, per op, how many kernels the whole-graph compile launches for it
(``kernels``: the GPU cost model's launch gaps are per kernel, :class:`opweave.costs.Costs`). Kernels computing no
captured op (copies of the model's inputs into another layout, constants Inductor fills on each call) are counted
in ``stats["unowned"]``.

Inductor's fusion is read from its internals: ``GraphLowering.run_node`` and ``Scheduler.codegen`` are wrapped for
the one compile (the scheduler's nodes as code generation receives them, after every fusion pass; the config hook
``_post_fusion_custom_pass`` would see them earlier, and whether torch 2.11 has it was not checked). Checked with
torch 2.13 on the CPU only. A wrong reading costs fusion, never correctness: the segments are compiled, run and
checked like any others. Where Inductor cannot compile the whole model, or names no captured node at all (a torch
whose lowering keeps no ``from_node``), the captured graph is kept as it is, with a warning.

**Coarsening** does not apply (``coarsen=False`` is implied): the kernels are the grouping, and coarsening's
BatchNorm folding gives a bias-free convolution a bias, which Inductor on CUDA peels off into its consumer's
kernel, tying each convolution to its epilogue, so a concatenation's inputs written in place would tie the last
convolutions of all its branches into one op.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

import torch
from torch import nn

from opweave.backends.compilers import Inductor
from opweave.backends.segments import whole_module
from opweave.backends.threads import total_threads
from opweave.capture.coarsen import merge_ops
from opweave.capture.runtime import Captured
from opweave.errors import CaptureError, first_line
from opweave.ir.graph import OpGraph


@dataclass(frozen=True)
class Kernel:
    """One node of Inductor's scheduler after fusion: the captured ops it computes and the launches it makes. Nodes
    counted as one kernel (a concatenation written in place and the kernels that write its inputs, an extern call
    and its further outputs) keep, in ``parts``, each node's own ops and launches, the first node's first."""

    ops: frozenset[str]
    launches: int  # 1 for a kernel or an extern call; 0 for what launches nothing (a concatenation in place)
    kind: str  # the scheduler node's class, e.g. "FusedSchedulerNode", "ExternKernelSchedulerNode"
    parts: tuple[tuple[frozenset[str], int], ...] = ()


@dataclass
class InductorGraph:
    """The captured model with one op per group of ops that share Inductor's kernels (module docstring)."""

    captured: Captured
    kernels: dict[str, int]  # op -> kernels the whole-graph compile launches for it
    stats: dict = field(default_factory=dict)

    @property
    def graph(self) -> OpGraph:
        return self.captured.graph


def inductor_graph(captured: Captured, inputs: tuple, threads: int | None = None,
                   freeze: bool | None = None) -> InductorGraph:
    """``captured``'s ops grouped by the kernels Inductor fuses when it compiles the whole model for ``inputs``
    (compiled for ``threads`` intra-op threads on the CPU; default: :func:`opweave.backends.threads.total_threads`).
    ``freeze``: as the segment compiler's (default: frozen on the CPU only); ``False`` lowers CPU inputs the way
    CUDA's are lowered (convolutions as ATen's extern calls, BatchNorm and activations in Inductor's epilogue
    kernels), which is how ``opweave simulate --inductor`` predicts a GPU without one."""
    start = time.perf_counter()
    try:
        kernels, unowned = fused_kernels(captured, inputs, threads, freeze)
    except CaptureError as exc:
        warnings.warn(f"{exc}; its captured graph is scheduled as it is", stacklevel=2)
        return InductorGraph(captured, {}, {"ops_before": len(captured.graph), "ops": len(captured.graph),
                                            "error": first_line(exc)})
    lowering_s = time.perf_counter() - start
    stats = {"kernels": len(kernels) + len(unowned), "launches": sum(k.launches for k in kernels + unowned),
             "unowned": sum(k.launches for k in unowned), "ops_before": len(captured.graph),
             "lowering_s": round(lowering_s, 3)}
    if not kernels:
        warnings.warn(f"{captured.graph.name}: Inductor's kernels name no captured node; the captured graph is "
                      "scheduled as it is", stacklevel=2)
        return InductorGraph(captured, {}, {**stats, "split": 0, "ops": len(captured.graph)})
    groups, split = kernel_groups(captured.graph, kernels)
    merged = heaviest_targets(merge_ops(captured, groups), captured.graph, groups)
    return InductorGraph(merged, launch_counts(groups, kernels), {**stats, "split": split, "ops": len(merged.graph)})


def heaviest_targets(merged: Captured, fine: OpGraph, groups: list[list[str]]) -> Captured:
    """``merged`` with each op's target that of its member with the most FLOPs (the first of equals): a group whose
    kernels begin with an elementwise prologue (an add before a matrix product) is priced as the product it mostly
    computes by a cost model that prices ops by their kind (:mod:`opweave.costs.calibrated`), not as an add."""
    target = {group[0]: max((fine.op[op] for op in group), key=lambda o: o.flops or 0.0).target for group in groups}
    graph = merged.graph
    ops = [replace(o, target=target.get(o.id, o.target)) for o in graph.ops]
    return replace(merged, graph=OpGraph(ops, graph.edges, graph.name))


def launch_counts(groups: list[list[str]], kernels: list[Kernel]) -> dict[str, int]:
    """The kernels each group (named by its first op) launches per call: each scheduler node's launches in every
    group that holds some of its ops (a node split across groups is compiled, and launched, once per part); a
    kernel's parts each where their own ops are, and a part whose own ops are not known (a further output of an
    extern call, a writer whose values were attributed elsewhere) once, in the last group of the first part's ops.
    Pure: no torch."""
    group_of = {op: group[0] for group in groups for op in group}
    order = {group[0]: i for i, group in enumerate(groups)}
    counts = {group[0]: 0 for group in groups}
    for k in kernels:
        parts = k.parts or ((k.ops, k.launches),)
        home = max({group_of[op] for op in parts[0][0] or k.ops}, key=order.__getitem__)
        for ops, launched in parts:
            for head in {group_of[op] for op in ops} or {home}:
                counts[head] += launched
    return counts


# torch.nn modules that read no layout of their input (a module called in the graph is run as it is, not traced)
_LAYOUT_FREE = (nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm,
                nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
                nn.modules.pooling._AdaptiveMaxPoolNd, nn.Linear, nn.modules.dropout._DropoutNd, nn.Identity,
                nn.Flatten, nn.Upsample, nn.modules.padding._ConstantPadNd, nn.modules.padding._ReflectionPadNd,
                nn.modules.padding._ReplicationPadNd, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.GELU,
                nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Mish, nn.Softmax)


def free_layouts(captured: Captured) -> bool:
    """Whether the segments of ``captured`` may hand each other values in the layouts Inductor chose rather than
    eager's: no fx node reads a layout (a view, ``as_strided``, a stride or a data pointer: values in another
    layout would give other results or fail) and every module the graph calls is one of :data:`_LAYOUT_FREE`."""
    for node in captured.gm.graph.nodes:
        if node.op == "call_module":
            if not isinstance(captured.gm.get_submodule(node.target), _LAYOUT_FREE):
                return False
        elif node.op in ("call_method", "call_function"):
            name = str(node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target))
            if any(word in name.lower() for word in ("view", "strided", "stride", "data_ptr", "storage")):
                return False
    return True


def kernel_groups(graph: OpGraph, kernels: list[Kernel]) -> tuple[list[list[str]], int]:
    """The ops of ``graph`` grouped so that the ops of each kernel share a group wherever that keeps the graph of
    groups acyclic; then every group that launches nothing joins its only successor, else its only predecessor.
    Returns the groups (members in capture order, groups by their first member) and how many merges were refused
    to keep the graph acyclic. Pure: no torch."""
    parent = {op: op for op in graph.ids}
    succs = {op: set(graph.succs[op]) for op in graph.ids}
    preds = {op: set(graph.preds[op]) for op in graph.ids}
    launching: set[str] = set()

    def find(op: str) -> str:
        while parent[op] != op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op

    def reaches(src: str, dst: str) -> bool:  # a path src -> ... -> dst through at least one other group
        seen, todo = set(), [s for s in succs[src] if s != dst]
        while todo:
            g = todo.pop()
            if g == dst:
                return True
            if g not in seen:
                seen.add(g)
                todo.extend(succs[g])
        return False

    def merge(a: str, b: str) -> bool:
        a, b = find(a), find(b)
        if a == b:
            return True
        if reaches(a, b) or reaches(b, a):
            return False
        parent[b] = a
        if b in launching:
            launching.add(a)
        for s in succs.pop(b):
            preds[s].discard(b)
            if s != a:
                preds[s].add(a)
                succs[a].add(s)
        for p in preds.pop(b):
            succs[p].discard(b)
            if p != a:
                succs[p].add(a)
                preds[a].add(p)
        succs[a].discard(a)
        preds[a].discard(a)
        return True

    split = 0
    for kernel in kernels:
        members = sorted(kernel.ops, key=graph.index.__getitem__)
        split += sum(not merge(members[0], op) for op in members[1:])
        if kernel.launches:
            launching.update(find(op) for op in members)
    for op in reversed(graph.topo_order):  # consumers first: a chain of such groups joins the kernel after it
        group = find(op)
        if group in launching:
            continue
        for side in (succs, preds):
            if len(side[group]) == 1:
                merge(next(iter(side[group])), group)
                break
    groups: dict[str, list[str]] = {}
    for op in graph.ids:  # capture order
        groups.setdefault(find(op), []).append(op)
    return list(groups.values()), split


def fused_kernels(captured: Captured, inputs: tuple, threads: int | None = None,
                  freeze: bool | None = None) -> tuple[list[Kernel], list[Kernel]]:
    """Inductor's kernels for the whole of ``captured`` on ``inputs``, in Inductor's order: those that compute some
    captured op, and those that compute none (module docstring); ``freeze`` as :func:`inductor_graph`'s."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import Scheduler

    whole = whole_module(captured, tuple(inputs))
    owner = {n.name: op for op, members in captured.nodes.items() for n in members}
    seen: list[tuple[Any, Any]] = []
    values: dict[torch.fx.Node, Any] = {}  # what each lowered node became (the lowering drops it after last use)
    lower = GraphLowering.run_node

    def record(lowering, node):
        values[node] = result = lower(lowering, node)
        return result

    def stop(scheduler) -> None:  # replaces Scheduler.codegen: what was fused is known, nothing to generate
        from torch._inductor.virtualized import V

        seen.append((scheduler, V.graph))
        raise _Fused

    compiler = Inductor(freeze=freeze)
    patches = {"fx_graph_cache": False}  # a cache hit would skip the scheduler
    with mock.patch.object(Scheduler, "codegen", stop), mock.patch.object(GraphLowering, "run_node", record), \
            config.patch(patches), \
            torch._functorch.config.patch(enable_autograd_cache=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compiler(whole.gm, whole.inputs, total_threads(threads))
        except Exception as exc:  # noqa: BLE001 - _Fused, wrapped by Inductor; anything else: it cannot compile
            if not seen:
                raise CaptureError(f"{captured.graph.name}: Inductor cannot compile the whole model: "
                                   f"{first_line(exc)}") from exc
    scheduler, lowered = seen[0]  # the model's graph (a subgraph's scheduler would generate inside it)
    kernels, unowned = _attribute(scheduler, {n: values[n] for n in lowered.graph.nodes if n in values}, owner)
    if compiler.freezes(whole.inputs):  # each foldable BatchNorm is folded into its convolution (compilers.Inductor)
        from opweave.capture.coarsen import foldable

        folded = [Kernel(frozenset({owner[n.args[0].name], owner[n.name]}), 0, "folded BatchNorm")
                  for n in whole.gm.graph.nodes if n.args and isinstance(n.args[0], torch.fx.Node)
                  and n.name in owner and n.args[0].name in owner and foldable(n.args[0], n, whole.gm)]
        kernels = folded + kernels
    return kernels, unowned


class _Fused(Exception):
    """Raised from the wrapped ``Scheduler.codegen`` once the fused nodes are recorded."""


def _attribute(scheduler, values: dict, owner: dict[str, str]) -> tuple[list[Kernel], list[Kernel]]:
    """Each final scheduler node with the captured ops it computes (module docstring, step 2); ``values``: each node
    of the lowered graph and what its lowering returned."""
    from torch._inductor import ir

    nodes = list(scheduler.nodes)
    writer: dict[str, int] = {}  # buffer name -> index of the scheduler node that writes it
    for i, snode in enumerate(nodes):
        for name in snode.get_buffer_names():
            writer[name] = i
    unite = list(range(len(nodes)))  # a concatenation in place and the kernels writing its inputs count as one

    def root(i: int) -> int:
        while unite[i] != i:
            i = unite[i]
        return i

    for i, snode in enumerate(nodes):
        node = getattr(snode, "node", None)
        if isinstance(node, ir.MultiOutput):  # a further output of an extern call: that call computes it
            unite[i] = _first_writer(node.inputs, writer, i)
    for i, snode in enumerate(nodes):
        node = getattr(snode, "node", None)
        if isinstance(node, ir.ConcatKernel):
            for inp in node.inputs:
                for name in _buffer_names(inp):
                    if name in writer and root(writer[name]) != i:
                        unite[root(writer[name])] = i
    inlined: dict[Any, int] = {}  # post-grad node -> the first kernel whose loops include it
    for i, snode in enumerate(nodes):
        for part in snode.get_nodes():
            for origin in getattr(getattr(part, "node", None), "origins", None) or ():
                inlined.setdefault(origin, i)

    ops: list[set[str]] = [set() for _ in nodes]  # by the kernel (root) a node is united in
    own: list[set[str]] = [set() for _ in nodes]  # by the node itself
    found = {fx_node: _sources(fx_node) for fx_node in values}
    given = _given_graph(list(found.values()), set(owner))
    for fx_node, value in values.items():
        sources = {owner[name] for graph_id, name in found[fx_node] if graph_id == given and name in owner}
        if not sources:
            continue
        names = [n for n in _buffer_names(value) if n in writer]
        where = {writer[n] for n in names} if names else {inlined[fx_node]} if fx_node in inlined else set()
        for i in where:
            ops[root(i)] |= sources
            own[i] |= sources
    groups: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        groups.setdefault(root(i), []).append(i)
    owned: list[Kernel] = []
    unowned: list[Kernel] = []
    for head, members in groups.items():
        parts = tuple((frozenset(own[i]), launches(nodes[i])) for i in sorted(members, key=lambda i: i != head)
                      ) if len(members) > 1 else ()
        kernel = Kernel(frozenset(ops[head]), sum(launches(nodes[i]) for i in members), type(nodes[head]).__name__,
                        parts)
        (owned if kernel.ops else unowned).append(kernel)
    return owned, unowned


def launches(snode) -> int:
    """The launches one node of Inductor's scheduler makes: none for a node that only names memory (a concatenation
    written in place, a further output of an extern call), else one kernel or extern call."""
    from torch._inductor import ir
    from torch._inductor.scheduler import NopKernelSchedulerNode

    return 0 if isinstance(snode, NopKernelSchedulerNode) or isinstance(getattr(snode, "node", None),
                                                                          ir.MultiOutput) else 1


def _first_writer(inputs, writer: dict[str, int], default: int) -> int:
    for inp in inputs:
        for name in _buffer_names(inp):
            if name in writer:
                return writer[name]
    return default


def _buffer_names(value) -> list[str]:
    """The buffers holding a lowered value (several for a tuple; none for loops never stored, or a scalar)."""
    from torch._inductor import ir

    if isinstance(value, (list, tuple)):
        return [name for v in value for name in _buffer_names(v)]
    for _ in range(64):  # boxes and views around the storage
        if isinstance(value, ir.MutableBox):
            value = value.data
        elif isinstance(value, ir.BaseView):
            value = value.unwrap_view()
        else:
            break
    return [value.get_name()] if isinstance(value, ir.Buffer) else []


def _sources(fx_node) -> set[tuple[int | None, str]]:
    """``(graph id, node name)`` of every node that ``fx_node`` of the lowered graph came from, through every graph
    between (``meta["from_node"]``, followed to its roots)."""
    found: set[tuple[int | None, str]] = set()
    todo = list(fx_node.meta.get("from_node") or ())
    while todo:
        source = todo.pop()
        found.add((getattr(source, "graph_id", None), source.name))
        todo.extend(getattr(source, "from_node", None) or ())
    return found


def _given_graph(sources: list[set[tuple[int | None, str]]], names: set[str]) -> Any:
    """The id of the graph Inductor was given: of the graphs the lowered nodes came from, the one with the most
    nodes named as captured nodes are (the graphs between, ATen's, name their nodes after ATen ops, which a captured
    node's name may equal; Inductor's own passes may hand on a copy of the graph it was given, with a new id)."""
    count: dict[Any, set[str]] = {}
    for found in sources:
        for graph_id, name in found:
            if name in names:
                count.setdefault(graph_id, set()).add(name)
    return max(count, key=lambda g: len(count[g]), default=None)


__all__ = ["InductorGraph", "Kernel", "free_layouts", "fused_kernels", "inductor_graph", "kernel_groups", "launches"]
