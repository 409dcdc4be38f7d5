"""Batch normalisation in training mode: `batch_norm(x[N, C, *spatial], weight[C], bias[C])`.

The statistics of channel c are the mean and variance over every sample and position of c, so
- channels:   x S(1), weight S(0), bias S(0) -> y S(1)   a device normalises whole channels;
- replicate:  x F, weight F, bias F           -> y F.
No batch or spatial rule: a device would normalise with the statistics of its own samples only,
which changes the result (and the gradient) of every sample. No Partial rule: the statistics
are not linear in x.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import OpRule, replicate, rule


@rule("batch_norm")
def batch_norm_rules(node: Node, graph: Graph) -> list[OpRule]:
    affine = (0,) * (len(node.inputs) - 1)
    return [replicate(node), OpRule("channels", (1,) + affine, 1)]
