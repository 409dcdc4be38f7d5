"""A mixture-of-experts forward that torch.export captures at real sizes: every expert on every token, weighted.

transformers' experts kernels do not suit a static capture: `grouped_mm` sizes its groups from the routing
(`histc`), `eager` loops over the `nonzero()` experts (data-dependent shapes both), and `batched_mm` gathers one
copy of an expert's weights per routed token, tokens x top-k x hidden x intermediate elements: 47 GB for a
2048-wide Qwen2-MoE layer on 1024 tokens. `dense_experts_forward` runs each expert on all tokens (a static loop
over the experts) and adds its output times the token's routing weight for it, zero where it was not picked:
the same sum, exactly zero contributions aside, for E/k times the experts' compute and no gather. Registered
as `hap_dense` in transformers' experts interface; `engine.model.source` picks it for MoE classes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "hap_dense"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """x @ W (transposed layout, weight (in, out)) or x @ W^T (weight (out, in)), plus the bias."""
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward (`self` as transformers' `use_experts_implementation` sets it up)."""
    out = torch.zeros_like(hidden_states, dtype=top_k_weights.dtype)
    up, up_bias = (self.gate_up_proj, "gate_up_proj_bias") if self.has_gate else (self.up_proj, "up_proj_bias")
    for e in range(up.shape[0]):
        h = _linear(hidden_states, up[e], getattr(self, up_bias)[e] if self.has_bias else None, self.is_transposed)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _linear(h, self.down_proj[e], self.down_proj_bias[e] if self.has_bias else None, self.is_transposed)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)  # 0 where e was not routed
        out = out + h * weight
    return out.to(hidden_states.dtype)


def register(transformers_module) -> None:
    """Add `hap_dense` to transformers' experts interface (once; later calls change nothing)."""
    from transformers.integrations.moe import ExpertsInterface

    if NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(NAME, dense_experts_forward)
