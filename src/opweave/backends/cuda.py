"""CUDA backend: an interpreter of the LaunchPlan on CUDA streams, recorded ahead of time into a CUDA Graph.

Two modes, one interpreter (:meth:`CudaBackend._issue`, in the plan's issue order, from one host thread):

* ``streams`` — every call runs the plan live: each (device, stream) lane is a ``torch.cuda.Stream``, a ``record``
  is ``Event.record(stream)``, a ``wait`` is ``stream.wait_event(event)``. The first lane runs on the caller's
  current stream; every other lane waits for an event recorded there at the start (fork) and the caller's stream
  waits for every lane's last event at the end (join), so the caller sees an ordinary stream-ordered result. The
  current stream is switched only where the next launch is on another lane than the previous one.
* ``graph`` (default; Nimble's ahead-of-time scheduling, NeurIPS'20 Sec. 4) — the same run is captured once into a
  ``torch.cuda.CUDAGraph`` and every call is a copy into static input buffers (one ``torch._foreach_copy_`` for the
  inputs already on the GPU; pinned host inputs copied with ``non_blocking=True``, so the caller must not overwrite
  them before the call's work is done, as for any non-blocking copy), one ``replay()``, and a clone of the static
  outputs (unless ``static_outputs=True``: then the returned tensors are the graph's own and are overwritten by the
  next call).

**Capture** (graph mode, once per input signature). On the backend's capture stream: ``warmup`` plain runs of the
plan (cuDNN/cuBLAS initialization, lazy allocations; the first keeps every intermediate to find the release plan),
then one *checked* run in CUDA's sync-debug "error" mode, then the capture itself, forked from and joined into the
capture stream as above, with ``capture_error_mode="thread_local"`` (another thread's CUDA calls, a server's
other requests say, neither break the capture nor are refused because of it).

* An op that synchronizes the CPU with the GPU (``.item()``, ``.tolist()``, ``nonzero``, boolean masks, Python
  control flow on a tensor's value) cannot be recorded; the checked run finds it before capture and
  :class:`GraphCaptureError` names the op and the cause. With ``fallback="eager"`` that signature then runs in
  ``streams`` mode instead, with a warning. ``torch.cuda.set_sync_debug_mode`` is process-wide: while the checked
  run lasts (one run of the plan, once per new signature), a synchronizing call made by *another* thread raises
  there too. Two opweave backends never overlap their checked runs (a module lock), so the mode is always restored.
  (The alternative, "warn" mode and Python's warning filters, would be just as process-wide and would misattribute
  another thread's sync to our op.)
* Anything that fails *during* capture is re-raised as :class:`GraphCaptureError` naming the op (never a fallback:
  the checked run passed, so the failure is not a sync and running the signature eagerly would hide it). The
  process is left usable: the other lanes are joined back where the capture allows it, the capture is ended, the
  graph memory pool is handed back to the allocator when PyTorch's ``capture_end`` raised before doing so, pending
  work is drained, and the caller's current stream is restored in a ``finally`` (``torch.cuda.graph``'s own exit
  skips the restore when ``capture_end`` raises, which is why the capture is driven here with ``capture_begin`` /
  ``capture_end``).

**Streams.** ``torch.cuda.Stream()`` hands out streams round robin from a per-device pool (32 per priority), so
several lanes could share one CUDA stream. The lanes and the capture stream are checked to be distinct CUDA
streams (:class:`~opweave.errors.DeviceError` otherwise); :func:`default_streams` (8, the GPU's default number of
hardware queues, ``CUDA_DEVICE_MAX_CONNECTIONS``) is the stream cap ``opweave.compile`` gives the scheduler for
CUDA. Streams of *different* backends, or of the caller, may still coincide once more than 32 are in use: that
only serializes their work, except while a graph is being captured, when work another thread puts on the same
CUDA stream would be recorded into the graph; keep captures (first calls of a signature) out of such overlaps.

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
take fails there, naming the input), and the least recently used entry is dropped when the cache is full. A call
whose arguments are all plain (no lists, tuples or dicts) and match the previous call's signature reuses that
entry without any pytree walk. Parameters passed as inputs (``nn.Parameter``s, or tensors dynamo marked as static,
as ``torch.compile`` passes them) are used in place rather than copied.

Calls are serialized (one lock per backend). A call made from another stream than the previous call first makes
that stream wait for the previous call's stream (they share streams, events and static buffers); calls from the
same stream need no wait. Inference only: runs under ``torch.no_grad``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opweave.backends.liveness import Buffer, release_points, steps_with_releases
from opweave.backends.program import Lane, Program
from opweave.capture.runtime import Captured, module_tensors
from opweave.errors import CaptureError, DeviceError, UsageError
from opweave.plan.launchplan import LaunchPlan

log = logging.getLogger(__name__)

MODES = ("graph", "streams")
FALLBACKS = ("error", "eager")
DEFAULT_STREAMS = 8  # CUDA's default number of hardware work queues per device (CUDA_DEVICE_MAX_CONNECTIONS)
_SYNC_HINT = ("synchronizes the CPU with the GPU (e.g. .item(), .tolist(), .cpu(), printing a tensor, nonzero or "
              "boolean-mask indexing, or Python control flow on a tensor's value), which a CUDA graph cannot record")
_SYNC_CHECK = threading.Lock()  # one checked run at a time in the process: set_sync_debug_mode is process-wide


class GraphCaptureError(CaptureError):
    """The plan could not be recorded into a CUDA graph; the message names the op and the cause."""


def require_cuda() -> None:
    """Raise a one-line RuntimeError unless a CUDA device is usable."""
    if torch.cuda.is_available():
        return
    reason = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
              else "no CUDA device is visible to PyTorch")
    raise DeviceError(f"CUDA is not available: {reason} (torch {torch.__version__}); use device='cpu'")


def default_streams() -> int:
    """The stream cap per device for CUDA plans: ``CUDA_DEVICE_MAX_CONNECTIONS`` when set to a positive integer
    (the number of hardware queues streams are multiplexed onto), else its default, 8. More lanes than queues
    share queues, and a kernel queued behind another lane's in the same queue waits for it (false dependencies)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_STREAMS


