"""Views and layout changes: `view` (reshape) and `permute` (transpose).

- permute: S(dims[i]) -> S(i); F -> F; P -> P (a layout change commutes with sums).
- view: dims are grouped into runs with equal products; a shard on the leading non-unit dim of a
  run maps to the leading non-unit dim of the matching output run (splitting the outer factor
  keeps each slice contiguous). Shard sizes then come in multiples of the inner factors, which the
  plan's rounding guarantees (see `plan.shard_units`).
"""
from __future__ import annotations

import math

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, rule


@rule("permute")
def permute_rules(node: Node, graph: Graph) -> list[OpRule]:
    dims = node.attrs["dims"]
    rules = [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)]
    rules += [OpRule("shard", (dims[i],), i) for i in range(node.rank)]
    return rules


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source dims with runs of destination dims of equal element count (unit dims skipped)."""
    a = [i for i, s in enumerate(src) if s != 1]
    b = [j for j, s in enumerate(dst) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= src[a[i]]
                gi.append(a[i])
                i += 1
            else:
                pb *= dst[b[j]]
                gj.append(b[j])
                j += 1
        groups.append((gi, gj))
    assert i == len(a) and j == len(b) and math.prod(src) == math.prod(dst), f"bad view {src} -> {dst}"
    return groups


@rule("view")
def view_rules(node: Node, graph: Graph) -> list[OpRule]:
    src = graph[node.inputs[0]].shape
    rules = [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)]
    for gi, gj in view_groups(src, node.shape):
        rules.append(OpRule("shard", (gi[0],), gj[0]))
    return rules
