"""Pooling over the trailing spatial dims: `max_pool`, `avg_pool`, `adaptive_avg_pool` (1-, 2-, 3-D),
and resampling: `upsample` (nearest, linear, bilinear, bicubic, trilinear interpolation).

Rows, with why they hold:
- S(d) -> S(d) for a leading (batch or channel) dim: every window lies inside one (sample, channel).
- P -> P for the average pools: an average of addends is an addend of the average (they are
  linear, and the divisor is the window's size, which does not depend on the data).
- F -> F.
No spatial dim is ever sharded: windows near a shard border would need the neighbour's rows, and
max is not linear, so max pooling has no Partial rule. Interpolation is a fixed weighted sum of
input entries per (sample, channel): the leading dims split, and it is linear (P -> P).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import PARTIAL, OpRule, replicate, rule


@rule("max_pool", "avg_pool", "adaptive_avg_pool")
def pool_rules(node: Node, graph: Graph) -> list[OpRule]:
    leading = node.rank - node.attrs["spatial"]
    rules = [replicate(node)] + [OpRule("batch" if d == 0 else "channels", (d,), d) for d in range(leading)]
    if node.op != "max_pool":
        rules.append(OpRule("partial", (PARTIAL,), PARTIAL))
    return rules


@rule("upsample")
def upsample_rules(node: Node, graph: Graph) -> list[OpRule]:
    leading = node.rank - node.attrs["spatial"]
    rules = [replicate(node), OpRule("partial", (PARTIAL,), PARTIAL)]
    return rules + [OpRule("batch" if d == 0 else "channels", (d,), d) for d in range(leading)]
