"""The index operators of MoE gating (GShard-style top-k routing): `topk_values`, `topk_indices`,
`one_hot`, `cumsum`.

Dispatch (tokens -> expert slots) and combine (expert outputs -> tokens) are einsums whose rules
come from `einsum.py`; the expert dim is a letter like any other, so an uneven split of it gives a
faster device more experts (HAP §7.6) with no padding to a multiple of the device count. What is
left is the gating, whose index ops only allow the rules that stay exact:
- topk over `dim`: any other dim may be sharded (each row's top-k lies in one slice); not linear.
- one_hot(ids, C): ids sharded on d -> output sharded on d (a per-element map); not linear.
- cumsum over `dim`: any other dim may be sharded; and it is linear, so P -> P. Sharding the
  scanned dim itself would need each device's prefix (a scan), which is no rule here.
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import PARTIAL, OpRule, replicate, rule


@rule("topk_values", "topk_indices")
def topk_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    return [replicate(node)] + [OpRule("rows", (d,), d) for d in range(node.rank) if d != dim]


@rule("one_hot")
def one_hot_rules(node: Node, graph: Graph) -> list[OpRule]:
    ids = graph[node.inputs[0]]
    return [replicate(node)] + [OpRule("elements", (d,), d) for d in range(ids.rank)]


@rule("cumsum")
def cumsum_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    rules = [replicate(node), OpRule("partial", (PARTIAL,), PARTIAL)]
    return rules + [OpRule("rows", (d,), d) for d in range(node.rank) if d != dim]
