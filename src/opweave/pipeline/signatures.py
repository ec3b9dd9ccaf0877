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

The signature the model was built for is never dropped.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from opweave.backends.cache import BoundedCache, signature
from opweave.errors import UsageError

log = logging.getLogger(__name__)


def describe(key: tuple) -> str:
    """A signature as a user reads it: ``(2, 3, 160, 160) float32, ...``."""
    parts = []
    for leaf in key[1:]:
        if leaf and leaf[0] == "value":
            parts.append(leaf[1])
        else:
            shape, dtype = leaf[:2]
            parts.append(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}")
    return ", ".join(parts) or "no inputs"


def key_of(args: tuple) -> tuple:
    """The signature of ``args`` as this module keys it: :func:`~opweave.backends.cache.signature` without the
    tensors' devices (the backends move inputs to theirs)."""
    return signature(args, devices=False)[0]


class Signatures:
    """The signatures a compiled model serves besides its example's (``example_key``: :func:`key_of` the example
    inputs): ``build(args)`` makes the model for new inputs ``args`` (module docstring); at most ``bound`` are
    kept; ``dynamic=False`` refuses them. ``stats``:
    ``builds`` and ``evictions``."""

    def __init__(self, name: str, example_key: tuple, build: Callable[[tuple], Any], *, bound: int,
                 dynamic: bool | None = None, arity: int | None = None):
        self.name, self.example_key, self.dynamic, self.bound = name, example_key, dynamic, bound
        self.arity = arity  # how many inputs the model takes: another count is the backend's error to raise
        self._build = build
        self._built: BoundedCache = BoundedCache(bound, self._evicted)
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.stats = {"builds": 0, "evictions": 0}

    def keys(self) -> list[tuple]:
        """The signatures built, the example's first."""
        with self._lock:
            return [self.example_key, *self._built]

    def for_inputs(self, args: tuple):
        """The compiled model for ``args`` when their signature is not the example's; None when it is (or when
        ``args`` are not as many as the model takes: the caller's backend says so)."""
        if self.arity is not None and len(args) != self.arity:
            return None
        key = key_of(args)
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
            pending = self._pending.get(key)
            mine = pending is None
            if mine:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result()  # another thread builds it: wait for it (its error is raised here too)
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

    def _evicted(self, key: tuple, compiled: Any) -> None:
        """Dropped, not closed: a call may still be running it (what it holds goes when the last caller lets go)."""
        self.stats["evictions"] += 1
        if self.stats["evictions"] == 1:
            warnings.warn(f"{self.name}: more than cache_size={self.bound} input signatures besides the one it was "
                          f"compiled for; the least recently used ({describe(key)}) is dropped and built again if it "
                          "comes back (a larger cache_size keeps more; dynamic=False refuses new signatures)",
                          stacklevel=4)


__all__ = ["Signatures", "describe", "key_of"]
