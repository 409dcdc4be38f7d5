"""Mean losses `cross_entropy(logits[N, V], target[N])` and `mse_loss(x, y)`.

Sharding the samples gives each device the sum of its samples' losses divided by the *global*
count: addends of the true mean, so S(0), S(0) -> P. The all-Full rule gives a Full loss.
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import OpRule, PARTIAL, replicate, rule


@rule("cross_entropy")
def cross_entropy_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [replicate(node), OpRule("samples", (0, 0), PARTIAL)]


@rule("mse_loss")
def mse_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    return [replicate(node)] + [OpRule("samples", (d, d), PARTIAL) for d in range(x.rank)]
