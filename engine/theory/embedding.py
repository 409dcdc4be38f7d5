"""Embedding lookup `embedding(w[V, C], ids[...]) -> out[..., C]`.

- ids S(d), w F -> out S(d): each device looks up its own tokens.
- ids F, w S(1) -> out S(-1): each device holds a slice of every embedding vector.
- ids F, w S(0) -> out P (vocabulary parallel, Megatron-style): each device holds a range of rows,
  looks up the ids inside its range and writes zeros for the others; exactly one device holds
  each id, so the outputs are addends of the result. The executor needs the device's row offset.
- w P, ids F -> out P: a lookup is linear in the table.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("embedding")
def embedding_rules(node: Node, graph: Graph) -> list[OpRule]:
    ids = graph[node.inputs[1]]
    rules = [replicate(node), OpRule("hidden", (1, FULL), node.rank - 1), OpRule("vocab", (0, FULL), PARTIAL),
             OpRule("partial", (PARTIAL, FULL), PARTIAL)]
    rules += [OpRule("batch", (FULL, d), d) for d in range(ids.rank)]
    return rules
