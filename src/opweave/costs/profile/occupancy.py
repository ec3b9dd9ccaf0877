"""From a kernel's launch configuration to what it demands of the device: blocks per SM, occupancy, the op's
resource demand and utilization, and the compute/memory category check against the device's ridge point.
"""

from __future__ import annotations

import math

import torch

from opweave.ir.graph import OpGraph


def cuda_properties() -> dict:
    """The current CUDA device's properties that occupancy needs."""
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    major, minor = p.major, p.minor
    return {
        "name": p.name,
        "capability": [major, minor],
        "sm_count": p.multi_processor_count,
        "max_threads_per_sm": getattr(p, "max_threads_per_multi_processor", 2048),
        "registers_per_sm": getattr(p, "regs_per_multiprocessor", 65536),
        "shared_memory_per_sm": getattr(p, "shared_memory_per_multiprocessor", 0) or 0,
        "max_blocks_per_sm": _max_blocks_per_sm(major, minor),
        "warp_size": getattr(p, "warp_size", 32),
    }


def _max_blocks_per_sm(major: int, minor: int) -> int:
    """Resident blocks per SM (CUDA C Programming Guide, "Compute capabilities" table)."""
    if major >= 9 or (major, minor) == (8, 0) or major < 7 or (major, minor) in ((7, 0), (7, 2)):
        return 32
    return {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}.get((major, minor), 16)


def occupancy(kernel: dict, props: dict) -> dict:
    """Blocks of ``kernel`` that fit on one SM at once (threads, registers, shared memory, block-slot limits) and
    the resulting occupancy (active warps / max warps). Registers are allocated per warp in units of 256,
    shared memory per block with 1 KiB reserved by the system (sm_80 and later)."""
    if not props:
        return {}
    warp = props.get("warp_size", 32)
    threads = math.prod(kernel["block"])
    warps_per_block = max(1, math.ceil(threads / warp))
    max_warps = props["max_threads_per_sm"] // warp
    limits = [props["max_blocks_per_sm"], max_warps // warps_per_block]
    regs = kernel.get("registers_per_thread", 0)
    if regs:
        regs_per_warp = math.ceil(regs * warp / 256) * 256
        limits.append((props["registers_per_sm"] // regs_per_warp) // warps_per_block)
    smem = kernel.get("shared_memory_bytes", 0)
    if smem and props.get("shared_memory_per_sm"):
        limits.append(props["shared_memory_per_sm"] // (smem + 1024))
    blocks_per_sm = max(0, min(limits))
    return {"blocks_per_sm": blocks_per_sm, "occupancy": blocks_per_sm * warps_per_block / max_warps}


def op_demand(kernels: list[dict], props: dict) -> tuple[dict[str, float], float]:
    """An op's resource demand (the largest of its kernels', which run one after another) and its utilization
    (the duration-weighted share of the device's block slots its kernels fill, capped at 1)."""
    demand = {"threads": 0.0, "registers": 0.0, "shared_memory": 0.0, "blocks": 0.0}
    weighted, total_us = 0.0, 0.0
    for k in kernels:
        blocks, threads = math.prod(k["grid"]), math.prod(k["block"])
        demand["blocks"] = max(demand["blocks"], blocks)
        demand["threads"] = max(demand["threads"], blocks * threads)
        demand["registers"] = max(demand["registers"], blocks * threads * k.get("registers_per_thread", 0))
        demand["shared_memory"] = max(demand["shared_memory"], blocks * k.get("shared_memory_bytes", 0))
        slots = max(1, k.get("blocks_per_sm", 1)) * props.get("sm_count", 1)
        share = min(1.0, blocks / slots)
        duration = max(k.get("duration_us", 0.0), 1e-3)
        weighted += share * duration
        total_us += duration
    return demand, min(1.0, max(0.01, weighted / total_us))


# ---- categories -----------------------------------------------------------------------------------------------------


def check_categories(graph: OpGraph, ridge_flops_per_byte: float | None) -> tuple[dict[str, str], list[dict]]:
    """The table's category per op, and the ops whose arithmetic intensity puts them on the other side of the
    device's ridge point (ops with no bytes counted are not checked)."""
    category = {o.id: o.category for o in graph.ops}
    disagreements: list[dict] = []
    if not ridge_flops_per_byte:
        return category, disagreements
    for o in graph.ops:
        if o.bytes <= 0:
            continue
        intensity = o.flops / o.bytes
        by_intensity = "compute" if intensity >= ridge_flops_per_byte else "memory"
        if by_intensity != o.category:
            disagreements.append({"op": o.id, "target": o.target, "table": o.category, "by_intensity": by_intensity,
                                  "flops_per_byte": intensity, "ridge_flops_per_byte": ridge_flops_per_byte})
    return category, disagreements


def ridge_point(device: str, dtype: str) -> float | None:
    """Peak FLOP/s over bandwidth of the device's roofline preset (tensor-core peak for float16/bfloat16)."""
    from opweave.costs import roofline

    name = "cpu" if device == "cpu" else roofline.preset_for_gpu(torch.cuda.get_device_name())
    if name is None:
        return None
    dev = roofline.preset(name)
    tensor_cores = dtype == "float16" or (dtype == "bfloat16" and dev.bf16)
    return (dev.fp16_tflops if tensor_cores else dev.fp32_tflops) * 1e12 / (dev.bandwidth_gbs * 1e9)
