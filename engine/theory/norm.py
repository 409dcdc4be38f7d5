"""Normalisations over trailing dims: `layer_norm`, `softmax`, `log_softmax`, and `group_norm`.

Each output element depends on a whole row along the normalised dims, so only the other dims may be
sharded (S(d) -> S(d), weight and bias Full). No Partial rule: the statistics are nonlinear.
group_norm's statistics span a sample's channel group and all its positions: only the batch dim
(0) may be sharded.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, OpRule, replicate, rule


@rule("layer_norm")
def layer_norm_rules(node: Node, graph: Graph) -> list[OpRule]:
    free = node.rank - len(node.attrs["normalized_shape"])
    affine = (FULL,) * (len(node.inputs) - 1)
    return [replicate(node)] + [OpRule("shard", (d,) + affine, d) for d in range(free)]


@rule("softmax", "log_softmax")
def softmax_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    return [replicate(node)] + [OpRule("shard", (d,), d) for d in range(node.rank) if d != dim]


@rule("group_norm")
def group_norm_rules(node: Node, graph: Graph) -> list[OpRule]:
    affine = (FULL,) * (len(node.inputs) - 1)
    return [replicate(node), OpRule("batch", (0,) + affine, 0)]
