"""VGG19 (Simonyan & Zisserman 2015, configuration E), the CNN of HAP §7 (Table 1).

image (B, 3, S, S) -> 16 x [conv3x3 -> (batch norm) -> ReLU], max-pooled after the 2nd, 4th, 8th,
12th and 16th conv -> adaptive average pool to 7x7 (a no-op at S = 224, as in torchvision) ->
flatten -> FC 25088-4096 -> ReLU -> FC 4096-4096 -> ReLU -> FC 4096-classes -> cross-entropy.
At the defaults (224x224, 1000 classes) it has 143.7M parameters, 123.6M of them in the three FC
layers. (Table 1 of the paper says 133 "millions": 139.6M with CIFAR-10's 10 classes, in units of
2^20.) Dropout, after the first two FC layers in the paper, is a knob that defaults to off (on, the
runner draws the masks single-device training draws: engine/model/dropout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

STAGES = ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4))
"""Configuration E: (output channels, convs) per stage; each stage ends with a 2x2 max pool."""


@dataclass(frozen=True, kw_only=True)
class VGG19Config:
    """Size knobs of the VGG19 zoo model (defaults: the paper's ImageNet network)."""

    batch: int = 64
    """Global batch size B (images per iteration; HAP §7 uses 64 per device)."""
    image_size: int = 224
    """Side S of the square input images; at least 32 (five 2x2 pools)."""
    channels: int = 3
    """Channels of the input images."""
    classes: int = 1000
    """Number of output classes."""
    width: float = 1.0
    """Multiplier of every conv's channel count (0.125 gives 8, 16, 32, 64, 64)."""
    hidden: int = 4096
    """Width of the two hidden fully connected layers."""
    pool_size: int = 7
    """Side of the adaptive average pool before the classifier (7 as in torchvision)."""
    batch_norm: bool = False
    """Batch norm after every conv (VGG19-BN); the convs then have no bias (its mean subtraction cancels one)."""
    dropout: float = 0.0
    """Dropout probability after the hidden FC layers (0: left out)."""

    def __post_init__(self) -> None:
        if self.image_size < 32:
            raise ValueError(f"image_size ({self.image_size}) must be at least 32: five 2x2 max pools halve it 5 times")
        if self.width <= 0 or round(64 * self.width) < 1:
            raise ValueError(f"width ({self.width}) must give at least one channel: 64 * width >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")


def _conv_block(cin: int, cout: int, bn: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=not bn)]  # batch norm cancels a bias
    if bn:
        layers.append(nn.BatchNorm2d(cout))
    return nn.Sequential(*layers, nn.ReLU())


def _fc_block(cin: int, cout: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cin, cout), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []))


class VGG19(nn.Module):
    """One numbered list of layers, so captured segments (layer ids) grow from input to head."""

    def __init__(self, cfg: VGG19Config) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = cfg.channels
        for out, convs in STAGES:
            cout = max(1, round(out * cfg.width))
            for _ in range(convs):
                layers.append(_conv_block(cin, cout, cfg.batch_norm))
                cin = cout
            layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(cfg.pool_size), nn.Flatten(1),  # (B, 512 * 7 * 7)
                   _fc_block(cin * cfg.pool_size ** 2, cfg.hidden, cfg.dropout), _fc_block(cfg.hidden, cfg.hidden, cfg.dropout)]
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = images  # (B, 3, S, S)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x), labels)


def build(cfg: VGG19Config) -> nn.Module:
    return VGG19(cfg)


def example_inputs(cfg: VGG19Config, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Images and class labels (random values on a real device, shapes only on `meta`)."""
    shape = (cfg.batch, cfg.channels, cfg.image_size, cfg.image_size)
    if torch.device(device).type == "meta":  # a paper-size batch of images would take gigabytes on the CPU
        return torch.empty(shape, device="meta"), torch.empty(cfg.batch, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(shape, generator=g)
    labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
    return images.to(device), labels.to(device)
