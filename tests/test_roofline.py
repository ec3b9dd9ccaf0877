"""The roofline cost model: presets, compute- vs memory-bound ops, monotonicity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from opweave.capture import capture
from opweave.costs import roofline
from opweave.ir import Op, OpGraph


def conv_graph(channels: int, size: int) -> OpGraph:
    return capture(nn.Conv2d(channels, channels, 3, padding=1).eval(), (torch.randn(1, channels, size, size),)).graph


@pytest.fixture(scope="module")
def small_net() -> OpGraph:
    model = nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1)).eval()
    return capture(model, (torch.randn(1, 64, 28, 28),)).graph


def test_every_preset_loads_and_estimates(small_net):
    assert set(roofline.PRESETS) >= {"h100", "h200", "a100", "v100", "rtx2080super", "cpu"}
    for name, dev in roofline.PRESETS.items():
        assert dev.fp16_tflops >= dev.fp32_tflops > 0 and dev.bandwidth_gbs > 0 and dev.units > 0
        costs = roofline.estimate(small_net, name)
        assert costs.model == "gpu" and costs.source == f"roofline:{name}:float32"
        assert all(v > dev.floor_ms for v in costs.latency_ms.values())
        assert all(roofline.UTILIZATION_MIN <= u <= 1 for u in costs.utilization.values())
        assert costs.category == {o.id: o.category for o in small_net.ops}


def test_unknown_device_lists_presets(small_net):
    with pytest.raises(ValueError, match="h100.*rtx2080super.*cpu"):
        roofline.estimate(small_net, "tpu-v9")
    with pytest.raises(ValueError, match="float16"):
        roofline.estimate(small_net, "h100", dtype="int4")


def test_bigger_conv_takes_longer():
    def latency_ms(channels: int, size: int) -> float:
        (latency,) = roofline.estimate(conv_graph(channels, size), "h100").latency_ms.values()
        return latency

    latencies = [latency_ms(c, s) for c, s in ((16, 14), (32, 14), (32, 28), (64, 28), (256, 56))]
    assert latencies == sorted(latencies) and latencies[0] < latencies[-1]


def test_compute_bound_conv_and_memory_bound_relu(small_net):
    dev = roofline.preset("h100")
    conv, relu = small_net.ops[2], small_net.ops[1]
    assert conv.category == "compute" and relu.category == "memory"
    conv_compute_ms = conv.flops / (dev.fp32_tflops * 1e12) * 1e3
    conv_memory_ms = conv.bytes / (dev.bandwidth_gbs * 1e9) * 1e3
    assert conv_compute_ms > conv_memory_ms  # 3x3 conv, 256 channels: high arithmetic intensity
    assert roofline.op_latency_ms(conv, dev) == pytest.approx(conv_compute_ms + dev.floor_ms)
    relu_memory_ms = relu.bytes / (dev.bandwidth_gbs * 1e9) * 1e3
    assert relu_memory_ms > relu.flops / (dev.fp32_tflops * 1e12) * 1e3
    assert roofline.op_latency_ms(relu, dev) == pytest.approx(relu_memory_ms + dev.floor_ms)
    # half precision: tensor cores speed up the conv; the relu moves half the bytes
    assert roofline.op_latency_ms(conv, dev, "float16") - dev.floor_ms < conv_compute_ms / 5
    assert roofline.op_latency_ms(relu, dev, "float16") == pytest.approx(relu_memory_ms / 2 + dev.floor_ms)
    assert roofline.estimate(small_net, "h200").latency_ms[relu.id] < roofline.estimate(small_net).latency_ms[relu.id]


def test_utilization_grows_with_output_size():
    dev = roofline.preset("a100")
    tiny, mid, big = (Op(f"v{i}", shape=[1, c, 7, 7]) for i, c in enumerate((1, 1024, 100_000)))
    assert roofline.op_utilization(tiny, dev) == roofline.UTILIZATION_MIN
    assert roofline.op_utilization(mid, dev) == pytest.approx(1024 * 49 / (108 * 2048))
    assert roofline.op_utilization(big, dev) == 1.0


def test_with_estimates_fills_latency_and_utilization(small_net):
    filled = roofline.with_estimates(small_net, "v100")
    assert small_net.ops[0].latency_ms is None  # the input graph is untouched
    assert all(o.latency_ms and o.utilization for o in filled.ops)
    assert [(e.src, e.dst) for e in filled.edges] == [(e.src, e.dst) for e in small_net.edges]
    assert filled.critical_path_ms() == pytest.approx(sum(o.latency_ms for o in filled.ops))  # a chain


@settings(max_examples=40, deadline=None)
@given(flops=st.floats(0, 1e13), bytes_=st.floats(0, 1e10), more=st.floats(1, 1e3),
       device=st.sampled_from(sorted(roofline.PRESETS)), category=st.sampled_from(["compute", "memory"]))
def test_latency_is_monotone_in_flops_and_bytes(flops, bytes_, more, device, category):
    dev = roofline.preset(device)
    base = roofline.op_latency_ms(Op("a", category=category, flops=flops, bytes=bytes_), dev)
    assert roofline.op_latency_ms(Op("a", category=category, flops=flops * more, bytes=bytes_), dev) >= base
    assert roofline.op_latency_ms(Op("a", category=category, flops=flops, bytes=bytes_ * more), dev) >= base
    assert base >= dev.floor_ms


def test_gpu_names_map_to_presets():
    from opweave.costs.roofline import preset_for_gpu

    assert preset_for_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert preset_for_gpu("NVIDIA H200") == "h200"
    assert preset_for_gpu("Tesla V100-SXM2-16GB") == "v100"
    assert preset_for_gpu("NVIDIA GeForce RTX 2080 SUPER") == "rtx2080super"
    assert preset_for_gpu("NVIDIA L4") is None