@dataclass
class _Entry:
    """What one input signature needs: its Captured (shape-checked for it), release plan and the plan's steps with
    their releases; in graph mode the graph, its static buffers and which input leaves are copied into which."""

    captured: Captured
    releases: dict[tuple[Lane, int], list[str]]
    steps: list[tuple[int, str, Any, tuple]] = field(default_factory=list)
    graph: torch.cuda.CUDAGraph | None = None
    static_inputs: Any = None
    static_output: Any = None
    copies: InputCopies | None = None


@dataclass
class InputCopies:
    """Which input leaves a call copies into which static buffers: ``device_*`` (already on the backend's device:
    one ``torch._foreach_copy_``) and ``host_*`` (elsewhere: one ``copy_`` each, non-blocking from pinned memory).
    Leaves that are used in place (parameters) or are not tensors are not copied."""

    device_positions: list[int]
    device_buffers: list[torch.Tensor]
    host_positions: list[int]
    host_buffers: list[torch.Tensor]

    @classmethod
    def plan(cls, leaves, static_leaves, device: torch.device) -> InputCopies:
        copies = cls([], [], [], [])
        for i, (x, static) in enumerate(zip(leaves, static_leaves, strict=True)):
            if not isinstance(x, torch.Tensor) or _in_place(x, device):
                continue
            if x.device == device:
                copies.device_positions.append(i)
                copies.device_buffers.append(static)
            else:
                copies.host_positions.append(i)
                copies.host_buffers.append(static)
        return copies

    def copy_in(self, leaves) -> None:
        if self.device_positions:
            torch._foreach_copy_(self.device_buffers, [leaves[i] for i in self.device_positions])
        for i, static in zip(self.host_positions, self.host_buffers, strict=True):
            x = leaves[i]
            static.copy_(x, non_blocking=x.is_pinned())


