"""Mean losses `cross_entropy(logits[N, V], target[N])` and `mse_loss(x, y)`.

Sharding the samples gives each device the sum of its samples' losses divided by the *global*
count: addends of the true mean, so S(0), S(0) -> P. The all-Full rule gives a Full loss.
Captured cross-entropy carries the count as a third operand, `sum(target != ignore_index)` (targets
equal to ignore_index, -100 by default, add nothing to the sum nor to the count: torch's mean):
the count must be Full, the whole batch's, so S(0), S(0), F -> P. A static `count` attribute
(two operands) is the count when no target is ignored.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("cross_entropy")
def cross_entropy_rules(node: Node, graph: Graph) -> list[OpRule]:
    if len(node.inputs) == 3:  # the count of kept targets is an operand: Full, the whole batch's count
        return [replicate(node), OpRule("samples", (0, 0, FULL), PARTIAL)]
    return [replicate(node), OpRule("samples", (0, 0), PARTIAL)]


@rule("mse_loss")
def mse_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    return [replicate(node)] + [OpRule("samples", (d, d), PARTIAL) for d in range(x.rank)]
