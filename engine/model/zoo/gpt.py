"""A decoder-only transformer language model (GPT-2 shape, Radford et al. 2019).

tokens (B, T) -> token + position embedding -> [pre-norm attention block, pre-norm MLP block] * layers
-> final LayerNorm -> LM head -> cross-entropy against the next tokens. Dropout is left out: the
runner's equivalence with single-device training needs identical random streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size knobs of the GPT zoo model (defaults: GPT-2 small with a 128-token context)."""

    layers: int = 12
    """Number of transformer blocks."""
    hidden: int = 768
    """Model width (embedding size)."""
    heads: int = 12
    """Attention heads; must divide `hidden`."""
    ffn: int = 3072
    """Width of the MLP inside each block."""
    vocab: int = 50304
    """Vocabulary size (GPT-2's 50257 rounded up to a multiple of 64, as nanoGPT does)."""
    seq_len: int = 128
    """Context length T."""
    batch: int = 64
    """Global batch size B (sequences per iteration)."""
    tie_weights: bool = False
    """Share the token embedding with the LM head."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.heads
        q = self.q(x).view(B, T, self.heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.heads, hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.heads, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc_proj = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Parameter(torch.randn(cfg.seq_len, cfg.hidden) * 0.02)  # (T, C), added by broadcast
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(cfg: GPTConfig) -> nn.Module:
    return GPT(cfg)


def example_inputs(cfg: GPTConfig, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Token ids and next-token targets (random tokens; shapes only on `meta`)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
