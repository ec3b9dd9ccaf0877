"""``torch.compile(model, backend="opweave")``: opweave as a TorchDynamo backend.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so no import is needed::

    fast = torch.compile(model, backend="opweave", options={"scheduler": "lios", "streams": 4})

Dynamo hands the backend each graph it extracted as an ``fx.GraphModule`` with real example inputs; in recent
PyTorch versions the module's parameters and buffers are among those inputs (lifted, marked static). Each graph is
captured, scheduled, lowered and validated as ``opweave.compile`` does, and runs on the CPU backend or the CUDA
backend according to the example inputs' device. Lifted parameters and buffers are first turned back into the
module's attributes (:func:`bake_static_inputs`): the CUDA backend then neither copies them per call nor checks
their addresses, as for a module's own weights. The returned callable returns what the graph module returns (dynamo
expects its tuple/list back).

**Swapped weights.** Dynamo does not guard the lifted parameters ("unguarded" static inputs): after
``model.fc.weight = nn.Parameter(...)`` it simply passes the new tensor in the same position. Every call therefore
checks that the tensors in the baked positions are the very tensors baked in (an identity check per parameter,
no data pointer read), and compiles the graph again, with the tensors it was given, when one differs. In-place
updates (``p.copy_(...)``, an optimizer step) keep the tensor and are seen by the graph as they are; replacing a
parameter's storage behind its back (``p.data = other``) is not detected.

**Inference only.** A graph compiled with grad mode on while a parameter or an input requires grad (an ``eval()``
model called without ``torch.no_grad()``, as ``torch.compile``'s users call it) runs opweave's plan and returns
outputs equal to eager's that require grad as eager's do; a backward through them raises a
:class:`~opweave.errors.UsageError` in one line (:class:`InferenceOnly`): opweave plans forward passes only.

``mode`` and ``options`` (``torch.compile(..., mode=...)`` or ``options=...``, as for inductor and apex's
``torchsched``) mean what they mean for ``opweave.compile`` (:mod:`opweave.pipeline.options`): ``mode`` one of
torch's presets (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``),
``options`` any of :data:`opweave.pipeline.OPTIONS` (``scheduler``, ``streams``, ``compiler``, ``cudagraphs``, ...),
with the same defaults: no scheduler means the device's default plan. Each graph's device follows the rule
``opweave.compile`` follows (:func:`opweave.devices.device_of`: CUDA when an example input or the graph module's weights
are on a GPU, or a ``runtime`` is given, the fake CUDA runtime running it on the CPU), and its options are resolved
once, when dynamo hands the graph over, then handed down resolved to every build of it (a swapped weight's, a
symbolic graph's first call).
``fold_bn`` is refused: dynamo's graphs hold no BatchNorm modules to fold.
An option that does not apply there is a :class:`~opweave.errors.UsageError` (dynamo reports it as
``BackendCompilerFailed``).

**Shapes.** Dynamo guards on its inputs' shapes and hands over a new graph when they no longer hold; after a size
has changed once (its automatic dynamic shapes), or with ``torch.compile(..., dynamic=True)``, the graph it hands
over has symbolic sizes. Such a graph is compiled once, at its first call, for the concrete inputs of that call,
with ``dynamic=True`` unless the options say otherwise (every size free in a segment compiler from that build), and
every later size runs that plan, as :func:`opweave.compile`'s do (:mod:`opweave.pipeline.sizes`; refused with
``options={"dynamic": False}``). Dynamo passes each symbolic size as an input of its own beside the tensors
(``view(s0, -1)``); the graph reads it from a tensor it sizes instead (:func:`sizes_from_tensors`), so no op takes
a size as a separate value, which a segment compiler would bake in and compile again for each.

Every compiled graph is kept (the last :data:`KEEP` of them) for introspection: :func:`last_compiled` and
:func:`compiled_graphs` return the :class:`opweave.Compiled` objects, with their ``schedule`` and ``plan``.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from opweave.capture.runtime import static_input
from opweave.errors import UsageError

KEEP = 32
_COMPILED: deque = deque(maxlen=KEEP)


def opweave_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                    options: dict | None = None) -> Callable:
    """TorchDynamo backend: compile ``gm`` with opweave for ``example_inputs`` (see the module docstring)."""
    example_inputs = tuple(example_inputs)
    symbolic = any(isinstance(x, torch.SymInt) or _symbolic(x) for x in example_inputs)
    options = {"dynamic": True, **(options or {})} if symbolic else dict(options or {})
    resolved = _resolved(gm, example_inputs, mode, options)
    graph: Callable
    if symbolic:  # compiled once, at its first call, for every size
        graph = SymbolicGraph(sizes_from_tensors(gm, example_inputs), resolved)
    else:
        graph = OpweaveGraph(gm, example_inputs, resolved)
    needs_grad = torch.is_grad_enabled() and (
        any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        or any(p.requires_grad for p in gm.parameters()))
    return InferenceOnly(graph, gm) if needs_grad else graph


class InferenceOnly:
    """A graph compiled with grad mode on while a parameter or an input requires grad (an ``eval()`` model called
    without ``torch.no_grad()``, as ``torch.compile``'s users call it): opweave's plan computes the outputs as under
    ``no_grad``, and they are attached to the tensors that require grad through one autograd node, so they require
    grad as eager's do, and a backward through them is refused with one line (:class:`_NoBackward`) rather than
    silently giving no gradient. A model to train is compiled with another backend."""

    def __init__(self, graph: Callable, gm: fx.GraphModule) -> None:
        self.graph, self.gm = graph, gm

    def __getattr__(self, name: str) -> Any:  # recompiles, compiled, ... of the graph it wraps
        return getattr(self.__dict__["graph"], name)

    def __call__(self, *args):
        from torch.utils import _pytree as pytree

        leaves = [x for x in (*args, *self.gm.parameters()) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not torch.is_grad_enabled() or not leaves:
            return self.graph(*args)
        box: dict = {}
        flat = _NoBackward.apply(lambda: self.graph(*args), box, *leaves)
        return pytree.tree_unflatten(list(flat), box["spec"])


class _NoBackward(torch.autograd.Function):
    """Runs ``run()`` (under ``no_grad``, as every ``Function.forward`` does) and returns its tensors as outputs of
    one node over ``leaves``; its backward raises."""

    @staticmethod
    def forward(ctx, run, box, *leaves):
        from torch.utils import _pytree as pytree

        flat, box["spec"] = pytree.tree_flatten(run())
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise UsageError("opweave: a graph whose outputs are not all tensors cannot be called with grad mode on; "
                             "call it under torch.no_grad()")
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads):
        raise UsageError("opweave compiles for inference: this graph's backward is not planned (compile the model "
                         "with another backend, e.g. torch.compile's default, to train it)")


def _resolved(gm: fx.GraphModule, example_inputs: tuple, mode: str | None, options: dict):
    """The graph's options, resolved once (its device by :func:`opweave.devices.device_of`, the rule
    ``opweave.compile`` follows); ``fold_bn`` refused (module docstring), before anything is captured."""
    from opweave.devices import device_of
    from opweave.pipeline import resolve

    resolved = resolve(device_of(gm, example_inputs, None, options), mode, options)
    if resolved.fold_bn:
        raise UsageError("option 'fold_bn' folds BatchNorm modules when capturing a module; dynamo hands over a "
                         "graph whose BatchNorm is a function of its parameters (compile the module with "
                         "opweave.compile to fold it)")
    return resolved


class SymbolicGraph:
    """What the backend returns for a dynamo graph with symbolic sizes: an :class:`OpweaveGraph` built at the first
    call, for that call's inputs, with the options resolved when dynamo handed the graph over; it builds every later
    signature itself (module docstring, Shapes)."""

    def __init__(self, gm: fx.GraphModule, options) -> None:
        self.gm, self.options = gm, options
        self.graph: OpweaveGraph | None = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self.graph is None:
            with self._lock:
                if self.graph is None:
                    self.graph = OpweaveGraph(self.gm, args, self.options)
        return self.graph(*args)


class OpweaveGraph:
    """What the backend returns for one dynamo graph: the opweave-compiled graph, built with ``options`` (resolved
    once), and rebuilt with them when the tensors dynamo passes in the baked positions are not the ones baked in
    (swapped weights, see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: tuple, options) -> None:
        self.gm, self.options = gm, options
        self.device = options.device
        self.recompiles = 0
        self._lock = threading.Lock()
        self._build(example_inputs)

    def _build(self, inputs: tuple) -> None:
        from opweave.api import compile_with

        gm, dynamic = bake_static_inputs(self.gm, inputs)
        # Outside dynamo's tracing context: shape propagation would otherwise pick up its fake mode and symbolic sizes.
        with torch._guards.tracing(None):
            compiled = compile_with(gm, tuple(inputs[i] for i in dynamic), self.options)
        static = [i for i in range(len(inputs)) if i not in set(dynamic)]
        self.compiled, self.dynamic = compiled, dynamic
        self._baked = [(i, inputs[i]) for i in static]
        _COMPILED.append(compiled)

    def __call__(self, *args):
        for i, baked in self._baked:
            if args[i] is not baked:
                with self._lock:
                    if any(args[j] is not t for j, t in self._baked):  # not already rebuilt by another thread
                        self._build(args)
                        self.recompiles += 1
                break
        return self.compiled(*[args[i] for i in self.dynamic])


