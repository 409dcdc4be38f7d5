"""BERT-Base (Devlin et al. 2019; HAP §7 Table 1) trained with a masked-language-model loss.

tokens, segments (B, T) -> word + segment + position embeddings -> LayerNorm -> [post-norm
attention block, post-norm feed-forward block] * layers -> gather the hidden states at the masked
positions (B, P) -> MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings, bias)
-> cross-entropy against the original tokens at those positions.

As in BERT's own pre-training code, each sequence carries a fixed number P of predicted positions
(max_predictions_per_seq, 20 for T = 128), so the mean loss divides by the fixed count B * P. The
gather of the masked positions is a one-hot matmul (exact: one nonzero term per output). The paper
does not state the sequence length: 128 is BERT's main pre-training length. Dropout is a knob,
off by default (on, the runner draws the masks single-device training draws: engine/model/dropout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Size knobs of the BERT zoo model (defaults: BERT-Base, HAP Table 1)."""

    layers: int = 12
    """Number of transformer encoder blocks."""
    hidden: int = 768
    """Model width."""
    heads: int = 12
    """Attention heads; must divide `hidden`."""
    ffn: int = 3072
    """Width of the feed-forward block (4 * hidden in BERT)."""
    vocab: int = 30522
    """WordPiece vocabulary size of BERT."""
    seq_len: int = 128
    """Sequence length T."""
    segments: int = 2
    """Token-type (segment) vocabulary: sentence A / sentence B."""
    predictions: int = 20
    """Masked positions predicted per sequence (BERT's max_predictions_per_seq for T = 128)."""
    batch: int = 512
    """Global batch size (HAP §7.1: 64 per device, here for 8 devices)."""
    dropout: float = 0.0
    """Dropout probability after embeddings, attention and feed-forward (BERT uses 0.1)."""
    tie_weights: bool = False
    """Share the word embedding with the MLM decoder, as BERT does. Off by default: tied, the table's
    two uses want different shardings (a hidden-split lookup, a vocabulary-split decoder), and on
    the paper's testbed no program beats data parallelism on it; untied, each is sharded its way."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.predictions > self.seq_len:
            raise ValueError(f"predictions ({self.predictions}) cannot exceed seq_len ({self.seq_len})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.heads
        q = self.q(x).view(B, T, self.heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.heads, hs).transpose(1, 2)
        v = self.v(x).view(B, T, self.heads, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class EncoderBlock(nn.Module):
    """Post-norm block: x = LN(x + attn(x)); x = LN(x + ffn(x)). `ffn` may be any (B, T, C) map (MoE)."""

    def __init__(self, cfg, ffn: nn.Module) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.dropout)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.ffn = ffn
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class Bert(nn.Module):
    """BERT encoder + MLM head; `ffn_for(i)` builds the feed-forward of block i (bert_moe swaps some)."""

    def __init__(self, cfg, ffn_for=None) -> None:
        super().__init__()
        ffn_for = ffn_for or (lambda i: FeedForward(cfg.hidden, cfg.ffn, cfg.dropout))
        self.word = nn.Embedding(cfg.vocab, cfg.hidden)
        self.segment = nn.Embedding(cfg.segments, cfg.hidden)
        self.position = nn.Parameter(torch.randn(cfg.seq_len, cfg.hidden) * 0.02)  # (T, C), added by broadcast
        self.ln_emb = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg, ffn_for(i)) for i in range(cfg.layers))
        self.head_fc = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_ln = nn.LayerNorm(cfg.hidden, eps=1e-12)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)
        if cfg.tie_weights:
            self.decoder.weight = self.word.weight

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.ln_emb(self.word(tokens) + self.segment(segments) + self.position))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        pick = F.one_hot(positions, x.shape[1]).to(x.dtype)  # (B, P, T): row p selects position positions[b, p]
        h = self.head_ln(F.gelu(self.head_fc(pick @ x)))  # (B, P, C)
        logits = self.decoder(h)  # (B, P, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(cfg: BertConfig) -> nn.Module:
    return Bert(cfg)


def example_inputs(cfg, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A masked-LM batch: tokens (15% of which would be [MASK]ed in real data: here the predicted
    positions are drawn without repetition), segment ids, the predicted positions and their labels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len), generator=g)
    segments = (torch.arange(cfg.seq_len) >= cfg.seq_len // 2).long().expand(cfg.batch, -1).contiguous()
    positions = torch.stack([torch.randperm(cfg.seq_len, generator=g)[: cfg.predictions] for _ in range(cfg.batch)])
    labels = torch.randint(0, cfg.vocab, (cfg.batch, cfg.predictions), generator=g)
    return tuple(t.to(device) for t in (tokens, segments, positions, labels))
