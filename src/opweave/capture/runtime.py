"""The captured model at run time: :class:`Captured` binds inputs, runs one op's fx nodes, and rebuilds the output.

Every fx node becomes a closure ``env -> value`` (:func:`_compile`) that runs it as ``torch.fx.Interpreter`` would,
with its arguments read from the environment by precompiled loaders: no per-node dispatch on the node kind at run
time. An op that raises is re-raised as :class:`~opweave.errors.CaptureError` naming the op and its fx node
("while executing ..."), with the original error as its cause.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, ClassVar

import torch
from torch import fx

from opweave.capture import opinfo
from opweave.capture.functionalize import aliases, writes_state
from opweave.errors import CaptureError, UsageError, first_line
from opweave.ir.graph import OpGraph

Step = Callable[[dict[str, Any]], Any]


@dataclass(eq=False)
class Captured:
    """A captured model: its OpGraph and everything needed to run it op by op.

    Execution contract (what the CPU and CUDA backends rely on)::

        with torch.no_grad():                      # on every thread that runs ops (see backends.cpu)
            env = captured.bind(args, kwargs)      # inputs, parameters, input-only views
            for op in captured.graph.topo_order:   # or any order/streams that respect graph.edges
                captured.run_op(op, env)
            out = captured.output(env)             # same structure and values as model(*args, **kwargs)

    ``run_op`` writes only the env keys of its own fx nodes, so distinct ops may run on different threads.
    Parameters live in ``gm``; move them with ``captured.gm.to(device)`` (in place: ``run_op`` holds ``gm``'s
    submodules, and ``bind`` re-reads ``get_attr`` constants on every call).

    ``bind`` takes inputs of the shapes the model was captured with, and of other sizes in the dimensions
    :meth:`free` has freed (a graph whose ops read sizes from their inputs, as ``symbolic_trace``'s and a program's
    with dynamic dimensions do, runs at any of them; whether its output is right at a size is the caller's check,
    :mod:`opweave.pipeline.sizes`). A tensor's rank and dtype are always checked.
    """

    graph: OpGraph
    gm: fx.GraphModule
    nodes: dict[str, list[fx.Node]]
    signature: inspect.Signature | None = None  # the model's forward(): keyword arguments are bound by it
    example_inputs: tuple = ()  # the inputs it was captured with, keyword arguments bound to their positions
    # the graph's output on example_inputs as capture checked it against the model, for the build that follows the
    # capture (opweave.compile hands it on and drops it: weights or inputs changed later would make it stale)
    example_output: Any = field(default=None, repr=False, compare=False)
    _inputs: list[tuple[fx.Node, tuple | None]] = field(init=False, repr=False)
    _free: dict[int, frozenset[int]] = field(init=False, repr=False)  # input -> dims bind takes at any size
    _constants: list[tuple[str, list[str]]] = field(init=False, repr=False)
    _prelude: list[tuple[str, Step]] = field(init=False, repr=False)
    _steps: dict[str, list[tuple[str, Step]]] = field(init=False, repr=False)
    _output: Step = field(init=False, repr=False)

    any_batch: ClassVar[bool] = False  # a compiled whole that takes any size of dimension 0 (segments.Segmented)

    def __post_init__(self) -> None:
        owned = {n for group in self.nodes.values() for n in group}
        self._inputs, self._constants, self._prelude, self._free = [], [], [], {}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                metas = opinfo.node_metas(node)
                self._inputs.append((node, (tuple(metas[0].shape), metas[0].dtype) if metas else None))
            elif node.op == "get_attr":
                self._constants.append((node.name, node.target.split(".")))
            elif node.op == "output":
                self._output = _loader(node.args[0])
            elif node not in owned:
                self._prelude.append((node.name, _compile(node, self.gm)))
        self._steps = {op: [(n.name, _compile(n, self.gm)) for n in group] for op, group in self.nodes.items()}

    def bind(self, args: tuple, kwargs: dict | None = None) -> dict[str, Any]:
        """The environment for one run: placeholders ← ``args`` and ``kwargs`` (checked against the captured shapes
        and dtypes), ``get_attr`` constants, and the trivial nodes that depend only on those."""
        if kwargs:
            args = positional(self.signature, tuple(args), kwargs, self.graph.name)
        flat = list(self.gm.graph.process_inputs(*args))
        if len(flat) > len(self._inputs):
            raise UsageError(f"{self.graph.name}: expected {len(self._inputs)} inputs, got {len(flat)}")
        env: dict[str, Any] = {}
        for i, (node, expected) in enumerate(self._inputs):
            if i < len(flat):
                value = flat[i]
            elif node.args:  # a forward() default
                value = node.args[0]
            else:
                raise UsageError(f"{self.graph.name}: missing input {i} ({node.name!r})")
            signature = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
            if self.any_batch and signature is not None and expected is not None and signature[0] and expected[0]:
                signature = ((expected[0][0], *signature[0][1:]), signature[1])  # dimension 0 may be any size
            if expected is not None and signature is not None and signature != expected and not self._takes(
                    i, signature, expected):
                raise UsageError(f"{self.graph.name}: input {i} ({node.name!r}) has shape {tuple(value.shape)} and "
                                 f"dtype {value.dtype}; it was captured with {expected[0]} and {expected[1]} "
                                 "(capture again for this signature)")
            env[node.name] = value
        for name, path in self._constants:
            value = self.gm
            for part in path:
                value = getattr(value, part)
            env[name] = value
        for name, step in self._prelude:
            env[name] = step(env)
        return env

    def free(self, args: tuple) -> bool:
        """Let :meth:`bind` take inputs shaped like ``args`` from now on: each dimension in which a tensor of
        ``args`` differs from the captured shape is freed. False, freeing nothing, when ``args`` are not the
        captured inputs in other sizes (another count, rank or dtype)."""
        flat = list(self.gm.graph.process_inputs(*args))
        if len(flat) > len(self._inputs):
            return False
        free = {}
        for i, value in enumerate(flat):
            expected = self._inputs[i][1]
            if expected is None or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != len(expected[0]) or value.dtype != expected[1]:
                return False
            dims = {d for d, (a, b) in enumerate(zip(value.shape, expected[0], strict=True)) if a != b}
            if dims:
                free[i] = frozenset(dims)
        self._free = {i: self._free.get(i, frozenset()) | free.get(i, frozenset()) for i in {*self._free, *free}}
        return True

    def _takes(self, i: int, signature: tuple, expected: tuple) -> bool:
        """Whether input ``i`` of ``signature`` (shape, dtype) differs from ``expected`` only in freed dims."""
        shape, dtype = signature
        free = self._free.get(i) or frozenset()
        return bool(free) and dtype == expected[1] and len(shape) == len(expected[0]) and all(
            a == b or d in free for d, (a, b) in enumerate(zip(shape, expected[0], strict=True)))

    def run_op(self, op_id: str, env: dict[str, Any]) -> None:
        """Run op ``op_id``'s fx nodes in order (main node, then absorbed trivial nodes), reading/writing ``env``."""
        for name, step in self._steps[op_id]:
            try:
                env[name] = step(env)
            except Exception as exc:
                raise self._failure(op_id, name, exc, env) from exc

    def run(self, args: tuple) -> Any:
        """One run op by op in the topological order, under ``no_grad``: the reference a backend's or a
        candidate's output is held against."""
        with torch.no_grad():
            return self.output(self.run_all(self.bind(tuple(args))))

    def run_all(self, env: dict[str, Any]) -> dict[str, Any]:
        """Every op run once on the bound ``env``, in the topological order; ``env`` then holds every value."""
        for op in self.graph.topo_order:
            self.run_op(op, env)
        return env

    def emit(self, op_id: str, graph: fx.Graph, load: Callable[[fx.Node], fx.Node]) -> dict[fx.Node, fx.Node]:
        """Copy op ``op_id``'s fx nodes into ``graph`` (generated lane code, :mod:`opweave.backends.lanecode`);
        ``load(node)`` gives the node in ``graph`` that holds a value from outside the op. Returns each of the op's
        nodes with its copy."""
        made: dict[fx.Node, fx.Node] = {}
        for node in self.nodes[op_id]:
            made[node] = graph.node_copy(node, lambda a: made[a] if a in made else load(a))
        return made

    def _failure(self, op_id: str, name: str, exc: Exception, env: dict[str, Any]) -> CaptureError:
        """The error of a failed op: the op, what it runs on which tensors (dtype and shape), and its fx node as
        ``torch.fx.Interpreter`` names it."""
        node = next(n for n in self.nodes[op_id] if n.name == name)
        tensors = [env.get(a.name) for a in node.all_input_nodes]
        shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors
                           if isinstance(t, torch.Tensor))
        return CaptureError(f"{self.graph.name}: op {op_id!r} ({opinfo.target_name(node, self.gm)} on "
                            f"{shapes or 'no tensors'}) failed while executing fx node {name!r} "
                            f"({node.format_node()}): {first_line(exc, 10**6)}")

    def output(self, env: dict[str, Any]) -> Any:
        """The model's output, in the structure ``model(*args)`` returns, rebuilt from ``env``."""
        return self.gm.graph.process_outputs(self._output(env))

    def state_writes(self) -> dict[str, set[str]]:
        """Op id -> the ``get_attr`` nodes (module state: a KV cache's buffers) it writes in place, for every op that
        writes one, in capture order. A compiler that copies the model's weights cannot run such an op: it runs
        as it is (:mod:`opweave.backends.segments`)."""
        writes: dict[str, set[str]] = {}
        for op, group in self.nodes.items():
            for node in group:
                if writes_state(node, self.gm):
                    target = node.args[0]
                    assert isinstance(target, fx.Node)
                    writes.setdefault(op, set()).update(a.name for a in aliases(target, self.gm) if a.op == "get_attr")
        return writes

    def readers(self) -> dict[str, list[str]]:
        """fx node name → ids of the ops that read its value (a value may be freed once all of them finished)."""
        out: dict[str, list[str]] = {}
        for op, group in self.nodes.items():
            for node in group:
                for arg in node.all_input_nodes:
                    if op not in out.setdefault(arg.name, []):
                        out[arg.name].append(op)
        return out


