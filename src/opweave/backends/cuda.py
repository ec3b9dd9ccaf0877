"""CUDA backend: an interpreter of the LaunchPlan on CUDA streams, recorded ahead of time into a CUDA Graph.

Two ways to run, one interpreter (:class:`~opweave.backends.streams.CudaLanes`, in the plan's issue order, from one
host thread; its module says how lanes map to streams and where their streams come from):

* ``cudagraphs=False`` — every call runs the plan live on the streams: each (device, stream) lane is a CUDA stream,
  a ``record`` is ``Event.record(stream)``, a ``wait`` is ``stream.wait_event(event)``. The first lane runs on the
  caller's current stream; the other lanes are forked from and joined into it, so the caller sees an ordinary
  stream-ordered result. The example's signature runs once when the backend is made (compiled segments compile
  there, as the capture's warm-ups compile them with graphs), so no first call pays for it.
* ``cudagraphs=True`` (default; Nimble's ahead-of-time scheduling, NeurIPS'20 Sec. 4) — the same run is captured once
  into a ``torch.cuda.CUDAGraph`` and every call is a copy into static input buffers (one ``torch._foreach_copy_``
  for the inputs already on the GPU; pinned host inputs copied with ``non_blocking=True``, so the caller must not
  overwrite them before the call's work is done, as for any non-blocking copy), one ``replay()``, and a clone of
  the static outputs (unless ``static_outputs=True``: then the returned tensors are the graph's own and are
  overwritten by the next call).

**Capture** (once per input signature; :mod:`opweave.backends.cudagraph`): on the backend's capture stream,
``warmup`` plain runs, one sync-checked run, then the capture, every run freeing buffers where the release plan says
(below). An op that synchronizes the CPU with the GPU is found by the checked run and named in a
:class:`GraphCaptureError`; with ``capture_fallback="eager"`` that signature then runs on the streams without a
graph instead, with a warning. A failure during the capture itself is always raised, and leaves the process usable.

**Streams.** The side lanes and the capture stream are distinct streams of the device's
:func:`~opweave.backends.streams.stream_pool` (a :class:`~opweave.errors.DeviceError` when PyTorch has too few),
given back by :meth:`CudaBackend.close` or when the backend is collected; :func:`default_streams` is the stream cap
``opweave.compile`` gives the scheduler for CUDA.

A plan for several devices runs all its devices on the current GPU (their lanes become extra streams; a
``send``/``recv`` pair becomes an event), which keeps every schedule runnable and checkable on one GPU; the
distributed backend places devices on real GPUs.

**Buffers** are planned before the first run of an input signature: the model runs once on fake tensors
(:func:`opweave.backends.liveness.static_buffers`: storage identity, shapes and sizes, no memory and no kernels; for
the example inputs, the run the build's memory pass made, passed as ``fake_run``) to find which environment entries
share a storage, the memory pass (:func:`opweave.plan.lifetimes.release_points`) says after which step of which lane
each group may be dropped (the earliest point of its allocating lane that the plan's joins order after every use),
and the memory validator proves each release (:func:`opweave.plan.lifetimes.validate_releases`, a
:class:`~opweave.errors.PlanError` naming the buffer otherwise). Every run drops the group there, the first one
included: the warm-ups, the capture, every call without graphs. Groups that are model inputs, parameters, outputs,
or allocated on several lanes, and groups whose lane never joins a consumer, stay alive until the end of the run;
with graphs the capture pool keeps the memory of the graph's buffers for the graph's lifetime (freed blocks are
reused inside the capture by their own stream), and without them the caller's stream has joined every lane before
they are dropped. A model that cannot run on fake tensors (an op without a fake implementation) learns its buffers
from a first run that keeps every intermediate instead (``stats["keep_all_runs"]`` counts them).

**Input signatures.** One entry (a captured graph, or a release plan to run without one) per input signature —
pytree structure and every leaf's shape, dtype and device (plus strides without graphs, where inputs are used in
place, and the address of inputs used in place by a graph; :func:`input_signature`) — in a
:class:`~opweave.backends.cache.BoundedCache` of ``cache_size`` entries; a new signature is captured on first use
(the graph was traced for the example's shapes, so a shape the model cannot take fails there, naming the input),
and the least recently used entry is dropped when the cache is full. A call whose arguments are all plain (no
lists, tuples or dicts) and match the previous call's signature reuses that entry without any pytree walk.
Parameters passed as inputs (``nn.Parameter``s, or tensors dynamo marked as static, as ``torch.compile`` passes
them) are used in place rather than copied.

Calls are serialized (one lock per backend). A call made from another stream than the previous call first makes
that stream wait for the previous call's stream (they share streams, events and static buffers); calls from the
same stream need no wait. Inference only: runs under ``torch.no_grad``.

**Runtime.** Everything CUDA goes through ``runtime`` (:mod:`opweave.backends.runtime`): ``torch.cuda`` by default,
or :class:`opweave.testing.fakecuda.FakeCuda`, which runs the same logic on the CPU with every stream's work in a
random order the events allow (how the backend is tested without a GPU). Each op, input copy and output clone is
issued through ``runtime.launch`` on the stream it runs on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache, signature
from opweave.backends.cudagraph import GraphCaptureError, checked_run, record
from opweave.backends.liveness import FakeRun, release_keys, static_buffers, steps_with_releases, storage_buffers
from opweave.backends.program import Lane, Program, Step
from opweave.backends.runtime import CUDA, Runtime
from opweave.backends.streams import CudaLanes, default_streams, stream_pool
from opweave.capture.runtime import Captured, SharedCopies, as_tuple, module_tensors, static_input
from opweave.errors import DeviceError, UsageError, did_you_mean
from opweave.plan.launchplan import LaunchPlan

__all__ = ["CudaBackend", "GraphCaptureError", "InputCopies", "default_streams", "input_signature", "moved",
           "on_device", "require_cuda"]

log = logging.getLogger(__name__)

CAPTURE_FALLBACKS = ("error", "eager")


def require_cuda(runtime: Runtime = CUDA) -> None:
    """Raise a one-line RuntimeError unless a CUDA device is usable (through ``runtime``)."""
    if runtime.is_available():
        return
    reason = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
              else "no CUDA device is visible to PyTorch")
    raise DeviceError(f"CUDA is not available: {reason} (torch {torch.__version__}); use device='cpu' (--device cpu)")


@dataclass
class _Entry:
    """What one input signature needs: its Captured (shape-checked for it), release plan and the plan's steps with
    their releases; with a CUDA graph the graph, its static buffers and which input leaves are copied into which."""

    captured: Captured
    releases: dict[tuple[Lane, int], list[str]]
    steps: list[tuple[Lane, Step]] = field(default_factory=list)
    graph: Any = None  # torch.cuda.CUDAGraph, or the runtime's
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
    """A plan on CUDA streams, recorded into a CUDA graph per input signature unless ``cudagraphs=False`` (module
    docstring), through ``runtime`` (default: ``torch.cuda``). ``fake_run``: the model's run on fake tensors for
    ``example_inputs``, when one was made already (the build's memory pass): the example's buffers are grouped from
    it rather than from a run of its own. ``stats``: ``captures``, ``evictions``, ``eager_fallbacks``,
    ``keep_all_runs``. ``close()`` drops the cached graphs and gives the streams back to the pool (also done when the
    backend is collected); a closed backend refuses calls."""

    def __init__(self, captured: Captured, plan: LaunchPlan, example_inputs, *, cudagraphs: bool = True,
                 static_outputs: bool = False, capture_fallback: str = "error", cache_size: int = 8, warmup: int = 2,
                 runtime: Runtime | None = None, fake_run: FakeRun | None = None):
        runtime = runtime or CUDA
        require_cuda(runtime)
        if not isinstance(cudagraphs, bool):
            raise UsageError(f"cudagraphs must be True or False, got {cudagraphs!r}")
        if capture_fallback not in CAPTURE_FALLBACKS:
            raise UsageError(f"capture_fallback must be one of {', '.join(CAPTURE_FALLBACKS)}, "
                             f"got {capture_fallback!r}{did_you_mean(capture_fallback, CAPTURE_FALLBACKS)}")
        if cache_size < 1 or warmup < 1:
            raise UsageError(f"cache_size and warmup must be at least 1, got {cache_size} and {warmup}")
        self.cudagraphs, self.static_outputs, self.capture_fallback = cudagraphs, static_outputs, capture_fallback
        self.cache_size, self.warmup, self.runtime = cache_size, warmup, runtime
        self.device = runtime.device
        self.captured = on_device(captured, self.device)
        self.program = Program.from_plan(plan)
        self.lanes: list[Lane] = sorted(self.program.lanes)
        self.stats = {"captures": 0, "evictions": 0, "eager_fallbacks": 0, "keep_all_runs": 0}
        example_inputs = as_tuple(example_inputs)
        self.arity = len(example_inputs)
        self._example_shapes = _shapes(example_inputs)
        pool = stream_pool(self.device, runtime)
        *side, self._capture_stream = pool.take([f"lane {lane}" for lane in self.lanes[1:]] + ["the capture stream"])
        self._give_back = weakref.finalize(self, pool.give_back, [*side, self._capture_stream])
        self._lanes = CudaLanes(self.lanes, side, self.program.num_signals, runtime)
        self._last_origin = None
        self._last_key: tuple | None = None
        self._last_entry: _Entry | None = None
        self._entries = BoundedCache(cache_size, self._evicted)
        self._lock = threading.Lock()
        with torch.no_grad():  # ahead of time: the example's signature is ready before the first call
            key, leaves = input_signature(example_inputs, self.cudagraphs, self.device)
            entry = self._entry(key, example_inputs, leaves, fake_run)
            if not self.cudagraphs:
                self._warm_up(entry, example_inputs)

    def _warm_up(self, entry: _Entry, args: tuple) -> None:
        """One run of ``entry`` on ``args``, its output dropped: without graphs, what the capture's warm-ups do
        for a graph (compiled segments compiled, the libraries' kernels chosen) happens here, ahead of the first
        call."""
        origin = self.runtime.current_stream(self.device)
        env = self.runtime.launch(origin, entry.captured.bind, self._to_device(args))
        self._lanes.issue(entry.steps, origin, entry.captured, env)
        del env
        self._last_origin = origin

    # ---- calls --------------------------------------------------------------------------------------------------
    def __call__(self, *args) -> Any:
        if len(args) != self.arity:
            raise TypeError(f"{self.captured.graph.name}: expected {self.arity} inputs (as the example inputs), "
                            f"got {len(args)}")
        with self._lock, torch.no_grad():
            if not self._give_back.alive:
                raise UsageError(f"{self.captured.graph.name}: this CUDA backend was closed")
            runtime = self.runtime
            origin = runtime.current_stream(self.device)
            if self._last_origin is not None and origin != self._last_origin:
                origin.wait_stream(self._last_origin)  # the previous call ran there and shares our buffers
            key, leaves = input_signature(args, self.cudagraphs, self.device)
            entry = self._last_entry
            if entry is None or key != self._last_key:
                entry = self._entry(key, args, leaves)
                self._last_key, self._last_entry = key, entry
            if entry.graph is not None:
                assert entry.copies is not None  # a recorded graph reads its inputs from its static copies
                runtime.launch(origin, entry.copies.copy_in, leaves)
                entry.graph.replay()
                out = entry.static_output if self.static_outputs else runtime.launch(
                    origin, pytree.tree_map, _clone, entry.static_output)
            else:
                env = runtime.launch(origin, entry.captured.bind, self._to_device(args))
                self._lanes.issue(entry.steps, origin, entry.captured, env)
                out = entry.captured.output(env)
                for t in pytree.tree_leaves(out):  # it may come from a side stream's pool; the caller reads it here
                    if isinstance(t, torch.Tensor):
                        runtime.record_stream(t, origin)
            self._last_origin = origin
            return out

    def close(self) -> None:
        """Drop every cached entry (their graphs' memory goes back to the allocator once no replay runs) and give
        the streams back to the device's pool. Calling it again does nothing."""
        with self._lock:
            if not self._give_back.alive:
                return
            if any(entry.graph is not None for entry in self._entries.values()):
                self.runtime.synchronize(self.device)
            self._entries.clear()
            self._last_key = self._last_entry = None
            self._give_back()

    def free(self, args: tuple) -> bool:
        """Take inputs shaped like ``args``: every new signature is recorded on its own (module docstring, Input
        signatures), its shapes propagated through the graph first."""
        return True

    @property
    def signatures(self) -> list[tuple]:
        """Input signatures with a ready entry, in the order they were first cached."""
        return list(self._entries)

    def capturing_streams(self) -> list[str]:
        """The backend's streams that are capturing now (none, unless a capture is under way in this thread)."""
        found = []
        named = [("the capture stream", self._capture_stream)] + [
            (f"lane {lane}", s) for lane, s in zip(self.lanes[1:], self._lanes.side, strict=True)]
        for name, stream in named:
            with self.runtime.stream(stream):
                if self.runtime.is_current_stream_capturing():
                    found.append(name)
        return found

    def _to_device(self, args: tuple) -> tuple:
        def move(x):
            if not isinstance(x, torch.Tensor) or x.device == self.device:
                return x
            return self.runtime.to_device(x, self.device)

        if any(isinstance(a, (list, tuple, dict)) for a in args):
            return pytree.tree_map(move, args)
        return tuple(map(move, args))

    def _entry(self, key: tuple, args: tuple, leaves, fake_run: FakeRun | None = None) -> _Entry:
        if key in self._entries:
            return self._entries[key]
        # Static buffers made under a caller's inference_mode would refuse the next call's copy_ outside it.
        # (inference_mode(False) turns grad mode back on, hence no_grad inside it.)
        with torch.inference_mode(False), torch.no_grad():
            args_on_device = self._to_device(args)
            captured = self._captured_for(args_on_device)
            if self.cudagraphs:
                entry = self._record(captured, args_on_device, leaves, fake_run)
            else:
                entry = self._planned(captured, args_on_device, self.runtime.current_stream(self.device), fake_run)
        self._entries[key] = entry
        return entry

    def _evicted(self, key: tuple, entry: _Entry) -> None:
        if entry.graph is not None:  # its pool goes back to the allocator: no replay may still be running
            self.runtime.synchronize(self.device)
        if key == self._last_key:
            self._last_key = self._last_entry = None
        self.stats["evictions"] += 1

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

    def _planned(self, captured: Captured, args: tuple, origin, fake_run: FakeRun | None = None) -> _Entry:
        """The entry of a new signature with its release plan, proven safe (module docstring: Buffers); its buffers
        grouped from ``fake_run`` when given (a run on fake tensors for inputs of this signature)."""
        try:
            buffers = static_buffers(captured, args, self.program, fake_run)
        except Exception as exc:  # noqa: BLE001 - any failure on fake tensors: learn the buffers from a real run
            log.debug("%s: no buffers from fake tensors (%s: %s); a first run keeps every intermediate",
                      captured.graph.name, type(exc).__name__, exc)
            buffers = self._keep_all_run(captured, args, origin)
        releases = release_keys(self.program, buffers)
        return _Entry(captured, releases, steps_with_releases(self.program, releases))

    def _keep_all_run(self, captured: Captured, args: tuple, origin) -> list:
        """Run once keeping every intermediate; the buffers of that run."""
        self.stats["keep_all_runs"] += 1
        env = self.runtime.launch(origin, captured.bind, args)
        self._lanes.issue(steps_with_releases(self.program, {}), origin, captured, env)
        return storage_buffers(captured, env, self.program, module_tensors(captured.gm))

    # ---- CUDA graphs --------------------------------------------------------------------------------------------
    def _record(self, captured: Captured, args: tuple, leaves, fake_run: FakeRun | None = None) -> _Entry:
        """Warm up and check on the capture stream, then capture one run into a CUDA graph
        (:mod:`opweave.backends.cudagraph`)."""
        runtime = self.runtime
        caller = runtime.current_stream(self.device)
        static_inputs = runtime.launch(caller, pytree.tree_map, lambda x: _static_copy(x, self.device), args)
        side = self._capture_stream
        side.wait_stream(caller)
        try:
            with runtime.stream(side):
                entry = self._planned(captured, static_inputs, side, fake_run)
                for _ in range(self.warmup):
                    env = runtime.launch(side, captured.bind, static_inputs)
                    self._lanes.issue(entry.steps, side, captured, env)
                env = runtime.launch(side, captured.bind, static_inputs)
                checked_run(self._lanes, entry.steps, captured, env, side)
                del env
        except GraphCaptureError as exc:  # only the checked run raises it: nothing was captured yet
            if self.capture_fallback != "eager":
                raise
            warnings.warn(f"{exc}; running this input signature on streams without a CUDA graph", stacklevel=4)
            self.stats["eager_fallbacks"] += 1
            # Signatures keyed for graphs ignore strides, which can change what aliases what: keep every buffer.
            return _Entry(captured, {}, steps_with_releases(self.program, {}))
        finally:
            caller.wait_stream(side)
        entry.static_inputs = static_inputs
        entry.copies = InputCopies.plan(leaves, pytree.tree_leaves(static_inputs), self.device)
        entry.graph, entry.static_output = record(self._lanes, entry.steps, captured, static_inputs, side)
        self.stats["captures"] += 1
        log.debug("captured a CUDA graph on %s for a new input signature (%d captures, %d cached)", self.device,
                  self.stats["captures"], len(self._entries) + 1)
        return entry


# ---- helpers (no CUDA needed) ----------------------------------------------------------------------------------


def input_signature(args: tuple, cudagraphs: bool, device: torch.device) -> tuple[tuple, Any]:
    """The cache key of a call's arguments and their leaves (:func:`opweave.backends.cache.signature`): strides
    count without CUDA graphs (inputs are used in place), and with them the address of inputs used in place
    (parameters: the graph reads them where they are)."""
    if not cudagraphs:
        return signature(args, strides=True)
    return signature(args, by_address=lambda x: _in_place(x, device))


def on_device(captured: Captured, device: torch.device) -> Captured:
    """``captured`` itself when its parameters and buffers are on ``device``, else a copy moved there (the caller's
    model is left where it is), whose tensors are the ones every other capture of the same model moved there too
    (:func:`moved`): a model compiled for another device than its own holds one copy there, however many input
    signatures (each captured again) it meets."""
    tensors = module_tensors(captured.gm)
    if all(t.device == device for t in tensors):
        return captured
    gm = copy.deepcopy(captured.gm, {id(t): moved(t, device) for t in tensors})  # the module's tensors: these
    by_name = {n.name: n for n in gm.graph.nodes}
    return dataclasses.replace(captured, gm=gm, nodes={op: [by_name[n.name] for n in group]
                                                       for op, group in captured.nodes.items()})


_MOVED = SharedCopies()


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a parameter stays one, of its class), copied once while ``t`` stays as it is and while
    the copy is in use (:class:`~opweave.capture.runtime.SharedCopies`): every capture moved there shares it."""
    def move() -> torch.Tensor:
        there = t.detach().to(device)
        return _parameter(t, there) if isinstance(t, nn.Parameter) else there

    return _MOVED.get((device,), [t], move)


def _parameter(like: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """``data`` as a parameter of ``like``'s class (``nn.Parameter`` where that class takes other arguments)."""
    try:
        return type(like)(data, requires_grad=like.requires_grad)
    except TypeError:
        return nn.Parameter(data, requires_grad=like.requires_grad)


def _shapes(args) -> list:
    return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in pytree.tree_leaves(args)]


def _in_place(x: torch.Tensor, device: torch.device) -> bool:
    """An input whose address stays put between calls (a parameter), so a graph may read it without a copy."""
    return static_input(x) and x.device == device


def _static_copy(x, device: torch.device):
    if not isinstance(x, torch.Tensor) or _in_place(x, device):
        return x
    return torch.empty_like(x, device=device, memory_format=torch.contiguous_format).copy_(x)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x
