"""GoogLeNet / Inception-v1 (Szegedy et al., "Going Deeper with Convolutions", CVPR 2015), the network of Table 1.

Nine Inception modules (3a-5b) of four parallel branches each: 1x1; 1x1 -> 3x3; 1x1 -> 5x5; 3x3 max-pool -> 1x1.
Input 3x224x224, output 1000 logits.

Departures from the paper, all as in torchvision's ``googlenet`` (the model the Opara paper measures): every convolution
is followed by BatchNorm instead of local response normalisation, and max-pools use ``ceil_mode``. No auxiliary
classifiers (training only) and no dropout (identity in eval). Unlike torchvision, the third branch uses the paper's
5x5 convolution (torchvision keeps a 3x3 there for weight compatibility).
"""

from __future__ import annotations

import torch
from torch import nn

from opweave.zoo.inception_v3 import BasicConv2d  # the same conv-BN-ReLU unit


class Inception(nn.Module):
    """One Inception module; the arguments are the columns of the paper's Table 1."""

    def __init__(self, in_ch: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int, pool_proj: int):
        super().__init__()
        self.branch1 = BasicConv2d(in_ch, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(
            BasicConv2d(in_ch, ch3x3red, kernel_size=1), BasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1)
        )
        self.branch3 = nn.Sequential(
            BasicConv2d(in_ch, ch5x5red, kernel_size=1), BasicConv2d(ch5x5red, ch5x5, kernel_size=5, padding=2)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), BasicConv2d(in_ch, pool_proj, kernel_size=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            BasicConv2d(3, 64, kernel_size=7, stride=2, padding=3),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            BasicConv2d(64, 64, kernel_size=1),
            BasicConv2d(64, 192, kernel_size=3, padding=1),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
        )
        self.inception3 = nn.Sequential(
            Inception(192, 64, 96, 128, 16, 32, 32),  # 3a
            Inception(256, 128, 128, 192, 32, 96, 64),  # 3b
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
        )
        self.inception4 = nn.Sequential(
            Inception(480, 192, 96, 208, 16, 48, 64),  # 4a
            Inception(512, 160, 112, 224, 24, 64, 64),  # 4b
            Inception(512, 128, 128, 256, 24, 64, 64),  # 4c
            Inception(512, 112, 144, 288, 32, 64, 64),  # 4d
            Inception(528, 256, 160, 320, 32, 128, 128),  # 4e
            nn.MaxPool2d(2, stride=2, ceil_mode=True),
        )
        self.inception5 = nn.Sequential(
            Inception(832, 256, 160, 320, 32, 128, 128),  # 5a
            Inception(832, 384, 192, 384, 48, 128, 128),  # 5b
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inception5(self.inception4(self.inception3(self.stem(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def create(batch_size: int = 1, num_classes: int = 1000, image_size: int = 224):
    """GoogLeNet and one batch of ``image_size``x``image_size`` RGB images (224 as published)."""
    model = GoogLeNet(num_classes)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
