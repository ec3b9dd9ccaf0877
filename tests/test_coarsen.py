"""Coarsening (opweave.capture.coarsen): the papers' operators, BatchNorm folded, same outputs as the fine graph for
every scheduler, every coarsened plan valid, profiles tied to their granularity."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opweave import schedulers, zoo
from opweave.api import compile_captured
from opweave.backends.cpu import CpuBackend
from opweave.capture import capture, coarsen
from opweave.capture.coarsen import epilogue_groups
from opweave.costs.roofline import estimate
from opweave.outputs import compare
from opweave.pipeline import plan_for

# Small inputs that keep every model's activations at a sane scale (see docs/zoo.md); BERT at 2 layers.
SMALL = {"inception_v3": {"image_size": 139}, "googlenet": {"image_size": 96}, "squeezenet": {"image_size": 64},
         "resnet50": {"image_size": 96}, "nasnet_a_mobile": {"image_size": 96}, "randwire": {"image_size": 96},
         "bert_base": {"num_layers": 2, "seq_len": 32}}


@functools.cache
def fine_and_coarse(name: str):
    model, inputs = zoo.create(name, **SMALL.get(name, {}))
    fine = capture(model, inputs, name=name)
    with torch.inference_mode():
        reference = model(*inputs)
    return fine, coarsen(fine), inputs, reference


def run(captured, inputs):
    env = captured.bind(inputs)
    for op in captured.graph.topo_order:
        captured.run_op(op, env)
    return captured.output(env)


class ConvBNReLU(nn.Module):
    """Two conv-BN-ReLU units and a residual add: conv(x) -> bn -> relu -> conv -> bn -> + x -> relu."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b, self.bn_b = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        y = F.relu(self.bn_a(self.a(x)))
        return F.relu(self.bn_b(self.b(y)) + x)


def calibrated(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 2)
            m.bias.data.uniform_(-1, 1)
    return model.eval()


def test_conv_bn_relu_units_and_the_residual_add_become_two_ops_with_batchnorm_folded():
    model, x = calibrated(ConvBNReLU()), torch.randn(1, 4, 6, 6)
    fine = capture(model, (x,))
    coarse = coarsen(fine)
    assert len(fine.graph) == 7 and [o.name for o in coarse.graph.ops] == ["a+bn_a+relu", "b+bn_b+add+relu_1"]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in coarse.gm.modules())
    assert [n.name for n in coarse.nodes["b"]] == ["b", "add", "relu_1"]  # members in graph order, BN folded away
    torch.testing.assert_close(run(coarse, (x,)), model(x), atol=1e-5, rtol=1e-5)
    # bytes of a fused op: its inputs from outside (x, weights, folded bias) and its output, no intermediates
    t = 4 * 4 * 6 * 6
    weights = 4 * (4 * 4 * 9 + 4)
    assert coarse.graph.op["a"].bytes == t + weights + t
    assert coarse.graph.op["b"].bytes == t + weights + t + t  # also reads x for the residual add
    assert coarse.graph.op["a"].flops == 2 * 4 * 36 * 4 * 9 + 4 * 36  # conv + relu (the folded BN costs nothing)
    assert [(e.src, e.dst) for e in coarse.graph.edges] == [("a", "b")]


def test_coarsen_is_pure():
    model, x = calibrated(ConvBNReLU()), torch.randn(1, 4, 6, 6)
    fine = capture(model, (x,))
    names = [n.name for n in fine.gm.graph.nodes]
    weight = fine.gm.a.weight.detach().clone()
    coarsen(fine)
    assert [n.name for n in fine.gm.graph.nodes] == names and len(fine.graph) == 7
    assert isinstance(fine.gm.bn_a, nn.BatchNorm2d) and torch.equal(fine.gm.a.weight, weight)
    torch.testing.assert_close(run(fine, (x,)), model(x))


def test_a_residual_add_waiting_for_a_sibling_branch_stays_an_op():
    class Downsample(nn.Module):  # ResNet's projection block: the add joins two parallel conv branches
        def __init__(self) -> None:
            super().__init__()
            self.main, self.bn_main = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.short, self.bn_short = nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8)

        def forward(self, x):
            return F.relu(self.bn_main(self.main(x)) + self.bn_short(self.short(x)))

    model, x = calibrated(Downsample()), torch.randn(1, 4, 5, 5)
    coarse = coarsen(capture(model, (x,)))
    assert [o.name for o in coarse.graph.ops] == ["main+bn_main", "short+bn_short", "add+relu"]
    torch.testing.assert_close(run(coarse, (x,)), model(x), atol=1e-5, rtol=1e-5)


