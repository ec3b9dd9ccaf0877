"""A GPU fitted to measurements: each op's kernels and their time, and what a CUDA Graph call costs around them.

The model has two halves, each a handful of numbers with a physical meaning, read from a device file
(``costs/data/h200.json`` for the NVIDIA H200, written by ``opweave calibrate``; the H100 is derived from it by
datasheet ratios, see :func:`device`):

**An op alone** (class ``c`` of :func:`op_class`: conv, pointwise conv, depthwise conv, matmul, norm, elementwise,
pool, reduce, data) launches ``k_c`` kernels and takes ::

    t = k_c x floor_c + max(flops / (eff_c x peak(c, dtype) x fill), bytes / (mem_eff x bandwidth x fill_mem))

* ``floor_c``: the shortest a kernel of the class runs (launch into the SMs, one tile, drain), per kernel;
* ``peak(c, dtype)``: the datasheet throughput the class runs at: convolutions on tensor cores (TF32 for float32,
  as cuDNN does by default; FP16/BF16 dense tensor for half types), matmuls on FP32 CUDA cores for float32
  (PyTorch's default, no TF32) and on tensor cores for half types, everything else on FP32 CUDA cores;
  ``eff_c`` is the share of it the class's kernels reach when they fill the device;
* ``fill = min(1, output elements / (tile x SMs))`` for a convolution: an implicit GEMM with fewer output tiles
  than SMs leaves SMs idle (one wave of ``tile`` = 64 x 64 outputs per SM), so below a wave its time stops
  shrinking with its size; for every other class ``fill = fill_mem = min(1, elements / (SMs x threads per SM))``
  with ``elements`` = bytes / element size (a thread per element read or written): too few threads in flight cannot
  pull the full bandwidth (a matmul at batch 1 is a GEMV, bound by its weights, which cuBLAS splits over the SMs).
  Half types halve ``bytes`` (the graph's bytes are scaled by the element size).

``k_c``, ``floor_c`` and ``eff_c`` are fitted per class on a real trace of every op alone (``opweave calibrate
--trace``: the kernels each op launched and their durations); a class the trace lacks borrows the parameters of the
class that runs the same way (depthwise conv: pool's, a windowed kernel on CUDA cores, one kernel; reduce: the
adaptive average pool's; ...), named in the file's ``classes[c].source``. A convolution's kernels: a pointwise
(1x1) convolution at batch 1 is one GEMM over NCHW, sometimes with a split-K reduction; every other convolution is
an implicit GEMM in NHWC with its layout transforms (input and filter in, sometimes the output back).

**A call** (``opweave.backends.simulate`` under the ``gpu`` model, one CUDA Graph replay):

A graph holds kernels and the edges between them; a plan's streams and waits become edges only (a stream's order
is a chain of edges, each wait one edge), and each kind of edge has its latency:

* ``kernel_gap_us``: a same-stream edge: between the end of a kernel and the start of the next on its stream;
  an op of ``k`` kernels takes ``k - 1`` gaps between its own kernels and one after its stream's previous kernel;
* ``event_wait_us``: a cross-stream edge (an event wait): between the end of the recorded kernel and the start of
  the kernel waiting for it; it holds that kernel, not the waiting stream, and the kernel starts when the later of
  its two edges allows;
* ``dispatch_us``: the device's front end starts one kernel at a time, this long apart, whatever the stream, in the
  order the kernels become ready: the most kernels per µs a graph can start however many streams it uses;
* ``call_us`` + (input + output bytes) / bandwidth: copying the inputs into the graph's buffers, launching it,
  cloning the outputs;
* concurrent ops share the device by processor sharing: an op fills ``share = min(1, concurrency x fill_mem)`` of
  it; while the running ops' shares sum past 1 they slow down in proportion (:mod:`opweave.costs.contention`).
  ``concurrency`` is how much more of the device an op holds than its threads say (registers, shared memory,
  memory bandwidth).

Where a profile measured an op (``latency``), its measured time replaces the first half; the kernel count stays
the class's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from opweave.costs.model import Costs, GpuModel, file_fields
from opweave.errors import UsageError, did_you_mean
from opweave.ir import kinds
from opweave.ir.graph import Op, OpGraph

FORMAT = "opweave.device/1"
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
CLASSES = ("conv", "conv_pointwise", "conv_depthwise", "matmul", "norm", "elementwise", "pool", "reduce", "data")
TILED = ("conv", "conv_pointwise")  # GEMM tiles over the output: fill by output tiles
TILE_OUTPUTS = 64 * 64  # outputs of one GEMM tile (cuBLAS/cuDNN's 64x64 tiles on this trace)
EPILOGUE_DEPTH = 4  # what a coarse op's epilogues (activation, residual add, norm) add to its depth, at most
SPLIT_K_DEPTH = 384  # reduction depth past which cuBLAS splits a small GEMM (between 256 and 480 on the trace)

# the class that runs the same way, for a class the trace did not measure
BORROW = {"conv_depthwise": "pool", "reduce": "pool", "data": "elementwise", "norm": "elementwise",
          "matmul": "conv_pointwise", "conv_pointwise": "conv", "conv": "conv_pointwise", "pool": "elementwise",
          "elementwise": "data"}

# The class an op's kind (opweave.ir.kinds) is priced as: the fit's classes, coarser than the kinds
COST_CLASS = {"conv": "conv", "linear": "matmul", "matmul": "matmul", "einsum": "matmul", "rnn": "matmul",
              "attention": "matmul", "norm": "norm", "softmax": "norm", "pool": "pool", "adaptive_pool": "reduce",
              "reduce": "reduce", "data": "data"}


@dataclass(frozen=True)
class Datasheet:
    """The device's datasheet figures (dense, without sparsity)."""

    name: str
    sms: int
    threads_per_sm: int
    fp32_tflops: float  # CUDA-core FP32
    tf32_tflops: float  # TF32 tensor core
    fp16_tflops: float  # FP16/BF16 tensor core
    bandwidth_gbs: float


