"""Inputs of another shape: a compiled model meets an input signature it was not built for.

A :class:`~opweave.pipeline.compiled.Compiled` is built for its example inputs' signature
(:func:`opweave.backends.cache.signature`: the pytree structure, each tensor's shape and dtype, each other value).
Devices and strides are left to the backends, which move inputs to their device and key what depends on strides
themselves (the CUDA backend's recordings, a compiled segment's graphs): CPU inputs of the example's shapes given to
a model compiled for CUDA, or the reverse, are the example's signature. A call with another signature is handled as
``torch.compile`` handles a recompilation, by the option ``dynamic``:

* ``None`` (the default) or ``True``: the model is built for those inputs through the one pipeline — captured again
  (a ``torch.export`` program's own dynamic dimensions are honoured, and a size it fixed is refused naming the
  input), scheduled, lowered, validated and run by the device's backend, with the same options — and kept in a
  least-recently-used cache of ``cache_size`` signatures besides the example's. Past that bound the least recently
  used is dropped (a warning, once) and built again if it comes back. Each new signature logs one line
  (``opweave.pipeline.signatures``, INFO). Concurrent first calls of one signature build it once; calls of a built
  signature do not wait for a build. Each size is captured and scheduled on its own: a dimension is not yet
  captured symbolically, so ``True`` behaves as ``None``.
* ``False``: a :class:`~opweave.errors.UsageError` naming the signature the model was built for.

The signature the model was built for is never dropped. A model built with ``dynamic=True`` whose one ONNX Runtime
session takes any batch (:func:`takes_any_batch`: checked at another batch) is keyed without its inputs' dimension
0: another batch size is the example's signature.

**Batches** (:class:`Batched`, a server's blocks): where dimension 0 of every input and output stacks independent
samples, a call of ``n`` samples runs at ``bucket(n)`` (the next power of two: rows of zeros added, their outputs
dropped), and a size not built yet is built in the background (:class:`Builder`, one thread for a process's
builds) while the call runs on the sizes built: padded up to the smallest larger one, else in pieces of the
largest, outputs joined. The variants are the model's :class:`Signatures`, so a size asked for by many calls at
once is built once.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.cache import BoundedCache, signature
from opweave.errors import UsageError, first_line

log = logging.getLogger(__name__)


def describe(key: tuple[Any, ...]) -> str:
    """A signature as a user reads it: ``(2, 3, 160, 160) float32, ...``."""
    parts = []
    for leaf in key[1:]:
        if leaf and leaf[0] == "value":
            parts.append(leaf[1])
        else:
            shape, dtype = leaf[:2]
            parts.append(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}")
    return ", ".join(parts) or "no inputs"


def key_of(args: tuple[Any, ...], *, any_batch: bool = False) -> tuple[Any, ...]:
    """The signature of ``args`` as this module keys it: :func:`~opweave.backends.cache.signature` without the
    tensors' devices (the backends move inputs to theirs); with ``any_batch``, without their dimension 0."""
    return signature(args, devices=False, batch=not any_batch)[0]


class Signatures:
    """The signatures a compiled model serves besides its example's (``example_key``: :func:`key_of` the example
    inputs): ``compile_for(args)`` makes the model for new inputs ``args`` (module docstring); at most ``bound``
    are kept; ``dynamic=False`` refuses them; ``any_batch``: keyed without dimension 0. ``stats``: ``builds`` and
    ``evictions``."""

    def __init__(self, name: str, example_key: tuple[Any, ...], compile_for: Callable[[tuple[Any, ...]], Any], *,
                 bound: int, dynamic: bool | None = None, arity: int | None = None, any_batch: bool = False):
        self.name, self.example_key, self.dynamic, self.bound = name, example_key, dynamic, bound
        self.arity = arity  # how many inputs the model takes: another count is the backend's error to raise
        self.any_batch = any_batch
        self._build = compile_for
        self._built: BoundedCache = BoundedCache(bound, self._evicted)
        self._pending: dict[tuple[Any, ...], Future[Any]] = {}
        self._lock = threading.Lock()
        self.stats = {"builds": 0, "evictions": 0}

    def keys(self) -> list[tuple[Any, ...]]:
        """The signatures built, the example's first."""
        with self._lock:
            return [self.example_key, *self._built]

    def key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The signature ``args`` are keyed by here."""
        return key_of(args, any_batch=self.any_batch)

    def built(self) -> dict[tuple[Any, ...], Any]:
        """The models built so far besides the example's, by signature (none is built by asking)."""
        with self._lock:
            return dict(self._built.items())

    def get(self, key: tuple[Any, ...]) -> Any:
        """The model built for signature ``key`` (the most recently used now), or None: none is built by asking."""
        with self._lock:
            return self._built.get(key)

    def for_inputs(self, args: tuple[Any, ...]) -> Any:
        """The compiled model for ``args`` when their signature is not the example's; None when it is (or when
        ``args`` are not as many as the model takes: the caller's backend says so)."""
        if self.arity is not None and len(args) != self.arity:
            return None
        key = self.key(args)
        if key == self.example_key:
            return None
        if self.dynamic is False:
            raise UsageError(f"{self.name}: inputs {describe(key)} differ from those it was compiled for "
                             f"({describe(self.example_key)}), and dynamic=False refuses new input signatures "
                             "(leave dynamic unset to build one per signature)")
        with self._lock:
            found = self._built.get(key)
            if found is not None:
                return found
            waiting = self._pending.get(key)
            if waiting is None:
                pending: Future[Any] = Future()
                self._pending[key] = pending
        if waiting is not None:
            return waiting.result()  # another thread builds it: wait for it (its error is raised here too)
        log.info("%s: building for a new input signature %s (%d built so far)", self.name, describe(key),
                 len(self._built) + 1)
        try:
            compiled = self._build(args)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._built[key] = compiled
            del self._pending[key]
            self.stats["builds"] += 1
        pending.set_result(compiled)
        return compiled

    def _evicted(self, key: tuple[Any, ...], compiled: Any) -> None:
        """Dropped, not closed: a call may still be running it (what it holds goes when the last caller lets go)."""
        self.stats["evictions"] += 1
        if self.stats["evictions"] == 1:
            warnings.warn(f"{self.name}: more than cache_size={self.bound} input signatures besides the one it was "
                          f"compiled for; the least recently used ({describe(key)}) is dropped and built again if it "
                          "comes back (a larger cache_size keeps more; dynamic=False refuses new signatures)",
                          stacklevel=4)



