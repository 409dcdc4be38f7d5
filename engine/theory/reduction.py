"""Reductions `sum` and `mean` over a list of dims.

- S(d), d kept:    the result stays sharded on d's position in the output.
- S(d), d reduced: each device reduces its slice -> P. `mean` divides by the *global* count, so the
  addends sum to the true mean (the executor always divides by the global size).
- P -> P, F -> F: reductions are linear.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, rule


@rule("sum", "mean")
def reduce_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    dims, keep = node.attrs["dims"], node.attrs["keepdim"]
    rules = [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)]
    for d in range(x.rank):
        if d in dims:
            rules.append(OpRule("reduce_sharded", (d,), PARTIAL))
        else:
            rules.append(OpRule("shard", (d,), d if keep else d - sum(1 for r in dims if r < d)))
    return rules
