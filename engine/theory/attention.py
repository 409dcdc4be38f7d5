"""Scaled dot-product attention `sdpa(q, k, v[, mask])` over (..., T, hs) tensors.

Attention mixes key positions and reduces along hs, so:
- a leading dim (batch, heads) may be sharded in q, k, v and the output alike: S(d)^3 -> S(d);
  head parallelism is d = 1. An additive or boolean mask follows its own aligned dim, or stays
  Full where it is broadcast (size 1) along d;
- without a causal mask, the query positions may be split: q S(T) with k, v Full -> S(T) (each
  query row attends to all keys; the mask is split by rows alike). A causal mask is defined by
  global positions, so this rule is not offered for `is_causal`.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, OpRule, replicate, rule


def _mask_form(mask: Node, out_dim: int, out: Node) -> int:
    d = out_dim - (out.rank - mask.rank)
    return d if d >= 0 and mask.shape[d] == out.shape[out_dim] else FULL


@rule("sdpa")
def sdpa_rules(node: Node, graph: Graph) -> list[OpRule]:
    mask = graph[node.inputs[3]] if len(node.inputs) > 3 else None
    rules = [replicate(node)]
    for d in range(node.rank - 2):
        extra = (_mask_form(mask, d, node),) if mask is not None else ()
        rules.append(OpRule("batch" if d == 0 else "heads", (d, d, d) + extra, d))
    if not node.attrs.get("is_causal"):
        t = node.rank - 2
        extra = (_mask_form(mask, t, node),) if mask is not None else ()
        rules.append(OpRule("queries", (t, FULL, FULL) + extra, t))
    return rules
