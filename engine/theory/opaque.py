"""Opaque operators: what capture keeps, under `fallback="replicate"`, for an ATen op with no rule.

Nothing is known about how such an op splits, so its only rule is all-Full: every device runs the
original op on whole inputs (at its whole cost). The program stays exact; the op only costs time.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import OpRule, replicate, rule


@rule("opaque")
def opaque_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [replicate(node)]
