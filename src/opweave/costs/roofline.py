"""The built-in cost model: a roofline estimate of every op's latency and GPU share, for machines without a profile.

    latency_ms  = max(flops / peak_flops, bytes / bandwidth) + floor_ms
    utilization = clamp(output elements / (units × threads_per_unit), 0.05, 1)

* **Peak.** Compute-category ops (conv, linear, matmul, …) use the dense tensor-core peak for float16/bfloat16 and
  the CUDA-core FP32 peak for float32 (PyTorch's cuDNN convolutions may use TF32 on Ampere and later; we keep the
  conservative FP32 figure). Memory-category ops (elementwise, pooling, norms, cat, …) run on CUDA cores: FP32 peak.
* **Bytes** are the captured op's; estimating for another ``dtype`` than the op was captured in scales them by the
  ratio of element sizes.
* **Floor.** ``floor_ms`` is a kernel's minimum duration, an assumption, not a measurement: a GPU kernel that does
  almost nothing still takes a few microseconds from start to end; we take 5 µs, the same figure as
  :class:`opweave.costs.GpuModel`'s launch overhead. The CPU preset's 10 µs stands for PyTorch's per-op dispatch
  cost on a small core.
* **Utilization** is the share of the device one op fills alone, the input of the ``gpu`` contention model: one
  thread per output element against the device's resident-thread capacity (SMs × max threads per SM), clamped to
  [0.05, 1]. For the CPU preset a "unit" is a core and its capacity ATen's intra-op grain size (32768 elements: a
  smaller op runs on one thread).

The result is a lower bound of real latency (real kernels reach a fraction of peak), good for ranking ops and for
scheduling when nothing is measured; it never replaces a profile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from opweave.costs.model import Costs
from opweave.errors import UsageError, did_you_mean
from opweave.ir.graph import Op, OpGraph

UTILIZATION_MIN = 0.05


@dataclass(frozen=True)
class Device:
    """Datasheet numbers of one device (dense, i.e. without structured sparsity)."""

    name: str
    fp32_tflops: float  # CUDA-core (vector) FP32
    fp16_tflops: float  # dense FP16 tensor-core (FP32 accumulate where the datasheet distinguishes)
    bandwidth_gbs: float  # memory bandwidth, GB/s
    units: int  # streaming multiprocessors (CPU: cores)
    threads_per_unit: int  # max resident threads per SM (CPU: ATen grain size in elements)
    floor_ms: float = 0.005
    bf16: bool = True  # bfloat16 tensor cores (else bfloat16 runs at the FP32 rate)


PRESETS: dict[str, Device] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOPS, FP16 tensor 1,979 TFLOPS with sparsity
    # (989.5 dense), HBM3 3.35 TB/s; H100 architecture whitepaper: 132 SMs (SXM5), 2048 threads/SM.
    "h100": Device("NVIDIA H100 SXM5", 67.0, 989.5, 3350.0, 132, 2048),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, FP16 tensor 1,979 TFLOPS sparse (989.5 dense),
    # HBM3e 4.8 TB/s; same GH100 die as the H100 SXM5: 132 SMs.
    "h200": Device("NVIDIA H200 SXM", 67.0, 989.5, 4800.0, 132, 2048),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, FP16 tensor 312 TFLOPS dense,
    # HBM2e 2,039 GB/s; Ampere whitepaper: 108 SMs, 2048 threads/SM.
    "a100": Device("NVIDIA A100 SXM4 80GB", 19.5, 312.0, 2039.0, 108, 2048),
    # NVIDIA V100 datasheet (SXM2): FP32 15.7 TFLOPS, tensor 125 TFLOPS, HBM2 900 GB/s; Volta whitepaper:
    # 80 SMs, 2048 threads/SM; no bfloat16.
    "v100": Device("NVIDIA V100 SXM2", 15.7, 125.0, 900.0, 80, 2048, bf16=False),
    # GeForce RTX 2080 SUPER specifications: 3072 CUDA cores at 1815 MHz boost -> 11.15 TFLOPS FP32; 48 SMs x 8
    # tensor cores x 64 FMA x 2 x 1815 MHz = 89.2 TFLOPS FP16 with FP16 accumulate, half of that (44.6) with the
    # FP32 accumulate PyTorch uses on GeForce; GDDR6 15.5 Gbps x 256 bit = 496 GB/s; Turing: 1024 threads/SM.
    "rtx2080super": Device("NVIDIA GeForce RTX 2080 SUPER", 11.15, 44.6, 496.0, 48, 1024, bf16=False),
    # A modest 2-core x86 CPU (an assumption, not a datasheet): 2.5 GHz x 32 FP32 FLOP/cycle (AVX2, two FMA units)
    # = 80 GFLOP/s per core; no FP16 arithmetic units; 20 GB/s, about half of dual-channel DDR4-2666's 42.7 GB/s.
    "cpu": Device("2-core x86 CPU (AVX2)", 0.16, 0.16, 20.0, 2, 32768, floor_ms=0.010, bf16=False),
}

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def preset_for_gpu(gpu_name: str) -> str | None:
    """The preset of a GPU named as ``torch.cuda.get_device_name()`` names it, or None for an unknown GPU."""
    gpu = gpu_name.lower()
    for name in ("h200", "h100", "a100", "v100"):
        if name in gpu:
            return name
    return "rtx2080super" if "2080" in gpu else None


def preset(name: str) -> Device:
    """The preset called ``name`` (case-insensitive)."""
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise UsageError(f"unknown device {name!r}{did_you_mean(name.lower(), PRESETS)}; presets: {', '.join(PRESETS)}")
    return preset


def op_latency_ms(op: Op, dev: Device, dtype: str = "float32") -> float:
    """Roofline latency of one op on ``dev`` when computing in ``dtype``."""
    _check_dtype(dtype)
    tensor_cores = op.category == "compute" and (dtype == "float16" or dtype == "bfloat16" and dev.bf16)
    peak_flops = (dev.fp16_tflops if tensor_cores else dev.fp32_tflops) * 1e12
    scale = _ITEMSIZE[dtype] / _ITEMSIZE.get(op.dtype or dtype, _ITEMSIZE[dtype])  # int ops (ids) keep their bytes
    seconds = max(op.flops / peak_flops, op.bytes * scale / (dev.bandwidth_gbs * 1e9))
    return seconds * 1e3 + dev.floor_ms


def _check_dtype(dtype: str) -> None:
    if dtype not in _ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r}{did_you_mean(dtype, _ITEMSIZE)}; choose one of "
                         f"{', '.join(_ITEMSIZE)}")


def op_utilization(op: Op, dev: Device) -> float:
    """Share of ``dev`` the op fills alone: one thread per output element against the resident-thread capacity."""
    elements = 1
    for size in op.shape or ():
        elements *= size
    return min(1.0, max(UTILIZATION_MIN, elements / (dev.units * dev.threads_per_unit)))


def estimate(graph: OpGraph, device: str = "h100", dtype: str = "float32", model: str = "gpu") -> Costs:
    """Roofline costs of every op of ``graph`` on preset ``device``, under cost model ``model`` (default the ``gpu``
    contention model, for which the utilizations are estimated)."""
    dev = preset(device)
    _check_dtype(dtype)
    return Costs(
        latency_ms={o.id: op_latency_ms(o, dev, dtype) for o in graph.ops},
        utilization={o.id: op_utilization(o, dev) for o in graph.ops},
        category={o.id: o.category for o in graph.ops},
        edge_transfer_ms={(e.src, e.dst): e.transfer_ms for e in graph.edges if e.transfer_ms is not None},
        model=model,
        source=f"roofline:{device.lower()}:{dtype}",
    )


def with_estimates(graph: OpGraph, device: str = "h100", dtype: str = "float32") -> OpGraph:
    """A copy of ``graph`` whose ops carry the roofline ``latency_ms`` and ``utilization``."""
    costs = estimate(graph, device, dtype)
    ops = [Op(**{**asdict(o), "latency_ms": costs.latency_ms[o.id], "utilization": costs.utilization[o.id]})
           for o in graph.ops]
    return OpGraph(ops, [type(e)(**asdict(e)) for e in graph.edges], graph.name)