def as_tuple(example_inputs) -> tuple:
    """Example inputs as a tuple (a list becomes one; one tensor becomes a one-tuple)."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def static_input(x: Any) -> bool:
    """Whether ``x`` keeps its address between calls: a parameter, or a tensor dynamo marked static (the parameters
    and buffers it lifts to inputs), so a CUDA graph may read it in place."""
    return isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None


def tensor_state(t: torch.Tensor) -> tuple | None:
    """What says that ``t`` still holds what it held when a copy was made of it (a folded or moved weight): its
    storage (by identity: :class:`SharedCopies` keeps a weak reference to it, so that identity is not reused once
    the storage is freed), where in it, its shape, strides, dtype, device, ``requires_grad`` and version (bumped by
    every in-place op on it or its views). None for an inference tensor, which keeps no version, and for a tensor
    without a storage of its own (sparse, wrapper subclasses): a copy of those cannot be known to be current. Writes
    that bypass the version counter (through ``.data`` or a NumPy view) are not seen."""
    try:
        version = t._version
        storage = t.untyped_storage()
        return (storage._cdata, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                t.device, t.requires_grad, version)
    except (RuntimeError, NotImplementedError):  # no version, or no storage (sparse, wrapper subclasses)
        return None


class SharedCopies:
    """Copies made of a model's tensors (a BatchNorm folded into its convolution, weights moved to another device),
    each made once and shared by every caller while its sources stay as they are (:func:`tensor_state`; a weak
    reference to each source's storage keeps that storage's identity from being reused) and while a caller still
    holds the copy (the cache keeps only a weak reference to it). Entries are keyed by the sources' states, never by
    weak references to the tensors themselves, which would stop ``torch.utils.swap_tensors`` (``Module.to`` under
    ``torch.__future__.set_swap_module_params_on_conversion``) from swapping them."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, sources: list[torch.Tensor], make: Callable[[], Any], owners: tuple = ()) -> Any:
        """The copy of ``sources`` that ``make`` makes, for ``key`` (what else the copy depends on); ``owners``,
        objects the copy was made from, must be the very ones (held by weak reference). A source without a state
        (:func:`tensor_state`) is copied anew each time."""
        from torch.multiprocessing.reductions import StorageWeakRef

        states = [tensor_state(t) for t in sources]
        if None in states:
            return make()
        full = (key, *states)
        with self._lock:
            known = self._entries.get(full)
            made = None
            if known is not None and self._alive(known) and all(
                    r() is o for r, o in zip(known[1], owners, strict=True)):
                made = known[2]()
            if made is None:
                made = make()
                self._entries = {k: e for k, e in self._entries.items() if self._alive(e)}
                storages = [StorageWeakRef(t.untyped_storage()) for t in sources]
                self._entries[full] = (storages, [weakref.ref(o) for o in owners], weakref.ref(made))
            return made

    @staticmethod
    def _alive(entry: tuple) -> bool:
        """Whether the entry's sources and its copy still exist."""
        storages, _, made = entry
        return made() is not None and not any(s.expired() for s in storages)


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``module`` holds: its parameters and buffers and, for a GraphModule, the plain tensor attributes
    its ``get_attr`` nodes read (torch.export lifts constants into those)."""
    out = [*module.parameters(), *module.buffers()]
    if isinstance(module, fx.GraphModule):
        for node in module.graph.nodes:
            if node.op == "get_attr":
                value = module
                for part in node.target.split("."):
                    value = getattr(value, part)
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


def positional(signature: inspect.Signature | None, args: tuple, kwargs: dict, model_name: str) -> tuple:
    """``args`` and ``kwargs`` as one tuple of positional arguments of ``forward``: each keyword argument at its
    parameter's position, skipped parameters before it at their defaults. A keyword-only parameter, or one that
    ``forward`` takes only through ``**kwargs``, cannot be passed by position: :class:`UsageError`."""
    if not kwargs:
        return tuple(args)
    if signature is None:
        raise UsageError(f"{model_name}: keyword arguments need an inspectable forward() signature")
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise UsageError(f"{model_name}: {err}") from err
    params = [p for p in signature.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params]
    extra = [k for k in kwargs if k not in names]
    if extra:
        raise UsageError(f"{model_name}: keyword argument(s) {', '.join(extra)} cannot be passed by position "
                         "(keyword-only or **kwargs in forward()); wrap the model in a module whose forward takes them")
    last = max(names.index(k) for k in bound.arguments)
    return tuple(bound.arguments[p.name] if p.name in bound.arguments else p.default for p in params[:last + 1])


# ---- 7. node closures ---------------------------------------------------------------------------------------------
def _compile(node: fx.Node, gm: fx.GraphModule) -> Step:
    """A closure ``env -> value`` that runs one node as torch.fx.Interpreter would."""
    fn: Any
    if node.op == "call_function":
        fn = node.target
    elif node.op == "call_method":
        method = node.target

        def fn(self, *args, **kwargs):
            return getattr(self, method)(*args, **kwargs)
    elif node.op == "call_module":
        fn = opinfo.submodule(gm, node)
    else:
        raise CaptureError(f"cannot run fx node {node.name!r} of kind {node.op!r}")
    args = _loader(tuple(node.args))
    if not node.kwargs:
        return lambda env: fn(*args(env))
    kwargs = _loader(dict(node.kwargs))
    return lambda env: fn(*args(env), **kwargs(env))


def _has_node(arg: Any) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return bool(found)


def _loader(arg: Any) -> Step:
    """A closure ``env -> arg`` with every fx Node in ``arg`` replaced by its value in ``env``."""
    if isinstance(arg, fx.Node):
        return itemgetter(arg.name)
    if not _has_node(arg):
        return lambda env: arg
    if isinstance(arg, tuple) and not hasattr(arg, "_fields") and all(isinstance(a, fx.Node) for a in arg):
        getter = itemgetter(*(a.name for a in arg))
        return (lambda env: (getter(env),)) if len(arg) == 1 else getter
    if isinstance(arg, (tuple, list)):
        parts = [_loader(a) for a in arg]
        if hasattr(arg, "_fields"):  # a namedtuple
            return lambda env: type(arg)(*(p(env) for p in parts))
        build = tuple if isinstance(arg, tuple) else list
        return lambda env: build([p(env) for p in parts])
    if isinstance(arg, dict):
        parts_by_key = {k: _loader(v) for k, v in arg.items()}
        return lambda env: {k: p(env) for k, p in parts_by_key.items()}
    if isinstance(arg, slice):
        start, stop, step = _loader(arg.start), _loader(arg.stop), _loader(arg.step)
        return lambda env: slice(start(env), stop(env), step(env))
    raise CaptureError(f"cannot load fx argument {arg!r}")