class CudaBackend:
    def __init__(self, captured: Captured, plan: LaunchPlan, example_inputs, *, mode: str = "graph",
                 static_outputs: bool = False, fallback: str = "error", cache_size: int = 8, warmup: int = 2):
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
        self._side_list = list(self._side.values())
        self._capture_stream = torch.cuda.Stream(self.device)
        check_distinct_streams([(f"lane {lane}", s.cuda_stream) for lane, s in self._side.items()]
                               + [("the capture stream", self._capture_stream.cuda_stream)])
        self._events = [torch.cuda.Event() for _ in range(self.program.num_signals)]
        self._fork = torch.cuda.Event()
        self._joins = [torch.cuda.Event() for _ in self._side_list]
        self._last_origin: torch.cuda.Stream | None = None
        self._last_key: tuple | None = None
        self._last_entry: _Entry | None = None
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._current_op: str | None = None
        with torch.no_grad():  # ahead of time: the example's signature is ready before the first call
            key, leaves = input_signature(example_inputs, self.mode, self.device)
            self._entry(key, example_inputs, leaves)

    # ---- calls --------------------------------------------------------------------------------------------------
    def __call__(self, *args) -> Any:
        if len(args) != self.arity:
            raise TypeError(f"{self.captured.graph.name}: expected {self.arity} inputs (as the example inputs), "
                            f"got {len(args)}")
        with self._lock, torch.no_grad():
            origin = torch.cuda.current_stream(self.device)
            if self._last_origin is not None and origin != self._last_origin:
                origin.wait_stream(self._last_origin)  # the previous call ran there and shares our buffers
            key, leaves = input_signature(args, self.mode, self.device)
            if key == self._last_key:
                entry = self._last_entry
            else:
                entry = self._entry(key, args, leaves)
                self._last_key, self._last_entry = key, entry
            if entry.graph is not None:
                entry.copies.copy_in(leaves)
                entry.graph.replay()
                out = entry.static_output if self.static_outputs else pytree.tree_map(_clone, entry.static_output)
            else:
                env = entry.captured.bind(self._to_device(args))
                self._issue(entry, env, origin)
                out = entry.captured.output(env)
                for t in pytree.tree_leaves(out):  # it may come from a side stream's pool; the caller reads it here
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(origin)
            self._last_origin = origin
            return out

    @property
    def signatures(self) -> list[tuple]:
        """Input signatures with a ready entry, least recently used first."""
        return list(self._entries)

    def capturing_streams(self) -> list[str]:
        """The backend's streams that are capturing now (none, unless a capture is under way in this thread)."""
        found = []
        named = [("the capture stream", self._capture_stream)] + [(f"lane {lane}", s) for lane, s in self._side.items()]
        for name, stream in named:
            with torch.cuda.stream(stream):
                if torch.cuda.is_current_stream_capturing():
                    found.append(name)
        return found

    def _to_device(self, args: tuple) -> tuple:
        def move(x):
            if not isinstance(x, torch.Tensor) or x.device == self.device:
                return x
            return x.to(self.device, non_blocking=x.is_pinned())

        if any(isinstance(a, (list, tuple, dict)) for a in args):
            return pytree.tree_map(move, args)
        return tuple(map(move, args))

    def _entry(self, key: tuple, args: tuple, leaves) -> _Entry:
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        # Static buffers made under a caller's inference_mode would refuse the next call's copy_ outside it.
        # (inference_mode(False) turns grad mode back on, hence no_grad inside it.)
        with torch.inference_mode(False), torch.no_grad():
            args_on_device = self._to_device(args)
            captured = self._captured_for(args_on_device)
            if self.mode == "graph":
                entry = self._record(captured, args_on_device, leaves)
            else:
                entry = self._keep_all_run(captured, args_on_device, torch.cuda.current_stream(self.device))
        self._entries[key] = entry
        if len(self._entries) > self.cache_size:
            evicted_key, evicted = self._entries.popitem(last=False)
            if evicted.graph is not None:  # its pool goes back to the allocator: no replay may still be running
                torch.cuda.synchronize(self.device)
            if evicted_key == self._last_key:
                self._last_key = self._last_entry = None
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
        """Issue the whole plan, forked from and joined into ``origin`` (the current stream when called), dropping
        env entries at their releases. The current stream is switched only when the launching lane changes, and
        is ``origin`` again when this returns or raises."""
        streams = [origin, *self._side_list]
        if self._side_list:
            self._fork.record(origin)
            for side in self._side_list:
                side.wait_event(self._fork)
        run_op, events = entry.captured.run_op, self._events
        active = origin
        try:
            for lane, kind, arg, released in entry.steps:
                stream = streams[lane]
                if kind == "launch":
                    if stream is not active:
                        torch.cuda.set_stream(stream)
                        active = stream
                    self._current_op = arg
                    run_op(arg, env)
                elif kind == "signal":
                    events[arg].record(stream)
                else:
                    stream.wait_event(events[arg])
                for key in released:
                    env.pop(key, None)
        finally:
            if active is not origin:
                torch.cuda.set_stream(origin)
        self._current_op = None
        self._join(origin)

    def _join(self, origin: torch.cuda.Stream) -> None:
        for side, join in zip(self._side_list, self._joins, strict=True):
            join.record(side)
            origin.wait_event(join)

    def _steps(self, releases: dict[tuple[Lane, int], list[str]]) -> list[tuple[int, str, Any, tuple]]:
        """The plan in issue order as ``(stream index, kind, op or signal, env keys to drop after it)``; stream 0 is
        the origin (the first lane), stream ``k`` the ``k``-th side stream."""
        index = {lane: i for i, lane in enumerate(self.lanes)}
        return [(index[lane], step.kind, step.op if step.kind == "launch" else step.signal, tuple(released))
                for lane, step, released in steps_with_releases(self.program, releases)]

    def _keep_all_run(self, captured: Captured, args: tuple, origin: torch.cuda.Stream) -> _Entry:
        """Run once keeping every intermediate; return the entry with its release plan."""
        entry = _Entry(captured, {}, self._steps({}))
        env = captured.bind(args)
        self._issue(entry, env, origin)
        entry.releases = release_keys(captured, env, self.program)
        entry.steps = self._steps(entry.releases)
        return entry

    # ---- graph mode ---------------------------------------------------------------------------------------------
    def _record(self, captured: Captured, args: tuple, leaves) -> _Entry:
        """Warm up and check on the capture stream, then capture one run into a CUDA graph (module docstring)."""
        static_inputs = pytree.tree_map(lambda x: _static_copy(x, self.device), args)
        caller = torch.cuda.current_stream(self.device)
        side = self._capture_stream
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                entry = self._keep_all_run(captured, static_inputs, side)
                for _ in range(1, self.warmup):
                    self._issue(entry, captured.bind(static_inputs), side)
                self._issue_checking_syncs(entry, captured.bind(static_inputs), side)
        except GraphCaptureError as exc:  # only the checked run raises it: nothing was captured yet
            if self.fallback != "eager":
                raise
            warnings.warn(f"{exc}; running this input signature on streams without a CUDA graph", stacklevel=4)
            self.stats["eager_fallbacks"] += 1
            # Graph-mode signatures ignore strides, which can change what aliases what: keep every buffer.
            return _Entry(captured, {}, self._steps({}))
        finally:
            caller.wait_stream(side)
        entry.static_inputs = static_inputs
        entry.copies = InputCopies.plan(leaves, pytree.tree_leaves(static_inputs), self.device)
        entry.graph, entry.static_output = self._capture(entry, captured, static_inputs)
        self.stats["captures"] += 1
        log.debug("captured a CUDA graph on %s for a new input signature (%d captures, %d cached)", self.device,
                  self.stats["captures"], len(self._entries) + 1)
        return entry

    def _capture(self, entry: _Entry, captured: Captured, static_inputs) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Record one run of ``entry`` into a new CUDA graph on the capture stream; the graph and its static output.

        Driven with ``capture_begin``/``capture_end`` rather than ``torch.cuda.graph`` so that every failure path
        ends the capture, gives the memory pool back, and restores the caller's current stream (module docstring).
        """
        caller = torch.cuda.current_stream(self.device)
        side = self._capture_stream
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)  # as torch.cuda.graph: nothing of ours still pending when capture begins
        failure: BaseException | None = None
        where = output = None
        torch.cuda.set_stream(side)
        try:
            try:
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
                _give_back_pool(pool, self.device)
                failure, where = exc, "beginning the capture"
            else:
                env = None
                try:
                    env = captured.bind(static_inputs)
                    self._issue(entry, env, side)
                    output = captured.output(env)
                except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
                    failure = exc
                    self._join_quietly(side)
                try:
                    graph.capture_end()
                except BaseException as exc:  # noqa: BLE001 - re-raised after the clean-up
                    _give_back_pool(pool, self.device)
                    if failure is None:
                        failure, where = exc, "ending the capture"
                del env  # only now: the capture pool keeps these buffers for the graph, none reused mid-capture
        finally:
            torch.cuda.set_stream(caller)
        if failure is None:
            return graph, output
        del graph, output
        _settle()
        if not isinstance(failure, Exception):
            raise failure
        raise self._capture_error(failure, where=where, during_capture=True) from failure

    def _join_quietly(self, origin: torch.cuda.Stream) -> None:
        """After an op failed mid-capture: join the other lanes into ``origin`` so that the capture can end. Each
        step may itself fail when the capture was invalidated; the capture then ends with that error anyway."""
        for side, join in zip(self._side_list, self._joins, strict=True):
            try:
                join.record(side)
                origin.wait_event(join)
            except Exception:  # noqa: BLE001, S110 - best effort, see the docstring
                pass

    def _issue_checking_syncs(self, entry: _Entry, env: dict, origin: torch.cuda.Stream) -> None:
        """One run of the plan in CUDA's sync-debug "error" mode (process-wide: see the module docstring)."""
        with _SYNC_CHECK:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._issue(entry, env, origin)
            except Exception as exc:
                if any("synchroniz" in str(e) for e in _chain(exc)):
                    raise self._capture_error(exc, sync=True) from exc
                raise
            finally:
                torch.cuda.set_sync_debug_mode(previous)

    def _capture_error(self, exc: BaseException, sync: bool = False, where: str | None = None,
                       during_capture: bool = False) -> GraphCaptureError:
        op, self._current_op = self._current_op, None
        return capture_error(self.captured, op, exc, sync=sync, where=where, during_capture=during_capture)


