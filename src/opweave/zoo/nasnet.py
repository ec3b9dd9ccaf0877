"""NASNet-A Mobile, 4 @ 1056 (Zoph et al., "Learning Transferable Architectures for Scalable Image Recognition",
CVPR 2018): the Normal and Reduction cells of the paper's Fig. 4, stacked as in its Fig. 2 / Table 2 for ImageNet
mobile: a 3x3 stem conv, two reduction "stem" cells, then three stacks of N=4 Normal cells separated by two
Reduction cells; the penultimate layer has 1056 = 24 x 44 filters. Input 3x224x224, output 1000 logits.

Each cell takes the outputs of the two previous cells, h_{i-1} ("prev") and h_i ("cur"), first brought to the cell's
filter count by ReLU-1x1 conv-BN (or, when prev has twice the resolution, by the factorized reduction of two shifted
stride-2 1x1 paths). A cell has five blocks, each the sum of two operations; a separable convolution branch is
ReLU-sepconv-BN applied twice (paper Appendix A.1). Normal cells concatenate prev and the five block outputs (6f
channels); Reduction cells concatenate the four unused block outputs (4f channels).

Simplifications against the TF reference: symmetric "same" padding instead of TF's asymmetric padding (so the
stem's zero-pad-and-crop pooling tricks are gone), and no dropout / drop-path (identity in eval). Random weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SepConvBranch(nn.Module):
    """ReLU -> depthwise k x k -> pointwise 1x1 -> BN, twice; the first depthwise conv carries the stride."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        pad = kernel_size // 2
        layers: list[nn.Module] = []
        for i, (c_in, s) in enumerate([(in_ch, stride), (out_ch, 1)]):
            layers += [
                nn.ReLU(inplace=i > 0),  # the first ReLU reads a tensor other branches read too: keep it out-of-place
                nn.Conv2d(c_in, c_in, kernel_size, stride=s, padding=pad, groups=c_in, bias=False),
                nn.Conv2d(c_in, out_ch, 1, bias=False),
                nn.BatchNorm2d(out_ch, eps=0.001, momentum=0.1),
            ]
        self.branch = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch(x)


def relu_conv_bn(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(in_ch, out_ch, 1, bias=False), nn.BatchNorm2d(out_ch, eps=0.001))


