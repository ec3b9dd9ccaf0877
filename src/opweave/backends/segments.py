"""Stream segments, each compiled as one graph (``opweave.compile(..., compiler="inductor")`` or
``compiler="onnxruntime"``).

After scheduling, lowering and validation, every maximal run of launches on one lane (device, stream) with no
other instruction of that lane inside it (no record, wait, send or recv) is a **segment** (:func:`segment_groups`).
Each segment becomes one op of a :class:`Segmented` model (:func:`opweave.capture.coarsen.merge_ops` merges its
ops, its fx nodes kept in graph order) and the plan becomes a plan of segments (:func:`segment_plan`: each
segment is launched where its first op was, the other launches dropped, every sync instruction kept). The
backends run that plan unchanged: on the CPU a lane's worker thread calls one compiled segment where it called
each op; on CUDA the segment's kernels go to the lane's stream, inside the one CUDA Graph the backend records.
(On the CPU, Inductor's own C++ kernels hold the GIL while they run: torch 2.13's binding for them does not release
it. Library calls inside a segment, convolutions and matrix products, do release it, so lanes overlap in those.)

**Why a segment keeps every ordering the plan proved.** The validator proves, on the op-level plan, that each
dependency ``u -> v`` is ordered by FIFO order on a lane or by a record after ``u`` and a wait before ``v``
(:mod:`opweave.plan.validate`). A segment holds no record and no wait, so every wait issued before any of its ops
is issued before all of them, and every record issued after any of them after all of them: each cross-lane order
the validator found still holds between whole segments, and FIFO order between segments of one lane is kept.
Inside a segment, dependencies are data flow of one fx graph, which the compiler preserves (in-place ops are
functionalized by AOTAutograd, mutations of segment inputs written back). Segment values are written to the
environment only when the segment returns, before any record after it, so a consumer on another lane never reads
early; the liveness analysis of the CUDA backend runs on the segment plan's steps and keys. Only the op-level
plan is validated; the segment plan is derived from it by this rule alone.

**State.** An op that writes module state in place (:meth:`~opweave.capture.runtime.Captured.state_writes`) is a
segment of its own and runs as it is, op by op: a compiler holds its own copy of the weights (ONNX Runtime's
initializers, Inductor's frozen constants), so the write would land there, and the next call would not see it.

**Compiling.** A segment is an ``fx.GraphModule`` of its nodes: its inputs are the environment values it reads from
outside (the model's inputs, values computed in ``bind``, other segments' outputs: placeholders; tensors inside
tuples are separate placeholders; non-tensor values are baked in as constants), parameters stay module attributes
(but a buffer some op writes in place, module state such as a KV cache, is an input: a compiler would copy it, or
fold it in as a constant), and its outputs are the values read by another segment or returned by the model (every
leaf of them, Python scalars too: a scalar may depend on the data, as ``.item()``'s does, so none is baked). It is
handed to the
:mod:`~opweave.backends.compilers` compiler named by ``fuse`` with the thread budget of its lane (the smallest of its
ops' budgets): ``inductor`` compiles it as ``torch._inductor.compile`` does, under ``no_grad``, with
``triton.cudagraphs`` off (opweave records the whole plan into its own CUDA Graph; Inductor's graphs would nest and
pin memory per segment) and, on the CPU, frozen (parameters folded in as constants, as ``torch.compile``'s freezing
does: a parameter changed after compiling is not seen); ``onnxruntime`` exports it and runs it in one ONNX Runtime
session. On the CPU Inductor emits C++; on CUDA, Triton. ``compiler_options`` are keywords the compiler is made with:
``graph="inductor"`` makes Inductor's with ``eager_strides=False`` where the model reads no layout
(:func:`opweave.backends.inductorgraph.free_layouts`), so segments hand each other values in Inductor's layouts, and
:meth:`Segmented.output` makes a returned tensor contiguous where eager returns it so. One compiled function is
kept per segment and *input signature* (each input's shape, strides, dtype and device, the values of non-tensor
inputs; :func:`opweave.backends.cache.signature` with strides): Inductor checks sizes and strides, and constants were
baked for those values. The compiled functions sit in a :class:`~opweave.backends.cache.BoundedCache` of
:data:`MAX_SIGNATURES` entries that is never asked to evict: a signature met after it is full (a scalar input that
changes every call) runs op by op, with one warning. Evicting instead would recompile (seconds) on every call of a
workload that cycles through more signatures than the bound, where op by op only loses the fusion's gain, and a
compiled graph already recorded into the CUDA backend's graphs is kept. Compiling happens the first time a
signature is seen, under one process-wide lock (``opweave.compile`` runs the example once on the CPU, and the CUDA
backend's warm-up runs do it, so no compile happens during a call or a graph capture for the example's signature).
Identical segments (same structure and shapes) hit Inductor's FX graph cache and compile once per machine. A segment
Inductor cannot compile (an op AOTAutograd cannot trace, e.g. a custom op without a fake implementation) runs op by
op, with a warning naming it. ``stats`` counts segments, compiles, fallbacks and the seconds spent compiling.

**Sizes.** A compiler that takes symbolic sizes (``dynamic_shapes``: ONNX Runtime, whose exported graph then keeps
those dimensions free, and ``eager``) compiles one graph for a range of sizes, as ``torch.compile``'s automatic
dynamic shapes do: a segment met with tensors that differ from a compiled signature only in sizes (and strides,
which neither reads) is compiled again with the dimensions that changed left free (each dimension at its second
value), and that graph serves every later size of them without a compile (no entry of the bound above is spent on
them). With ``dynamic=True`` every dimension of every tensor input is free from the first compile. Non-tensor inputs
stay baked (a size read by another segment compiles per value), and Inductor compiles per shape.

**The other route, and why not.** Recent Inductor honours stream annotations on FX nodes (``node.meta["custom"]
["stream"]``): its scheduler blocks fusion across streams and its wrapper switches streams and emits event records
and waits (pytorch/pytorch PR 165505, re-landed as 176696, with PR 174223 / 177324 reading the node metadata; torch
2.13's ``torch/_inductor/graph.py`` ``_get_node_stream`` and ``scheduler.py`` ``_populate_stream_assignments``). The
whole plan could then be one annotated graph. It is not used: (1) torch 2.11, which the GPU machine runs, does not
have it: both PRs were still under review and re-submitted in March 2026, after the 2.11 release branch was cut
(16-19 February 2026), and the stack's last PRs were merged for the 2.12 cut (13-15 April 2026), so 2.12 is the
first release that can have it (2.13 has it); (2) the stream index names an object in dynamo's private registry of
traced streams and events (``torch._dynamo.graph_bytecode_inputs``; ``torch.ops.streams.record_event`` /
``wait_event``), which only dynamo's tracing fills, and the feature was still changing after 2.13 (pattern
replacements dropped the annotation until PR 189095); (3) it would not be faster inside opweave's CUDA Graph: a
replay runs the recorded kernels and event edges, which are the same per stream on both routes (neither fuses across
a stream boundary or a wait), so route 2 would save only host time per call, which a replay does not spend.
Per-segment compilation works on every torch with Inductor and keeps the validated plan in charge of the streams.
"""

