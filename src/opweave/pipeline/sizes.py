"""Sizes a compiled model was not built for: one plan for every size, checked once per dimension that changes.

A schedule places a graph's operators on lanes from their relative costs, which change slowly with the size of the
inputs; the plan, the lanes' generated code and their liveness slots read no size. So a call whose inputs are the
example's in other sizes (:func:`sizes_only`: the same structure, tensors of the same dtypes and ranks, other
values equal but integers, the sizes dynamo hands over) first runs on what is built, as ``torch.compile`` runs one
graph with symbolic sizes after a dimension has changed, and per new size only what truly depends on it is redone:

* on the CPU lanes, nothing (their binding takes the dimensions that changed: :meth:`Captured.free`);
* a segment compiler that needs fixed shapes compiles for the new size; ONNX Runtime exports the segment once more
  with the dimensions that changed left free, at their second value, and that session serves every later size
  (``dynamic=True``: every dimension free from the first build; :mod:`opweave.backends.segments`, Sizes);
* on CUDA, the backend records one more CUDA Graph (its buffers planned for the new shapes first).

**Checked once per dimension.** The first call of a plan in each dimension that differs from the example's is held
against the model run eagerly at that size (:func:`opweave.outputs.compare`, :meth:`Sizes.agrees`); its answer is
the call's. What the check catches is a size baked into what runs: a capture whose graph holds the example's size
(the ``torch.export`` route bakes them into reshapes; ``symbolic_trace``'s graph reads every size from its inputs,
and a ``.pt2`` keeps its dynamic dimensions free), or a segment compiled for one size, which both fail at the first
other value of that dimension, the value at which ONNX Runtime's session with free sizes is made. A later size in
dimensions already checked runs through the same graph and the same session, so it is not checked again: checking
every size cost one run of the model each (a new size's first call several times a steady call of BERT:
``benchmarks/results/new_signature_every_size_checked.md``), where ``torch.compile`` checks none (its
guards trust a graph with symbolic sizes). A capture that fails, or raises, sends that signature and every later
one to a build of its own from a new capture, as any other signature is. A plan that runs the model itself (the CPU
default's ``eager``) needs no check; a padded batch is checked at the first size padded (module docstring,
Buckets). A ``.pt2`` program says which sizes it takes (its dimensions' ranges, :meth:`Sizes.takes`): one outside
them is not served so, and its build meets the program's own refusal.

**State.** A model that writes state in place (a static KV cache, :data:`opweave.capture.trace.STATE`) is built
per signature from its first other one: a plan tried at a size it cannot serve has written the state before its
check could refuse it, and its captures come from ``torch.export``, which bakes the example's sizes in.

**When to plan again.** The costs the schedulers see move with the size, slowly: FLOPs grow with a batch or a
sequence, a weight's bytes do not. The first size in each power-of-two range of a changed dimension
(:func:`bucket`; the example's range is its plan's) re-runs the plan's scheduler on the target's costs at that size
(:func:`replan_gain`: the roofline estimate on the CPU, the fitted GPU's on CUDA) and replays the plan kept on them
too; only when the new schedule is predicted at least :data:`REPLAN_GAIN` faster is that range planned again
(from the same capture, at that size: the target's whole build, the CPU default's race included), else it keeps
the example's plan. One lane in the model's order, a plan of one lane, a plan over costs the caller gave (made for
the example's shapes) and ONNX Runtime's own graph are never re-planned: no cost the schedulers see can reorder
them. The CPU default's race among its candidates is not run again for a size the example's plan serves.

**Buckets** (the ``buckets`` option): a call's batch, dimension 0 of every tensor input when they share it, is
padded up to the next power of two (``"pow2"``) or the next of the sizes named, repeating its last row, and every
output with that many rows is cut back, as TensorRT's optimization profiles and Triton's batcher serve few shapes.
Rows must not affect each other, which the check against the model at the first size padded sees (one that changes
the answer turns buckets off, with a warning). A batch beyond the
largest size named runs at its own; a pad that more than doubles the rows warns, once.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opweave.pipeline import targets

log = logging.getLogger(__name__)

REPLAN_GAIN = 0.10  # a new schedule predicted at least this much faster than the plan kept plans a range again
PAD_WARNING = 2.0  # a pad to this many times the rows asked, or more, warns


def _is_int(leaf: tuple) -> bool:
    return leaf[0] == "value" and leaf[1].lstrip("-").isdigit()


def sizes_only(example: tuple, key: tuple) -> bool:
    """Whether signature ``key`` (:func:`opweave.pipeline.signatures.key_of`) is ``example``'s in other sizes: the
    same structure, tensors of the same dtypes and ranks, other values equal but integers."""
    if key[0] != example[0] or len(key) != len(example):
        return False
    for new, old in zip(key[1:], example[1:], strict=True):
        if old[0] == "value" or new[0] == "value":
            if new != old and not (_is_int(new) and _is_int(old)):
                return False
        elif new[1] != old[1] or len(new[0]) != len(old[0]):
            return False
    return True


def _changes(example: tuple, key: tuple):
    """Leaf, dimension, size in ``key`` and in ``example`` of every size that differs (an integer leaf's dimension:
    None); ``key`` is ``example``'s in other sizes (:func:`sizes_only`)."""
    for i, (new, old) in enumerate(zip(key[1:], example[1:], strict=True)):
        if new[0] == "value":
            if _is_int(new) and new != old:
                yield i, None, int(new[1]), int(old[1])
        else:
            yield from ((i, d, a, b) for d, (a, b) in enumerate(zip(new[0], old[0], strict=True)) if a != b)