@dataclass(frozen=True)
class OpClass:
    """Fitted figures of one op class: kernels per op, the shortest kernel, the share of peak reached."""

    kernels: float = 1.0
    floor_us: float = 2.0
    efficiency: float = 0.3
    source: str = "default"  # "trace: N ops", or "as <class>"


@dataclass(frozen=True)
class Device:
    """A fitted GPU: datasheet, per-class op costs, and what a call costs around them (see the module doc)."""

    datasheet: Datasheet
    classes: dict[str, OpClass]
    mem_efficiency: float = 0.8
    kernel_gap_us: float = 1.0
    event_wait_us: float = 1.0
    call_us: float = 20.0
    concurrency: float = 1.0
    dispatch_us: float = 0.0
    fit: dict = field(default_factory=dict)  # what it was fitted on and how well (opweave calibrate)

    @property
    def name(self) -> str:
        return self.datasheet.name

    def op_class(self, name: str) -> OpClass:
        return self.classes.get(name) or OpClass(source="default")

    # ---- file ------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Device:
        fields = file_fields(cls, data, FORMAT, "device file")
        try:
            sheet = Datasheet(**fields.pop("datasheet"))
            classes = {name: OpClass(**c) for name, c in fields.pop("classes").items()}
        except (KeyError, TypeError) as exc:
            raise UsageError(f"device file: bad datasheet or classes ({exc})") from None
        wrong = sorted(set(classes) - set(CLASSES))
        if wrong:
            raise UsageError(f"device file: unknown op class {wrong[0]!r}; classes: {', '.join(CLASSES)}")
        return cls(sheet, classes, **fields)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Device:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise UsageError(f"cannot read device file {str(path)!r}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None

    def gpu_model(self, graph: OpGraph | None = None, dtype: str = "float32") -> GpuModel:
        """The simulator's ``gpu`` model of one call of ``graph`` on this device."""
        io_us = io_bytes(graph, dtype) / (self.datasheet.bandwidth_gbs * 1e3) if graph is not None else 0.0
        return GpuModel(launch_overhead_ms=0.0, graph_launch_overhead_ms=(self.call_us + io_us) / 1e3,
                        event_overhead_ms=self.event_wait_us / 1e3, cuda_graph=True,
                        kernel_gap_ms=self.kernel_gap_us / 1e3, dispatch_ms=self.dispatch_us / 1e3)


# ---- the H200 file and the presets derived from it ----------------------------------------------------------------
H100 = Datasheet("NVIDIA H100 SXM5", 132, 2048, 67.0, 494.7, 989.5, 3350.0)
FITTED = ("h200", "h100")


def shipped_path(name: str = "h200") -> Path:
    """Where the package keeps the device file of ``name``."""
    return Path(str(resources.files("opweave.costs") / "data" / f"{name}.json"))


def user_path(name: str = "h200") -> Path:
    """Where ``opweave calibrate`` writes the device file of ``name`` for this user unless told otherwise, and where
    :func:`device` looks first: ``$OPWEAVE_CONFIG_DIR/devices/NAME.json`` (default ``$XDG_CONFIG_HOME/opweave``,
    else ``~/.config/opweave``)."""
    import os

    root = os.environ.get("OPWEAVE_CONFIG_DIR") or Path(os.environ.get("XDG_CONFIG_HOME") or
                                                         Path.home() / ".config") / "opweave"
    return Path(root) / "devices" / f"{name}.json"


def device_path(name: str = "h200") -> Path:
    """The device file of ``name`` that :func:`device` reads: this user's (:func:`user_path`) when there is one, else
    the one shipped in the package."""
    mine = user_path(name)
    return mine if mine.exists() else shipped_path(name)


def device(name: str = "h200", path: str | Path | None = None) -> Device:
    """The fitted device ``name``: ``h200`` from its file (``path``, default :func:`device_path`: this user's refit
    if there is one, else the one shipped), ``h100`` derived from the H200 fit by datasheet ratios (the same GH100
    die, SMs and clocks: the same kernels, floors and overheads; 3.35 against 4.8 TB/s of memory bandwidth) until an
    H100 is measured."""
    key = name.lower()
    if key not in FITTED:
        raise UsageError(f"no fitted device {name!r}{did_you_mean(key, FITTED)}; fitted: {', '.join(FITTED)}")
    fitted = Device.load(path or device_path("h200"))
    if key == "h100":
        return replace(fitted, datasheet=H100, fit={**fitted.fit, "derived": "from the H200 fit by datasheet ratios"})
    return fitted


# ---- one op -------------------------------------------------------------------------------------------------------
def op_class(graph: OpGraph, op: Op) -> str:
    """The class of ``op``: its kind's (:data:`COST_CLASS`, the kind :mod:`opweave.ir.kinds` gives it); a
    convolution is ``conv_pointwise`` when its reduction depth (FLOPs / 2 / output elements) equals its input's
    channels (1x1, one group), ``conv_depthwise`` when the depth is not a whole multiple of them (grouped), ``conv``
    else (or when the input's channels are unknown). A coarse op's epilogues add up to :data:`EPILOGUE_DEPTH` to the
    depth, which is allowed for (up to a tenth of a tap)."""
    kind = COST_CLASS.get(kinds.of(op), "elementwise")
    if kind != "conv":
        return kind
    out = _numel(op.shape)
    preds = graph.preds[op.id]
    shape = graph.op[preds[0]].shape if preds else None
    if not out or not shape or len(shape) < 2 or not op.flops:
        return "conv"
    depth, channels = op.flops / 2 / out, shape[1]
    taps, rest = divmod(depth, channels)  # kernel taps of a dense convolution, and what is left over
    if taps < 1 or rest > min(EPILOGUE_DEPTH, channels / 10):
        return "conv_depthwise"
    return "conv_pointwise" if taps == 1 else "conv"


def _numel(shape) -> int:
    return math.prod(shape) if shape else 0


def _batch(op: Op) -> int:
    return op.shape[0] if op.shape else 1


def kernels(device: Device, graph: OpGraph, op: Op, cls: str | None = None) -> float:
    """Kernels ``op`` launches: its class's count; a pointwise convolution at batch > 1 is no longer one GEMM over
    NCHW (the batch dimension sits outside the channels) and counts as a convolution."""
    cls = cls or op_class(graph, op)
    if cls == "conv_pointwise" and _batch(op) > 1:
        cls = "conv"
    return device.op_class(cls).kernels + (1.0 if cls == "conv_pointwise" and split_k(device.datasheet, op) else 0.0)


def split_k(sheet: Datasheet, op: Op) -> bool:
    """Whether cuBLAS splits a pointwise convolution's GEMM over its reduction (one more kernel, the reduction of the
    partial sums): when its output has fewer tiles than the device has SMs and the reduction is deeper than
    :data:`SPLIT_K_DEPTH` (on the H200 trace: every 1x1 convolution with depth 480 or more at 14x14 and below, none of
    depth 256 or less)."""
    out = _numel(op.shape)
    return bool(out) and out < TILE_OUTPUTS * sheet.sms and op.flops / 2 / out > SPLIT_K_DEPTH


def peak_tflops(sheet: Datasheet, cls: str, dtype: str) -> float:
    half = dtype in ("float16", "bfloat16")
    if cls in ("conv", "conv_pointwise"):
        return sheet.fp16_tflops if half else sheet.tf32_tflops
    if cls == "matmul":
        return sheet.fp16_tflops if half else sheet.fp32_tflops
    return sheet.fp32_tflops


def op_time_us(device: Device, graph: OpGraph, op: Op, dtype: str = "float32", launches: float | None = None) -> float:
    """The time of ``op`` alone on ``device`` computing in ``dtype``, kernels' floors included (module doc): one
    floor per kernel of its class, or per kernel of ``launches`` where a compiler decided its kernels."""
    cls = op_class(graph, op)
    c = device.op_class(cls)
    sheet = device.datasheet
    work = terms_us(sheet, cls, op, dtype)
    count = kernels(device, graph, op, cls) if launches is None else launches
    return count * c.floor_us + max(work[0] / c.efficiency, work[1] / device.mem_efficiency)


def terms_us(sheet: Datasheet, cls: str, op: Op, dtype: str) -> tuple[float, float]:
    """(compute at full efficiency, memory at full efficiency) of ``op``, µs, fill included."""
    scale = ITEMSIZE[dtype] / ITEMSIZE.get(op.dtype or dtype, ITEMSIZE[dtype])  # integer ops keep their bytes
    fill_mem = min(1.0, max(1.0, op.bytes / ITEMSIZE.get(op.dtype or dtype, 4)) / (sheet.sms * sheet.threads_per_sm))
    fill = min(1.0, max(1, _numel(op.shape)) / (TILE_OUTPUTS * sheet.sms)) if cls in TILED else fill_mem
    flops = op.flops / 2 if cls == "conv_depthwise" else op.flops  # a multiply-add per window element, as a pool
    compute = flops / (peak_tflops(sheet, cls, dtype) * 1e6 * fill)
    memory = op.bytes * scale / (sheet.bandwidth_gbs * 1e3 * fill_mem)
    return compute, memory


def share(device: Device, op: Op) -> float:
    """The share of the device ``op`` fills alone (processor sharing's utilization)."""
    sheet = device.datasheet
    return min(1.0, max(0.01, device.concurrency * _numel(op.shape) / (sheet.sms * sheet.threads_per_sm)))


def io_bytes(graph: OpGraph, dtype: str = "float32") -> float:
    """Bytes a call copies in and clones out: what the source ops read beyond their own output (the inputs, and
    those ops' weights, an over-estimate of a few kB) plus the sink ops' outputs."""
    size = ITEMSIZE[dtype]
    total = 0.0
    for o in graph.ops:
        out = _numel(o.shape) * size
        scale = size / ITEMSIZE.get(o.dtype or dtype, size)
        if not graph.preds[o.id]:
            total += max(0.0, o.bytes * scale - out)
        if not graph.succs[o.id]:
            total += out
    return total


def costs(graph: OpGraph, dev: Device, dtype: str = "float32", latency_ms: Mapping[str, float] | None = None,
          launches: Mapping[str, float] | None = None) -> Costs:
    """Costs of ``graph`` on the fitted ``dev`` under the ``gpu`` model: each op's time alone (from ``latency_ms``
    where a profile measured it, else :func:`op_time_us`), its kernels and its share, and the call's overheads
    (:meth:`Device.gpu_model`). ``launches``: the kernels each op launches where a compiler decided them (Inductor's
    count of a ``graph="inductor"`` op, :mod:`opweave.backends.inductorgraph`), counted for its floors and gaps
    instead of its class's. Schedulers see it as they would a profile: use ``dataclasses.replace(costs,
    model="ideal")``, which is what the GPU benchmark scheduled on."""
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r}{did_you_mean(dtype, DTYPES)}; choose one of {', '.join(DTYPES)}")
    measured, launches = latency_ms or {}, launches or {}
    return Costs(
        latency_ms={o.id: measured[o.id] if o.id in measured
                    else op_time_us(dev, graph, o, dtype, launches.get(o.id)) / 1e3 for o in graph.ops},
        utilization={o.id: share(dev, o) for o in graph.ops},
        category={o.id: o.category for o in graph.ops},
        kernels={o.id: launches[o.id] if o.id in launches else kernels(dev, graph, o) for o in graph.ops},
        model="gpu",
        gpu=dev.gpu_model(graph, dtype),
        source=f"fitted:{dev.name}:{dtype}",
    )
