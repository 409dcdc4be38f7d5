"""Vision Transformer (Dosovitskiy et al. 2021), the transformer image classifier of HAP §7.

image (B, 3, S, S) -> patches of P x P -> linear patch embedding (a P-strided conv, or the
equivalent reshape + linear) -> prepend a learned class token -> + position embedding ->
layers x [pre-norm multi-head attention block, pre-norm GELU MLP block] -> LayerNorm of the class
token -> linear head -> cross-entropy. Defaults are ViT-Base/16 (hidden 768, 12 layers, 12
heads, MLP 3072, 224x224 images, 1000 classes: 86.6M parameters). Dropout defaults to off (on, the
runner draws the masks single-device training draws: engine/model/dropout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PATCH_EMBEDS = ("conv", "linear")


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """Size knobs of the ViT zoo model (defaults: ViT-Base/16 on ImageNet)."""

    batch: int = 64
    """Global batch size B (images per iteration; HAP §7 uses 64 per device)."""
    image_size: int = 224
    """Side S of the square input images; a multiple of `patch`."""
    channels: int = 3
    """Channels of the input images."""
    patch: int = 16
    """Side P of the square patches: (S / P)^2 tokens plus the class token."""
    hidden: int = 768
    """Model width."""
    layers: int = 12
    """Number of transformer blocks."""
    heads: int = 12
    """Attention heads; must divide `hidden`."""
    mlp: int = 3072
    """Width of the MLP inside each block."""
    classes: int = 1000
    """Number of output classes."""
    patch_embed: str = "conv"
    """`conv` (a P-strided P x P convolution) or `linear` (cut the image into patches by reshapes, then a linear)."""
    qkv_fused: bool = False
    """One linear for queries, keys and values, chunked in three (as timm writes it), instead of three."""
    dropout: float = 0.0
    """Dropout probability after attention and MLP (0: left out)."""

    def __post_init__(self) -> None:
        if self.image_size % self.patch:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch ({self.patch})")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.patch_embed not in PATCH_EMBEDS:
            raise ValueError(f"patch_embed ({self.patch_embed!r}) must be one of {', '.join(PATCH_EMBEDS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")


class PatchEmbed(nn.Module):
    """(B, C, S, S) -> (B, N, hidden), N = (S / P)^2 patches in row-major order."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.patch, self.kind = cfg.patch, cfg.patch_embed
        if cfg.patch_embed == "conv":
            self.proj = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        else:
            self.proj = nn.Linear(cfg.channels * cfg.patch ** 2, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "conv":
            return self.proj(x).flatten(2).transpose(1, 2)  # (B, hidden, n, n) -> (B, N, hidden)
        B, C, S, _ = x.shape
        n, P = S // self.patch, self.patch
        x = x.reshape(B, C, n, P, n, P).permute(0, 2, 4, 1, 3, 5)  # (B, n, n, C, P, P)
        return self.proj(x.reshape(B, n * n, C * P * P))


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads, self.fused = cfg.heads, cfg.qkv_fused
        if cfg.qkv_fused:
            self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        else:
            self.q, self.k, self.v = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(3))
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.hidden), Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc, self.fc_proj = nn.Linear(cfg.hidden, cfg.mlp), nn.Linear(cfg.mlp, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        tokens = (cfg.image_size // cfg.patch) ** 2 + 1
        self.embed = PatchEmbed(cfg)
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, cfg.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)  # (B, N, hidden)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, N + 1, hidden)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x[:, 0])), labels)  # classify from the class token


def build(cfg: ViTConfig) -> nn.Module:
    return ViT(cfg)


def example_inputs(cfg: ViTConfig, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Images and class labels (random values on a real device, shapes only on `meta`)."""
    shape = (cfg.batch, cfg.channels, cfg.image_size, cfg.image_size)
    if torch.device(device).type == "meta":  # a paper-size batch of images would take gigabytes on the CPU
        return torch.empty(shape, device="meta"), torch.empty(cfg.batch, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(shape, generator=g)
    labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
    return images.to(device), labels.to(device)