def bake_static_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, list[int]]:
    """A copy of ``gm`` whose static inputs (the parameters and buffers dynamo lifted to inputs) are attributes of
    the module again, and the positions of the inputs that remain.

    Dynamo does not guard their addresses ("unguarded" static inputs) and passes the same tensors on every call, so
    they are the model's weights as far as a CUDA graph is concerned, exactly as for ``opweave.compile`` on the
    module. Baked in, they are neither copied into static buffers nor checked on every call.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = [i for i, x in enumerate(example_inputs) if static_input(x)]
    if not static or len(placeholders) != len(example_inputs):
        return gm, list(range(len(example_inputs)))
    baked = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    nodes = [n for n in baked.graph.nodes if n.op == "placeholder"]
    for i in static:
        name = f"_opweave_input_{i}"
        value = example_inputs[i]
        if isinstance(value, nn.Parameter):
            baked.register_parameter(name, value)
        else:
            baked.register_buffer(name, value)
        with baked.graph.inserting_before(nodes[i]):
            attr = baked.graph.get_attr(name)
        attr.meta = dict(nodes[i].meta)
        nodes[i].replace_all_uses_with(attr)
        baked.graph.erase_node(nodes[i])
    baked.recompile()
    return baked, [i for i in range(len(example_inputs)) if i not in set(static)]


def sizes_from_tensors(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """A copy of ``gm`` in which every use of a size input (a ``SymInt`` dynamo passes beside the tensors it sizes)
    reads that size from the first tensor input it sizes (``x.size(d)``); the size input stays, unused, so the graph
    is called as dynamo calls it. ``gm`` itself when no use changes (a size that no tensor input has as one of its
    dimensions is left as it is)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return gm
    where: dict[str, tuple[int, int]] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for d, size in enumerate(x.shape):
                if isinstance(size, torch.SymInt):
                    where.setdefault(str(size), (i, d))
    sizes = [(i, where[str(x)]) for i, x in enumerate(example_inputs)
             if isinstance(x, torch.SymInt) and str(x) in where and placeholders[i].users]
    if not sizes:
        return gm
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    nodes = [n for n in copied.graph.nodes if n.op == "placeholder"]
    first = next(n for n in copied.graph.nodes if n.op != "placeholder")
    for i, (j, d) in sizes:
        with copied.graph.inserting_before(first):
            read = copied.graph.call_method("size", (nodes[j], d))
        nodes[i].replace_all_uses_with(read)
    copied.recompile()
    return copied


def last_compiled():
    """The :class:`opweave.Compiled` of the last graph the backend compiled (None before any)."""
    return _COMPILED[-1] if _COMPILED else None


def compiled_graphs() -> list:
    """The last :data:`KEEP` compiled graphs, oldest first."""
    return list(_COMPILED)


def _symbolic(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
