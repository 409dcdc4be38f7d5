"""Discrete Fourier transforms: `fft(x)` over some dims, of a real tensor or of a complex one held as a real
(re, im) pair (a trailing dim of 2, engine/model/capture.py), into a pair (FNet's token mixing).

Rows, with why they hold:
- shard:     S(d) -> S(d) for d not transformed (nor the pair's trailing dim): the transform mixes entries
             along its dims only, so each slice of another dim is transformed on its own.
- partial:   P -> P   the transform is linear, so it commutes with summing addends.
- replicate: F -> F.
A transformed dim stays whole: every output entry reads every entry along it. The (re, im) dim never splits.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, rule


@rule("fft")
def fft_rules(node: Node, graph: Graph) -> list[OpRule]:
    """Every dim but the transformed ones and the (re, im) dim keeps its shards."""
    x, complex_rank = graph[node.inputs[0]], node.rank - 1
    assert x.rank == complex_rank + node.attrs["pair"], "an fft operand is a pair of its output's rank, or real"
    kept = [d for d in range(complex_rank) if d not in node.attrs["dims"]]
    rules = [OpRule("replicate", (FULL,), FULL), OpRule("partial", (PARTIAL,), PARTIAL)]
    return rules + [OpRule("shard", (d,), d) for d in kept]
