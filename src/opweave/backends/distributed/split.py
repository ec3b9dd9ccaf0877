"""A captured model and its launch plan cut into one :class:`RankPart` per device (plain data, no processes).

What rank ``r`` (= device ``r`` of the plan) gets:

* **Its lanes**: the plan's (device ``r``, stream) lanes as :class:`~opweave.backends.program.Program` steps, and
  ``issue``, its steps interleaved in the plan's order with the :class:`Message` s it sends or receives.
* **Its messages.** Every ``send`` instruction of the plan is one message, numbered by the instruction's position
  in the plan (``index``, the global order). It carries the values (fx nodes) of the sent op that ops on the
  receiving device read, each with its layout from capture (:mod:`.wire`); a message that carries nothing
  (a write-after-read edge, or an op whose output the receiver does not read) is a one-byte token. A ``send``
  raises signal ``s`` in the Program, and every ``recv`` paired with it (:meth:`~opweave.plan.semantics.
  PlanInterpreter.pair`, through ``Program.from_plan``) waits for ``s``: on the receiving rank ``s`` is the message's
  arrival.
* **Its share of the model.** A copy of the fx graph (the whole graph: it is small; node metadata dropped except
  placeholders' shapes) and a ``root`` mapping every ``call_module`` and ``get_attr`` target to an object:
  the real module or tensor when an op of rank ``r`` (or the ``bind`` prelude, which every rank runs) uses it,
  else a stand-in holding no memory: :class:`Elsewhere` (a parameter-less module that refuses to run) for a
  module, an ``empty(..., device="meta")`` tensor for a tensor. ``fx.GraphModule(root, graph)`` on the rank then
  materializes exactly the parameters and buffers of the rank's ops. A parameter used by ops of several ranks
  (tied weights, a module called twice) is materialized on each of them.
* **Its inputs**: the model inputs (placeholders) its ops read, directly or through ``bind``'s prelude (views of
  inputs and parameters); it binds meta stand-ins for the others. Non-tensor inputs go to every rank.
* **Its outputs**: the values of its ops that the model's output reads; the caller rebuilds the output from them
  (``Captured.output``), computing itself the parts that are inputs, parameters or prelude views.

Refused with :class:`~opweave.errors.PlanError`: a plan using a device outside ``0 … world - 1``; a value that
must cross devices but is neither tensors nor an int/float/bool (:func:`.wire.layout_of`); an op that kept an
in-place write (see :mod:`opweave.capture.functionalize`) whose tensor another device also uses (each rank has its
own copy of a tensor, so a write on one device would not reach the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx, nn

from opweave.backends.distributed import wire
from opweave.backends.program import Lane, Program, Step
from opweave.capture import opinfo
from opweave.capture.functionalize import aliases
from opweave.capture.runtime import Captured
from opweave.errors import PlanError
from opweave.ir.graph import OpGraph
from opweave.plan.launchplan import LaunchPlan


@dataclass(frozen=True)
class Message:
    """One ``send`` instruction of the plan: ``op``'s values ``keys`` from rank ``src`` to rank ``dst``."""

    index: int  # the send instruction's position in the plan: the order every rank posts messages in
    op: str
    src: int
    dst: int
    signal: int  # Program signal raised by the send and waited for by its recvs
    lane: Lane  # the sending lane
    keys: tuple[str, ...]
    layouts: tuple
    tag: int  # tag of the first buffer; buffer i of the message has tag + i
    sizes: tuple[int, ...]  # bytes of each buffer (a token: one byte)


@dataclass
class RankPart:
    """Everything rank ``rank`` needs to run its share of the plan (see the module docstring)."""

    rank: int
    world: int
    graph: OpGraph
    fx_graph: fx.Graph
    nodes: dict[str, list[str]]  # op -> names of its fx nodes
    root: dict[str, Any]  # call_module / get_attr target -> module, tensor or stand-in
    lanes: dict[Lane, list[Step]]
    num_signals: int
    issue: list  # (lane, Step) and Message items of this rank, in plan order
    placeholders: list[tuple[str, Any]]  # every model input (name, layout or None), in order
    inputs: list[str]  # the inputs this rank reads
    outputs: dict[str, Any]  # values this rank returns -> layout
    output_tag: int  # first tag of the buffers this rank returns over torch.distributed (torchrun)
    ops: list[str] = field(default_factory=list)

    @property
    def messages(self) -> list[Message]:
        return [item for item in self.issue if isinstance(item, Message)]


class Elsewhere(nn.Module):
    """Stand-in for a module whose ops run on other ranks: holds nothing, refuses to run."""

    def __init__(self, target: str, ranks: list[int]):
        super().__init__()
        self.target, self.ranks = target, ranks

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"module {self.target!r} runs on rank(s) {self.ranks}, not on this one")


