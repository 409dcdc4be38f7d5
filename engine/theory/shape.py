"""Shape operators: `cat`, `narrow` (slice, and each piece of split/chunk), `select`, `expand`, `flip`, `unfold`.

Rows, with why they hold:
- cat(S(d), ..., S(d)) -> S(d) for d != the cat dim: every operand is cut at the same rows of d, so
  the local concatenations are the slices of the global one. Not on the cat dim itself: the
  pieces of different operands would interleave.
- cat(P, ..., P) -> P, narrow/select/expand(P) -> P: these are linear maps (copies of entries),
  so they commute with summing addends.
- narrow(S(d)) -> S(d) for d != the narrowed dim; select(S(d)) -> S(d') with d' = d shifted past
  the removed dim. The narrowed or selected dim itself stays whole: a device's slice of it need
  not contain the chosen rows.
- expand(S(d)) -> S(d') on a dim the operand really has (aligned from the right, size > 1).
- expand(F) -> S(d) on a broadcast dim (new or of size 1): each device expands to its own rows,
  which is a slice of the global expansion. Its gradient (the sum over local rows) is an addend
  of the true gradient, as a Full operand's gradient must be.
- flip(S(d)) -> S(d) for d not flipped (each slice flips within itself); P -> P (a permutation of entries).
- unfold(S(d)) -> S(d) for d other than the windowed dim (windows lie along it); P -> P (a selection of entries).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, rule


def _linear_base(node: Node) -> list[OpRule]:
    """The all-Full and all-Partial rules every linear shape operator has."""
    n = len(node.inputs)
    return [OpRule("replicate", (FULL,) * n, FULL), OpRule("partial", (PARTIAL,) * n, PARTIAL)]


@rule("cat")
def cat_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim, n = node.attrs["dim"], len(node.inputs)
    return _linear_base(node) + [OpRule("shard", (d,) * n, d) for d in range(node.rank) if d != dim]


@rule("narrow")
def narrow_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    return _linear_base(node) + [OpRule("shard", (d,), d) for d in range(node.rank) if d != dim]


@rule("select")
def select_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    x = graph[node.inputs[0]]
    return _linear_base(node) + [OpRule("shard", (d,), d if d < dim else d - 1) for d in range(x.rank) if d != dim]


@rule("expand")
def expand_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    lead = node.rank - x.rank
    rules = _linear_base(node)
    for d in range(node.rank):
        src = d - lead
        if src >= 0 and x.shape[src] == node.shape[d]:
            rules.append(OpRule("shard", (src,), d))
        else:
            rules.append(OpRule("broadcast", (FULL,), d))
    return rules


@rule("unfold")
def unfold_rules(node: Node, graph: Graph) -> list[OpRule]:
    """Windows along one dim: every other dim keeps its shards (the windows' dim is new and last)."""
    dim = node.attrs["dim"]
    return _linear_base(node) + [OpRule("shard", (d,), d) for d in range(node.rank - 1) if d != dim]


@rule("flip")
def flip_rules(node: Node, graph: Graph) -> list[OpRule]:
    dims = node.attrs["dims"]
    return _linear_base(node) + [OpRule("shard", (d,), d) for d in range(node.rank) if d not in dims]
