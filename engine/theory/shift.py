"""Shift operators: `roll` (cyclic shift along some dims) and `pad` (constant padding of the
trailing dims), as Swin's shifted windows and padding to whole windows use them.

Rows, with why they hold:
- roll(S(d)) -> S(d) and pad(S(d)) -> S(d) for a dim d that is neither rolled nor padded: the op
  moves entries only along other dims, so each device's rows of d are the same rows of the result.
  The rolled or padded dims stay whole: a slice of them would wrap or pad at the wrong place.
- roll(P) -> P: a roll is a permutation of entries, linear, so it commutes with summing addends.
- pad(P) -> P only when the pad value is 0: the addends' pads then sum to the global pad (a
  value v would be counted once per device).
- replicate (all Full) for both.
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import FULL, PARTIAL, OpRule, rule


def rolled_dims(node: Node) -> set[int]:
    """Dims a roll moves entries along (every dim when it rolls the flattened tensor)."""
    dims = node.attrs["dims"]
    return set(range(node.rank)) if not dims else {d % node.rank for d in dims}


def padded_dims(node: Node) -> set[int]:
    """Dims a pad changes: the last len(pad) // 2 dims (the pad list runs from the last dim backwards)."""
    return {node.rank - 1 - k for k in range(len(node.attrs["pad"]) // 2)}


def _kept(node: Node, moved: set[int]) -> list[OpRule]:
    return [OpRule("shard", (d,), d) for d in range(node.rank) if d not in moved]


@rule("roll")
def roll_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)] + _kept(node, rolled_dims(node))


@rule("pad")
def pad_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = [OpRule("replicate", (FULL,), FULL)] + _kept(node, padded_dims(node))
    if node.attrs["value"] == 0:
        rules.append(OpRule("partial", (PARTIAL,), PARTIAL))
    return rules