class FactorizedReduce(nn.Module):
    """Halve the resolution of ``prev``: two stride-2 1x1 paths, the second shifted by one pixel, concatenated."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.path1 = nn.Sequential(nn.AvgPool2d(1, stride=2), nn.Conv2d(in_ch, out_ch // 2, 1, bias=False))
        self.path2 = nn.Sequential(nn.AvgPool2d(1, stride=2), nn.Conv2d(in_ch, out_ch - out_ch // 2, 1, bias=False))
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.path1(x), self.path2(shifted)], 1))


def avg3x3(stride: int = 1) -> nn.AvgPool2d:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


class NormalCell(nn.Module):
    """Paper Fig. 4 (left). ``reduce_prev``: prev has twice this cell's resolution (first cell after a reduction)."""

    def __init__(self, prev_ch: int, cur_ch: int, f: int, reduce_prev: bool = False) -> None:
        super().__init__()
        self.adjust_prev = FactorizedReduce(prev_ch, f) if reduce_prev else relu_conv_bn(prev_ch, f)
        self.adjust_cur = relu_conv_bn(cur_ch, f)
        self.b0_cur, self.b0_prev = SepConvBranch(f, f, 5), SepConvBranch(f, f, 3)
        self.b1_prev5, self.b1_prev3 = SepConvBranch(f, f, 5), SepConvBranch(f, f, 3)
        self.b2_cur = avg3x3()
        self.b3_prev_a, self.b3_prev_b = avg3x3(), avg3x3()
        self.b4_cur = SepConvBranch(f, f, 3)

    def forward(self, cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        prev, cur = self.adjust_prev(prev), self.adjust_cur(cur)
        b0 = self.b0_cur(cur) + self.b0_prev(prev)
        b1 = self.b1_prev5(prev) + self.b1_prev3(prev)
        b2 = self.b2_cur(cur) + prev
        b3 = self.b3_prev_a(prev) + self.b3_prev_b(prev)
        b4 = self.b4_cur(cur) + cur
        return torch.cat([prev, b0, b1, b2, b3, b4], 1)


class ReductionCell(nn.Module):
    """Paper Fig. 4 (right): every op touching an input has stride 2.

    As a stem cell (``stem=True``) ``prev`` enters the separable branches unadjusted (stem cell 0, whose prev is the
    stem conv), or ``reduce_prev`` halves it first (stem cell 1, whose prev is the stem conv at twice the resolution).
    """

    def __init__(self, prev_ch: int, cur_ch: int, f: int, reduce_prev: bool = False, raw_prev: bool = False) -> None:
        super().__init__()
        self.adjust_prev: nn.Module
        if raw_prev:
            self.adjust_prev, p = nn.Identity(), prev_ch
        else:
            self.adjust_prev, p = (FactorizedReduce(prev_ch, f) if reduce_prev else relu_conv_bn(prev_ch, f)), f
        self.adjust_cur = relu_conv_bn(cur_ch, f)
        self.b0_cur, self.b0_prev = SepConvBranch(f, f, 5, 2), SepConvBranch(p, f, 7, 2)
        self.b1_cur, self.b1_prev = nn.MaxPool2d(3, stride=2, padding=1), SepConvBranch(p, f, 7, 2)
        self.b2_cur, self.b2_prev = avg3x3(stride=2), SepConvBranch(p, f, 5, 2)
        self.b3_b0 = avg3x3()
        self.b4_b0, self.b4_cur = SepConvBranch(f, f, 3), nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        prev, cur = self.adjust_prev(prev), self.adjust_cur(cur)
        b0 = self.b0_cur(cur) + self.b0_prev(prev)
        b1 = self.b1_cur(cur) + self.b1_prev(prev)
        b2 = self.b2_cur(cur) + self.b2_prev(prev)
        b3 = self.b3_b0(b0) + b1
        b4 = self.b4_b0(b0) + self.b4_cur(cur)
        return torch.cat([b1, b2, b3, b4], 1)


class NASNetAMobile(nn.Module):
    def __init__(self, num_classes: int = 1000, num_normal: int = 4, penultimate_filters: int = 1056) -> None:
        super().__init__()
        f = penultimate_filters // 24
        stem_ch = 32
        self.stem = nn.Sequential(nn.Conv2d(3, stem_ch, 3, stride=2, bias=False), nn.BatchNorm2d(stem_ch, eps=0.001))
        # Stem cells, filters f/4 and f/2: a reduction cell fed (stem, stem), then one fed (stem0, stem).
        cells: list[nn.Module] = [ReductionCell(stem_ch, stem_ch, f // 4, raw_prev=True),
                 ReductionCell(stem_ch, f, f // 2, reduce_prev=True)]
        channels = [stem_ch, f, 2 * f]  # output channels of the cells so far
        for stack in range(3):
            filters = f * 2**stack
            if stack > 0:
                cells.append(ReductionCell(channels[-2], channels[-1], filters))
                channels.append(4 * filters)
            for i in range(num_normal):
                cells.append(NormalCell(channels[-2], channels[-1], filters, reduce_prev=i == 0))
                channels.append(6 * filters)
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = cur = self.stem(x)
        for cell in self.cells:
            prev, cur = cur, cell(cur, prev)
        return self.fc(torch.flatten(self.avgpool(self.relu(cur)), 1))


def create(batch_size: int = 1, num_classes: int = 1000, image_size: int = 224, num_normal: int = 4,
           penultimate_filters: int = 1056):
    """NASNet-A Mobile (N @ penultimate filters, 4 @ 1056 by default) and one batch of 224x224 RGB images."""
    model = NASNetAMobile(num_classes, num_normal, penultimate_filters)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