def test_shared_conv_module_is_not_folded_into_one_of_its_calls():
    """A conv module called twice, BatchNorm after one call only: folding would change the other call too (capture's
    fold_bn used torch.fx.experimental.optimization.fuse, which folded it and gave wrong outputs)."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

        def forward(self, x, y):
            return self.bn(self.conv(x)), self.conv(y)

    model = calibrated(Shared())
    args = (torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4))
    expected = model(*args)
    for captured in (capture(model, args, fold_bn=True, verify=False), coarsen(capture(model, args))):
        got = run(captured, args)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_counts_beside_the_papers():
    """docs/zoo.md's table (default inputs there; the counts do not depend on the image size)."""
    counts = {name: (len(fine_and_coarse(name)[1].graph), len(fine_and_coarse(name)[1].graph.edges))
              for name in ("inception_v3", "resnet50", "squeezenet")}
    assert counts == {"inception_v3": (124, 158), "resnet50": (60, 75), "squeezenet": (38, 45)}
    inception = fine_and_coarse("inception_v3")[1].graph
    convs = [o for o in inception.ops if o.target == "torch.nn.Conv2d"]
    assert len(convs) == 94 and all(o.name.endswith("+relu") or "relu" in o.name for o in convs)


@pytest.mark.parametrize("name", zoo.names())
def test_coarse_graph_gives_the_fine_outputs_under_every_scheduler(name):
    fine, coarse, inputs, reference = fine_and_coarse(name)
    assert len(coarse.graph) < len(fine.graph)
    assert sum(len(g) for g in epilogue_groups(fine)) == len(fine.graph)
    costs = estimate(coarse.graph, "cpu")
    with torch.inference_mode():
        fine_out = run(fine, inputs)
        assert compare(reference, fine_out).max_diff < 1e-4
        for scheduler in schedulers.names():
            if scheduler == "ios" and len(coarse.graph) > 200:
                continue  # IOS's dynamic program is exponential in the width; the fine-graph sweep runs it
            devices = 2 if scheduler in schedulers.MULTI_DEVICE else 1
            _, plan = plan_for(coarse.graph, costs, scheduler, streams=3, devices=devices)  # validates the plan
            got = CpuBackend(coarse, plan)(*inputs)
            check = compare(fine_out, got, tolerance=1e-4)  # relative to the output's scale
            assert check.ok, (scheduler, check.reason)


def test_a_profile_belongs_to_its_granularity(tmp_path):
    from opweave.costs.profile import ProfileKeyError, profile_model

    fine, coarse, inputs, _ = fine_and_coarse("deepfm")
    path = tmp_path / "fine.json"
    profile_model(fine, inputs, device="cpu", repeats=1, warmup=0).save(path)
    with pytest.raises(ProfileKeyError, match="coarsen"):
        compile_captured(fine, inputs, scheduler="lios", profile=path)  # coarsen=True by default
    fast = compile_captured(fine, inputs, scheduler="lios", profile=path, coarsen=False)
    assert fast.costs.source == "profile" and len(fast.graph) == len(fine.graph)
    profile_model(coarse, inputs, device="cpu", repeats=1, warmup=0).save(path)
    fast = compile_captured(fine, inputs, scheduler="lios", profile=path)
    assert fast.costs.latency_ms.keys() == set(coarse.graph.ids)


def test_a_folded_layer_is_made_once_per_model_unless_its_tensors_keep_no_version():
    from opweave.capture.coarsen import folded_layer

    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 4, 3).eval(), nn.BatchNorm2d(4).eval()
    first = folded_layer(conv, bn)
    assert folded_layer(conv, bn) is first
    conv.half().float()  # new storages, rounded values: folded again (an address a freed storage had is not reused)
    assert folded_layer(conv, bn) is not first
    again = folded_layer(conv, bn)
    with torch.no_grad():
        bn.running_var.copy_(bn.running_var * 4)  # in place: its version moves on
    assert folded_layer(conv, bn) is not again
    with torch.inference_mode():  # inference tensors keep no version: a copy of them cannot be known current
        conv, bn = nn.Conv2d(3, 4, 3).eval(), nn.BatchNorm2d(4).eval()
    with torch.no_grad():  # (folding inference tensors needs no_grad, as torch.nn.utils.fusion computes)
        first, second = folded_layer(conv, bn), folded_layer(conv, bn)
    assert first is not second and torch.equal(first.weight, second.weight)


def test_a_folded_layer_is_not_taken_for_current_when_a_new_weight_reuses_a_freed_address():
    """A weight replaced by one the allocator put where the old one was, at the same version, looked unchanged (an
    address and a version were all that was compared): the old folded weights came back."""
    from opweave.capture.coarsen import folded_layer

    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 64, 3).eval(), nn.BatchNorm2d(64).eval()
    shape = conv.weight.shape
    for _ in range(20):
        kept = folded_layer(conv, bn)  # in use, as by a compiled model: it stays the one to hand out while current
        conv.weight.data = torch.empty(0)  # the old storage freed first, so the next may take its address
        conv.weight.data = torch.randn(shape)
        assert torch.equal(folded_layer(conv, bn).weight, nn.utils.fusion.fuse_conv_bn_eval(conv, bn).weight)
        del kept