def split(captured: Captured, plan: LaunchPlan, world: int) -> list[RankPart]:
    """Cut ``captured`` and ``plan`` into ``world`` rank parts (see the module docstring)."""
    outside = [d for d in plan.devices if not 0 <= d < world]
    if outside:
        raise PlanError(f"the plan uses device {outside[0]}, but there are only {world} ranks (0 … {world - 1})")
    gm = captured.gm
    program = Program.from_plan(plan)  # checks the plan; each send/recv -> the signal that pairs them
    device_of = {ins.target: ins.device for ins in plan.instrs if ins.kind == "launch"}
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    _check_inplace(captured, owner, device_of)
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}

    reads: dict[tuple[str, int], set[fx.Node]] = {}  # (op, device) -> its nodes that ops of the device read
    for op, group in captured.nodes.items():
        for node in group:
            for arg in node.all_input_nodes:
                source = owner.get(arg.name)
                if source is not None and source != op and device_of[source] != device_of[op]:
                    reads.setdefault((source, device_of[op]), set()).add(arg)

    messages: dict[int, Message] = {}
    tag = 0
    for i, (ins, (lane, step)) in enumerate(zip(plan.instrs, program.issue_order, strict=True)):
        if ins.kind != "send":
            continue
        peer = ins.peer
        assert peer is not None  # a send names its peer
        nodes = sorted(reads.get((ins.target, peer), ()), key=lambda n: position[n.name])
        layouts = tuple(wire.layout_of(n, ins.target) for n in nodes)
        sizes = wire.part_sizes(layouts) or (1,)
        messages[i] = Message(i, ins.target, ins.device, peer, step.signal, lane, tuple(n.name for n in nodes),
                              layouts, tag, sizes)
        tag += len(sizes)

    graph = _bare_graph(gm)
    placeholders = [(n.name, wire.layout_of(n, "input") if "tensor_meta" in n.meta else None)
                    for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    prelude = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output") and n.name not in owner]
    runs_module: dict[str, set[int]] = {}
    for op, group in captured.nodes.items():
        for node in group:
            if node.op == "call_module":
                runs_module.setdefault(str(node.target), set()).add(device_of[op])

    parts = []
    for r in range(world):
        ops = [op for op in captured.graph.ids if device_of[op] == r]
        needed = _prelude_closure([n for op in ops for n in captured.nodes[op]], owner)
        real_modules = {t for t, ranks in runs_module.items() if r in ranks}
        real_modules |= {n.target for n in prelude if n.op == "call_module"}
        root = _root(gm, real_modules, needed, runs_module)
        returned = [n for n in output.all_input_nodes if owner.get(n.name) in ops]
        issue: list = []
        for i, (ins, item) in enumerate(zip(plan.instrs, program.issue_order, strict=True)):
            if ins.device == r:
                issue.append(item)
            if i in messages and r in (messages[i].src, messages[i].dst):
                issue.append(messages[i])
        parts.append(RankPart(
            rank=r, world=world, graph=captured.graph, fx_graph=graph,
            nodes={op: [n.name for n in group] for op, group in captured.nodes.items()}, root=root,
            lanes={lane: steps for lane, steps in program.lanes.items() if lane[0] == r},
            num_signals=program.num_signals,
            issue=issue,
            placeholders=placeholders,
            inputs=[name for name, layout in placeholders if name in needed or layout is None],
            outputs={n.name: wire.layout_of(n, owner[n.name]) for n in returned},
            output_tag=0, ops=ops))
    for part in parts:  # the buffers each rank returns over torch.distributed follow the messages' tags
        part.output_tag = tag
        tag += len(wire.part_sizes(part.outputs.values()))
    return parts


def _prelude_closure(nodes: list[fx.Node], owner: dict[str, str]) -> set[str]:
    """Names of the placeholders, ``get_attr`` s and prelude nodes that ``nodes`` read, directly or through the
    prelude (the trivial nodes ``bind`` computes from inputs and parameters alone)."""
    needed: set[str] = set()
    stack = [arg for node in nodes for arg in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node.name in needed or owner.get(node.name) is not None:
            continue
        needed.add(node.name)
        if node.op not in ("placeholder", "get_attr"):
            stack.extend(node.all_input_nodes)
    return needed


def _root(gm: fx.GraphModule, real_modules: set[str], needed: set[str],
          runs_module: dict[str, set[int]]) -> dict[str, Any]:
    """Target -> object for the rank's GraphModule: real where the rank uses it, a stand-in elsewhere."""

    def under_real(target: str) -> bool:  # a parameter of a module the rank runs stays real
        parts = target.split(".")
        return any(".".join(parts[:i]) in real_modules for i in range(1, len(parts)))

    root: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            root[node.target] = module if node.target in real_modules else Elsewhere(
                node.target, sorted(runs_module.get(node.target, ())))
        elif node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            real = node.name in needed or under_real(node.target)
            root[node.target] = value if real else _stand_in(node.target, value)
    return root


def _stand_in(target: str, value: Any) -> Any:
    if isinstance(value, nn.Module):
        return Elsewhere(target, [])
    if isinstance(value, torch.Tensor):
        meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
        return nn.Parameter(meta, requires_grad=False) if isinstance(value, nn.Parameter) else meta
    return value


def _bare_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm.graph`` that pickles: same node names, default code generation (inputs come flat),
    metadata dropped except the placeholders' shapes (``Captured.bind`` checks inputs against them)."""
    graph = fx.Graph()
    value, _ = cast(tuple, graph.graph_copy(gm.graph, {}, return_output_node=True))  # (its value, the node)
    graph.output(value)
    for node in graph.nodes:
        meta = node.meta.get("tensor_meta") if node.op == "placeholder" else None
        node.meta = {} if meta is None else {"tensor_meta": meta}
        node.type = None
    return graph


def _check_inplace(captured: Captured, owner: dict[str, str], device_of: dict[str, int]) -> None:
    """Refuse an in-place write whose tensor (or an alias of it) is produced or read on another device."""
    gm = captured.gm
    for op, group in captured.nodes.items():
        for node in group:
            if not (opinfo.inplace_target(node, gm) and node.args and isinstance(node.args[0], fx.Node)):
                continue
            for alias in aliases(node.args[0], gm):
                users = [owner.get(alias.name)] + [owner.get(u.name) for u in alias.users]
                for other in users:
                    if other is not None and device_of[other] != device_of[op]:
                        raise PlanError(f"op {op!r} writes {node.args[0].name!r} in place on device "
                                        f"{device_of[op]}, and op {other!r} on device {device_of[other]} uses it; "
                                        "the distributed backend needs both on one device")
