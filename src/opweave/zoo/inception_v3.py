"""Inception-v3 (Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", CVPR 2016).

Layer for layer the network of the paper's Table 1 as torchvision lays it out (Mixed_5b ... Mixed_7c, modules
InceptionA-E). Input 3x299x299, output 1000 logits.

Simplifications: no auxiliary classifier (it only runs in training) and no dropout before the classifier (identity in
eval); weights are random.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm -> ReLU, the unit every Inception branch is made of."""

    def __init__(self, in_ch: int, out_ch: int, **conv_kwargs) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, bias=False, **conv_kwargs)
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


class InceptionA(nn.Module):
    """35x35 module (paper Fig. 5): 1x1, 5x5, double 3x3 and pooling branches."""

    def __init__(self, in_ch: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, 64, kernel_size=1)
        self.branch5x5 = _seq(BasicConv2d(in_ch, 48, kernel_size=1), BasicConv2d(48, 64, kernel_size=5, padding=2))
        self.branch3x3dbl = _seq(
            BasicConv2d(in_ch, 64, kernel_size=1),
            BasicConv2d(64, 96, kernel_size=3, padding=1),
            BasicConv2d(96, 96, kernel_size=3, padding=1),
        )
        self.branch_pool = _seq(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_ch, pool_features, kernel_size=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), self.branch_pool(x)]
        return torch.cat(branches, 1)


class InceptionB(nn.Module):
    """Grid reduction 35x35 -> 17x17 (paper Fig. 10)."""

    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_ch, 384, kernel_size=3, stride=2)
        self.branch3x3dbl = _seq(
            BasicConv2d(in_ch, 64, kernel_size=1),
            BasicConv2d(64, 96, kernel_size=3, padding=1),
            BasicConv2d(96, 96, kernel_size=3, stride=2),
        )
        self.branch_pool = nn.MaxPool2d(3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), self.branch_pool(x)], 1)


class InceptionC(nn.Module):
    """17x17 module with factorized 7x7 convolutions (paper Fig. 6)."""

    def __init__(self, in_ch: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, 192, kernel_size=1)
        self.branch7x7 = _seq(
            BasicConv2d(in_ch, c7, kernel_size=1),
            BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3)),
            BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0)),
        )
        self.branch7x7dbl = _seq(
            BasicConv2d(in_ch, c7, kernel_size=1),
            BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0)),
            BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3)),
            BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0)),
            BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3)),
        )
        self.branch_pool = _seq(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_ch, 192, kernel_size=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), self.branch_pool(x)]
        return torch.cat(branches, 1)


class InceptionD(nn.Module):
    """Grid reduction 17x17 -> 8x8."""

    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.branch3x3 = _seq(BasicConv2d(in_ch, 192, kernel_size=1), BasicConv2d(192, 320, kernel_size=3, stride=2))
        self.branch7x7x3 = _seq(
            BasicConv2d(in_ch, 192, kernel_size=1),
            BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3)),
            BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0)),
            BasicConv2d(192, 192, kernel_size=3, stride=2),
        )
        self.branch_pool = nn.MaxPool2d(3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), self.branch_pool(x)], 1)


class InceptionE(nn.Module):
    """8x8 module with expanded filter banks (paper Fig. 7): 3x3 split into parallel 1x3 and 3x1."""

    def __init__(self, in_ch: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_ch, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = _seq(
            BasicConv2d(in_ch, 448, kernel_size=1), BasicConv2d(448, 384, kernel_size=3, padding=1)
        )
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = _seq(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_ch, 192, kernel_size=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_1(x)
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        return torch.cat([self.branch1x1(x), b3, bd, self.branch_pool(x)], 1)


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = _seq(
            BasicConv2d(3, 32, kernel_size=3, stride=2),
            BasicConv2d(32, 32, kernel_size=3),
            BasicConv2d(32, 64, kernel_size=3, padding=1),
            nn.MaxPool2d(3, stride=2),
            BasicConv2d(64, 80, kernel_size=1),
            BasicConv2d(80, 192, kernel_size=3),
            nn.MaxPool2d(3, stride=2),
        )
        self.mixed = _seq(
            InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64),  # Mixed_5b, 5c, 5d
            InceptionB(288),  # Mixed_6a
            InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160), InceptionC(768, 192),  # Mixed_6b-e
            InceptionD(768),  # Mixed_7a
            InceptionE(1280), InceptionE(2048),  # Mixed_7b, 7c
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.mixed(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


def create(batch_size: int = 1, num_classes: int = 1000, image_size: int = 299):
    """Inception-v3 and one batch of ``image_size``x``image_size`` RGB images (299 as published)."""
    model = InceptionV3(num_classes)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
