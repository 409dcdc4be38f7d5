"""The index operators of MoE gating (GShard-style top-k routing): `topk_values`, `topk_indices`,
`one_hot`, `cumsum`.

Dispatch (tokens -> expert slots) and combine (expert outputs -> tokens) are einsums whose rules
come from `einsum.py`; the expert dim is a letter like any other, so an uneven split of it gives a
faster device more experts (HAP §7.6) with no padding to a multiple of the device count. What is
left is the gating, whose index ops only allow the rules that stay exact:
- topk and sort over `dim`: any other dim may be sharded (each row's top-k, or its order, lies in
  one slice); not linear.
- one_hot(ids, C): ids sharded on d -> output sharded on d (a per-element map); not linear.
- cumsum over `dim`: any other dim may be sharded; and it is linear, so P -> P. Sharding the
  scanned dim itself would need each device's prefix (a scan), which is no rule here.
- index_add(x, dim, idx, src) / scatter_add(x, dim, idx, src) (combine: expert outputs summed into
  their tokens): linear in (x, src) together, so (P, F, P) -> P; a dim other than `dim` where
  x, src (and scatter's idx) have the same size may be sharded in all of them -> S(d).
- histc(x, bins, min, max) with a fixed range (min < max): the histogram of a partition is the
  sum of the parts' histograms, so x sharded on any dim -> P. With min = max torch takes the
  range from the data, which a shard does not know: replicate only.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("topk_values", "topk_indices", "sort_values", "sort_indices")
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


@rule("index_add", "scatter_add")
def index_add_rules(node: Node, graph: Graph) -> list[OpRule]:
    x, idx, src = (graph[i] for i in node.inputs)
    dim = node.attrs["dim"]
    rules = [replicate(node), OpRule("partial", (PARTIAL, FULL, PARTIAL), PARTIAL)]
    for d in range(x.rank):
        if d == dim or src.shape[d] != x.shape[d]:
            continue
        if node.op == "scatter_add":
            if idx.shape[d] == x.shape[d]:
                rules.append(OpRule("rows", (d, d, d), d))
        else:
            rules.append(OpRule("rows", (d, FULL, d), d))
    return rules


@rule("histc")
def histc_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    rules = [replicate(node)]
    if node.attrs["min"] < node.attrs["max"]:
        rules += [OpRule("counts", (d,), PARTIAL) for d in range(x.rank)]
    return rules
