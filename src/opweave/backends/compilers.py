"""Segment compilers: what turns one stream segment (an ``fx.GraphModule`` over tensors) into a fast callable.

:mod:`opweave.backends.segments` hands every segment to one :class:`SegmentCompiler`, chosen by name
(``opweave.compile(..., compiler=NAME)``); a compiler is a callable ``compiler(gm, inputs, threads) -> fn`` where
``gm`` takes the segment's tensor inputs and returns a flat tuple of its outputs, ``inputs`` are example tensors
(their shapes, strides and dtypes are the ones the result is called with), and ``threads`` is the intra-op thread
budget of the lane that runs the segment (:mod:`opweave.backends.threads`). ``fn(*tensors)`` returns the outputs as
a tuple (the same leaves as ``gm``). A compiler raises when it cannot compile a segment; the segment then runs op
by op, with a warning. A compiler whose ``dynamic_shapes`` is true also takes ``dynamic_dims`` (tensor input ->
the dimensions left free): ``fn`` then takes any size in them (:mod:`opweave.backends.segments`, Sizes).

* ``inductor`` — TorchInductor (C++ on the CPU, Triton on CUDA), as ``torch.compile`` compiles a graph. On the CPU
  it **freezes** the segment as ``torch.compile`` does with ``torch._inductor.config.freezing``: parameters become
  constants, so Inductor folds them and prepacks convolution and linear weights for oneDNN instead of reading them
  on every call. Frozen, each BatchNorm module after a convolution module is folded into it before Inductor sees
  the segment (:func:`opweave.capture.coarsen.fold_batchnorm`, which is what Inductor's freezing does itself): Inductor
  folds it while the segment's parameters are already fake tensors of the tracing context the segment is compiled
  in, and the folded bias, a real tensor among fake ones, made the segment fail to compile (a convolution and its
  BatchNorm in one segment of an uncoarsened graph ran op by op). The generated C++ kernels open OpenMP regions of a
  fixed width: they are compiled for the lane's
  ``threads`` (``cpp.threads``, which is also part of Inductor's cache key, so a cached kernel is never reused at
  another width). Inductor's on-disk FX graph cache serves identical segments (``TORCHINDUCTOR_CACHE_DIR``).
* ``onnxruntime`` — each segment exported with ``torch.onnx`` and run by one ONNX Runtime ``InferenceSession`` whose
  intra-op pool has the lane's ``threads`` (sequential executor, one inter-op thread). The pool spins between parallel
  sections, as ORT's does by default, only when the caller says the segment runs ``alone`` (the segments of a one-lane
  plan); otherwise it sleeps when idle, since another lane may need the core. Spinning matters both ways: a model
  compiled whole runs slower with the pool sleeping than spinning, so a sleeping one-lane plan lost to plain ONNX
  Runtime; but in a plan with two lanes, a segment that the replayed plan runs alone (so it gets both cores) may in
  fact overlap the other lane, and spinning pools then take the cores from each other, which made a two-lane plan
  several times slower than one lane (the measurements: docs/design.md, §3.6, segments). The export uses the
  TorchScript exporter (``dynamo=False``): it exports a segment far faster than the ``torch.export``-based exporter,
  whose cost per segment adds up to minutes over a model's hundreds of segments; when it fails the
  ``torch.export``-based one is tried. Before it is exported, a segment's average pools, sums over a stack and
  cropped zero pads are rewritten into the ops ONNX Runtime runs fast (:mod:`opweave.backends.ortrewrite`). ORT
  releases the GIL while it runs, so lanes overlap. Inputs are handed over as NumPy views (no copy
  for contiguous tensors), outputs come back as tensors sharing ORT's arrays. A segment with a non-tensor output (a
  shape read by a later segment) cannot be exported and runs op by op. With ``dynamic_dims`` the exported graph keeps
  those dimensions of its inputs, and every dimension of its outputs, symbolic (``dynamic_axes``): one session for
  every size of them. The zoo's plans built at batch 1 (BERT: 32 tokens) with such a session run at the first new
  size as fast as the plans built for that size, within the machine's noise (timed interleaved:
  ``benchmarks/results/new_signature.md``, steady ms). Three choices serve many sessions
  in one process (the server's blocks): ``shared_pool`` runs a session on ONNX Runtime's process-wide thread pool
  (:func:`shared_pool`) instead of a pool of its own (once that pool exists every session of the process runs on it:
  ONNX Runtime allows no other); ``arena=False`` gives it no memory arena (what a run allocates goes back to the C
  heap when the run ends, where an arena keeps its largest run's memory for the session's lifetime); ``share_weights``
  makes it read the graph's own parameters in place (ONNX Runtime's shared initializers, an ``OrtValue`` over each
  tensor's storage), so that several sessions of one graph (one per batch size) hold no copy of the weights. ONNX
  Runtime copies a weight it rewrites (the NCHWc layout of ``ORT_ENABLE_ALL``, a matrix product's prepacked operand),
  so those rewrites are off in a session that shares its weights.
* ``eager`` — the segment's ``GraphModule`` as it is (a check of the segment machinery); it takes any size.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import threading
import warnings
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch
from torch import fx

from opweave.backends import ortrewrite
from opweave.errors import MissingPackageError, UsageError, did_you_mean, first_line


class SegmentCompiler(Protocol):
    """Turns a segment into a callable (module docstring). ``outputs``: how many tensors ``gm`` returns, where the
    caller knows (a compiler that needs it then runs no forward pass to find out)."""

    name: str
    per_op_threads: bool  # its thread pools sleep when idle, so an op that runs alone may take every thread
    dynamic_shapes: bool  # it takes dynamic_dims: one compiled function for every size of them

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor], threads: int, *, alone: bool = False,
                 outputs: int | None = None, dynamic_dims: dict | None = None) -> Callable[..., tuple]: ...


class Eager:
    name = "eager"
    per_op_threads = False
    dynamic_shapes = True

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor], threads: int, *, alone: bool = False,
                 outputs: int | None = None, dynamic_dims: dict | None = None) -> Callable[..., tuple]:
        return gm


class Inductor:
    """TorchInductor; ``freeze`` (default: on the CPU) folds the parameters in as constants; ``eager_strides=False``
    lets each output keep the layout Inductor chose for it (``keep_output_stride`` off) instead of eager's."""

    name = "inductor"
    per_op_threads = False  # its OpenMP teams spin between kernels (opweave.backends.threads)
    dynamic_shapes = False  # compiled for the shapes it is given

    def __init__(self, freeze: bool | None = None, eager_strides: bool = True):
        self.freeze, self.eager_strides = freeze, eager_strides

    def freezes(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a graph over ``inputs`` is compiled frozen."""
        return all(x.device.type == "cpu" for x in inputs) if self.freeze is None else self.freeze

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor], threads: int, *, alone: bool = False,
                 outputs: int | None = None, dynamic_dims: dict | None = None) -> Callable[..., tuple]:
        from torch._guards import TracingContext, tracing

        if dynamic_dims:
            raise UsageError("compiler='inductor' compiles the shapes it is given (dynamic_dims)")
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        on_cpu = all(x.device.type == "cpu" for x in inputs)
        freeze = self.freezes(inputs)
        patches: dict[str, Any] = {"triton.cudagraphs": False, "freezing": freeze,
                                   "keep_output_stride": self.eager_strides}
        if on_cpu:
            patches["cpp.threads"] = threads
        if freeze:  # as Inductor's freezing would, but outside its fake mode (module docstring)
            from opweave.capture.coarsen import fold_batchnorm

            gm = fold_batchnorm(gm)
        static: dict[str, Any] = {"ignore_shape_env": True} if "ignore_shape_env" in inspect.signature(
            compile_fx).parameters else {}
        # Inside a tracing context whose fake mode has a ShapeEnv: without one Inductor bypasses its FX graph cache
        # ("No shape env") and identical segments would each compile again.
        compile_graph: Any = compile_fx  # a callable of the graph's tensors for a graph over tensors
        with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), torch.no_grad():
            return compile_graph(gm, inputs, config_patches=patches, **static)


class OnnxRuntime:
    """ONNX Runtime, one session per segment (module docstring). Made with the defaults of a call's session
    choices (``dynamic_batch``, ``shared_pool``, ``arena``, ``share_weights``: :meth:`__call__`), as a segment's
    ``compiler_options`` give them."""

    name = "onnxruntime"
    per_op_threads = True
    dynamic_shapes = True

    def __init__(self, dynamic_batch: bool = False, shared_pool: bool = False, arena: bool = True,
                 share_weights: bool = False):
        self.defaults = {"dynamic_batch": dynamic_batch, "shared_pool": shared_pool, "arena": arena,
                         "share_weights": share_weights}

    def __call__(self, gm: fx.GraphModule, inputs: list[torch.Tensor], threads: int, *, alone: bool = False,
                 outputs: int | None = None, dynamic_batch: bool | None = None, dynamic_dims: dict | None = None,
                 shared_pool: bool | None = None, arena: bool | None = None,
                 share_weights: bool | None = None) -> Callable[..., tuple]:
        """``alone``: nothing else runs while the session does (its pool may spin); ``dynamic_batch``: dimension
        0 of every input and output left free (one session for every batch size; the caller checks it at another
        batch, since a graph may have baked its batch in); ``dynamic_dims``: input position -> its dimensions left
        free, and every dimension of every output (:func:`export_onnx`; the caller checks it at other sizes too);
        ``shared_pool``: run on the process's thread pool, which
        :func:`shared_pool` made, ``threads`` being its size; ``arena``: False: no memory arena of its own;
        ``share_weights``: read ``gm``'s parameters and buffers in place (module docstring). None: the compiler's
        default, as it was made."""
        given = {"dynamic_batch": dynamic_batch, "shared_pool": shared_pool, "arena": arena,
                 "share_weights": share_weights}
        dynamic_batch, shared_pool, arena, share_weights = (
            self.defaults[k] if v is None else v for k, v in given.items())
        ort = import_onnxruntime()
        if any(x.device.type != "cpu" for x in inputs):
            raise UsageError("compiler='onnxruntime' runs on the CPU")
        ranks = None
        if outputs is None or dynamic_dims:
            with torch.no_grad():
                examples = gm(*inputs)
            if not all(isinstance(x, torch.Tensor) for x in examples):
                raise UsageError("a segment output is not a tensor (ONNX exports tensors only)")
            outputs, ranks = len(examples), [x.dim() for x in examples]
        weights: dict[str, torch.Tensor] | None = None if share_weights else {}
        model = export_onnx(gm, inputs, outputs, dynamic_batch=dynamic_batch, dynamic_dims=dynamic_dims,
                            output_ranks=ranks, weights=weights)
        options = session_options(threads, alone=alone, shared_pool=shared_pool, arena=arena)
        shared = {}
        if share_weights:
            shared = shared_initializers(model, gm)
            for name, value in shared.items():
                options.add_initializer(name, value)
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # no NCHWc copies
            options.add_session_config_entry("session.disable_prepacking", "1")
        if weights:  # read by the session where they lie: kept alive with it
            shared = external_initializers(options, weights)
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return OrtSegment(session, ort.RunOptions(), shared)


def session_options(threads: int, *, alone: bool = False, shared_pool: bool = False, arena: bool = True) -> Any:
    """The ``SessionOptions`` of a segment's session: nodes run in order, errors only logged, ``threads``
    (:func:`session_threads`), no memory arena of its own unless ``arena``."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    session_threads(options, threads, alone=alone, shared=shared_pool)
    if not arena:
        options.enable_cpu_mem_arena = False
    return options


def graph_tensors(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """``gm``'s parameters and buffers, by name."""
    tensors: dict[str, torch.Tensor] = dict(gm.named_parameters())
    tensors.update(gm.named_buffers())
    return tensors


def external_initializers(options: Any, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``weights`` handed to a session's ``options`` as the data of the initializers of those names that a model
    exported apart leaves out (:func:`export_onnx`'s ``weights``), read where they lie: each an ``OrtValue`` over the
    tensor (contiguous), which the session's owner keeps alive with it (returned)."""
    ort = import_onnxruntime()
    shared = {name: ort.OrtValue.ortvalue_from_numpy(t.detach().contiguous().numpy()) for name, t in weights.items()}
    options.add_external_initializers(list(shared), list(shared.values()))
    return shared


def shared_initializers(model: bytes, gm: fx.GraphModule) -> dict[str, Any]:
    """The initializers of the ONNX ``model`` that are ``gm``'s own parameters or buffers (the same name, shape,
    dtype and values: the exporter may have folded a constant into a tensor of the same name), each as an
    ``OrtValue`` over the tensor's storage (no copy)."""
    import onnx
    from onnx import numpy_helper

    ort = import_onnxruntime()
    tensors = graph_tensors(gm)
    out = {}
    for init in onnx.load_from_string(model).graph.initializer:
        tensor = tensors.get(init.name)
        if tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        value = torch.from_numpy(numpy_helper.to_array(init).copy())
        if value.dtype == tensor.dtype and value.shape == tensor.shape and torch.equal(value, tensor.detach()):
            out[init.name] = ort.OrtValue.ortvalue_from_numpy(tensor.detach().numpy())
    return out


_POOL: dict[str, int] = {}
_POOL_LOCK = threading.Lock()


def shared_pool(threads: int) -> bool:
    """Make ONNX Runtime's process-wide thread pool (its global intra-op pool, ``threads`` threads with the caller's;
    no inter-op pool: sessions run sequentially), unless made already; whether a session whose budget is ``threads``
    may run on it (``shared_pool=True``). Its size is fixed once made, so a process gets one, and once it exists ONNX
    Runtime lets no session of the process keep a pool of its own: a session of another budget runs on it too, at
    its size (:func:`session_threads`). ONNX Runtime's global pool spins between parallel sections, as its own pools
    do by default (its Python API sets only the sizes)."""
    ort = import_onnxruntime()
    with _POOL_LOCK:
        if "threads" not in _POOL:
            try:
                ort.set_global_thread_pool_sizes(threads, 1)
            except Exception:  # noqa: BLE001 - made before, by someone else: of a size we do not know
                _POOL["threads"] = 0
            else:
                _POOL["threads"] = threads
        return _POOL["threads"] == threads


def pool_made() -> bool:
    """Whether ONNX Runtime's process-wide thread pool exists (:func:`shared_pool` made it, or found it made)."""
    with _POOL_LOCK:
        return "threads" in _POOL


def session_threads(options, threads: int, *, alone: bool = False, shared: bool = False) -> None:
    """Set the threads of an ONNX Runtime session (its ``SessionOptions``): ``threads`` intra-op threads in a pool
    of its own, sleeping when idle unless ``alone`` (nothing runs beside it); or, with ``shared`` or once the
    process-wide pool exists (ONNX Runtime then refuses a session a pool of its own), that pool, whatever
    ``threads`` is."""
    if shared or pool_made():
        options.use_per_session_threads = False  # the pool's size is the process's (shared_pool)
        return
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if threads > 1 and not alone:  # the pool sleeps when idle: another lane may need the core
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")


class OrtSegment:
    """One ONNX Runtime session called like the segment: tensors in, a tuple of tensors out."""

    def __init__(self, session, options, shared: dict[str, Any] | None = None):
        self.session, self.options = session, options
        self.shared = shared or {}  # initializer name -> the OrtValue over the tensor it reads (kept alive here)
        self.run = session._sess.run  # the binding itself: InferenceSession.run adds checks per call
        # the exporter drops inputs the graph does not read: keep each name's position ("in{i}", export_onnx)
        self.inputs = [(i.name, int(i.name.removeprefix("in"))) for i in session.get_inputs()]
        self.outputs = [o.name for o in session.get_outputs()]

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        feeds = {name: tensors[i].numpy() for name, i in self.inputs}
        return tuple(torch.from_numpy(a) for a in self.run(self.outputs, feeds, self.options))


def export_onnx(gm: fx.GraphModule, inputs: list[torch.Tensor], outputs: int, dynamic_batch: bool = False,
                dynamic_dims: dict | None = None, output_ranks: list[int] | None = None,
                weights: dict[str, torch.Tensor] | None = None, apart: Collection[str] | None = None) -> bytes:
    """``gm`` as an ONNX model (bytes), parameters as initializers; TorchScript exporter first (module docstring).
    ``dynamic_batch``: dimension 0 of every input and output is left free. ``dynamic_dims`` (input position -> its
    dimensions) leaves those dimensions of the inputs free, and every dimension of the outputs (``output_ranks``:
    each output's rank), whose sizes ONNX Runtime infers from the inputs'.

    ``weights``: a dict to fill; where given, the parameters and buffers are left out of the bytes (initializers
    whose data lies outside the model, :func:`_weights_apart`) and ``weights`` gets each (contiguous), by name, to
    hand to ONNX Runtime (``SessionOptions.add_external_initializers``); ``apart``: the names of the weights left out
    so (None: every one), the others' data travels in the bytes. The exporter then neither writes the
    weights nor runs ONNX's shape inference over them, so a model with large weights exports and makes its session
    faster, and runs as fast (docs/design.md, §3.6, segments). Left empty where that export fails (the weights then
    travel in the bytes)."""
    names: dict[str, Any] = {"input_names": [f"in{i}" for i in range(len(inputs))],
                             "output_names": [f"out{i}" for i in range(outputs)]}
    axes: dict[str, dict[int, str]] = {}
    if dynamic_batch:
        axes = {name: {0: "batch"} for name in names["input_names"] + names["output_names"]}
    if dynamic_dims:  # besides the batch (one size for every input), the dimensions given
        for i, dims in dynamic_dims.items():
            axes.setdefault(f"in{i}", {}).update({d: f"in{i}_{d}" for d in sorted(dims)
                                                  if not (dynamic_batch and d == 0)})
        for i, rank in enumerate(output_ranks or []):
            axes.setdefault(f"out{i}", {}).update({d: f"out{i}_{d}" for d in range(rank)
                                                   if not (dynamic_batch and d == 0)})
    if axes:
        names["dynamic_axes"] = {name: dims for name, dims in axes.items() if dims}
    if isinstance(gm, fx.GraphModule):  # ops ONNX Runtime runs slowly, in a form it runs fast (ortrewrite)
        gm, _ = ortrewrite.rewrite(gm, fixed_sizes=not dynamic_dims)
    if weights is not None and isinstance(gm, fx.GraphModule):
        done = _weights_apart(gm, inputs, names, apart)
        if done is not None:
            weights.update(done[1])
            return done[0]
    try:
        return _export_quietly(gm, inputs, dynamo=False, do_constant_folding=True, **names).getvalue()
    except Exception as first:  # noqa: BLE001 - the other exporter may still manage
        if dynamic_dims and not dynamic_batch:  # the other exporter keeps fixed shapes (dynamic_batch: checked after)
            raise UsageError(f"torch.onnx cannot export the segment with free sizes: {first_line(first)}") from first
        try:
            dynamo_names = {k: v for k, v in names.items() if k != "dynamic_axes"}  # static shapes there
            program = _export_quietly(gm, inputs, dynamo=True, verbose=False, **dynamo_names)
        except Exception as second:
            raise UsageError(f"torch.onnx cannot export the segment: {first_line(first)}; "
                             f"dynamo: {first_line(second)}") from second
        return program.model_proto.SerializeToString()


def _export_quietly(gm: fx.GraphModule, inputs: list[torch.Tensor], **kwargs) -> Any:
    """``torch.onnx.export`` of ``gm`` with its warnings and printing silenced: the TorchScript exporter
    (``dynamo=False``) writes into a buffer, returned; the other exporter returns its program."""
    onnx_export: Any = torch.onnx.export  # its stub names a path; it writes to a file object too
    buffer = io.BytesIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if kwargs.get("dynamo"):
            return onnx_export(gm, tuple(inputs), **kwargs)
        onnx_export(gm, tuple(inputs), buffer, **kwargs)
    return buffer


def _weights_apart(gm: fx.GraphModule, inputs: list[torch.Tensor], names: dict,
                   apart: Collection[str] | None = None) -> tuple[bytes, dict] | None:
    """``gm`` exported without its weights (:func:`export_onnx`'s ``weights``): each parameter or buffer the graph
    reads becomes an initializer whose data is external, named as in ``gm``, and the tensor itself (read by ONNX
    Runtime in place, where it lies: no copy of the weights beyond the layouts ONNX Runtime rewrites some to; as with
    Inductor's freezing, the session runs the weights as they were when it was made, and weights changed in place
    afterwards call for a new compile); None where the TorchScript
    exporter fails or a weight has no NumPy dtype. Constants are not folded in the export (a folded weight would be
    a new tensor with no data): ONNX Runtime folds them when it makes the session. ``apart``: the names of the
    weights left out (None: every one); the others are initializers with their data."""
    import onnx
    from onnx import numpy_helper

    tensors = graph_tensors(gm)
    if any(t.device.type != "cpu" or t.dtype in (torch.bfloat16, torch.complex32) for t in tensors.values()):
        return None
    try:
        buffer = _export_quietly(gm, inputs, dynamo=False, do_constant_folding=False, export_params=False, **names)
    except Exception:  # noqa: BLE001 - the export with its weights decides what to say
        return None
    model = onnx.load_from_string(buffer.getvalue())
    out: dict[str, torch.Tensor] = {}
    for value in list(model.graph.input):
        tensor = tensors.get(value.name)
        if tensor is None:
            continue
        copy = tensor.detach().contiguous()
        model.graph.input.remove(value)
        if apart is not None and value.name not in apart:
            model.graph.initializer.append(numpy_helper.from_array(copy.numpy(), value.name))
            continue
        init = onnx.TensorProto(name=value.name, dims=list(copy.shape),
                                data_type=onnx.helper.np_dtype_to_tensor_dtype(copy.numpy().dtype))
        init.data_location = onnx.TensorProto.EXTERNAL
        init.external_data.add(key="location", value="opweave-memory")
        model.graph.initializer.append(init)
        out[value.name] = copy
    if any(i.name not in names["input_names"] for i in model.graph.input):
        return None  # an input that is neither the segment's nor a weight (a weight named like an input renames it)
    return model.SerializeToString(), out


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingPackageError("compiler='onnxruntime' needs ONNX Runtime: pip install onnxruntime") from exc
    return onnxruntime


COMPILERS: dict[str, Callable[[], SegmentCompiler]] = {"inductor": Inductor, "onnxruntime": OnnxRuntime,
                                                       "eager": Eager}


def available() -> list[str]:
    """The compilers that can run here, fastest first where that is known (ONNX Runtime only when installed)."""
    try:
        import_onnxruntime()
    except ImportError:
        return ["inductor"]
    return ["onnxruntime", "inductor"]


def get(name: str, **options) -> SegmentCompiler:
    """The compiler called ``name``, made with ``options`` (its constructor's keywords);
    :class:`~opweave.errors.UsageError` naming the choices otherwise."""
    if name not in COMPILERS:
        raise UsageError(f"compiler must be one of {', '.join(COMPILERS)} (or None), got {name!r}"
                         f"{did_you_mean(name, COMPILERS)}")
    return COMPILERS[name](**options)
