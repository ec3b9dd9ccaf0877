"""CUDA backend: an interpreter of the LaunchPlan on CUDA streams, recorded ahead of time into a CUDA Graph.

Two modes, one interpreter (:meth:`CudaBackend._issue`, in the plan's issue order, from one host thread):

* ``streams`` — every call runs the plan live: each (device, stream) lane is a ``torch.cuda.Stream``, a ``record``
  is ``Event.record(stream)``, a ``wait`` is ``stream.wait_event(event)``. The first lane runs on the caller's
  current stream; every other lane waits for an event recorded there at the start (fork) and the caller's stream
  waits for every lane's last event at the end (join), so the caller sees an ordinary stream-ordered result.
* ``graph`` (default; Nimble's ahead-of-time scheduling, NeurIPS'20 Sec. 4) — the same run is captured once into a
  ``torch.cuda.CUDAGraph`` and every call is a copy into static input buffers, one ``replay()``, and a clone of the
  static outputs (unless ``static_outputs=True``: then the returned tensors are the graph's own and are overwritten
  by the next call). Before capture the plan runs ``warmup`` times on the capture stream (cuDNN/cuBLAS
  initialization, lazy allocations); the capture forks from and joins into the capture stream as above.

A plan for several devices runs all its devices on the current GPU (their lanes become extra streams; a
``send``/``recv`` pair becomes an event), which keeps every schedule runnable and checkable on one GPU; the
distributed backend places devices on real GPUs.

**Buffers**. The first run of an input signature keeps every intermediate alive until the final
join. From it, environment entries are grouped by the storage they share (views and in-place results included),
each group's allocating lane is the lane of the first op that held it, and :func:`opweave.backends.liveness.
release_points` says after which step of that lane every op touching the group is ordered: later runs (the other
warm-ups, the capture, later ``streams`` calls) drop the group there. Groups that are model inputs, parameters,
outputs, or allocated on several lanes, and groups whose lane never joins a consumer, stay alive until the end of
the run; in ``graph`` mode the capture pool keeps their memory for the graph's lifetime, and in ``streams`` mode
the caller's stream has joined every lane before they are dropped.

**Input signatures.** One entry (a captured graph, or a streams-mode release plan) per input signature — pytree
structure and every leaf's shape, dtype and device (plus strides in ``streams`` mode, where inputs are used in
place, and the address of inputs used in place in ``graph`` mode) — in an LRU cache of ``cache_size`` entries; a
new signature is captured on first use (the graph was traced for the example's shapes, so a shape the model cannot
take fails there, naming the input), and the least recently used entry is dropped when the cache is full.
Parameters passed as inputs (``nn.Parameter``s, or tensors dynamo marked as static, as ``torch.compile`` passes
them) are used in place rather than copied.

**Not capturable.** An op that synchronizes the CPU with the GPU (``.item()``, ``.tolist()``, ``nonzero``, boolean
masks, Python control flow on a tensor's value) cannot be recorded; the last warm-up runs in CUDA's sync-debug
"error" mode to find it before capture, and :class:`GraphCaptureError` names the op and the cause.
With ``fallback="eager"`` that signature runs in ``streams`` mode instead (with a warning).

Calls are serialized (one lock); a call made from another stream than the previous one first waits for the
previous call, since both share streams, events and static buffers. Inference only: runs under ``torch.no_grad``.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opweave.backends.liveness import Buffer, release_points, steps_with_releases
from opweave.backends.program import Lane, Program
from opweave.capture.runtime import Captured
from opweave.errors import CaptureError, DeviceError, UsageError
from opweave.plan.launchplan import LaunchPlan

MODES = ("graph", "streams")
FALLBACKS = ("error", "eager")
_SYNC_HINT = ("synchronizes the CPU with the GPU (e.g. .item(), .tolist(), .cpu(), printing a tensor, nonzero or "
              "boolean-mask indexing, or Python control flow on a tensor's value), which a CUDA graph cannot record")


class GraphCaptureError(CaptureError):
    """The plan could not be recorded into a CUDA graph; the message names the op and the cause."""


def require_cuda() -> None:
    """Raise a one-line RuntimeError unless a CUDA device is usable."""
    if torch.cuda.is_available():
        return
    reason = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
              else "no CUDA device is visible to PyTorch")
    raise DeviceError(f"CUDA is not available: {reason} (torch {torch.__version__}); use device='cpu'")


@dataclass
class _Entry:
    """What one input signature needs: its Captured (shape-checked for it) and release plan, and in graph mode the
    graph with its static buffers."""

    captured: Captured
    releases: dict[tuple[Lane, int], list[str]]
    graph: torch.cuda.CUDAGraph | None = None
    static_inputs: Any = None
    static_output: Any = None


class CudaBackend:
    def __init__(self, captured: Captured, plan: LaunchPlan, example_inputs, *, mode: str = "graph",
                 static_outputs: bool = False, fallback: str = "error", cache_size: int = 8, warmup: int = 3):
        require_cuda()
        if mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if fallback not in FALLBACKS:
            raise UsageError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
        if cache_size < 1 or warmup < 1:
            raise UsageError(f"cache_size and warmup must be at least 1, got {cache_size} and {warmup}")
        self.mode, self.static_outputs, self.fallback = mode, static_outputs, fallback
        self.cache_size, self.warmup = cache_size, warmup
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.captured = on_device(captured, self.device)
        self.program = Program.from_plan(plan)
        self.lanes: list[Lane] = sorted(self.program.lanes)
        self.stats = {"captures": 0, "evictions": 0, "eager_fallbacks": 0}
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.arity = len(example_inputs)
        self._example_shapes = _shapes(example_inputs)
        self._side = {lane: torch.cuda.Stream(self.device) for lane in self.lanes[1:]}
        self._events = [torch.cuda.Event() for _ in range(self.program.num_signals)]
        self._fork = torch.cuda.Event()
        self._joins = {lane: torch.cuda.Event() for lane in self.lanes[1:]}
        self._done = torch.cuda.Event()
        self._last_origin: torch.cuda.Stream | None = None
        self._capture_stream = torch.cuda.Stream(self.device)
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._current_op: str | None = None
        with torch.no_grad():  # ahead of time: the example's signature is ready before the first call
            self._entry(self._to_device(example_inputs), example_inputs)

    # ---- calls --------------------------------------------------------------------------------------------------
    def __call__(self, *args) -> Any:
        if len(args) != self.arity:
            raise TypeError(f"{self.captured.graph.name}: expected {self.arity} inputs (as the example inputs), "
                            f"got {len(args)}")
        with self._lock, torch.no_grad():
            origin = torch.cuda.current_stream(self.device)
            if self._last_origin is not None and self._last_origin != origin:
                origin.wait_event(self._done)  # the previous call ran on another stream and shares our buffers
            entry = self._entry(None, args)
            if entry.graph is not None:
                for static, x in zip(pytree.tree_leaves(entry.static_inputs), pytree.tree_leaves(args), strict=True):
                    if isinstance(x, torch.Tensor) and static.data_ptr() != x.data_ptr():
                        static.copy_(x)
                entry.graph.replay()
                out = entry.static_output if self.static_outputs else pytree.tree_map(_clone, entry.static_output)
            else:
                env = entry.captured.bind(self._to_device(args))
                self._issue(entry, env, origin)
                out = entry.captured.output(env)
                for t in pytree.tree_leaves(out):  # it may come from a side stream's pool; the caller reads it here
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(origin)
            self._done.record(origin)
            self._last_origin = origin
            return out

    @property
    def signatures(self) -> list[tuple]:
        """Input signatures with a ready entry, least recently used first."""
        return list(self._entries)

    def _signature(self, args: tuple) -> tuple:
        if any(isinstance(a, (list, tuple, dict)) for a in args):
            leaves, spec = pytree.tree_flatten(args)
            return (str(spec), *map(self._leaf_signature, leaves))
        return (None, *map(self._leaf_signature, args))  # flat arguments: no pytree walk on the hot path

    def _leaf_signature(self, x) -> tuple:
        if not isinstance(x, torch.Tensor):
            return ("value", repr(x))
        if self.mode == "streams":
            return (x.shape, x.dtype, x.device, x.stride())
        if _in_place(x, self.device):
            return (x.shape, x.dtype, x.device, x.data_ptr())
        return (x.shape, x.dtype, x.device)

    def _to_device(self, args: tuple) -> tuple:
        return pytree.tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, args)

    def _entry(self, args_on_device: tuple | None, args: tuple) -> _Entry:
        key = self._signature(args)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        # Static buffers made under a caller's inference_mode would refuse the next call's copy_ outside it.
        # (inference_mode(False) turns grad mode back on, hence no_grad inside it.)
        with torch.inference_mode(False), torch.no_grad():
            if args_on_device is None:
                args_on_device = self._to_device(args)
            captured = self._captured_for(args_on_device)
            if self.mode == "graph":
                entry = self._record(captured, args_on_device)
            else:
                entry = self._prepare_streams(captured, args_on_device)
        self._entries[key] = entry
        if len(self._entries) > self.cache_size:
            _, evicted = self._entries.popitem(last=False)
            if evicted.graph is not None:  # its pool goes back to the allocator: no replay may still be running
                torch.cuda.synchronize(self.device)
            self.stats["evictions"] += 1
        return entry

    def _captured_for(self, args: tuple) -> Captured:
        """The Captured whose ``bind`` accepts ``args``: the compiled one, or a copy re-shaped for a new signature."""
        if _shapes(args) == self._example_shapes:
            return self.captured
        from torch.fx.passes.shape_prop import ShapeProp

        gm = self.captured.gm
        try:
            ShapeProp(gm).propagate(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised with the signature named
            raise UsageError(f"{self.captured.graph.name}: inputs with shapes {_shapes(args)} cannot run through the "
                             f"graph captured for {self._example_shapes}: {type(exc).__name__}: {exc}") from exc
        return dataclasses.replace(self.captured, gm=gm)  # keeps a subclass (backends/segments.py: Segmented)

    # ---- the interpreter ----------------------------------------------------------------------------------------
    def _issue(self, entry: _Entry, env: dict, origin: torch.cuda.Stream) -> None:
        """Issue the whole plan, forked from and joined into ``origin``, dropping env entries at their releases."""
        streams = {self.lanes[0]: origin, **self._side} if self.lanes else {}
        if self._side:
            self._fork.record(origin)
            for side in self._side.values():
                side.wait_event(self._fork)
        run_op = entry.captured.run_op
        for lane, step, released in steps_with_releases(self.program, entry.releases):
            stream = streams[lane]
            if step.kind == "launch":
                self._current_op = step.op
                with torch.cuda.stream(stream):
                    run_op(step.op, env)
            elif step.kind == "signal":
                self._events[step.signal].record(stream)
            else:
                stream.wait_event(self._events[step.signal])
            for key in released:
                env.pop(key, None)
        self._current_op = None
        for lane, side in self._side.items():
            self._joins[lane].record(side)
            origin.wait_event(self._joins[lane])

    def _keep_all_run(self, captured: Captured, args: tuple, origin: torch.cuda.Stream) -> _Entry:
        """Run once keeping every intermediate; return the entry with its release plan."""
        entry = _Entry(captured, {})
        env = captured.bind(args)
        self._issue(entry, env, origin)
        entry.releases = release_keys(captured, env, self.program)
        return entry

    # ---- streams mode -------------------------------------------------------------------------------------------
    def _prepare_streams(self, captured: Captured, args: tuple) -> _Entry:
        return self._keep_all_run(captured, args, torch.cuda.current_stream(self.device))

    # ---- graph mode ---------------------------------------------------------------------------------------------
    def _record(self, captured: Captured, args: tuple) -> _Entry:
        """Warm up on the capture stream, then capture one run into a CUDA graph (see the module docstring)."""
        static_inputs = pytree.tree_map(lambda x: _static_copy(x, self.device), args)
        caller = torch.cuda.current_stream(self.device)
        side = self._capture_stream
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                entry = self._keep_all_run(captured, static_inputs, side)
                for i in range(1, self.warmup):
                    env = captured.bind(static_inputs)
                    if i == self.warmup - 1:
                        self._issue_checking_syncs(entry, env, side)
                    else:
                        self._issue(entry, env, side)
                    del env
            caller.wait_stream(side)
            entry.static_inputs = static_inputs
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=side):
                    env = captured.bind(static_inputs)
                    self._issue(entry, env, side)
                    entry.static_output = captured.output(env)
                del env  # only now: the capture pool keeps these buffers for the graph, none reused mid-capture
            except Exception as exc:
                _settle()
                raise self._capture_error(exc) from exc
        except GraphCaptureError as exc:
            if self.fallback != "eager":
                raise
            warnings.warn(f"{exc}; running this input signature on streams without a CUDA graph", stacklevel=3)
            self.stats["eager_fallbacks"] += 1
            caller.wait_stream(side)
            # Graph-mode signatures ignore strides, which can change what aliases what: keep every buffer.
            return _Entry(captured, {})
        entry.graph = graph
        self.stats["captures"] += 1
        return entry

    def _issue_checking_syncs(self, entry: _Entry, env: dict, origin: torch.cuda.Stream) -> None:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._issue(entry, env, origin)
        except RuntimeError as exc:
            if "synchroniz" in str(exc):
                raise self._capture_error(exc, sync=True) from exc
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _capture_error(self, exc: BaseException, sync: bool = False) -> GraphCaptureError:
        op, self._current_op = self._current_op, None
        text = " ".join(str(e) for e in _chain(exc))
        if sync or any(s in text for s in ("capturing", "not permitted", "synchroniz")):
            cause = _SYNC_HINT
        else:
            cause = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if op in self.captured.graph.op:
            nodes = ", ".join(n.name for n in self.captured.nodes[op])
            where = f"op {op!r} ({self.captured.graph.op[op].target}; fx nodes {nodes})"
        else:
            where = "a step outside the ops (binding the inputs or building the output)"
        return GraphCaptureError(f"cannot record {self.captured.graph.name} into a CUDA graph: {where} {cause}; "
                                 "pass fallback='eager' or mode='streams' to run it without a graph")


# ---- helpers (no CUDA needed) ----------------------------------------------------------------------------------


def on_device(captured: Captured, device: torch.device) -> Captured:
    """``captured`` itself when its parameters and buffers are on ``device``, else a copy moved there (the caller's
    model is left where it is)."""
    if all(t.device == device for t in _module_tensors(captured.gm)):
        return captured
    gm = copy.deepcopy(captured.gm).to(device)
    for node in gm.graph.nodes:  # plain tensor attributes (torch.export constants) are not moved by .to()
        if node.op == "get_attr":
            *path, leaf = node.target.split(".")
            owner = gm.get_submodule(".".join(path))
            value = getattr(owner, leaf)
            if isinstance(value, torch.Tensor) and value.device != device and not isinstance(value, nn.Parameter):
                setattr(owner, leaf, value.to(device))
    by_name = {n.name: n for n in gm.graph.nodes}
    return dataclasses.replace(captured, gm=gm, nodes={op: [by_name[n.name] for n in group]
                                                       for op, group in captured.nodes.items()})


def _module_tensors(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    out = [*gm.parameters(), *gm.buffers()]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def release_keys(captured: Captured, env: dict, program: Program) -> dict[tuple[Lane, int], list[str]]:
    """From the environment of a finished keep-all run: after which step of which lane each env key may be dropped."""
    buffers = storage_buffers(captured, env, program)
    keys = {b.name: b.keys for b in buffers}
    return {at: [k for name in group for k in keys[name]] for at, group in release_points(program, buffers).items()}


def storage_buffers(captured: Captured, env: dict, program: Program) -> list[Buffer]:
    """Group the environment of a finished keep-all run by shared storage (a view, an in-place result and its base
    are one group) into :class:`Buffer` s for the liveness analysis.

    Only groups computed by ops are returned: a group that holds a model input, a parameter or anything computed
    in ``bind``, a group the output returns, and a group allocated by ops on several lanes are left out (kept).
    """
    launches = [(lane, step.op) for lane, step in program.issue_order if step.kind == "launch"]
    lane_of = {op: lane for lane, op in launches}
    issue_order = [op for _, op in launches]
    owner = {n.name: op for op, group in captured.nodes.items() for n in group}
    readers = captured.readers()
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    returned = {n.name for n in output.all_input_nodes}
    rank = {op: i for i, op in enumerate(issue_order)}

    parent: dict[object, object] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    storages_of: dict[str, list[tuple]] = {}
    for key, value in env.items():
        found = [_storage(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        storages_of[key] = [s for s in found if s is not None]
        for s in storages_of[key]:
            parent[find(s)] = find(("key", key))
    groups: dict[object, list[str]] = {}
    for key, found in storages_of.items():
        if found:
            groups.setdefault(find(("key", key)), []).append(key)
    buffers = []
    for keys in groups.values():
        if any(k not in owner or k in returned for k in keys):
            continue
        first_holder: dict[tuple, str] = {}
        for k in sorted(keys, key=lambda k: rank[owner[k]]):
            for s in storages_of[k]:
                first_holder.setdefault(s, owner[k])
        alloc_lanes = {lane_of[op] for op in first_holder.values()}
        if len(alloc_lanes) != 1:
            continue
        users = {owner[k] for k in keys} | {op for k in keys for op in readers.get(k, ())}
        buffers.append(Buffer(keys[0], alloc_lanes.pop(), frozenset(users), tuple(keys)))
    return buffers


def _storage(t: torch.Tensor) -> tuple | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
        return None
    return (str(t.device), ptr) if ptr else None


def _shapes(args) -> list:
    return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in pytree.tree_leaves(args)]


def _in_place(x: torch.Tensor, device: torch.device) -> bool:
    """An input whose address stays put between calls (a parameter), so a graph may read it without a copy."""
    static = isinstance(x, nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None
    return static and x.device == device


def _static_copy(x, device: torch.device):
    if not isinstance(x, torch.Tensor) or _in_place(x, device):
        return x
    return torch.empty_like(x, device=device, memory_format=torch.contiguous_format).copy_(x)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _settle() -> None:
    """After a failed capture, let pending work finish so the error does not surface in an unrelated call."""
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        pass
