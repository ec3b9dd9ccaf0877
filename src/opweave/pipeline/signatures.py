"""Inputs of another shape: a compiled model meets an input signature it was not built for.

A :class:`~opweave.pipeline.compiled.Compiled` is built for its example inputs' signature
(:func:`opweave.backends.cache.signature`: the pytree structure, each tensor's shape and dtype, each other value).
Devices and strides are left to the backends, which move inputs to their device and key what depends on strides
themselves (the CUDA backend's recordings, a compiled segment's graphs): CPU inputs of the example's shapes given to
a model compiled for CUDA, or the reverse, are the example's signature. A call with another signature is handled as
``torch.compile`` handles a recompilation, by the option ``dynamic``:

* ``None`` (the default) or ``True``: **another size** (the example's inputs in other sizes,
  :func:`opweave.pipeline.sizes.sizes_only`) runs the plan built, checked against the model at the first size of each
  dimension that changes; per size only what depends on it is redone (:mod:`opweave.pipeline.sizes`: what, and when a
  range of sizes is planned again). ``True`` leaves every size free in a segment compiler from the first build;
  unset, a dimension becomes free at its second value, as ``torch.compile``'s automatic dynamic shapes make it
  symbolic. A size the plan cannot serve (its backend runs one size, or the capture baked a size in: the check fails)
  and **another signature** (dtype, structure, a value) are built for those inputs through the one pipeline —
  captured again (a ``torch.export`` program's own dynamic dimensions are honoured, and a size it fixed is refused
  naming the input), scheduled, lowered, validated and run by the device's backend, with the same options. Each new
  signature logs one line (``opweave.pipeline.signatures``, INFO). Concurrent first calls of one signature serve it
  once; calls of a signature served before do not wait.
* ``False``: a :class:`~opweave.errors.UsageError` naming the signature the model was built for.

**Bounds.** At most ``cache_size`` plans are built besides the example's (new captures, and ranges of sizes
planned again). Past that, a signature that would need one more runs on the model itself, with a warning, once, as
``torch.compile`` runs a frame eagerly past its ``recompile_limit``: nothing built is dropped, so a sweep over more
sizes than the bound never builds one size twice. (Without a model to fall back on, a :class:`Signatures` drops the
least recently used build instead, with a warning, once, and builds it again if it comes back.) The sizes a plan
serves are remembered in a least-recently-used cache of :data:`SERVED` signatures; one dropped is checked again if
it comes back.

**Buckets** (option ``buckets``): the batch is padded to a bucket first (:func:`opweave.pipeline.sizes.padding`),
so a model compiled at a bucket's batch, with ``dynamic=False``, serves every smaller batch of that bucket.

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

SERVED = 1024  # signatures remembered as served (a dropped one is checked again when it comes back)
OWN = "own"  # served by the example's own backend


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
    built; ``dynamic=False`` refuses them; ``sizes`` (:class:`~opweave.pipeline.sizes.Sizes`) serves other sizes
    with what is built, pads to buckets and runs signatures past the bound on the model (without it, the least
    recently used build is dropped). ``stats``: ``builds`` (new captures), ``replans`` (ranges of sizes planned
    again), ``resized`` (sizes served by a plan built for another size), ``padded`` (signatures
    served padded to a bucket), ``eager`` (signatures run on the model past the bound), ``evictions`` (builds
    dropped, without ``sizes``), ``checks`` (first calls held against the model)."""

    def __init__(self, name: str, example_key: tuple, build: Callable[[tuple], Any], *, bound: int,
                 dynamic: bool | None = None, arity: int | None = None, sizes: Any = None):
        self.name, self.example_key, self.dynamic, self.bound = name, example_key, dynamic, bound
        self.arity = arity  # how many inputs the model takes: another count is the backend's error to raise
        self.sizes = sizes
        self._build = build
        self._built: BoundedCache = BoundedCache(bound, self._evicted)  # key -> a build for it (never full: sizes)
        self._plans: dict[tuple, Any] = {}  # a range of sizes (sizes.bucket) -> the plan serving it
        self._served: BoundedCache = BoundedCache(SERVED)  # key -> what runs it (OWN: the example's backend)
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._plan_lock = threading.Lock()  # one range of sizes planned at a time
        self._warned_bound = False
        self._checked: dict[int, frozenset] = {}  # id of a plan -> the dimensions it was checked in (sizes.changed)
        self._pads_checked = False
        self.stats = {"builds": 0, "replans": 0, "resized": 0, "padded": 0, "eager": 0, "evictions": 0,
                      "checks": 0}

    def keys(self) -> list[tuple]:
        """The signatures served, the example's first."""
        with self._lock:
            return [self.example_key, *self._served]

    def for_inputs(self, args: tuple):
        """What runs ``args`` when their signature is not the example's (a callable); None when it is, or when
        the example's backend serves them (or when ``args`` are not as many as the model takes: the caller's
        backend says so). The first call of a signature gets a callable that returns the answer computed while it
        was checked."""
        if self.arity is not None and len(args) != self.arity:
            return None
        key = key_of(args)
        if key == self.example_key:
            return None
        runner, answer = self._lookup(args, key, padded=True)
        if answer is not _NO_ANSWER:
            return _Answered(answer)
        return None if runner is OWN else runner

    def _lookup(self, args: tuple, key: tuple, *, padded: bool) -> tuple[Any, Any]:
        """What runs ``args`` (signature ``key``: served before, or served now, once however many threads ask),
        and the answer when it was computed now to check it. ``padded``: a bucket may serve it."""
        with self._lock:
            found = self._served.get(key)
            if found is not None:
                return found, _NO_ANSWER
            pending = self._pending.get(key)
            mine = pending is None
            if mine:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result(), _NO_ANSWER  # another thread serves it first (its error is raised here too)
        try:
            served = self._padded(args, key) if padded else None
            runner, answer = served if served is not None else self._serve(args, key)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._served[key] = runner
            del self._pending[key]
        pending.set_result(runner)
        return runner, answer

    def _padded(self, args: tuple, key: tuple) -> tuple[Any, Any] | None:
        """``args`` padded to their bucket, run by what serves the bucket's signature and checked against the
        model; None without a bucket, or when the pad changes the answer (then buckets are turned off)."""
        from opweave.pipeline.sizes import Padded, padding

        sizes = self.sizes
        pad = padding(args, sizes.buckets) if sizes is not None else None
        if pad is None:
            return None
        sizes.pad_warning(self.name, pad)
        target = key_of(pad.inputs)
        if target == self.example_key:
            run, out = sizes.compiled.backend, _NO_ANSWER
        else:
            if self.dynamic is False:
                raise self._refusal(key)
            run, out = self._lookup(pad.inputs, target, padded=False)
            run = sizes.compiled.backend if run is OWN else run
        out = pad.cut(run(*pad.inputs) if out is _NO_ANSWER else out)
        if not self._pads_checked:
            ok, why = sizes.agrees(args, out)
            self.stats["checks"] += 1
            if not ok:
                sizes.buckets = None
                warnings.warn(f"{self.name}: padding a batch of {pad.rows} to {pad.to} changes its answer ({why}): "
                              "its rows are not independent; buckets are ignored from now on", stacklevel=5)
                return None
            self._pads_checked = True
        self.stats["padded"] += 1
        log.info("%s: %s served padded to %s", self.name, describe(key), describe(target))
        return Padded(run, sizes.buckets), out

    def _refusal(self, key: tuple) -> UsageError:
        return UsageError(f"{self.name}: inputs {describe(key)} differ from those it was compiled for "
                          f"({describe(self.example_key)}), and dynamic=False refuses new input signatures "
                          "(leave dynamic unset to serve other sizes and build for other signatures)")

    def _serve(self, args: tuple, key: tuple) -> tuple[Any, Any]:
        """What runs ``args`` (signature ``key``, not padded), and the answer when it was computed to check it."""
        from opweave.pipeline.sizes import sizes_only

        if self.dynamic is False:
            raise self._refusal(key)
        sizes = self.sizes
        if sizes is not None and sizes.generic and sizes_only(self.example_key, key):
            served = self._resized(args, key)
            if served is not None:
                return served
        return self._built_for(args, key), _NO_ANSWER

    def _resized(self, args: tuple, key: tuple) -> tuple[Any, Any] | None:
        """``args`` run by the plan that serves their sizes and checked against the model where the plan was not
        checked in their dimensions yet (:mod:`opweave.pipeline.sizes`, Checked once per dimension); None when it
        cannot run them or its answer is wrong (then nothing is trusted at other sizes any more:
        :attr:`Sizes.generic`)."""
        from opweave.pipeline.sizes import bucket, changed

        sizes = self.sizes
        if not sizes.takes(args):
            log.info("%s: %s lie outside the sizes the model takes", self.name, describe(key))
            return None
        plan = self._plan(args, bucket(self.example_key, key))
        own = plan is sizes.compiled
        free = getattr(plan.backend, "free", None)
        if free is None or not free(args):
            log.info("%s: its backend runs the sizes it was built for; building for %s", self.name, describe(key))
            return None
        run = plan.backend if own else plan
        try:
            out = run(*args)
        except Exception as exc:  # noqa: BLE001 - the capture cannot run this size: built on its own
            sizes.generic = False
            log.info("%s: the plan built for %s fails at %s (%s); building for it, and for every later size",
                     self.name, describe(self.example_key), describe(key), exc)
            return None
        dims = changed(self.example_key, key)
        if not sizes.trusted(plan) and not dims <= self._checked.get(id(plan), frozenset()):
            try:
                ok, why = sizes.agrees(args, out)
            except Exception as exc:  # noqa: BLE001 - the model refuses them: a capture says where, as for any
                log.info("%s: the model raises at %s (%s)", self.name, describe(key), exc)
                return None
            if not ok:
                sizes.generic = False
                log.info("%s: the plan built for %s differs from the model at %s (%s); building for it, and for "
                         "every later size", self.name, describe(self.example_key), describe(key), why)
                return None
            self.stats["checks"] += 1
            self._checked[id(plan)] = self._checked.get(id(plan), frozenset()) | dims
        self.stats["resized"] += 1
        log.info("%s: %s served by %s", self.name, describe(key),
                 f"the plan built for {describe(self.example_key)}" if own else "the plan made for its range of sizes")
        return (OWN if own else run), out

    def _plan(self, args: tuple, bucket: tuple):
        """The plan that serves sizes of ``bucket`` (:func:`opweave.pipeline.sizes.bucket`): the example's, or one
        planned again for this range at the sizes of ``args`` when predicted faster enough (and within the
        bound)."""
        from opweave.pipeline.sizes import REPLAN_GAIN, replan_gain

        sizes = self.sizes
        if not bucket:
            return sizes.compiled
        with self._plan_lock:
            plan = self._plans.get(bucket)
            if plan is not None:
                return plan
            plan = sizes.compiled
            if sizes.replan is not None and self._room():
                gain = replan_gain(plan, args)
                if gain is not None and gain >= REPLAN_GAIN:
                    log.info("%s: planning again for %s (predicted %.0f%% faster than the plan built for %s)",
                             self.name, describe(key_of(args)), 100 * gain, describe(self.example_key))
                    plan = sizes.replan(args)
                    self.stats["replans"] += 1
            self._plans[bucket] = plan
            return plan

    def _room(self) -> bool:
        """Whether one more plan may be built (module docstring, Bounds)."""
        return len(self._built) + sum(p is not self.sizes.compiled for p in self._plans.values()) < self.bound

    def _built_for(self, args: tuple, key: tuple):
        """What runs ``args``: a build for them; past the bound, the model itself (module docstring, Bounds)."""
        if self.sizes is not None and not self._room():
            self.stats["eager"] += 1
            if not self._warned_bound:
                self._warned_bound = True
                warnings.warn(f"{self.name}: more than cache_size={self.bound} plans built besides the one it was "
                              f"compiled for; {describe(key)} and every later signature that would need one run on "
                              "the model itself (a larger cache_size builds more; buckets pads batches to fewer "
                              "sizes)", stacklevel=6)
            return self.sizes.eager()
        log.info("%s: building for a new input signature %s (%d built so far)", self.name, describe(key),
                 len(self._built) + 1)
        built = self._build(args)
        with self._lock:
            self._built[key] = built
            self.stats["builds"] += 1
        return built

    def _evicted(self, key: tuple, compiled: Any) -> None:
        """Dropped, not closed: a call may still be running it (what it holds goes when the last caller lets go).
        Only without ``sizes``, which never fills the bound."""
        self.stats["evictions"] += 1
        self._served.pop(key, None)  # under the lock: _built_for stores it while holding it
        if self.stats["evictions"] == 1:
            warnings.warn(f"{self.name}: more than cache_size={self.bound} input signatures besides the one it was "
                          f"compiled for; the least recently used ({describe(key)}) is dropped and built again if it "
                          "comes back (a larger cache_size keeps more; dynamic=False refuses new signatures)",
                          stacklevel=6)


class _Answered:
    """The answer of a signature's first call, computed while it was checked: what the call returns."""

    def __init__(self, answer: Any):
        self.answer = answer

    def __call__(self, *args) -> Any:
        return self.answer


_NO_ANSWER = object()


__all__ = ["Signatures", "describe", "key_of"]
