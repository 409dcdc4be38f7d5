"""Shift operators: `roll`, the cyclic shift of Swin's shifted windows (constant `pad`, which Swin
uses beside it, is in index.py).

Rows, with why they hold:
- roll(S(d)) -> S(d) for a dim d that is not rolled: the op moves entries only along other dims, so
  each device's rows of d are the same rows of the result. The rolled dims stay whole: a slice of
  them would wrap at the wrong place.
- roll(P) -> P: a roll is a permutation of entries, linear, so it commutes with summing addends.
- replicate (all Full).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, rule


def rolled_dims(node: Node) -> set[int]:
    """Dims a roll moves entries along (every dim when it rolls the flattened tensor)."""
    dims = node.attrs["dims"]
    return set(range(node.rank)) if not dims else {d % node.rank for d in dims}


@rule("roll")
def roll_rules(node: Node, graph: Graph) -> list[OpRule]:
    kept = [OpRule("shard", (d,), d) for d in range(node.rank) if d not in rolled_dims(node)]
    return [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)] + kept
