"""SqueezeNet **1.0** (Iandola et al., "SqueezeNet: AlexNet-level accuracy with 50x fewer parameters and <0.5MB model
size", arXiv:1602.07360, 2016), the macroarchitecture of the paper's Table 1: conv1, Fire2-Fire9, conv10, with
max-pools after conv1, Fire4 and Fire8. Input 3x224x224, output 1000 class scores.

A Fire module squeezes with 1x1 convolutions and expands with parallel 1x1 and 3x3 convolutions whose outputs are
concatenated. ``bypass`` selects the variants of the paper's Section 6:

* ``"none"`` (default): vanilla SqueezeNet, as torchvision's ``squeezenet1_0``;
* ``"simple"``: identity shortcuts around Fire3, 5, 7 and 9 (where input and output channels agree);
* ``"complex"``: in addition 1x1-convolution shortcuts around Fire2, 4, 6 and 8. This is the variant the IOS benchmark
  (and so LIOS) schedules; its 50 operators / 65 edges count each Fire module's concat and add as one operator each
  and fold ReLUs into the convolutions.

Simplifications: no dropout before conv10 (identity in eval); random weights.
"""

from __future__ import annotations

import torch
from torch import nn

BYPASS_KINDS = ("none", "simple", "complex")


class Fire(nn.Module):
    def __init__(self, in_ch: int, squeeze: int, expand: int, bypass: str = "none") -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(in_ch, squeeze, kernel_size=1)
        self.squeeze_relu = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand, kernel_size=1)
        self.expand1x1_relu = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand, kernel_size=3, padding=1)
        self.expand3x3_relu = nn.ReLU(inplace=True)
        out_ch = 2 * expand
        self.identity_bypass = bypass in ("simple", "complex") and in_ch == out_ch
        self.conv_bypass = nn.Conv2d(in_ch, out_ch, 1) if bypass == "complex" and in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.squeeze_relu(self.squeeze(x))
        out = torch.cat([self.expand1x1_relu(self.expand1x1(s)), self.expand3x3_relu(self.expand3x3(s))], 1)
        if self.identity_bypass:
            out = out + x
        elif self.conv_bypass is not None:
            out = out + self.conv_bypass(x)
        return out


class SqueezeNet(nn.Module):
    def __init__(self, num_classes: int = 1000, bypass: str = "none") -> None:
        super().__init__()
        if bypass not in BYPASS_KINDS:
            raise ValueError(f"bypass must be one of {BYPASS_KINDS}, got {bypass!r}")
        self.features = nn.Sequential(
            nn.Conv2d(3, 96, kernel_size=7, stride=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            Fire(96, 16, 64, bypass),  # fire2
            Fire(128, 16, 64, bypass),  # fire3
            Fire(128, 32, 128, bypass),  # fire4
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            Fire(256, 32, 128, bypass),  # fire5
            Fire(256, 48, 192, bypass),  # fire6
            Fire(384, 48, 192, bypass),  # fire7
            Fire(384, 64, 256, bypass),  # fire8
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            Fire(512, 64, 256, bypass),  # fire9
        )
        self.classifier = nn.Sequential(
            nn.Conv2d(512, num_classes, kernel_size=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1)
        )
        for m in self.modules():  # He init keeps activations at unit scale through the ReLUs (there is no BN)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        classes = self.classifier[0]
        assert isinstance(classes, nn.Conv2d)
        nn.init.normal_(classes.weight, std=0.01)  # as torchvision: small class scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


def create(batch_size: int = 1, num_classes: int = 1000, bypass: str = "none", image_size: int = 224):
    """SqueezeNet 1.0 and one batch of ``image_size``x``image_size`` RGB images (224 as published)."""
    model = SqueezeNet(num_classes, bypass)
    generator = torch.Generator().manual_seed(0)
    return model, (torch.randn(batch_size, 3, image_size, image_size, generator=generator),)