# ---- helpers (no CUDA needed) ----------------------------------------------------------------------------------


def capture_error(captured: Captured, op: str | None, exc: BaseException, *, sync: bool = False,
                  where: str | None = None, during_capture: bool = False) -> GraphCaptureError:
    """The one-line :class:`GraphCaptureError` for ``exc`` raised while op ``op`` ran (None: outside the ops), in
    the checked run before capture or ``during_capture``."""
    text = " ".join(str(e) for e in _chain(exc))
    if sync or any(s in text for s in ("capturing", "not permitted", "synchroniz")):
        cause = _SYNC_HINT
    else:
        first = str(exc).strip().splitlines()
        cause = f"failed: {type(exc).__name__}: {first[0] if first else ''}"
    if where is not None:
        place = where
    elif op in captured.graph.op:
        nodes = ", ".join(n.name for n in captured.nodes[op])
        place = f"op {op!r} ({captured.graph.op[op].target}; fx nodes {nodes})"
    else:
        place = "a step outside the ops (binding the inputs or building the output)"
    remedy = ("mode='streams' runs it without a graph (a failure during the capture is never run eagerly instead)"
              if during_capture else "pass fallback='eager' or mode='streams' to run it without a graph")
    return GraphCaptureError(f"cannot record {captured.graph.name} into a CUDA graph: {place} {cause}; {remedy}")


