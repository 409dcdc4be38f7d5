"""BERT-MoE (HAP §7 Table 1): BERT-Base whose feed-forward is a mixture of experts every second
block, GShard-style (Lepikhin et al. 2021) top-2 gating with a capacity per expert.

Routing works per sequence (GShard's "group" = one sequence of T tokens), so splitting the batch
never changes which tokens an expert keeps. In one MoE block, shapes (B, T, E experts, K = top-k,
cap = slots per expert and sequence):

  gate probabilities (B, T, E) -> top-k weights and expert ids (B, T, K)
  slot of each choice = running count of earlier choices of that expert (first choices of all
  tokens before second choices), choices beyond `cap` dropped
  dispatch (B, T, E, cap) one-hot, combine = dispatch weighted by the gate
  expert inputs  einsum("btec,btd->ebcd")   (E, B, cap, C)
  experts        einsum("ebcd,edf->ebcf"), GELU, einsum("ebcf,efd->ebcd") (batched matmuls)
  outputs        einsum("btec,ebcd->btd")   (B, T, C)

Every expert tensor has the expert dim e, so sharding it places whole experts on devices in any
integer split (HAP §7.6): a faster device may hold more experts, and any count works on any
number of devices. The paper scales experts with devices (84M + 36M per device): the default is
8 experts for 8 devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.model.zoo import bert


@dataclass(frozen=True, kw_only=True)
class BertMoEConfig(bert.BertConfig):
    """BERT knobs plus the mixture of experts (defaults: BERT-Base, 8 experts, top-2)."""

    batch: int = 256
    """Global batch size (HAP §7.1: 32 per device for BERT-MoE, here for 8 devices)."""
    experts: int = 8
    """Experts per MoE layer; any positive number (no need to divide the device count)."""
    top_k: int = 2
    """Experts each token is sent to (GShard: 2)."""
    capacity_factor: float = 1.25
    """Slots per expert and sequence = ceil(capacity_factor * top_k * seq_len / experts)."""
    moe_every: int = 2
    """Every `moe_every`-th block (the 2nd, 4th, ...) has the MoE feed-forward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed experts ({self.experts})")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor ({self.capacity_factor}) must be positive")

    @property
    def capacity(self) -> int:
        return max(1, math.ceil(self.capacity_factor * self.top_k * self.seq_len / self.experts))


class MoEFeedForward(nn.Module):
    """Top-k gated experts; each expert is BERT's feed-forward (hidden -> ffn -> hidden)."""

    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        self.top_k, self.capacity, E = cfg.top_k, cfg.capacity, cfg.experts
        self.gate = nn.Linear(cfg.hidden, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, cfg.hidden, cfg.ffn) * cfg.hidden ** -0.5)  # (E, C, F)
        self.b1 = nn.Parameter(torch.zeros(E, 1, 1, cfg.ffn))
        self.w2 = nn.Parameter(torch.randn(E, cfg.ffn, cfg.hidden) * cfg.ffn ** -0.5)  # (E, F, C)
        self.b2 = nn.Parameter(torch.zeros(E, 1, 1, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dispatch (B, T, E, cap) in {0, 1} and combine (B, T, E, cap) = dispatch * gate weight."""
        B, T, _ = x.shape
        K, cap = self.top_k, self.capacity
        probs = torch.softmax(self.gate(x), dim=-1)  # (B, T, E)
        weight, expert = torch.topk(probs, K, dim=-1)  # (B, T, K)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        choice = F.one_hot(expert, probs.shape[-1])  # (B, T, K, E)
        order = choice.permute(0, 2, 1, 3).reshape(B, K * T, -1)  # k-major: all first choices first
        slot = (torch.cumsum(order, dim=1) - 1).reshape(B, K, T, -1).permute(0, 2, 1, 3)  # (B, T, K, E)
        keep = choice * (slot < cap)  # the choice is made and its slot exists
        onehot = F.one_hot(slot * keep, cap) * keep.unsqueeze(-1)  # (B, T, K, E, cap)
        per_choice = onehot.to(x.dtype)
        dispatch = per_choice.sum(dim=2)  # (B, T, E, cap)
        combine = torch.einsum("btk,btkec->btec", weight, per_choice)
        return dispatch, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self.route(x)
        xe = torch.einsum("btec,btd->ebcd", dispatch, x)  # (E, B, cap, C)
        h = F.gelu(torch.einsum("ebcd,edf->ebcf", xe, self.w1) + self.b1)  # (E, B, cap, F)
        ye = torch.einsum("ebcf,efd->ebcd", h, self.w2) + self.b2  # (E, B, cap, C)
        return self.drop(torch.einsum("btec,ebcd->btd", combine, ye))


def build(cfg: BertMoEConfig) -> nn.Module:
    def ffn_for(i: int) -> nn.Module:
        if (i + 1) % cfg.moe_every == 0:
            return MoEFeedForward(cfg)
        return bert.FeedForward(cfg.hidden, cfg.ffn, cfg.dropout)

    return bert.Bert(cfg, ffn_for)


example_inputs = bert.example_inputs
