"""ResNet-50 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016), the 50-layer column of Table 1:
a 7x7 stem and four stages of 3, 4, 6 and 3 bottleneck blocks (1x1 -> 3x3 -> 1x1, expansion 4), with a projection
shortcut on the first block of each stage. Input 3x224x224, output 1000 logits.

As in torchvision ("ResNet v1.5") the stride of a downsampling block sits on its 3x3 convolution rather than on the
first 1x1. Random weights.
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, in_ch = [], 64
        for stage, count in enumerate(blocks):
            width = 64 * 2**stage
            for i in range(count):
                layers.append(Bottleneck(in_ch, width, stride=2 if i == 0 and stage > 0 else 1))
                in_ch = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def create(batch_size: int = 1, num_classes: int = 1000, image_size: int = 224):
    """ResNet-50 and one batch of ``image_size``x``image_size`` RGB images (224 as published)."""
    model = ResNet50(num_classes)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
