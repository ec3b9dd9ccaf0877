"""A fake CUDA runtime on the CPU: the CUDA backend's logic run for real, against a stand-in for the device.

:class:`FakeCuda` meets :class:`opweave.backends.runtime.Runtime`; pass it as ``runtime=`` to
:class:`~opweave.backends.cuda.CudaBackend` (or :class:`~opweave.serve.engine.cuda.CudaExecutor`) and the backend
runs on a machine without a GPU, streams, events, CUDA graphs and all, as ``torch.distributed``'s fake process group
runs collective code without a network. It exists to find ordering bugs: what a GPU may run in any order, the fake
runs in a random order.

**Device memory** is CPU tensors on the fake's device (the CPU). **Work is asynchronous as on a GPU.** Every ATen op
that host code issues inside :meth:`FakeCuda.launch` (the backend's ops, input copies, output clones) is split, as
CUDA splits it, into what the host sees at once and a kernel: the outputs are allocated when the op is issued (their
shapes, strides and aliasing from the op's meta kernel; views and aliases are made on the spot, as they move no
data) and filled with garbage (NaN for floating point: every byte ``0xFF``), and the kernel that computes the values
into those very tensors is queued on the launching stream. ``Event.record`` and ``Stream.wait_event`` queue markers;
a wait holds its stream until the record it pairs with (the latest one of its event issued before it) has run.

**Nothing runs until something must observe it**: ``synchronize``, ``Stream.synchronize``, ``Event.synchronize``,
and, issued inside a launch, the ops that synchronize on CUDA: ``.item()`` and every op whose meta kernel cannot say
its output (a data-dependent one: ``nonzero``, boolean masks, Python control flow on a value), and host reads that
are no ATen op (``tolist``, ``numpy``, printing); these first run their stream's queue. Queued work then runs in a
**seeded random interleaving** that respects only each stream's FIFO order and the waits: each drain gives the
streams random priorities and always runs the ready stream with the highest one; half the drains reshuffle the
priorities now and then (long runs of one stream, a few switches), the other half before every item (a stream
picked at random each time). The seed is ``seed=`` or else ``$OPWEAVE_FAKECUDA_SEED`` or else a fresh random one;
``FakeCuda.seed`` says which, so a failing order can be replayed.

**Freeing** (:meth:`FakeCuda.dropped`, which the backend calls at each liveness release) is modelled as CUDA's
caching allocator behaves: the block goes back to the pool of the stream that allocated it, whose *later* work may
reuse it at once without waiting for other streams. The fake queues a kernel that fills the block with garbage on
its allocating stream at that point, so a reader on another stream that is not ordered before the release may
read garbage. Memory statistics count the bytes of the live blocks the fake allocated, as CUDA's allocator counts
its allocated blocks: a block is live from the op that allocated it until it is dropped or the host holds no tensor
on it any more (queued kernels and captured graphs keep only aliases of their tensors, which do not count, as
CUDA's queues hold no references). ``compute=False`` runs no kernel at all (every output stays garbage, and no block
is filled): the host's side and the memory statistics are the same, for measuring memory where the CPU's kernels
would take too long (half precision, large batches).

**CUDA graphs.** Between ``capture_begin`` and ``capture_end`` the capturing stream, and every stream that waits
on an event recorded in the capture, queue into the graph instead of running; ``capture_end`` refuses a capture
with a stream not joined back (``capturing stream has unjoined work``) or one invalidated by a sync. ``replay``
queues the whole graph on the current stream; when it runs, its kernels run again in a new random interleaving of
its streams, into the same tensors (a graph's buffers have fixed addresses: its static inputs and outputs are the
tensors of the capture). A synchronizing op, or ``synchronize``, while this thread captures raises ``operation not
permitted when stream is capturing`` and invalidates the capture; in sync-debug mode ``"error"`` a synchronizing op
raises ``called a synchronizing CUDA operation`` (``"warn"`` warns).

**Streams**: the default stream (handle 0) and, per priority, a pool of 32 handed out round robin by ``Stream()``
as PyTorch's pool is, so two users may get the same stream. The current stream is per thread.

**Not modelled**: timing (kernels take no time: ``torch.cuda._sleep`` has no counterpart, events have no
``elapsed_time``, and the profiler sees nothing); the host/device distinction (the fake's device is the CPU, so
moving a tensor there or back, ``.cpu()`` included, is no copy and no sync, pinned memory means nothing, and host
code that reads device tensors *outside* a launch reads them as they are now, with no implicit synchronization: call
``synchronize`` first); blocks freed other than through :meth:`FakeCuda.dropped` (a tensor the host simply lets go
of, such as an op's temporary, is counted as free but not reused early); ops without a meta kernel (taken for
synchronizing ops) and ops whose output the meta kernel gets wrong; in-place ops that change a tensor's metadata
(``resize_``, ``t_``, ``as_strided_``), whose new shape the host's tensor never sees (the kernel changes its
alias); where a failing kernel's error surfaces (at the drain that runs it, as an asynchronous CUDA error does, but
not as a device-side assert); several devices (one fake device); Inductor compiling a segment on its first run
inside a launch (the fake's interception sees Inductor's own tracing on fake tensors, the compile fails, and the
segment runs op by op, with a warning).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from opweave.backends.streams import TORCH_POOL

__all__ = ["SEED_ENV", "FakeCuda", "FakeEvent", "FakeGraph", "FakeStream"]

SEED_ENV = "OPWEAVE_FAKECUDA_SEED"
RESHUFFLES = (0.125, 1.0)  # chance, per queued item run, that a drain draws new stream priorities: one per drain
POISON = 0xFF  # the byte a fresh or reused block holds: NaN in every floating-point format, -1 in integers

_aten = torch.ops.aten
_VIEWS = {_aten._unsafe_view.default}  # aliases its input without saying so in its schema
_UNINITIALIZED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                  _aten.new_empty.default, _aten.new_empty_strided.default}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__repr__}
_META = torch.device("meta")
_CAPTURING = "CUDA error: operation not permitted when stream is capturing"


def default_seed() -> int:
    """``$OPWEAVE_FAKECUDA_SEED`` when set, else a fresh random seed."""
    value = os.environ.get(SEED_ENV, "").strip()
    return int(value) if value else random.SystemRandom().randrange(2**32)


# ---- what a stream's queue holds -------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Kernel:
    run: Callable[[], None]
    name: str


@dataclass(eq=False)
class _Record:
    event: FakeEvent
    seq: int


@dataclass(eq=False)
class _Wait:
    event: FakeEvent
    seq: int


@dataclass(eq=False)
class _GraphLaunch:
    graph: FakeGraph


class _Done:
    """The record numbers of one event that have run (all up to ``upto``, and ``extra``)."""

    __slots__ = ("upto", "extra")

    def __init__(self) -> None:
        self.upto: int = 0
        self.extra: set[int] = set()

    def add(self, seq: int) -> None:
        self.extra.add(seq)
        while self.upto + 1 in self.extra:
            self.upto += 1
            self.extra.remove(self.upto)

    def __contains__(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.extra


@dataclass(eq=False)
class _Lane:
    """One fake CUDA stream: its handle, its queue and the capture it is part of (None: not capturing)."""

    handle: int
    priority: int
    queue: deque = field(default_factory=deque)
    capture: _Capture | None = None
    stream: FakeStream | None = None


def _stream(lane: _Lane) -> FakeStream:
    """The stream a lane stands for (set as soon as the lane is made)."""
    assert lane.stream is not None
    return lane.stream


@dataclass(eq=False)
class _Capture:
    origin: _Lane
    mode: str
    thread: int
    items: dict[_Lane, list] = field(default_factory=dict)
    invalid: str | None = None


@dataclass(eq=False)
class _Block:
    lane: _Lane
    nbytes: int
    ptr: int
    dropped: bool = False
    holders: int = 0  # host tensors on the block (queued work holds aliases only)
    free: bool = False  # counted as freed: dropped, or no host tensor left


# ---- the user-facing objects -----------------------------------------------------------------------------------------


class FakeStream:
    """A fake CUDA stream (``torch.cuda.Stream``'s methods); equal to another when it is the same stream."""

    def __init__(self, fake: FakeCuda, lane: _Lane):
        self._fake, self._lane = fake, lane

    @property
    def cuda_stream(self) -> int:
        return self._lane.handle

    @property
    def priority(self) -> int:
        return self._lane.priority

    @property
    def device(self) -> torch.device:
        return self._fake.device

    def wait_event(self, event: FakeEvent) -> None:
        self._fake._wait(self._lane, event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent(self._fake)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._fake._synchronize_lane(self._lane)

    def query(self) -> bool:
        return not self._lane.queue

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other._lane is self._lane

    def __hash__(self) -> int:
        return hash(self._lane.handle)

    def __repr__(self) -> str:
        return f"<FakeStream {self._lane.handle:#x}>"


class FakeEvent:
    """A fake CUDA event: each ``record`` is numbered; a wait pairs with the latest record issued before it."""

    def __init__(self, fake: FakeCuda):
        self._fake = fake
        self.issued = 0
        self.done = _Done()
        self.captured_in: _Capture | None = None  # the capture its latest record was issued into

    def record(self, stream: FakeStream | None = None) -> None:
        self._fake._record(self, (stream or self._fake.current_stream())._lane)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self._fake.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.issued in self.done or self.issued == 0

    def synchronize(self) -> None:
        self._fake._synchronize_event(self)


class FakeGraph:
    """A fake ``torch.cuda.CUDAGraph``: ``capture_begin``/``capture_end`` record, ``replay`` queues a rerun."""

    def __init__(self, fake: FakeCuda):
        self._fake = fake
        self._capture: _Capture | None = None
        self.lanes: dict[_Lane, list] | None = None  # what each stream of the capture runs, once captured

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self._fake._capture_begin(self, capture_error_mode)

    def capture_end(self) -> None:
        self._fake._capture_end(self)

    def replay(self) -> None:
        self._fake._replay(self)

    def reset(self) -> None:
        self.lanes = None


class _Issue(TorchDispatchMode):
    """Inside :meth:`FakeCuda.launch`: every ATen op becomes outputs now and a kernel on ``lane`` later."""

    def __init__(self, fake: FakeCuda, lane: _Lane):
        super().__init__()
        self.fake, self.lane = fake, lane

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.fake._issue(self.lane, func, args, kwargs or {})


class _HostReads(TorchFunctionMode):
    """Inside :meth:`FakeCuda.launch`: reading a tensor's values on the host without an ATen op (``tolist``,
    ``numpy``, printing) synchronizes, as the copy to the host does on CUDA."""

    def __init__(self, fake: FakeCuda, lane: _Lane):
        super().__init__()
        self.fake, self.lane = fake, lane

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and not self.fake._executing:
            self.fake._sync_point(self.lane, f"Tensor.{func.__name__} reads the device")
        return func(*args, **(kwargs or {}))


# ---- the runtime -----------------------------------------------------------------------------------------------------


class FakeCuda:
    """A fake CUDA runtime (see the module docstring); ``seed`` fixes the interleavings; ``compute=False`` runs no
    kernel (memory statistics only)."""

    name = "fake"
    device = torch.device("cpu")  # device memory is CPU tensors

    def __init__(self, seed: int | None = None, *, compute: bool = True):
        self.seed = default_seed() if seed is None else seed
        self.compute = compute
        self._rng = random.Random(self.seed)
        self.pools: dict[int, Any] = {}
        self.pools_lock = threading.Lock()
        self.stats = {"kernels": 0, "replays": 0, "syncs": 0}
        self._lock = threading.RLock()
        self._local = threading.local()
        self._default = self._new_lane(0, 0)
        self._slots: dict[tuple[int, int], _Lane] = {}
        self._handed_out: dict[int, int] = {}
        self._captures: list[_Capture] = []
        self._executing = False
        self._sync_debug = 0
        self._blocks: dict[int, _Block] = {}
        self._allocated = self._peak = 0

    def __repr__(self) -> str:
        return f"FakeCuda(seed={self.seed})" if self.compute else f"FakeCuda(seed={self.seed}, compute=False)"

    # ---- devices, streams, events, graphs ----
    def is_available(self) -> bool:
        return True

    def device_name(self) -> str:
        return "fake CUDA device (CPU)"

    def Stream(self, device=None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        """The next stream of the pool of ``priority``, round robin over :data:`TORCH_POOL` as PyTorch's."""
        with self._lock:
            count = self._handed_out.get(priority, 0)
            self._handed_out[priority] = count + 1
            key = (priority, count % TORCH_POOL)
            if key not in self._slots:
                self._slots[key] = self._new_lane(0x1000 * (1 + abs(priority)) + 0x10 * (key[1] + 1), priority)
            return _stream(self._slots[key])

    def Event(self) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802
        return FakeGraph(self)

    def default_stream(self, device=None) -> FakeStream:
        return _stream(self._default)

    def current_stream(self, device=None) -> FakeStream:
        return getattr(self._local, "stream", None) or _stream(self._default)

    def set_stream(self, stream: FakeStream) -> None:
        self._local.stream = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None):
        if stream is None:
            yield
            return
        previous = self.current_stream()
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(previous)

    def synchronize(self, device=None) -> None:
        """Run everything queued (refused while this thread captures)."""
        with self._lock:
            self._refuse_while_capturing("synchronize")
            self._drain(None)

    # ---- issuing work ----
    def launch(self, stream: FakeStream, fn: Callable, *args) -> Any:
        """``fn(*args)`` now, its ATen ops queued on ``stream`` as kernels (module docstring)."""
        with self._lock:
            if stream != self.current_stream():
                raise RuntimeError(f"fake CUDA: work launched on {stream!r} while {self.current_stream()!r} is "
                                   "current (PyTorch would issue it on the current stream)")
            with _Issue(self, stream._lane), _HostReads(self, stream._lane):
                return fn(*args)

    def dropped(self, values) -> None:
        """The host dropped ``values``: each block the fake allocated among them goes back to its allocating
        stream, whose later work may overwrite it (a garbage fill is queued there)."""
        with self._lock:
            for t in pytree.tree_leaves(values):
                if not isinstance(t, torch.Tensor):
                    continue
                storage: Any = t.untyped_storage()  # fill_ is there, not in its stub
                block = self._blocks.get(storage.data_ptr())
                if block is None or block.dropped:
                    continue
                block.dropped = True
                self._free(block)
                self._enqueue(block.lane, _Kernel(functools.partial(storage.fill_, POISON), "reuse of a freed block"))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        """Nothing: blocks are only reused where :meth:`dropped` says so."""

    def to_device(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        return x.to(device)

    # ---- capture ----
    def graph_pool_handle(self) -> object:
        return object()

    def give_back_pool(self, pool, device) -> None:
        """Nothing to give back: a fake capture holds no pool."""

    def get_sync_debug_mode(self) -> int:
        return self._sync_debug

    def set_sync_debug_mode(self, mode: int | str) -> None:
        levels = {"default": 0, "warn": 1, "error": 2}
        self._sync_debug = levels[mode] if isinstance(mode, str) else int(mode)

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream()._lane.capture is not None

    # ---- memory statistics ----
    def memory_allocated(self, device=None) -> int:
        return self._allocated

    def max_memory_allocated(self, device=None) -> int:
        return self._peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self._peak = self._allocated

    # ---- internals: lanes and queues ----
    def _new_lane(self, handle: int, priority: int) -> _Lane:
        lane = _Lane(handle, priority)
        lane.stream = FakeStream(self, lane)
        return lane

    def _lanes(self) -> list[_Lane]:
        return [self._default, *self._slots.values()]

    def _enqueue(self, lane: _Lane, item) -> None:
        if lane.capture is None:
            lane.queue.append(item)
        else:
            lane.capture.items.setdefault(lane, []).append(item)

    def _record(self, event: FakeEvent, lane: _Lane) -> None:
        with self._lock:
            event.issued += 1
            event.captured_in = lane.capture
            self._enqueue(lane, _Record(event, event.issued))

    def _wait(self, lane: _Lane, event: FakeEvent) -> None:
        with self._lock:
            if event.issued == 0:
                return  # CUDA: waiting for an event never recorded waits for nothing
            source = event.captured_in
            if source is not None and source not in self._captures:
                raise RuntimeError("CUDA error: operation not permitted on an event last recorded in a capturing "
                                   "stream (the capture has ended)")
            if source is None and lane.capture is not None:
                lane.capture.invalid = "a wait for an event recorded outside the capture"
                raise RuntimeError(f"{_CAPTURING} (a wait for an event recorded outside the capture)")
            if source is not None and lane.capture is None:  # the stream joins the capture, as CUDA's do
                lane.capture = source
                source.items.setdefault(lane, [])
            elif source is not None and lane.capture is not source:
                raise RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking "
                                   "stream (a wait across two captures)")
            self._enqueue(lane, _Wait(event, event.issued))

    # ---- internals: issuing ATen ops ----
    def _issue(self, lane: _Lane, func, args: tuple, kwargs: dict):
        if self._executing:
            return func(*args, **kwargs)  # a kernel running
        if func.is_view or func in _VIEWS:  # an op that moves no data: the host holds one more tensor on a block
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._hold(t, self._blocks.get(t.untyped_storage().data_ptr()))
            return out
        try:
            meta = func(*_to_meta(args), **_to_meta(kwargs))
        except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent output: a synchronizing op
            return self._synchronizing(lane, func, args, kwargs)
        leaves = [x for x in pytree.tree_leaves(meta) if x is not None]
        if not any(isinstance(x, torch.Tensor) for x in leaves) and leaves:
            return func(*args, **kwargs)  # metadata alone (a size, say): the meta kernel needed no data either
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            return self._synchronizing(lane, func, args, kwargs)
        schema = func._schema
        if schema.is_mutable:
            named = _named_arguments(schema, args, kwargs)
            metas = meta if len(schema.returns) > 1 else (meta,)
            outs, fresh = [], []
            for ret, m in zip(schema.returns, metas, strict=False):
                alias = ret.alias_info
                if alias is not None:  # the mutated argument itself
                    source = next(a for a in schema.arguments
                                  if a.alias_info is not None and a.alias_info.before_set == alias.before_set)
                    outs.append(named[source.name])
                else:
                    outs.append(self._allocate(lane, m))
                    fresh.append(len(outs) - 1)
            out = None if not schema.returns else outs[0] if len(schema.returns) == 1 else tuple(outs)
            targets = {i: _handles(outs[i]) for i in fresh}
            args, kwargs = _aliases((args, kwargs))

            def kernel():
                result = func(*args, **kwargs)
                results = result if len(schema.returns) > 1 else (result,)
                for i, handles in targets.items():
                    _copy_into(handles, results[i], func)
        else:
            out = pytree.tree_map_only(torch.Tensor, lambda m: self._allocate(lane, m), meta)
            if func in _UNINITIALIZED:
                return out
            handles = _handles(out)
            args, kwargs = _aliases((args, kwargs))

            def kernel():
                _copy_into(handles, func(*args, **kwargs), func)

        self._enqueue(lane, _Kernel(kernel, str(func)))
        return out

    def _allocate(self, lane: _Lane, meta) -> Any:
        if not isinstance(meta, torch.Tensor):
            return pytree.tree_map_only(torch.Tensor, lambda m: self._allocate(lane, m), meta)
        t = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=self.device)
        storage: Any = t.untyped_storage()  # fill_ is there, not in its stub
        nbytes = storage.nbytes()
        if nbytes:
            if self.compute:
                storage.fill_(POISON)
            block = _Block(lane, nbytes, storage.data_ptr())
            self._blocks[block.ptr] = block
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)
            weakref.finalize(storage, self._freed, block)
            self._hold(t, block)
        return t

    def _hold(self, t: torch.Tensor, block: _Block | None) -> None:
        """The host holds ``t``, a tensor on ``block``: the block stays live (unless dropped) while it does."""
        if block is not None and not block.free:
            block.holders += 1
            weakref.finalize(t, self._let_go, block)

    def _let_go(self, block: _Block) -> None:
        with self._lock:
            block.holders -= 1
            if not block.holders:
                self._free(block)

    def _free(self, block: _Block) -> None:
        if not block.free:
            block.free = True
            self._allocated -= block.nbytes

    def _freed(self, block: _Block) -> None:
        with self._lock:
            if self._blocks.get(block.ptr) is block:
                del self._blocks[block.ptr]
            self._free(block)

    def _synchronizing(self, lane: _Lane, func, args: tuple, kwargs: dict):
        """An op whose result the host needs now: its stream's queue runs first (module docstring)."""
        self._sync_point(lane, f"{func} synchronizes")
        return func(*args, **kwargs)

    def _sync_point(self, lane: _Lane, what: str) -> None:
        """The host waits for ``lane``'s work here: refused while capturing, checked in sync-debug mode, and the
        lane's queue (with whatever it waits for) run."""
        self._refuse_while_capturing(what)
        if self._sync_debug == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")
        if self._sync_debug == 1:
            warnings.warn(f"called a synchronizing CUDA operation ({what})", stacklevel=3)
        self.stats["syncs"] += 1
        self._drain(lambda: not lane.queue)

    def _refuse_while_capturing(self, what: str) -> None:
        me = threading.get_ident()
        active = [c for c in self._captures if c.mode == "global" or (c.mode == "thread_local" and c.thread == me)]
        if active:
            for capture in active:
                capture.invalid = what
            raise RuntimeError(f"{_CAPTURING} ({what})")

    # ---- internals: capture ----
    def _capture_begin(self, graph: FakeGraph, mode: str) -> None:
        with self._lock:
            lane = self.current_stream()._lane
            if lane is self._default:
                raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
            if lane.capture is not None:
                raise RuntimeError(f"{_CAPTURING} (capture_begin on a stream already capturing)")
            capture = _Capture(lane, mode, threading.get_ident(), {lane: []})
            lane.capture = graph._capture = capture
            self._captures.append(capture)

    def _capture_end(self, graph: FakeGraph) -> None:
        with self._lock:
            capture, graph._capture = graph._capture, None
            if capture is None:
                raise RuntimeError("capture_end without capture_begin")
            self._captures.remove(capture)
            for lane in capture.items:
                lane.capture = None
            if capture.invalid is not None:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture "
                                   f"({capture.invalid})")
            waited = {(i.event, i.seq) for items in capture.items.values() for i in items if isinstance(i, _Wait)}
            for lane, items in capture.items.items():
                last = items[-1] if items else None
                if lane is not capture.origin and last is not None and not (
                        isinstance(last, _Record) and (last.event, last.seq) in waited):
                    raise RuntimeError(f"CUDA error: capturing stream has unjoined work (stream {lane.handle:#x})")
            graph.lanes = {lane: list(items) for lane, items in capture.items.items() if items}

    def _replay(self, graph: FakeGraph) -> None:
        if graph.lanes is None:
            raise RuntimeError("replay of a CUDA graph that was not captured")
        with self._lock:
            self._enqueue(self.current_stream()._lane, _GraphLaunch(graph))

    # ---- internals: running the queues ----
    def _synchronize_lane(self, lane: _Lane) -> None:
        with self._lock:
            if lane.capture is not None:
                raise RuntimeError(f"{_CAPTURING} (synchronizing a capturing stream)")
            self._drain(lambda: not lane.queue)

    def _synchronize_event(self, event: FakeEvent) -> None:
        with self._lock:
            if event.captured_in is not None:
                raise RuntimeError(f"{_CAPTURING} (synchronizing an event recorded in a capture)")
            self._drain(event.query)

    def _drain(self, until: Callable[[], bool] | None) -> None:
        queues = {lane: lane.queue for lane in self._lanes() if lane.queue}
        self._run(queues, None, until)

    def _run(self, queues: dict[_Lane, deque], done: dict | None, until: Callable[[], bool] | None) -> None:
        """Run ``queues`` in a random interleaving until ``until()`` holds or all are empty; ``done``: the record
        numbers that have run by event, for a graph's own events (None: the events' own)."""
        priority: dict[_Lane, float] = {}
        reshuffle = self._rng.choice(RESHUFFLES)
        while until is None or not until():
            ready = [lane for lane, q in queues.items() if q and self._ready(q[0], done)]
            if not ready:
                stuck = [lane for lane, q in queues.items() if q]
                if stuck:
                    raise RuntimeError(f"fake CUDA: streams {[hex(lane.handle) for lane in stuck]} wait for events "
                                       "that no queued work records")
                return
            if self._rng.random() < reshuffle:
                priority.clear()
            for lane in ready:
                if lane not in priority:
                    priority[lane] = self._rng.random()
            lane = max(ready, key=priority.__getitem__)
            self._execute(queues[lane].popleft(), lane, done)

    @staticmethod
    def _ready(item, done: dict | None) -> bool:
        if not isinstance(item, _Wait):
            return True
        seen = item.event.done if done is None else done.get(item.event)
        return seen is not None and item.seq in seen

    def _execute(self, item, lane: _Lane, done: dict | None) -> None:
        if isinstance(item, _Record):
            (item.event.done if done is None else done.setdefault(item.event, _Done())).add(item.seq)
        elif isinstance(item, _Kernel):
            self.stats["kernels"] += 1
            if not self.compute:
                return
            executing, self._executing = self._executing, True
            try:
                with torch.inference_mode():
                    item.run()
            except Exception as exc:
                raise RuntimeError(f"fake CUDA: kernel {item.name} on stream {lane.handle:#x} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
            finally:
                self._executing = executing
        elif isinstance(item, _GraphLaunch):
            self.stats["replays"] += 1
            lanes = item.graph.lanes
            assert lanes is not None  # replayed: captured
            self._run({lane: deque(items) for lane, items in lanes.items()}, {}, None)


def _to_meta(value):
    def meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
        return _META if isinstance(x, torch.device) else x

    return pytree.tree_map(meta, value)


def _named_arguments(schema, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = dict(kwargs)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for argument, value in zip(positional, args, strict=False):
        named[argument.name] = value
    return named


def _aliases(value):
    """``value`` with each tensor replaced by an alias of it (same storage, sizes and strides) that a queued kernel
    holds instead of the host's tensor, so that the host letting go of a tensor is seen (memory statistics)."""
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def _handles(out) -> list:
    """Per leaf of an op's ``out``: what its kernel writes through, an alias and a weak reference to the host's
    tensor (None for a leaf that is no tensor)."""
    return [(o.detach(), weakref.ref(o)) if isinstance(o, torch.Tensor) else None for o in pytree.tree_leaves(out)]


def _copy_into(handles: list, result, func) -> None:
    """Write a kernel's ``result`` into the outputs allocated when it was issued (``handles``, :func:`_handles`). A
    CPU kernel may return an empty auxiliary output where the meta kernel sizes it (BatchNorm's saved statistics in
    inference, which CUDA's kernel fills): that output is resized to what the kernel computed, the host's tensor
    too while the host holds it."""
    for handle, r in zip(handles, pytree.tree_leaves(result), strict=True):
        if handle is None:
            continue
        o, host = handle
        if o.shape != r.shape and r.numel() == 0:
            o.resize_(r.shape)
            if (held := host()) is not None:
                held.resize_(r.shape)
        elif o.shape != r.shape:
            raise RuntimeError(f"{func} computed shape {tuple(r.shape)} where its meta kernel said "
                               f"{tuple(o.shape)}")
        o.copy_(r)
