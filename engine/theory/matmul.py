"""Matrix products: `linear` (x @ w^T, the bias is a separate add) and batched `matmul`.

For linear(x[..., k], w[n, k]) -> y[..., n]:
- batch:      x S(d) (d a leading dim), w F   -> y S(d)   (data parallel)
- column:     x F, w S(0)                    -> y S(-1)  (output features split)
- row:        x S(-1), w S(1)                -> y P      (contraction split: addends)
- partial:    x P, w F                       -> y P      (linear in x)
- replicate:  x F, w F                       -> y F      (sufficient-factor broadcasting, §4.4)
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("linear")
def linear_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    last = node.rank - 1
    rules = [replicate(node), OpRule("partial", (PARTIAL, FULL), PARTIAL)]
    rules += [OpRule("batch", (d, FULL), d) for d in range(last)]
    rules.append(OpRule("column", (FULL, 0), last))
    rules.append(OpRule("row", (x.rank - 1, 1), PARTIAL))
    return rules


@rule("matmul")
def matmul_rules(node: Node, graph: Graph) -> list[OpRule]:
    a, b = graph[node.inputs[0]], graph[node.inputs[1]]
    r = node.rank
    rules = [replicate(node), OpRule("partial", (PARTIAL, FULL), PARTIAL), OpRule("partial", (FULL, PARTIAL), PARTIAL)]
    for d in range(r - 2):  # batch dims, aligned from the right, broadcast ones stay Full
        da, db = d - (r - a.rank), d - (r - b.rank)
        fa = da if da >= 0 and a.shape[da] == node.shape[d] else FULL
        fb = db if db >= 0 and b.shape[db] == node.shape[d] else FULL
        rules.append(OpRule("batch", (fa, fb), d))
    rules.append(OpRule("rows", (a.rank - 2, FULL), r - 2))
    rules.append(OpRule("cols", (FULL, b.rank - 1), r - 1))
    rules.append(OpRule("contract", (a.rank - 1, b.rank - 2), PARTIAL))
    return rules