from __future__ import annotations

import functools
import operator
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache, signature
from opweave.backends.compilers import get as get_compiler
from opweave.backends.threads import total_threads
from opweave.capture import opinfo
from opweave.capture.coarsen import merge_ops
from opweave.capture.functionalize import writes_state
from opweave.capture.runtime import Captured
from opweave.cores import intra_op_threads
from opweave.errors import CaptureError, first_line
from opweave.ir.graph import OpGraph  # noqa: F401 - the annotation Segmented takes from Captured
from opweave.plan.launchplan import LaunchPlan
from opweave.plan.semantics import Lane

MAX_SIGNATURES = 8  # compiled graphs kept per segment; later signatures run op by op
ALIASES = 256  # signatures remembered as served by a graph compiled with free sizes (found again by a scan if dropped)
COMPILE_LOCK = threading.Lock()  # Inductor's compile is not thread-safe; CPU lanes may meet a new signature at once


def segment_groups(plan: LaunchPlan, alone: frozenset[str] | set[str] = frozenset()) -> list[list[str]]:
    """The plan's segments as lists of op ids in launch order, listed in the issue order of their first launch;
    each op in ``alone`` is a segment of its own (an op that writes module state, which runs as it is)."""
    current: dict[Lane, list[str]] = {}
    groups: list[list[str]] = []
    for ins in plan.instrs:
        lane = (ins.device, ins.stream)
        if ins.kind == "launch":
            if ins.target in alone:
                current.pop(lane, None)
                groups.append([ins.target])
                continue
            if lane not in current:
                current[lane] = []
                groups.append(current[lane])
            current[lane].append(ins.target)
        else:
            current.pop(lane, None)
    return groups


