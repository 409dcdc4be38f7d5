"""A multi-layer perceptron classifier: the smallest model with something to shard.

x (B, in) -> [Linear -> ReLU] * layers -> Linear -> logits (B, classes) -> cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Size knobs of the MLP zoo model."""

    layers: int = 4
    """Number of hidden Linear+ReLU layers."""
    in_features: int = 1024
    """Width of the input features."""
    hidden: int = 4096
    """Width of every hidden layer."""
    classes: int = 10
    """Number of output classes."""
    batch: int = 64
    """Global batch size of one training iteration."""


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        widths = [cfg.in_features] + [cfg.hidden] * cfg.layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], cfg.classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))  # (B, hidden)
        return F.cross_entropy(self.head(x), y)


def build(cfg: MLPConfig) -> nn.Module:
    return MLP(cfg)


def example_inputs(cfg: MLPConfig, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A batch (x, y); random values on a real device, shapes only on `meta`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch, cfg.in_features, generator=g)
    y = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
    return x.to(device), y.to(device)