def attach(compiled: Any, name: str, example: tuple[Any, ...], compile_for: Callable[[tuple[Any, ...]], Any], *,
           bound: int, dynamic: bool | None = None) -> Any:
    """``compiled`` (built for ``example``), which from now on builds itself for inputs of another signature with
    ``compile_for`` (:class:`Signatures`: at most ``bound`` kept, refused with ``dynamic=False``, keyed without
    dimension 0 where it takes any batch)."""
    any_batch = compiled.any_batch
    compiled.variants = Signatures(name, key_of(example, any_batch=any_batch), compile_for, bound=bound,
                                   dynamic=dynamic, arity=len(example), any_batch=any_batch)
    return compiled


def takes_any_batch(compiled: Any, captured: Any, inputs: tuple[Any, ...], tolerance: float = 1e-4) -> bool:
    """Whether ``compiled`` (built for ``inputs`` with a free batch dimension) answers at another batch as the
    captured model does: one more row of every input (random values where floating point), compared within
    ``tolerance`` (:func:`opweave.outputs.compare`). A graph that baked its batch in answers wrongly, or fails."""
    from opweave.outputs import compare

    probe = tuple(_grown(x) for x in inputs)
    try:
        with torch.no_grad():
            return compare(captured.gm(*probe), compiled(*probe), tolerance=tolerance).ok
    except Exception as exc:  # noqa: BLE001 - an export that took its batch as fixed fails at another one
        log.info("%s: no session for every batch (%s)", captured.graph.name, first_line(exc))
        return False


def _grown(x: Any) -> Any:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    grown = torch.cat([x, x[:1]])
    return torch.randn_like(grown) if grown.is_floating_point() else grown


def bucket(batch: int) -> int:
    """The batch a variant built per batch size is built for: the next power of two (a max batch of 16 needs at
    most 5 variants)."""
    return 1 << (batch - 1).bit_length()


def rows(args: Any) -> int:
    """The size of dimension 0 of the first tensor among ``args`` (1 when none has one)."""
    return next((x.shape[0] for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor) and x.dim() > 0), 1)


def padded(args: tuple[Any, ...], extra: int) -> tuple[Any, ...]:
    """``args`` with ``extra`` rows of zeros after their own, in dimension 0 of every tensor."""
    return tuple(torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) if isinstance(x, torch.Tensor) else x
                 for x in args)


def first_rows(out: Any, n: int) -> Any:
    """``out``'s tensors cut to their first ``n`` rows (a padded batch's own)."""
    return pytree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) else t, out)