def segment_plan(plan: LaunchPlan, groups: list[list[str]]) -> LaunchPlan:
    """``plan`` with each segment launched once, as its first op's id, where its first op was launched; sends and
    recvs name the segment of their op (a send follows the last op of a segment, so each pairs as before).

    Moving a segment's later launches up to its first is safe: no instruction of that lane lies between them, so
    nothing issued in between on another lane can wait for them, and they wait for nothing issued in between."""
    segment_of = {op: group[0] for group in groups for op in group}
    return LaunchPlan([replace(ins, op=segment_of[ins.target]) if ins.kind in ("send", "recv") else replace(ins)
                       for ins in plan.instrs if ins.kind != "launch" or segment_of[ins.target] == ins.op])


def fuse_segments(captured: Captured, plan: LaunchPlan, compiler: str = "inductor",
                  threads: dict[str, int] | None = None, compiler_options: dict | None = None,
                  dynamic: bool | None = None) -> tuple[Segmented, LaunchPlan]:
    """The :class:`Segmented` model of ``plan``'s segments and the plan that launches them (see the module
    docstring). ``plan`` must have passed the validator for ``captured.graph``. ``compiler`` names a
    :mod:`~opweave.backends.compilers` compiler; ``threads`` (op -> intra-op threads,
    :func:`opweave.pipeline.thread_budgets.op_threads`) gives each segment the smallest budget of its ops (the
    compiler's thread count; default 1 per op when some are given, :func:`opweave.backends.threads.total_threads`
    otherwise); ``compiler_options``: keywords the compiler is made with (:func:`opweave.backends.compilers.get`)."""
    get_compiler(compiler, **(compiler_options or {}))  # refuses an unknown name before anything is built
    writes = captured.state_writes()
    groups = segment_groups(plan, set(writes))
    merged = merge_ops(captured, groups)
    budget = {group[0]: min(threads.get(op, 1) for op in group) for group in groups} if threads else {}
    alone = len({(i.device, i.stream) for i in plan.instrs if i.kind == "launch"}) == 1
    segmented = Segmented(merged.graph, merged.gm, merged.nodes, signature=merged.signature,
                          example_inputs=merged.example_inputs, compiler=compiler, threads=budget, alone=alone,
                          compiler_options=dict(compiler_options or {}), dynamic=dynamic,
                          state=frozenset(name for names in writes.values() for name in names))
    return segmented, segment_plan(plan, groups)


