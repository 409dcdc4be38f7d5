"""Embedding lookup `embedding(w[V, C], ids[...]) -> out[..., C]`.

- ids S(d), w F -> out S(d): each device looks up its own tokens.
- ids F, w S(1) -> out S(-1): each device holds a slice of every embedding vector.
(Vocabulary-parallel lookup, w S(0) -> P with masking, comes with the MoE/ecosystem work.)
"""
from __future__ import annotations

from ..graph import Graph, Node
from .core import FULL, OpRule, replicate, rule


@rule("embedding")
def embedding_rules(node: Node, graph: Graph) -> list[OpRule]:
    ids = graph[node.inputs[1]]
    rules = [replicate(node), OpRule("hidden", (1, FULL), node.rank - 1)]
    rules += [OpRule("batch", (FULL, d), d) for d in range(ids.rank)]
    return rules
