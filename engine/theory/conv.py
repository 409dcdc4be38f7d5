"""Convolution `conv(x[N, Cin, *spatial], w[Cout, Cin/groups, *kernel])` (1-, 2- or 3-D; the bias is
a separate `add`, as for linear).

Rows, with why they hold:
- batch:      x S(0), w F   -> y S(0)   each sample is convolved on its own (data parallel).
- out:        x F, w S(0)   -> y S(1)   each output channel needs only its own filters.
- in:         x S(1), w S(1) -> y P     the sum over input channels splits into addends.
- partial:    x P, w F      -> y P      convolution is linear in x.
- replicate:  x F, w F      -> y F.
No rule shards a spatial dim: a window crossing a shard border would need the neighbour's rows
(a halo exchange), which no collective here provides. With groups > 1 the channel rules would have
to cut at group borders, so grouped convolutions get only the batch and replicate rules.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("conv")
def conv_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = [replicate(node), OpRule("batch", (0, FULL), 0), OpRule("partial", (PARTIAL, FULL), PARTIAL)]
    if node.attrs.get("groups", 1) == 1:
        rules += [OpRule("out_channels", (FULL, 0), 1), OpRule("in_channels", (1, 1), PARTIAL)]
    return rules