def changed(example: tuple, key: tuple) -> frozenset:
    """The dimensions (leaf, dimension) in which ``key``'s sizes differ from ``example``'s."""
    return frozenset((i, d) for i, d, _, _ in _changes(example, key))


def bucket(example: tuple, key: tuple) -> tuple:
    """The power-of-two range of each size of ``key`` that differs from ``example``'s range (leaf, dimension and
    bit length): ``()`` for sizes in the example's ranges, whose plan serves them."""
    return tuple((i, d, abs(a).bit_length()) for i, d, a, b in _changes(example, key)
                 if abs(a).bit_length() != abs(b).bit_length())


class Padding:
    """A call's batch padded up to a bucket (module docstring, Buckets): ``inputs`` the padded inputs, ``rows``
    the batch asked, ``to`` the batch run."""

    def __init__(self, inputs: tuple, rows: int, to: int):
        self.inputs, self.rows, self.to = inputs, rows, to

    def cut(self, out: Any) -> Any:
        """``out`` with every tensor of ``to`` rows cut back to ``rows``."""
        return pytree.tree_map(lambda t: t[:self.rows] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] ==
                               self.to else t, out)


def padding(args: tuple, buckets: str | tuple[int, ...] | None) -> Padding | None:
    """``args`` padded to the batch ``buckets`` says (module docstring), or None: no buckets, no batch shared by
    every tensor input, or a batch that is its own bucket (or beyond the largest)."""
    if buckets is None:
        return None
    leaves, spec = pytree.tree_flatten(args)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or any(x.dim() == 0 for x in tensors) or len({x.shape[0] for x in tensors}) != 1:
        return None
    rows = tensors[0].shape[0]
    if rows < 1:
        return None
    to = 1 << (rows - 1).bit_length() if isinstance(buckets, str) else next((b for b in buckets if b >= rows), rows)
    if to == rows:
        return None
    padded = [torch.cat([x, x[-1:].expand(to - rows, *x.shape[1:])]) if isinstance(x, torch.Tensor) else x
              for x in leaves]
    return Padding(pytree.tree_unflatten(padded, spec), rows, to)


class Padded:
    """``run`` on a call's inputs padded to a bucket, its outputs cut back (:func:`padding`)."""

    def __init__(self, run, buckets: str | tuple[int, ...]):
        self.run, self.buckets = run, buckets

    def __call__(self, *args):
        pad = padding(args, self.buckets)
        return self.run(*args) if pad is None else pad.cut(self.run(*pad.inputs))


