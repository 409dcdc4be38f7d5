"""Scaled dot-product attention `sdpa(q, k, v)` over (..., T, hs) tensors.

Attention mixes positions along T and reduces along hs, so only the leading dims (batch and heads)
may be sharded, all three operands alike: S(d), S(d), S(d) -> S(d). Head parallelism is d = 1.
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import OpRule, replicate, rule


@rule("sdpa")
def sdpa_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = [replicate(node)]
    rules += [OpRule("batch" if d == 0 else "heads", (d, d, d), d) for d in range(node.rank - 2)]
    return rules
