"""Random draws: `rand`, the site-keyed uniform numbers of stochastic depth, `bernoulli` and `uniform_`.

A `rand` node has no operand. Its numbers are a function of (seed, step, site, global index)
(engine/model/dropout.py), so a device draws exactly its block of the whole tensor:
- F: every device draws the whole tensor (the same numbers on each);
- S(d) on any dim of size >= 2: each device draws only its rows of d.
No P: the numbers are not a sum of addends. `bernoulli` is captured as `rand`, `lt` and a cast; `x.uniform_(low,
high)` (MoE jitter) as `rand` with attrs `low` and `high`: each number scaled on its own, so the same rules hold;
`randn`, `randn_like`, `normal_` and `normal` (LSH attention's rotations) as `rand` with `normal` (and `mean`, `std`):
each number is Box-Muller on two uniform numbers of its own global index, elementwise too, so F and every S(d) are
exact whatever consumes the draw (a rotation matrix contracted whole gets its Full form from the consumer's rules).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import OpRule, replicate, rule


@rule("rand")
def rand_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [replicate(node)] + [OpRule("shard", (), d) for d in range(node.rank)]
