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

**A new signature never waits.** Where a signature needs a build (another signature, or a size the plan cannot
take), its calls run on the model itself at once while the build is made off the callers' threads
(:data:`opweave.backends.builder.BACKGROUND`); once built, a short race on the inputs that asked for it decides
whether the build takes that signature's calls (one log line says which). A segment compiler meeting a new size
does the same inside the plan: the segment runs op by op while it is compiled for those sizes
(:mod:`opweave.backends.segments`). A model that writes state (a static KV cache) is built for a signature before
its first call of it, as a size it cannot take would have written the state before its check could refuse it.

**Bounds.** At most ``cache_size`` plans are built besides the example's (new captures, and ranges of sizes
planned again). Past that, a signature that would need one more runs on the model itself, with a warning, once, as
``torch.compile`` runs a frame eagerly past its ``recompile_limit``: nothing built is dropped, so a sweep over more
sizes than the bound never builds one size twice. (Without a model to fall back on, a :class:`Signatures` drops the
least recently used build instead, with a warning, once, and builds it again if it comes back.) The sizes a plan
serves are remembered in a least-recently-used cache of :data:`SERVED` signatures; one dropped is checked again if
it comes back.

**Buckets** (option ``buckets``): the batch is padded to a bucket first (:func:`opweave.pipeline.sizes.padding`),
so a model compiled at a bucket's batch, with ``dynamic=False``, serves every smaller batch of that bucket.

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

import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.backends.builder import BACKGROUND, Builder
from opweave.backends.cache import BoundedCache, key_of
from opweave.backends.cudagraph import GraphCaptureError
from opweave.errors import UsageError, first_line
from opweave.pipeline.search import fastest

log = logging.getLogger(__name__)

SERVED = 1024  # signatures remembered as served (a dropped one is checked again when it comes back)
OWN = "own"  # served by the example's own backend


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