@dataclass(eq=False)
class Segmented(Captured):
    """A :class:`Captured` whose ops are stream segments, each run as one compiled graph.

    ``stats`` (shared with copies made by :func:`dataclasses.replace`, e.g. the CUDA backend's copy on the device):
    ``segments``, ``compiles``, ``compile_s`` (wall seconds in the compiler), ``fallbacks`` (signatures run op by
    op because the compiler failed), ``dynamic_compiles`` (of them, those with free sizes). ``dynamic``: True,
    every size free from the first compile (module docstring, Sizes).
    """

    compiler: str = "inductor"
    threads: dict[str, int] = field(default_factory=dict)  # segment -> the intra-op threads it is compiled for
    alone: bool = False  # one lane: nothing runs beside a segment (its compiler's pool may spin)
    compiler_options: dict = field(default_factory=dict)  # keywords the compiler is made with
    dynamic: bool | None = None
    state: frozenset[str] = frozenset()  # get_attr nodes written in place: segment inputs, never compiled in
    stats: dict = field(default_factory=dict)
    _segments: dict[str, _Segment] = field(init=False, repr=False)
    _contiguous_outputs: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.nodes = absorb_prelude(self.gm, self.nodes)
        super().__post_init__()
        for key in ("compiles", "fallbacks", "dynamic_compiles"):
            self.stats.setdefault(key, 0)
        self.stats.setdefault("compile_s", 0.0)
        self.stats["segments"] = len(self.nodes)
        self._segments = {seg: _Segment(self, seg) for seg in self.nodes}
        returned = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output").all_input_nodes
        self._contiguous_outputs = [] if self.compiler_options.get("eager_strides", True) else [
            n.name for n in returned if [m.memory_format for m in opinfo.node_metas(n)] == [torch.contiguous_format]]

    @property
    def any_batch(self) -> bool:  # type: ignore[override]
        """Its segments are compiled with dimension 0 of every input and output free (``dynamic_batch``, ONNX
        Runtime): inputs of another size there are bound, and meet the same compiled graph."""
        return bool(self.compiler_options.get("dynamic_batch"))

    def run_op(self, op_id: str, env: dict[str, Any]) -> None:
        """Run segment ``op_id``: its compiled graph for the current input signature (compiled on first sight)."""
        self._segments[op_id](env)

    def output(self, env: dict[str, Any]) -> Any:
        """The model's output; where segments keep Inductor's layouts (``eager_strides=False``), a returned tensor that
        eager returns contiguous is made contiguous."""
        fixed = {name: value.contiguous() for name in self._contiguous_outputs
                 if isinstance(value := env.get(name), torch.Tensor) and not value.is_contiguous()}
        return super().output({**env, **fixed} if fixed else env)

    def emit(self, op_id: str, graph: fx.Graph, load) -> dict[fx.Node, fx.Node]:
        """Generated lane code (:mod:`opweave.backends.lanecode`): one call of segment ``op_id`` on its inputs,
        then one ``getitem`` per output node."""
        segment = self._segments[op_id]
        call = graph.call_function(segment.run, tuple(load(n) for n in segment.inputs))
        return {node: graph.call_function(operator.getitem, (call, i)) for i, node in enumerate(segment.outputs)}

    def run_unfused(self, op_id: str, env: dict[str, Any]) -> None:
        """Run segment ``op_id`` node by node, as :meth:`Captured.run_op` runs an op."""
        super().run_op(op_id, env)

    def prepare(self, args: tuple, plan: LaunchPlan, console: Any = None) -> None:
        """Run ``plan``'s segments once on ``args`` in issue order, compiling each for their signatures. A
        transient progress bar counts the segments on ``console`` (default: standard error), drawn only where that
        is a terminal: compiling a large model's segments takes minutes."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        launches = [ins.target for ins in plan.instrs if ins.kind == "launch"]
        env = self.bind(args)
        console = console or Console(stderr=True)
        if not console.is_terminal:  # no bar (and no thread redrawing one): a server's blocks build by the hundred
            with torch.no_grad():
                for seg in launches:
                    self.run_op(seg, env)
            return
        with torch.no_grad(), Progress(TextColumn(f"{self.graph.name}: compiling segments with {self.compiler}"),
                                       BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                                       console=console) as bar:
            task = bar.add_task("", total=len(launches))
            for seg in launches:
                self.run_op(seg, env)
                bar.advance(task)


def absorb_prelude(gm: fx.GraphModule, nodes: dict[str, list[fx.Node]]) -> dict[str, list[fx.Node]]:
    """``nodes`` (segment -> its fx nodes) with each node that depends on the inputs and constants only (what
    :meth:`Captured.bind` computes, the *prelude*) moved into the one segment that reads it, where only one does and
    the node reads and makes tensors only (recorded shapes): the segment then takes the model's input instead.

    A model that slices one input into many (DeepFM's 26 ``sparse[:, i]``) otherwise binds each slice in Python on
    every call and hands the compiled segment 26 inputs to check, convert and feed; read inside the segment, its
    compiler does the slicing: at batch 1 in one ONNX Runtime segment, binding DeepFM's slices in Python cost about
    as much as the session itself (docs/design.md, §3.6, segments). A prelude node read by several
    segments, by the output or by no segment stays in the prelude (bound once, read by each), and so does one that
    reads a value other than a tensor (a size: a segment bakes such values into its signature). A check
    ``torch.export`` left on a node (:func:`~opweave.capture.opinfo.is_assertion`) is not a reader: it moves with the
    node, and runs where the segment runs op by op (a compiled graph leaves it out). So a slice of a weight that
    export checked (timm's position embedding, resized to the image) is read inside the segment, as a constant its
    compiler folds, not a new input of every call."""
    from torch.fx.passes.shape_prop import TensorMetadata

    owner = {n: seg for seg, group in nodes.items() for n in group}
    moved: dict[str, list[fx.Node]] = {}
    for node in reversed(gm.graph.nodes):  # a node's readers before the node
        if node.op in ("placeholder", "get_attr", "output") or node in owner or not node.users:
            continue
        if not all(isinstance(n.meta.get("tensor_meta"), TensorMetadata) or n.op == "get_attr"
                   for n in (node, *node.all_input_nodes)):
            continue  # a size read as a value (a symbolic batch) stays an input: a segment bakes such values
        checks = [user for user in node.users if opinfo.is_assertion(user, gm) and user not in owner]
        readers = {owner.get(user) for user in node.users if user not in checks}
        seg = readers.pop() if len(readers) == 1 else None
        if seg is not None:
            for check in checks:  # after the node, in the segment (the list is reversed below)
                owner[check] = seg
                moved.setdefault(seg, []).append(check)
            owner[node] = seg
            moved.setdefault(seg, []).append(node)
    if not moved:
        return nodes
    return {seg: moved.get(seg, [])[::-1] + group for seg, group in nodes.items()}


class _Segment:
    """One segment: where its inputs and outputs sit in the environment, and its compiled graphs by signature."""

    def __init__(self, owner: Segmented, seg: str):
        self.owner, self.seg = owner, seg
        members = owner.nodes[seg]
        inside = set(members)
        inputs: dict[fx.Node, None] = {}
        for node in members:
            for arg in node.all_input_nodes:
                if arg not in inside and (arg.op != "get_attr" or arg.name in owner.state):
                    inputs.setdefault(arg)
        self.inputs = list(inputs)
        self.as_is = any(writes_state(n, owner.gm) for n in members)  # runs op by op: it writes module state
        read = {arg.name for node in members for arg in node.all_input_nodes if arg.op == "get_attr"}
        self.constants = [(name, path) for name, path in owner._constants if name in read]  # what op by op reads
        self.outputs = [n for n in members if any(u not in inside for u in n.users)]
        self.input_keys = [n.name for n in self.inputs]
        self.output_keys = [n.name for n in self.outputs]
        # signature -> compiled graph (None: the compiler failed); full at MAX_SIGNATURES, never evicting (docstring)
        self.compiled = BoundedCache(MAX_SIGNATURES)
        self.sized: list[_Compiled] = []  # those compiled with free sizes (module docstring, Sizes)
        self.aliases = BoundedCache(ALIASES)  # signatures served by one of them
        self.warned = False

    def __call__(self, env: dict[str, Any]) -> None:
        env.update(zip(self.output_keys, self.run(*[env[k] for k in self.input_keys]), strict=True))

    def run(self, *values: Any) -> list[Any]:
        """The segment's output values (in the order of ``outputs``) for its input values."""
        if self.as_is:
            return self.unfused(values)
        key, _ = signature(values, strides=True, batch=not self.owner.any_batch)
        compiled = self.compiled.get(key, False)
        if compiled is False:
            compiled = self.aliases.get(key, False)
        if compiled is False:
            with COMPILE_LOCK:
                compiled = self._find(key, values)
        if compiled is None:
            return self.unfused(values)
        try:
            results = compiled.fn(*(values if compiled.tensor_inputs else
                                    [leaf for v in values for leaf in pytree.tree_leaves(v)
                                     if isinstance(leaf, torch.Tensor)]))
        except Exception as exc:
            raise CaptureError(f"{self.owner.graph.name}: segment {self.seg!r} ({len(self.owner.nodes[self.seg])} "
                               f"fx nodes) failed in its compiled graph: {first_line(exc)}") from exc
        return results if compiled.flat else unflatten(results, compiled.output_specs)

    def _find(self, key: tuple, values: tuple) -> _Compiled | None:
        """The compiled graph for ``values`` (signature ``key``): one compiled already, one with free sizes that
        takes them, or one compiled now (with the sizes that changed left free where the compiler can); None: run
        op by op (the compiler failed, or the bound is reached)."""
        compiled = self.compiled.get(key, False)
        if compiled is not False:
            return compiled
        layout = _layout(values)
        for sized in self.sized:
            if sized.takes(layout):
                self.aliases[key] = sized
                return sized
        if len(self.compiled) >= MAX_SIGNATURES:
            if not self.warned:
                self.warned = True
                warnings.warn(f"{self.owner.graph.name}: segment {self.seg!r} met more than {MAX_SIGNATURES} input "
                              "signatures (a scalar input that changes every call?); new ones run op by op",
                              stacklevel=4)
            return None
        compiled = self.compiled[key] = self._compile(list(values), self._free(layout))
        if compiled is not None and compiled.free:
            self.sized.append(compiled)
        return compiled

    def _free(self, layout: _Layout) -> dict[int, frozenset[int]]:
        """The dimensions of each tensor input (by position among them) to compile free for ``layout``: every one
        with ``dynamic=True``, those in which it differs from a signature compiled before otherwise (module
        docstring, Sizes); none where the compiler compiles fixed shapes."""
        if not getattr(get_compiler(self.owner.compiler), "dynamic_shapes", False):
            return {}
        if self.owner.dynamic:
            return {i: frozenset(range(len(shape))) for i, shape in enumerate(layout.shapes)}
        free: dict[int, frozenset[int]] = {}
        for before in self.compiled.values():
            if before is not None and before.layout.same_but_sizes(layout):
                for i, (a, b) in enumerate(zip(layout.shapes, before.layout.shapes, strict=True)):
                    dims = frozenset(d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                    if dims:
                        free[i] = free.get(i, frozenset()) | dims
        return free

    def unfused(self, values: Any) -> list[Any]:
        """The segment's output values for its input values, run op by op (with the parameters and constants its
        ``get_attr`` nodes read)."""
        scratch = dict(zip(self.input_keys, values, strict=True))
        for name, path in self.constants:
            scratch.setdefault(name, _attr(self.owner.gm, path))
        self.owner.run_unfused(self.seg, scratch)
        return [scratch[k] for k in self.output_keys]

    def examples(self, values: list[Any]) -> list[Any]:
        """The segment's output values for ``values``, run op by op (an error of its own ops is raised here)."""
        with torch.no_grad():
            return self.unfused(values)

    def _structure(self, values: list[Any]) -> list[Any]:
        """Stand-ins of the segment's outputs, for their structure: where capture recorded every output as one
        tensor, meta tensors of its dtype (no run); else the outputs of one run op by op (:meth:`examples`: an error
        of the segment's own ops is raised there)."""
        from torch.fx.passes.shape_prop import TensorMetadata

        metas = [n.meta.get("tensor_meta") for n in self.outputs]
        recorded = [m for m in metas if isinstance(m, TensorMetadata)]
        if metas and len(recorded) == len(metas):
            return [torch.empty(0, dtype=m.dtype, device="meta") for m in recorded]
        return self.examples(values)

    def _compile(self, values: list[Any], free: dict[int, frozenset[int]] | None = None) -> _Compiled | None:
        """Compile the segment for these input values (``free``: per tensor input, the dimensions left free);
        None (with a warning) when the compiler fails. An error of the segment's own ops (found by one run op by
        op, where capture did not record the outputs' structure) is raised."""
        examples = self._structure(values)
        start = time.perf_counter()
        free = free or {}
        try:
            gm, specs = self._graph_module(values, examples)
            inputs = [leaf for v in values for leaf in pytree.tree_leaves(v) if isinstance(leaf, torch.Tensor)]
            threads = self.owner.threads.get(self.seg) or total_threads()
            leaves = [leaf for e in examples for leaf in pytree.tree_leaves(e)]
            known = len(leaves) if all(isinstance(leaf, torch.Tensor) for leaf in leaves) else None
            compiler = get_compiler(self.owner.compiler, **self.owner.compiler_options)
            try:
                fn = compiler(gm, inputs, threads, alone=self.owner.alone, outputs=known,
                              **({"dynamic_dims": free} if free else {}))
            except Exception:  # noqa: BLE001 - with free sizes it may fail where fixed ones do not
                if not free:
                    raise
                free = {}
                fn = compiler(gm, inputs, threads, alone=self.owner.alone, outputs=known)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: run this segment op by op
            self.owner.stats["fallbacks"] += 1
            warnings.warn(f"{self.owner.graph.name}: segment {self.seg!r} could not be compiled with "
                          f"{self.owner.compiler} ({first_line(exc, 200)}); it runs op by op", stacklevel=4)
            return None
        finally:
            self.owner.stats["compile_s"] += time.perf_counter() - start
        self.owner.stats["compiles"] += 1
        self.owner.stats["dynamic_compiles"] += bool(free)
        flat = all(spec.is_leaf() and count == 1 for spec, count in specs)
        return _Compiled(fn, specs, flat, all(isinstance(v, torch.Tensor) for v in values), _layout(values), free)

    def _graph_module(self, values: list[Any], examples: list[Any]) -> tuple[fx.GraphModule, list[tuple]]:
        """The segment as a GraphModule over the tensor leaves of ``values``, returning the leaves of the outputs
        (flat); and per output its pytree spec and number of leaves, to rebuild it."""
        graph = fx.Graph()
        copies: dict[fx.Node, Any] = {}
        for node, value in zip(self.inputs, values, strict=True):
            leaves, spec = pytree.tree_flatten(value)
            if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
                copies[node] = value  # baked in: part of the signature
                continue
            parts = [graph.placeholder(f"{node.name}_{i}") if isinstance(leaf, torch.Tensor) else leaf
                     for i, leaf in enumerate(leaves)]
            copies[node] = parts[0] if spec.is_leaf() else pytree.tree_unflatten(parts, spec)
        members = self.owner.nodes[self.seg]
        for node in members:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and arg not in copies:
                    copies[arg] = graph.get_attr(str(arg.target))
        for node in members:
            if not opinfo.is_assertion(node, self.owner.gm):  # a check: run op by op, left out of a compiled graph
                copies[node] = graph.node_copy(node, copies.__getitem__)
        outs, specs = [], []
        for node, example in zip(self.outputs, examples, strict=True):
            paths, spec = pytree.tree_flatten_with_path(example)
            for path, _ in paths:  # every leaf, scalars too: a scalar may depend on data (.item()), never baked
                value = copies[node]
                for key in path:
                    value = graph.call_function(operator.getitem, (value, _key(key)))
                outs.append(value)
            specs.append((spec, len(paths)))
        graph.output(tuple(outs))
        return fx.GraphModule(self.owner.gm, graph), specs


def unflatten(results, specs: list[tuple]) -> list[Any]:
    """A segment's outputs from its compiled graph's flat results (``specs``: per output its pytree spec and number
    of leaves, as :meth:`_Segment._graph_module` gives them)."""
    outputs, position = [], 0
    for spec, count in specs:
        outputs.append(pytree.tree_unflatten(list(results[position:position + count]), spec))
        position += count
    return outputs


@dataclass
class Whole:
    """A captured model as one graph, for a compiler that takes the model whole (:func:`whole_module`)."""

    gm: fx.GraphModule  # takes ``inputs``' tensors, returns the flat tensor leaves of the model's output values
    inputs: list[torch.Tensor]  # the example call's tensor leaves, in ``gm``'s order
    outputs: list[torch.Tensor]  # ``gm``'s results for them
    key: Any  # the example's input signature: a call with another runs elsewhere (:meth:`bind` says None)
    segmented: Segmented
    segment: _Segment
    specs: list[tuple]

    def bind(self, args: tuple) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
        """The call's environment (the model's arguments ``args`` bound) and the tensors ``gm`` takes for them;
        None for the tensors when their signature is not the example's, for which the graph was built (other
        strides or non-tensor values: other shapes and dtypes are refused by the captured model's ``bind``)."""
        env = self.segmented.bind(args)
        values = [env[k] for k in self.segment.input_keys]
        if signature(values, strides=True)[0] != self.key:
            return env, None
        return env, [leaf for v in values for leaf in pytree.tree_leaves(v) if isinstance(leaf, torch.Tensor)]

    def output(self, env: dict[str, Any], results) -> Any:
        """The model's output from the call's environment and ``gm``'s flat results (an output may be an input)."""
        values = unflatten(results, self.specs)
        return self.segmented.output({**env, **dict(zip(self.segment.output_keys, values, strict=True))})


def whole_module(captured: Captured, args: tuple) -> Whole:
    """``captured`` as one ``fx.GraphModule`` over the tensor leaves of its bound inputs, as a segment holding
    every op is given to a segment compiler (non-tensor values baked in for ``args``' signature), with what maps a
    call's arguments to its inputs and its flat results back to the model's output."""
    merged = merge_ops(captured, [list(captured.graph.topo_order)])
    segmented = Segmented(merged.graph, merged.gm, merged.nodes, signature=merged.signature,
                          example_inputs=merged.example_inputs, compiler="eager")
    segment = next(iter(segmented._segments.values()))
    env = segmented.bind(tuple(args))
    values = [env[k] for k in segment.input_keys]
    examples = segment.examples(values)
    gm, specs = segment._graph_module(values, examples)
    inputs = [leaf for v in values for leaf in pytree.tree_leaves(v) if isinstance(leaf, torch.Tensor)]
    outputs = [leaf for e in examples for leaf in pytree.tree_leaves(e)]
    if not all(isinstance(x, torch.Tensor) for x in outputs):
        raise CaptureError(f"{captured.graph.name}: an output is not a tensor; the model cannot run as one graph")
    return Whole(gm, inputs, outputs, signature(values, strides=True)[0], segmented, segment, specs)


@dataclass(frozen=True)
class _Layout:
    """What a graph compiled with free sizes fixes of its input values besides their sizes: the structure, each
    tensor leaf's dtype, device and rank, the other leaves' values; and the tensors' shapes. (Strides are not read by
    the compilers that take free sizes.)"""

    fixed: tuple
    shapes: tuple[tuple[int, ...], ...]

    def same_but_sizes(self, other: _Layout) -> bool:
        return self.fixed == other.fixed


def _layout(values) -> _Layout:
    leaves, spec = pytree.tree_flatten(list(values))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    fixed = (str(spec), *((x.dtype, x.device, x.dim()) if isinstance(x, torch.Tensor) else ("value", repr(x))
                          for x in leaves))
    return _Layout(fixed, tuple(tuple(x.shape) for x in tensors))


@dataclass
class _Compiled:
    fn: Any
    output_specs: list[tuple]
    flat: bool  # every output is one leaf: the compiled function's results are the outputs as they are
    tensor_inputs: bool  # every input is a tensor: passed as they are
    layout: _Layout | None = None  # the values it was compiled for
    free: dict[int, frozenset[int]] = field(default_factory=dict)  # tensor input -> dims it takes at any size

    def takes(self, layout: _Layout) -> bool:
        """Whether values of ``layout`` run through this graph: as compiled but in the free dimensions."""
        return self.layout is not None and self.layout.same_but_sizes(layout) and all(
            a == b or d in self.free.get(i, ()) for i, (new, old) in enumerate(zip(layout.shapes, self.layout.shapes,
                                                                                    strict=True))
            for d, (a, b) in enumerate(zip(new, old, strict=True)))


def _key(key) -> Any:
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    raise CaptureError(f"cannot index a segment output with {key!r}")


def _attr(module, path: list[str]):
    for part in path:
        module = getattr(module, part)
    return module


def op_latencies(captured: Captured, inputs: tuple, compiler: str, threads: int = 1, repeats: int = 5) -> dict:
    """Each op's latency (ms, median of ``repeats`` after one warm-up) when compiled alone by ``compiler`` and run
    on ``threads`` intra-op threads: the costs to plan a ``compiler=...`` model with, since a compiler's kernels
    differ from eager's in more than speed (ONNX Runtime's layout changes make a convolution several times faster
    than eager's at batch 1, an elementwise op hardly at all). Every op is one segment here; ops the compiler
    cannot take alone run op by op (their eager time)."""
    from opweave.costs import timing

    order = captured.graph.topo_order
    merged = merge_ops(captured, [[op] for op in order])
    single = Segmented(merged.graph, merged.gm, merged.nodes, signature=merged.signature,
                       example_inputs=merged.example_inputs, compiler=compiler, threads=dict.fromkeys(order, threads))
    with intra_op_threads(threads), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = single.bind(tuple(inputs))
        for op in order:
            single.run_op(op, env)
        return {op: timing.median_ms(functools.partial(single.run_op, op, env), runs=repeats, warmup=1)
                for op in order}