def check_distinct_streams(streams: list[tuple[str, int]]) -> None:
    """Raise :class:`DeviceError` naming two of ``streams`` (name, CUDA stream handle) that share a handle."""
    seen: dict[int, str] = {}
    for name, handle in streams:
        if handle in seen:
            raise DeviceError(f"{seen[handle]} and {name} got the same CUDA stream {handle:#x} from PyTorch's stream "
                              f"pool (32 streams per priority, handed out round robin; {len(streams)} asked for "
                              f"here): schedule with fewer streams (e.g. streams={default_streams()})")
        seen[handle] = name


def input_signature(args: tuple, mode: str, device: torch.device) -> tuple[tuple, Any]:
    """The cache key of a call's arguments and their leaves (the arguments themselves when none is a list, tuple
    or dict: no pytree walk). A leaf's part of the key: shape, dtype, device; plus strides in ``streams`` mode
    (inputs are used in place), plus the address of inputs used in place in ``graph`` mode; a non-tensor's repr."""
    if any(isinstance(a, (list, tuple, dict)) for a in args):
        leaves, spec = pytree.tree_flatten(args)
        head = str(spec)
    else:
        leaves, head = args, None
    return (head, *(_leaf_signature(x, mode, device) for x in leaves)), leaves


def _leaf_signature(x, mode: str, device: torch.device) -> tuple:
    if not isinstance(x, torch.Tensor):
        return ("value", repr(x))
    if mode == "streams":
        return (x.shape, x.dtype, x.device, x.stride())
    if _in_place(x, device):
        return (x.shape, x.dtype, x.device, x.data_ptr())
    return (x.shape, x.dtype, x.device)


def _give_back_pool(pool, device: torch.device) -> None:
    """Stop routing allocations to a capture's private pool and release it, for a capture that did not end
    cleanly: PyTorch's ``capture_end`` raises before doing either when ``cudaStreamEndCapture`` fails, and the
    graph's destructor releases the pool only after a capture that ended. If stopping is refused, ``capture_end``
    got past that point and the graph releases the pool itself: releasing it here too would do it twice.
    (The binding was renamed in torch 2.8.)"""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    try:
        end(device.index, pool)
    except Exception:  # noqa: BLE001 - not capturing to that pool any more: see the docstring
        return
    release(device.index, pool)


def on_device(captured: Captured, device: torch.device) -> Captured:
    """``captured`` itself when its parameters and buffers are on ``device``, else a copy moved there (the caller's
    model is left where it is)."""
    if all(t.device == device for t in module_tensors(captured.gm)):
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