class Signatures:
    """The signatures a compiled model serves besides its example's (``example_key``: :func:`key_of` the example
    inputs): ``compile_for(args)`` makes the model for new inputs ``args`` (module docstring); at most ``bound`` are
    built; ``dynamic=False`` refuses them; ``sizes`` (:class:`~opweave.pipeline.sizes.Sizes`) serves other sizes
    with what is built, pads to buckets and runs signatures past the bound on the model (without it, the least
    recently used build is dropped); ``any_batch``: keyed without dimension 0. ``stats``: ``builds`` (new
    captures), ``replans`` (ranges of sizes planned again), ``resized`` (sizes served by a plan built for another
    size), ``padded`` (signatures served padded to a bucket), ``eager`` (signatures run on the model past the
    bound), ``evictions`` (builds dropped, without ``sizes``), ``checks`` (first calls held against the model)."""

    def __init__(self, name: str, example_key: tuple[Any, ...], compile_for: Callable[[tuple[Any, ...]], Any], *,
                 bound: int, dynamic: bool | None = None, arity: int | None = None, sizes: Any = None,
                 any_batch: bool = False):
        self.name, self.example_key, self.dynamic, self.bound = name, example_key, dynamic, bound
        self.arity = arity  # how many inputs the model takes: another count is the backend's error to raise
        self.sizes, self.any_batch = sizes, any_batch
        self._build = compile_for
        self._built: BoundedCache = BoundedCache(bound, self._evicted)  # key -> a build for it (never full: sizes)
        self._plans: dict[tuple[Any, ...], Any] = {}  # a range of sizes (sizes.bucket) -> the plan serving it
        self._served: BoundedCache = BoundedCache(SERVED)  # key -> what runs it (OWN: the example's backend)
        self._pending: dict[tuple[Any, ...], Future[Any]] = {}
        self._lock = threading.Lock()
        self._plan_lock = threading.Lock()  # one range of sizes planned at a time
        self._warned_bound = False
        self._checked: dict[int, frozenset[int]] = {}  # a plan's id -> the dimensions it was checked in
        self._checks: dict[tuple[int, frozenset[int]], _Checking] = {}  # checks made beside the calls
        self._pads_checked = False
        self.stats = {"builds": 0, "replans": 0, "resized": 0, "padded": 0, "eager": 0, "evictions": 0,
                      "checks": 0}

    def keys(self) -> list[tuple[Any, ...]]:
        """The signatures served, the example's first."""
        with self._lock:
            return [self.example_key, *self._served]

    def key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The signature ``args`` are keyed by here."""
        return key_of(args, any_batch=self.any_batch)

    def built(self) -> dict[tuple[Any, ...], Any]:
        """What serves each signature so far besides the example's own backend (none is built by asking)."""
        with self._lock:
            return {k: v for k, v in self._served.items() if v is not OWN}

    def get(self, key: tuple[Any, ...]) -> Any:
        """What serves signature ``key`` (the most recently used now), or None: none is built by asking."""
        with self._lock:
            found = self._served.get(key)
        return None if found is OWN else found

    def for_inputs(self, args: tuple[Any, ...]) -> Any:
        """What runs ``args`` when their signature is not the example's (a callable); None when it is, or when
        the example's backend serves them (or when ``args`` are not as many as the model takes: the caller's
        backend says so). The first call of a signature gets a callable that returns the answer computed while it
        was checked."""
        if self.arity is not None and len(args) != self.arity:
            return None
        key = self.key(args)
        if key == self.example_key:
            return None
        runner, answer = self._lookup(args, key, padded=True)
        if answer is not _NO_ANSWER:
            return _Answered(answer)
        return None if runner is OWN else runner

    def _lookup(self, args: tuple[Any, ...], key: tuple[Any, ...], *, padded: bool) -> tuple[Any, Any]:
        """What runs ``args`` (signature ``key``: served before, or served now, once however many threads ask),
        and the answer when it was computed now to check it. ``padded``: a bucket may serve it."""
        with self._lock:
            found = self._served.get(key)
            if found is not None:
                return found, _NO_ANSWER
            waiting = self._pending.get(key)
            if waiting is None:
                pending: Future[Any] = Future()
                self._pending[key] = pending
        if waiting is not None:
            return waiting.result(), _NO_ANSWER  # another thread serves it first (its error is raised here too)
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

    def _padded(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> tuple[Any, Any] | None:
        """``args`` padded to their bucket, run by what serves the bucket's signature and checked against the
        model; None without a bucket, or when the pad changes the answer (then buckets are turned off)."""
        from opweave.pipeline.sizes import Padded, padding

        sizes = self.sizes
        pad = padding(args, sizes.buckets) if sizes is not None else None
        if pad is None:
            return None
        sizes.pad_warning(self.name, pad)
        target = self.key(pad.inputs)
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

    def _refusal(self, key: tuple[Any, ...]) -> UsageError:
        return UsageError(f"{self.name}: inputs {describe(key)} differ from those it was compiled for "
                          f"({describe(self.example_key)}), and dynamic=False refuses new input signatures "
                          "(leave dynamic unset to serve other sizes and build for other signatures)")

    def _serve(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> tuple[Any, Any]:
        """What runs ``args`` (signature ``key``, not padded), and the answer when it was computed to check it."""
        from opweave.pipeline.sizes import sizes_only

        if self.dynamic is False:
            raise self._refusal(key)
        sizes = self.sizes
        if sizes is not None and sizes_only(self.example_key, key) and not sizes.stateful and sizes.takes(args):
            served = self._resized(args, key) if sizes.generic else None
            if served is not None:
                return served
            self.stats["eager"] += 1  # a size the plan cannot take: the next tier down, the model itself, no build
            return sizes.eager(), _NO_ANSWER
        return self._built_for(args, key), _NO_ANSWER

    def _resized(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> tuple[Any, Any] | None:
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
            log.info("%s: its backend runs the sizes it was built for; %s runs on the model itself", self.name,
                     describe(key))
            return None
        run = plan.backend if own else plan
        dims = changed(self.example_key, key)
        check = not sizes.trusted(plan) and not dims <= self._checked.get(id(plan), frozenset())
        if check and plan.device == "cpu":  # CUDA records a graph per size on the caller's stream: checked below
            return self._checking(plan, run, own, args, key, dims), _NO_ANSWER
        try:
            out = run(*args)
        except GraphCaptureError:  # an op that cannot be recorded: the caller's error, never run eagerly instead
            raise
        except Exception as exc:  # noqa: BLE001 - the capture cannot run this size: the model itself runs it
            sizes.generic = False
            log.info("%s: the plan built for %s fails at %s (%s); it, and every later size, runs on the model itself",
                     self.name, describe(self.example_key), describe(key), exc)
            return None
        if check:
            try:
                ok, why = sizes.agrees(args, out)
            except Exception as exc:  # noqa: BLE001 - the model refuses them: a capture says where, as for any
                log.info("%s: the model raises at %s (%s)", self.name, describe(key), exc)
                return None
            if not ok:
                sizes.generic = False
                log.info("%s: the plan built for %s differs from the model at %s (%s); it, and every later size, runs "
                         "on the model itself", self.name, describe(self.example_key), describe(key), why)
                return None
            self.stats["checks"] += 1
            self._checked[id(plan)] = self._checked.get(id(plan), frozenset()) | dims
        self.stats["resized"] += 1
        log.info("%s: %s served by %s", self.name, describe(key),
                 f"the plan built for {describe(self.example_key)}" if own else "the plan made for its range of sizes")
        return (OWN if own else run), out

    def _checking(self, plan: Any, run: Any, own: bool, args: tuple[Any, ...], key: tuple[Any, ...],
                  dims: frozenset[int]) -> _Checking:
        """What runs a size at which ``plan`` is not checked yet in ``dims``: the model itself, while the plan's answer
        at that size is checked against the model's off the callers' threads (once per plan and dimensions); then
        the plan where it agreed, else the model, from then on for every later size too (Checked once per
        dimension). So no call waits for the check, nor for the plan's first run at a new size."""
        with self._lock:
            pending = self._checks.get((id(plan), dims))
            if pending is None:
                pending = self._checks[(id(plan), dims)] = _Checking(self.sizes.eager(), run)
                pending.check = functools.partial(self._queue_check, plan, pending, own, key, dims)
            pending.keys.append(key)
        return pending

    def _queue_check(self, plan: Any, pending: _Checking, own: bool, key: tuple[Any, ...], dims: frozenset[int],
                     args: tuple[Any, ...], answer: Any) -> None:
        BACKGROUND.submit((id(self), "check", id(plan), dims),
                          lambda: self._checked_later(plan, pending, own, args, answer, key, dims),
                          f"{self.name} check at {describe(key)}")

    def _checked_later(self, plan: Any, pending: _Checking, own: bool, args: tuple[Any, ...], answer: Any,
                       key: tuple[Any, ...], dims: frozenset[int]) -> None:
        """The check :meth:`_checking` queued: the plan run at ``args`` and held against the model's ``answer``
        there (the first call's: the model is not run again)."""
        sizes = self.sizes
        why = ""
        try:
            out = pending.plan(*args)
            ok, why = sizes.agrees(args, out, expected=answer)
        except Exception as exc:  # noqa: BLE001 - the plan (or the model) cannot run this size: the model runs it
            ok, why = False, first_line(exc)
        if ok:
            with self._lock:
                self._checked[id(plan)] = self._checked.get(id(plan), frozenset()) | dims
                self.stats["checks"] += 1
                self.stats["resized"] += len(pending.keys)
                for k in pending.keys:  # their calls go to the plan directly from now on
                    if self._served.get(k) is pending:
                        self._served[k] = OWN if own else pending.plan
            pending.verdict = True
            log.info("%s: %s served by %s (checked against the model beside the calls)", self.name, describe(key),
                     f"the plan built for {describe(self.example_key)}" if own else
                     "the plan made for its range of sizes")
        else:
            sizes.generic = False
            pending.verdict = False
            log.info("%s: the plan built for %s differs from the model at %s (%s); it, and every later size, runs on "
                     "the model itself", self.name, describe(self.example_key), describe(key), why)

    def _plan(self, args: tuple[Any, ...], bucket: tuple[Any, ...]) -> Any:
        """The plan that serves sizes of ``bucket`` (:func:`opweave.pipeline.sizes.bucket`): the example's, or one
        planned again for this range at the sizes of ``args`` when predicted faster enough (and within the bound),
        which is built off the callers' threads: the example's serves the range until it is."""
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
                    log.info("%s: planning again for %s, beside the calls (predicted %.0f%% faster than the plan "
                             "built for %s)", self.name, describe(key_of(args)), 100 * gain,
                             describe(self.example_key))
                    copies = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)
                    BACKGROUND.submit((id(self), "plan", bucket), lambda: self._replanned(bucket, copies),
                                      f"{self.name} {describe(key_of(args))}")
            self._plans[bucket] = plan
            return plan

    def _replanned(self, bucket: tuple[Any, ...], args: tuple[Any, ...]) -> None:
        """A range of sizes planned again (:meth:`_plan`), off the callers' threads: its later sizes run on it."""
        plan = self.sizes.replan(args)
        with self._plan_lock:
            self._plans[bucket] = plan
            self.stats["replans"] += 1

    def _room(self) -> bool:
        """Whether one more plan may be built (module docstring, Bounds)."""
        return len(self._built) + sum(p is not self.sizes.compiled for p in self._plans.values()) < self.bound

    def _built_for(self, args: tuple[Any, ...], key: tuple[Any, ...]) -> Any:
        """What runs ``args``: the model itself while a build for them is made in the background, which then takes
        their calls where it is no slower (module docstring, A new signature never waits); without the model to run,
        a build made now; past the bound, the model itself (Bounds)."""
        if self.sizes is not None and not self._room():
            self.stats["eager"] += 1
            if not self._warned_bound:
                self._warned_bound = True
                warnings.warn(f"{self.name}: more than cache_size={self.bound} plans built besides the one it was "
                              f"compiled for; {describe(key)} and every later signature that would need one run on "
                              "the model itself (a larger cache_size builds more; buckets pads batches to fewer "
                              "sizes)", stacklevel=6)
            return self.sizes.eager()
        if self.sizes is not None and not self.sizes.stateful and self.sizes.takes(args):  # built beside
            eager = self.sizes.eager()
            copies = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)
            if BACKGROUND.submit((id(self), key), lambda: self._built_later(copies, key, eager),
                                 f"{self.name} {describe(key)}"):
                log.info("%s: %s runs on the model itself while it is built for (%d built so far)", self.name,
                         describe(key), len(self._built) + 1)
            return eager
        log.info("%s: building for a new input signature %s (%d built so far)", self.name, describe(key),
                 len(self._built) + 1)
        built = self._build(args)
        with self._lock:
            self._built[key] = built
            self.stats["builds"] += 1
        return built

    def _built_later(self, args: tuple[Any, ...], key: tuple[Any, ...], eager: Any) -> None:
        """The build for ``args`` (signature ``key``), made off the callers' threads: it takes the signature's calls
        from the model where a short race on ``args`` finds it no slower (one log line says which)."""
        start = time.perf_counter()
        built = self._build(args)
        with self._lock:
            self._built[key] = built
            self.stats["builds"] += 1
        best, medians = fastest({"built": built, "model": eager}, args)
        if best == "built":
            with self._lock:
                self._served[key] = built
        log.info("%s: built for %s in %.1f s: %s (%.3f ms against the model's %.3f)", self.name, describe(key),
                 time.perf_counter() - start, "it takes the calls" if best == "built" else "the model keeps them",
                 medians["built"], medians["model"])

    def _evicted(self, key: tuple[Any, ...], compiled: Any) -> None:
        """Dropped, not closed: a call may still be running it (what it holds goes when the last caller lets go).
        Only without ``sizes``, which never fills the bound."""
        self.stats["evictions"] += 1
        self._served.pop(key, None)  # under the lock: _built_for stores it while holding it
        if self.stats["evictions"] == 1:
            warnings.warn(f"{self.name}: more than cache_size={self.bound} input signatures besides the one it was "
                          f"compiled for; the least recently used ({describe(key)}) is dropped and built again if it "
                          "comes back (a larger cache_size keeps more; dynamic=False refuses new signatures)",
                          stacklevel=6)


class _Checking:
    """Calls of sizes a plan is being checked at (:meth:`Signatures._checking`): the model itself answers them until
    the check says the plan agrees (``verdict``), then the plan. The check is queued once the first call has its
    answer (``check(args, answer)``): nothing beside that call slows it, and the model's answer is the check's."""

    def __init__(self, eager: Any, plan: Any):
        self.eager, self.plan = eager, plan
        self.check: Callable[[tuple[Any, ...], Any], Any] = lambda args, answer: None
        self.verdict: bool | None = None
        self.keys: list[tuple[Any, ...]] = []
        self._asked = False

    def __call__(self, *args: Any) -> Any:
        if self.verdict:
            return self.plan(*args)
        answer = self.eager(*args)
        if not self._asked:
            self._asked = True
            self.check(tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args),
                       pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, answer))
        return answer


class _Answered:
    """The answer of a signature's first call, computed while it was checked: what the call returns."""

    def __init__(self, answer: Any):
        self.answer = answer

    def __call__(self, *args: Any) -> Any:
        return self.answer


_NO_ANSWER = object()



def attach(compiled: Any, name: str, example: tuple[Any, ...], compile_for: Callable[[tuple[Any, ...]], Any], *,
           bound: int, dynamic: bool | None = None, sizes: Any = None) -> Any:
    """``compiled`` (built for ``example``), which from now on builds itself for inputs of another signature with
    ``compile_for`` (:class:`Signatures`: at most ``bound`` kept, refused with ``dynamic=False``, keyed without
    dimension 0 where it takes any batch; ``sizes``, a :class:`~opweave.pipeline.sizes.Sizes`, serves other sizes
    with what is built): the one way a compiled model, a library's or a server's block, meets other inputs."""
    any_batch = compiled.any_batch  # its own backend takes any batch: no other batch size is another signature
    compiled.variants = Signatures(name, key_of(example, any_batch=any_batch), compile_for, bound=bound,
                                   dynamic=dynamic, arity=len(example), sizes=sizes, any_batch=any_batch)
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
