"""Lanes over ONNX Runtime's optimized graph of the whole model: ``opweave.compile(..., graph="onnxruntime")``.

``compiler="onnxruntime"`` exports each segment of a plan on its own, so ONNX Runtime optimizes each alone: its NCHWc
layout (convolutions on 8-channel blocks, which doubles a small convolution's speed) is undone at every segment
boundary and its fusions stop there. Here the order is turned round:

1. **The whole model, optimized once.** The captured model is exported as one graph
   (:func:`opweave.backends.segments.whole_module`, :func:`opweave.backends.compilers.export_onnx`) and ONNX Runtime
   optimizes it (``ORT_ENABLE_ALL``, one thread) into its own graph: NCHWc convolutions with the reorders between
   them, fused activations and element-wise ops.
2. **That graph is what opweave schedules.** :class:`OrtGraph` turns each node of the optimized graph into one op of
   an :class:`~opweave.ir.graph.OpGraph` (edges: the values between nodes), with its kernel time on one thread
   from ONNX Runtime's own profiler (median of ``profile_runs`` runs after warm-up): the budget of a lane when the
   lanes fill the cores. Any scheduler plans it; the plan is lowered and validated as every plan is.
3. **Each segment of the plan is one session of its nodes** (:class:`OrtLanes`): a run of a lane's nodes with no
   sync inside (:func:`~opweave.backends.segments.segment_groups`) becomes a model of exactly those nodes, run with
   optimizations off so the nodes stay as ONNX Runtime made them, and tensors cross segments in the layout the whole
   graph gave them (NCHWc blocks included).
4. **No tensor allocated or copied per call.** Every value that crosses a segment boundary lives in one buffer
   allocated once, and each session reads and writes those buffers through an ``IOBinding`` made once; a call
   rebinds only the model's inputs (no copy) and copies only the model's outputs out (beside them, a call makes one
   ``Event`` per sync and one ``OrtValue`` header per input). The plan's lanes run as the CPU backend's do:
   the first in the caller's thread, every other on a worker of a :class:`~opweave.backends.cpu.LanePool`, a record
   an ``Event.set`` and a wait an ``Event.wait`` (ONNX Runtime releases the GIL while a session runs).

Each value is written once per call and the calls are serialised (one lock per backend), so the buffers need no
ordering beyond the plan's: a reader runs after its producer's signal, as the validator proved.

Why the buffers matter: with ONNX Runtime's ordinary ``run``, a plan of many small segments pays for new output
arrays at every segment of every call; bound buffers take that cost away and bring the segments closer to the
whole model run as one session (the measurement: docs/design.md, §3.6, ortgraph).

Memory: the boundary buffers are held for the compiled model's life (all values crossing segments at once, as a
CUDA graph's static memory is), beside each session's own arena for the values inside it.

**Budgets.** A plan with one lane is one session of the whole optimized graph on every thread the lanes may use
(``threads``; every core by default; ONNX Runtime's own run, its pool spinning). With several lanes each segment's
session gets the budget its lane's ops were given (:func:`opweave.pipeline.thread_budgets.lane_threads`: one thread, or
all of them for a segment of the first lane that the plan runs alone), its pool sleeping when idle, since another lane
may need the core.

Shapes and dtypes other than the example's are refused as every captured model refuses them
(:meth:`~opweave.capture.runtime.Captured.bind`); a call whose inputs have other strides (the graph was exported for
the example's) runs the captured model op by op, with one warning.

Each session with more than one intra-op thread has a pool of its own (sleeping when idle); on a machine with many
cores a plan's first-lane segments would hold many idle threads, where ONNX Runtime's global pool could share one
(not done: on 2 cores a session has at most one extra thread). In a process where a server made that pool
(:func:`opweave.backends.compilers.shared_pool`), ONNX Runtime allows no session a pool of its own, and every session
runs on it, at its size.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opweave.backends.compilers import export_onnx, import_onnxruntime, session_threads
from opweave.backends.cpu import Call, LanePool, LaneWorker
from opweave.backends.program import Program
from opweave.backends.segments import segment_groups, segment_plan, whole_module
from opweave.backends.threads import plan_budgets
from opweave.errors import UsageError
from opweave.ir.graph import Edge, Op, OpGraph
from opweave.plan.launchplan import LaunchPlan


def stable_names(graph) -> None:
    """Name every node of an ONNX graph by what it computes: its op, domain and attributes and, for each input, the
    name of the node that makes it (with the output's index), or the graph input's name, or an initializer's
    contents. ONNX Runtime names the nodes its optimizers add with a counter (``ReorderOutput``,
    ``ReorderOutput_token_18``), and which of two such nodes got which name differed once between two optimizations
    of one model in one process (tests/test_ortgraph.py under Python 3.12): a cached choice's latencies, keyed by
    node name, then fell on the wrong nodes. Nodes that compute the same thing from the same inputs are told apart
    by a counter in graph order (being alike, which is which does not matter). Renames in place; values keep their
    names."""
    import hashlib

    def digest(*parts: bytes) -> str:
        h = hashlib.blake2b(digest_size=8)
        for part in parts:
            h.update(len(part).to_bytes(8, "little") + part)
        return h.hexdigest()

    what: dict[str, bytes] = {"": b"none"}  # a value's name -> what computes it ("": an optional input left out)
    for t in graph.initializer:
        anonymous = type(t)()
        anonymous.CopyFrom(t)
        anonymous.name = ""
        what[t.name] = digest(b"const", anonymous.SerializeToString()).encode()
    made = {o for n in graph.node for o in n.output if o}
    taken: collections.Counter = collections.Counter()
    for node in graph.node:  # ONNX keeps a graph's nodes in topological order: what a node reads is known first
        reads = []
        for v in node.input:
            if v not in what and v in made:
                raise UsageError(f"ONNX graph {graph.name!r}: node {node.name!r} reads {v!r} before its maker")
            reads.append(what.get(v, f"input:{v}".encode()))
        attrs = sorted(a.SerializeToString() for a in node.attribute)
        digested = digest(node.op_type.encode(), node.domain.encode(), *attrs, b"|", *reads)
        what.update((o, f"{digested}:{k}".encode()) for k, o in enumerate(node.output) if o)
        base = f"{node.op_type}_{digested}"
        taken[base] += 1
        node.name = base if taken[base] == 1 else f"{base}_{taken[base] - 1}"


PROFILE_BUDGET_S = 2.0  # the profiling runs of OrtGraph stop after this long (at least 5 runs, 3 of them warm-up)


class OrtGraph:
    """``captured`` exported whole and optimized by ONNX Runtime; ``graph`` is an OpGraph of the optimized nodes with
    their one-thread kernel times (module docstring), or ``latency_ms`` where it names exactly those nodes (a cached
    choice: not profiled again). ``values`` holds each value's shape and dtype (what sizes a buffer), not its data.
    ``stats``: ``nodes``, ``export_s``, ``optimize_s`` (optimizing and profiling)."""

    def __init__(self, captured, example_inputs: tuple, profile_runs: int = 20,
                 latency_ms: dict[str, float] | None = None):
        import time

        import onnx

        written = sorted({name for names in captured.state_writes().values() for name in names})
        if written:
            raise UsageError(f"{captured.graph.name}: graph='onnxruntime' runs ONNX Runtime's graph of the whole "
                             f"model, which cannot write the model's state in place ({', '.join(written)}); "
                             "graph='fx' (the default) leaves those writes to PyTorch between its segments")
        self.ort = import_onnxruntime()
        self.captured = captured
        start = time.perf_counter()
        self.whole = whole_module(captured, tuple(example_inputs))
        raw = export_onnx(self.whole.gm, self.whole.inputs, len(self.whole.outputs))
        exported = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="opweave_ort_") as tmp:
            path = Path(tmp) / "optimized.onnx"
            self.session(raw, 1, optimize=True, save=path)
            self.model = onnx.load(str(path))
        graph = self.model.graph
        made = {o for n in graph.node for o in n.output if o}
        for output in graph.output:  # an output no node makes (an input or a constant): one node makes it now
            if output.name not in made:
                source = output.name
                output.name = f"{source}__out"
                graph.node.append(onnx.helper.make_node("Identity", [source], [output.name]))
        for node in graph.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise UsageError(f"{captured.graph.name}: ONNX Runtime's graph has a control-flow node "
                                 f"({node.op_type}); graph='onnxruntime' takes straight-line graphs")
        stable_names(graph)
        self.node = {n.name: n for n in graph.node}
        self.order = [n.name for n in graph.node]
        self.initializer = {t.name: t for t in graph.initializer}
        # the exporter drops inputs the graph does not read: each ONNX input is "in{i}", gm's i-th tensor
        self.inputs = [(i.name, int(i.name.removeprefix("in"))) for i in graph.input if i.name not in self.initializer]
        self.outputs = [o.name for o in graph.output]
        self.feed = {name: _array(self.whole.inputs[i]) for name, i in self.inputs}
        self.values = self._values()
        self.latency_ms = dict(latency_ms) if latency_ms is not None and set(latency_ms) == set(self.node) \
            else self._profile(profile_runs)
        producer = {o: n.name for n in graph.node for o in n.output if o}
        ops = [Op(id=n.name, name=n.op_type, target=f"{n.domain or 'ai.onnx'}::{n.op_type}",
                  latency_ms=max(self.latency_ms[n.name], 1e-4)) for n in graph.node]
        edges = [Edge(producer[i], n.name, bytes=float(self.values[i].nbytes)) for n in graph.node
                 for i in dict.fromkeys(n.input) if i in producer and producer[i] != n.name]
        self.graph = OpGraph(ops, edges, name=captured.graph.name)
        self.stats = {"nodes": len(ops), "export_s": round(exported - start, 2),
                      "optimize_s": round(time.perf_counter() - exported, 2)}

    def session(self, model, threads: int, *, optimize: bool = False, save: Path | None = None,
                profile: Path | None = None, alone: bool = True):
        """An ONNX Runtime session of ``model`` (bytes or a path) on ``threads`` intra-op threads, sequential
        executor; ``optimize`` (else every graph optimization off), ``save`` the optimized graph there,
        ``profile`` with the profiler writing there; ``alone``: nothing else runs beside it (its pool may spin).
        In a process whose ONNX Runtime pool a server made, the session runs on that pool
        (:func:`opweave.backends.compilers.session_threads`)."""
        ort = self.ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session_threads(options, threads, alone=alone)  # the process's pool instead, where a server made it
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else
                                            ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        if save is not None:
            options.optimized_model_filepath = str(save)
        if profile is not None:
            options.enable_profiling, options.profile_file_prefix = True, str(profile)
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                    providers=["CPUExecutionProvider"])

    def _values(self) -> dict[str, Any]:
        """Every value of the optimized graph for the example inputs, as its :class:`Value` (shape and dtype; the
        data is not kept)."""
        import onnx
        from onnx import helper

        produced = [o for n in self.model.graph.node for o in n.output if o]
        everything = onnx.ModelProto()
        everything.CopyFrom(self.model)
        del everything.graph.output[:]
        everything.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in produced)
        results = self.session(everything.SerializeToString(), 1).run(produced, self.feed)
        return {name: Value(tuple(value.shape), value.dtype)
                for name, value in (*self.feed.items(), *zip(produced, results, strict=True))}

    def _profile(self, runs: int) -> dict[str, float]:
        """Each node's kernel time (ms) on one thread: ONNX Runtime's profiler, median over ``runs`` runs after
        three, or over those made within :data:`PROFILE_BUDGET_S` (at least two): a large model's one-thread runs at
        batch 8 are slow, and a fixed count of them took most of a search's build (docs/design.md, §3.6, ortgraph)."""
        import time

        with tempfile.TemporaryDirectory(prefix="opweave_ort_profile_") as tmp:
            session = self.session(self.model.SerializeToString(), 1, profile=Path(tmp) / "profile")
            start = time.perf_counter()
            for k in range(runs + 3):
                session.run(None, self.feed)
                if k >= 4 and time.perf_counter() - start > PROFILE_BUDGET_S:
                    break
            events = json.loads(Path(session.end_profiling()).read_text())
        times = collections.defaultdict(list)
        for event in events:
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                times[event["name"].removesuffix("_kernel_time")].append(event["dur"] / 1e3)
        return {n: statistics.median(times[n][3:] or times[n]) if times.get(n) else 0.0 for n in self.node}

    def segment_model(self, group: list[str]) -> tuple[bytes, list[str], list[str]]:
        """The nodes of ``group`` as one ONNX model; its inputs (values made outside it, initializers excluded) and
        outputs (values it makes that another node or the model's output reads)."""
        from onnx import helper

        made = {o for op in group for o in self.node[op].output if o}
        inside = set(group)
        read_outside = {i for n in self.node.values() if n.name not in inside for i in n.input} | set(self.outputs)
        inputs = list(dict.fromkeys(i for op in group for i in self.node[op].input
                                    if i and i not in made and i not in self.initializer))
        weights = list(dict.fromkeys(i for op in group for i in self.node[op].input if i in self.initializer))
        outputs = [o for op in group for o in self.node[op].output if o in made and o in read_outside]

        def info(name: str):
            value = self.values[name]
            return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                 list(value.shape))

        sub = helper.make_graph([self.node[op] for op in group], group[0], [info(i) for i in inputs],
                                [info(o) for o in outputs], [self.initializer[w] for w in weights])
        model = helper.make_model(sub, opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        return model.SerializeToString(), inputs, outputs


class OrtLanes:
    """The validated ``plan`` of ``model.graph`` run as sessions of its segments over bound buffers (module docstring).
    ``threads`` (op -> intra-op threads, :func:`opweave.pipeline.thread_budgets.lane_threads`; default: its lanes'
    budgets) gives each segment the smallest budget of its ops (one thread when it says nothing); a one-lane plan's
    budget is every thread the lanes may use.
    ``stats``: ``calls``, ``segments`` (sessions), ``compiles`` (the same), ``compile_s`` (exporting, optimizing
    and profiling the model, then making the sessions), ``fallbacks`` (calls run op by op: inputs with other
    strides than the example's). ``close()`` stops the worker threads (also done when the backend is collected)
    and waits for a call in progress; a closed backend refuses calls."""

    compiler = "onnxruntime-graph"

    def __init__(self, model: OrtGraph, plan: LaunchPlan, threads: dict[str, int] | None = None):
        import time

        start = time.perf_counter()
        self.model = model
        groups = segment_groups(plan)
        self.program = Program.from_plan(segment_plan(plan, groups))
        lanes = sorted(self.program.lanes)
        alone = len(lanes) == 1
        ort = model.ort
        self.arrays: dict[str, Any] = {}  # value -> its buffer, a numpy array allocated once
        self.buffers: dict[str, Any] = {}  # value -> the OrtValue over that array, which the sessions are bound to

        def buffer(name: str):
            if name not in self.buffers:
                self.arrays[name] = model.values[name].empty()
                self.buffers[name] = ort.OrtValue.ortvalue_from_numpy(self.arrays[name])
            return self.buffers[name]

        feed_names = {name for name, _ in model.inputs}
        self.sessions, bound, self._rebind = {}, {}, []
        threads = threads if threads is not None else plan_budgets(plan)
        for group in groups:
            budget = min(threads.get(op, 1) for op in group)
            data, inputs, outputs = model.segment_model(group)
            session = model.session(data, budget, alone=alone)
            binding = session.io_binding()
            for name in inputs:
                if name in feed_names:
                    self._rebind.append((binding._iobinding, name))
                else:
                    binding.bind_ortvalue_input(name, buffer(name))
            for name in outputs:
                binding.bind_ortvalue_output(name, buffer(name))
            self.sessions[group[0]] = session
            bound[group[0]] = (session._sess.run_with_iobinding, binding._iobinding)
        self._ort_value = ort.OrtValue.ortvalue_from_numpy
        self._outputs = [self.arrays[o] for o in model.outputs]
        made_s = model.stats["export_s"] + model.stats["optimize_s"] + time.perf_counter() - start
        self.stats = {"calls": 0, "segments": len(groups), "compiles": len(groups), "compile_s": round(made_s, 2),
                      "fallbacks": 0}
        self._lock = threading.Lock()
        # the lanes hold the segments, not the backend: a worker thread that referred to it would keep it alive
        segments = _Segments(bound, ort.RunOptions())
        self._caller = LaneWorker(lanes[0], self.program.lanes[lanes[0]], segments)
        self._pool = LanePool({lane: LaneWorker(lane, self.program.lanes[lane], segments).run_call
                               for lane in lanes[1:]})
        self._warned = False
        self._stop = weakref.finalize(self, self._pool.close)

    def close(self) -> None:
        with self._lock:  # not in the middle of a call: its workers would never take it
            self._stop()

    def __call__(self, *args) -> Any:
        with self._lock, torch.no_grad():
            if not self._stop.alive:
                raise UsageError(f"{self.model.graph.name}: this ONNX Runtime lanes backend was closed")
            self.stats["calls"] += 1
            env, leaves = self.model.whole.bind(args)
            if leaves is None:
                return self._op_by_op(args)
            fed = {name: self._ort_value(_array(leaves[i])) for name, i in self.model.inputs}
            for binding, name in self._rebind:
                binding.bind_ortvalue_input(name, fed[name]._ortvalue)
            self._pool.run(Call({}, self.program.num_signals, len(self._pool.workers) + 1), self._caller.run_call)
            return self.model.whole.output(env, [torch.from_numpy(a.copy()) for a in self._outputs])

    def _op_by_op(self, args: tuple) -> Any:
        self.stats["fallbacks"] += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.model.graph.name}: inputs with another signature than the example's run op by op "
                          "(graph='onnxruntime' exported the model for the example's strides)", stacklevel=3)
        return self.model.captured.run(args)


class _Segments:
    """What the lanes run: each segment's bound session (a :class:`~opweave.backends.cpu.LaneWorker` launches an op
    with ``run_op``)."""

    def __init__(self, bound: dict[str, tuple], options):
        self.bound, self.options = bound, options

    def run_op(self, op: str, env: Any) -> None:
        run, binding = self.bound[op]
        run(binding, self.options)


@dataclass(frozen=True)
class Value:
    """A value of the optimized graph: its shape and dtype (what sizes its buffer)."""

    shape: tuple[int, ...]
    dtype: Any  # numpy dtype

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    def empty(self):
        import numpy as np

        return np.empty(self.shape, dtype=self.dtype)


def _array(tensor: torch.Tensor):
    """A tensor's memory as a NumPy array (no copy)."""
    return tensor.detach().numpy()


__all__ = ["OrtGraph", "OrtLanes"]