class Builder:
    """Builds off the callers' threads: one daemon thread, jobs in the order asked, each on one intra-op thread (the
    cores stay with the calls: :mod:`opweave.backends.threads` says why a worker's OpenMP team stays at one). A job
    asked for while it is queued or running is not queued again. ``failed``: one line per job that raised (the
    calls that asked for it ran on what was built)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._jobs: deque[tuple[Hashable, Callable[[], Any], str]] = deque()
        self.pending: set[Hashable] = set()
        self.failed: list[str] = []
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, job: Callable[[], Any], name: str = "") -> bool:
        """Queue ``job`` under ``key``; False if a job of that key is queued or running already."""
        with self._lock:
            if key in self.pending:
                return False
            self.pending.add(key)
            self._jobs.append((key, job, name))
            if self._thread is None:
                from opweave.cores import intra_op_threads

                ready = threading.Event()
                with intra_op_threads():  # its one thread sets the process-wide default too: put it back
                    self._thread = threading.Thread(target=self._work, args=(ready,), name="opweave-builder",
                                                    daemon=True)
                    self._thread.start()
                    ready.wait()
            self._lock.notify_all()
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no job is queued or running (False if ``timeout_s`` passed first)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self.pending, timeout_s)

    def _work(self, ready: threading.Event) -> None:
        from opweave.backends.threads import enter_budget

        enter_budget(1)  # an OpenMP team of one: a worker's larger team slows every kernel of the process
        ready.set()
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._jobs))
                key, job, name = self._jobs.popleft()
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - the calls keep running on what was built
                self.failed.append(f"{name or key}: {first_line(exc)}")
            finally:
                with self._lock:
                    self.pending.discard(key)
                    self._lock.notify_all()


class Batched:
    """``compiled`` called with a batch of any size in dimension 0 (module docstring, Batches): at its own batch,
    at any (``compiled.any_batch``), or at ``bucket(n)`` through its :class:`Signatures` (``compiled.variants``),
    built in the background by ``builder`` (None: built at once) while the call runs on the sizes built. ``close()``
    stops further builds (its model was dropped)."""

    def __init__(self, compiled: Any, *, bucket: Callable[[int], int] = bucket, builder: Builder | None = None,
                 name: str = ""):
        self.compiled, self.bucket, self.builder = compiled, bucket, builder
        self.name = name or compiled.graph.name
        self.closed = False

    def __call__(self, *args: Any) -> Any:
        if self.compiled.any_batch:
            return self.compiled(*args)
        n = rows(args)
        size = self.bucket(n)
        want = padded(args, size - n) if size > n else args
        variants = self.compiled.variants
        key = variants.key(want)
        fn = self.compiled if key == variants.example_key else variants.get(key)
        if fn is None and self.builder is not None:
            self.builder.submit((id(variants), key), lambda: None if self.closed else variants.for_inputs(want),
                                f"{self.name} x{size}")
            return on_sizes(self.sizes(), args)
        if fn is None:
            fn = variants.for_inputs(want)
        return first_rows(fn(*want), n) if size > n else fn(*want)

    def sizes(self) -> dict[int, Any]:
        """The batch sizes built, each its model: the example's and its variants'."""
        built = {rows_of(key): fn for key, fn in self.compiled.variants.built().items()}
        return {**built, rows_of(self.compiled.variants.example_key): self.compiled}

    def warm(self, examples: list[tuple[Any, ...]]) -> None:
        """Build now what calls with these inputs (each at a size :attr:`bucket` keeps) will run on."""
        variants = self.compiled.variants
        for args in examples:
            if not self.compiled.any_batch and variants.key(args) != variants.example_key:
                variants.for_inputs(args)

    def close(self) -> None:
        """Build nothing more for it (what is queued is skipped)."""
        self.closed = True


def on_sizes(built: dict[int, Callable[..., Any]], args: tuple[Any, ...]) -> Any:
    """``args``' samples through models built per batch size (``built``: size -> model): the smallest that takes
    them all, padded with rows of zeros, else pieces of the largest, outputs joined; the padding's outputs dropped."""
    n = rows(args)
    larger = [b for b in built if b >= n]
    if larger:
        size = min(larger)
        return first_rows(built[size](*padded(args, size - n)), n) if size > n else built[size](*args)
    size, pieces = max(built), []
    for first in range(0, n, size):
        chunk = tuple(x[first:first + size] if isinstance(x, torch.Tensor) else x for x in args)
        count = rows(chunk)
        pieces.append(first_rows(built[size](*(padded(chunk, size - count) if count < size else chunk)), count))
    flat = [pytree.tree_flatten(piece) for piece in pieces]
    joined = [torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0]
              for column in zip(*(leaves for leaves, _ in flat), strict=True)]
    return pytree.tree_unflatten(joined, flat[0][1])


def rows_of(key: tuple[Any, ...]) -> int:
    """The size of dimension 0 of the first tensor a signature (:func:`key_of`) names (1 when none has one)."""
    return next((leaf[0][0] for leaf in key[1:] if leaf and leaf[0] != "value" and len(leaf[0])), 1)


__all__ = ["Batched", "Builder", "Signatures", "attach", "bucket", "describe", "first_rows", "key_of", "on_sizes",
           "padded", "rows", "takes_any_batch"]