class Sizes:
    """What a compiled model needs to serve sizes it was not built for (module docstring): ``compiled``, the
    example's build (held weakly: it holds this object); ``model``, the model itself, the check's reference and
    what runs signatures past the bound; ``example``, the example inputs (a new size's inputs are moved to their
    devices for the model); ``replan(args)``, a build of the same capture at other sizes (None: never planned
    again); ``buckets``, the option. ``generic``: whether the capture is still trusted at other sizes (False once a
    size failed its check, and from the start for a model with state: module docstring, State)."""

    def __init__(self, compiled, model, example: tuple, *, replan=None, buckets=None):
        self._compiled = weakref.ref(compiled)
        self.model, self.example, self.replan, self.buckets = model, example, replan, buckets
        writes = getattr(getattr(compiled, "captured", None), "state_writes", None)
        self.stateful = bool(writes is not None and writes())  # its calls write state: each built before it runs
        self.generic = not self.stateful
        self.warned_pad = False

    @property
    def compiled(self):
        return self._compiled()

    def eager(self):
        """The model itself as a backend (past the bound), under ``no_grad`` on the example's devices."""
        from opweave.backends.cpu import EagerBackend

        backend = EagerBackend(self.model)
        return lambda *args: backend(*on_devices_of(args, self.example))

    def takes(self, args: tuple) -> bool:
        """Whether the model says it takes ``args``' sizes: a ``.pt2`` program only those its dimensions allow
        (:meth:`opweave.capture.trace.ExportedModule.takes`; its capture, free in them, would run others)."""
        takes = getattr(self.model, "takes", None)
        return takes is None or takes(args)

    def trusted(self, plan) -> bool:
        """Whether ``plan``'s output needs no check: it is the model itself."""
        from opweave.backends.cpu import EagerBackend

        return isinstance(plan.backend, EagerBackend) and plan.backend.model is self.model

    def agrees(self, args: tuple, out: Any, expected: Any = None) -> tuple[bool, str]:
        """Whether ``out`` equals the model's output on ``args`` (:func:`opweave.outputs.compare`, a tensor that
        rounds otherwise held against the model run in float64); and why not. The model raising is raised.
        ``expected``: the model's output there, where it was computed already."""
        from opweave.outputs import compare, exact_outputs

        compiled = self.compiled
        if compiled is not None and compiled.device == "cuda":
            from opweave.backends.runtime import CUDA

            (compiled.options.runtime or CUDA).synchronize()
        inputs = on_devices_of(args, self.example)
        if expected is None:
            with torch.no_grad():
                expected = self.model(*inputs)
        check = compare(expected, out)
        if not check.ok and isinstance(self.model, torch.nn.Module) and "differs by" in check.reason:
            try:
                check = compare(expected, out, exact=exact_outputs(self.model, inputs)[0])
            except Exception:  # noqa: BLE001 - a model that cannot run in float64: the plain rule decides
                pass
        return check.ok, check.reason

    def pad_warning(self, name: str, pad: Padding) -> None:
        """Warn, once, of a pad to :data:`PAD_WARNING` times the rows asked or more."""
        if pad.to >= PAD_WARNING * pad.rows and not self.warned_pad:
            self.warned_pad = True
            import warnings

            warnings.warn(f"{name}: a batch of {pad.rows} is padded to {pad.to} (buckets={list(self.buckets)}), "
                          f"{pad.to / pad.rows:.1f}x the rows; name sizes closer together, or leave buckets unset to "
                          "run each batch at its size", stacklevel=5)


def replan_gain(compiled, args: tuple) -> float | None:
    """How much faster the plan's scheduler predicts a new schedule for inputs ``args`` than ``compiled``'s plan, on
    the target's costs at those sizes (a share: 0.1 is 10% faster; module docstring, When to plan again); None
    where no cost the schedulers see could reorder the plan, or the prediction cannot be made (said at DEBUG)."""
    from opweave.backends.simulate import makespan_ms
    from opweave.capture.coarsen import at_sizes
    from opweave.plan.make import plan_for

    sched, options = compiled.schedule, compiled.options
    if (sched is None or options is None or sched.scheduler == "sequential" or sched.streams_used < 2
            or options.costs is not None or options.profile is not None or options.graph == "onnxruntime"
            or compiled.captured is None or options.devices > 1):
        return None
    try:
        resized = at_sizes(compiled.captured, args)
        costs = _costs(resized, args, options)
        kept = makespan_ms(resized.graph, compiled.plan, costs)
        scheduler_options = dict(sched.options)
        streams = scheduler_options.pop("streams", None) or sched.streams_used
        _, plan = plan_for(resized.graph, costs, sched.scheduler, streams=streams, **scheduler_options)
        new = makespan_ms(resized.graph, plan, costs)
    except Exception as exc:  # noqa: BLE001 - a prediction only: the plan kept runs, and is checked
        log.debug("%s: no prediction at new sizes (%s: %s)", compiled.graph.name, type(exc).__name__, exc)
        return None
    gain = 1.0 - new / kept if kept > 0 and math.isfinite(new) else 0.0
    log.debug("%s: %s predicted %.4f ms at new sizes against %.4f ms for the plan kept", compiled.graph.name,
              sched.scheduler, new, kept)
    return gain


def _costs(captured, args: tuple, options):
    """The costs the target plans on, for ``captured`` at the sizes of ``args``."""
    return targets.for_options(options).planning_costs(captured, args, options)


def on_devices_of(args: tuple, example: tuple) -> tuple:
    """``args`` with each tensor moved to the device of the example's tensor in the same place (when both are
    tensors and the structure matches; else left where they are): the device the model was captured on."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(args)
    where, example_spec = pytree.tree_flatten(example)
    if spec != example_spec:
        return args
    moved = [x.to(e.device) if isinstance(x, torch.Tensor) and isinstance(e, torch.Tensor) and x.device != e.device
             else x for x, e in zip(leaves, where, strict=True)]
    return pytree.tree_unflatten(moved, spec)


__all__ = ["PAD_WARNING", "REPLAN_GAIN", "Padded", "Padding", "Sizes", "bucket", "changed", "on_devices_of", "padding",
           "replan_gain", "sizes_only"]
