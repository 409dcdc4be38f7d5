"""Constants and index arithmetic that models build on the fly: `arange` and `gather`.

- arange has no operand: every device builds it whole (F). A sharded copy comes from a free slice.
- gather(x, dim, idx): out[..i..] = x[..idx[..i..]..] along `dim`; any other dim where x and idx
  have the same size may be sharded in both (each slice gathers within itself). Not linear in idx.
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import PARTIAL, FULL, OpRule, replicate, rule


@rule("arange")
def arange_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [replicate(node)]


@rule("gather")
def gather_rules(node: Node, graph: Graph) -> list[OpRule]:
    x, idx = graph[node.inputs[0]], graph[node.inputs[1]]
    dim = node.attrs["dim"]
    rules = [replicate(node), OpRule("partial", (PARTIAL, FULL), PARTIAL)]  # a selection is linear in x
    rules += [OpRule("rows", (d, d), d) for d in range(node.rank) if d != dim and x.shape[d] == idx.shape[d]]
    return rules
