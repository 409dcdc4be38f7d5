"""Reductions over a list of dims: `sum` and `mean`, and the nonlinear ones `amax`, `amin`, `any`,
`all`, `prod`, `var`, `argmax`, `argmin`.

- S(d), d kept:    the result stays sharded on d's position in the output.
- S(d), d reduced: each device reduces its slice -> P. `mean` divides by the *global* count, so the
  addends sum to the true mean (the executor always divides by the global size).
- P -> P, F -> F: reductions are linear.
- amax, amin, any, all, prod, var, argmax, argmin: only S(d) on a kept dim -> S(d') and all-Full. A
  shard of a reduced dim would need a max-, product- or variance-combining collective, which the
  theory has not (a sum of per-shard maxima is no maximum), and none of them is linear.
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
            rules.append(OpRule("shard", (d,), kept_dim(d, dims, keep)))
    return rules


def kept_dim(d: int, dims: list[int], keepdim: bool) -> int:
    """Where kept dim d of the input lands in a reduction's output."""
    return d if keepdim else d - sum(1 for r in dims if r < d)


@rule("amax", "amin", "any", "all", "prod", "var", "argmax", "argmin")
def nonlinear_reduce_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    dims, keep = node.attrs["dims"], node.attrs["keepdim"]
    return [OpRule("replicate", (FULL,), FULL)] + [OpRule("shard", (d,), kept_dim(d, dims, keep))
                                                   for d in range(x.rank) if d not in dims]
