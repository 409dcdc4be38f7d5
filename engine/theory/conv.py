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

`im2col(x[N, C, H, W])` (F.unfold) -> [N, C*kh*kw, L]: each column gathers one patch of every channel.
- batch:    S(0) -> S(0)   patches never cross samples.
- channels: S(1) -> S(1)   a channel's taps are a contiguous run of kh*kw rows of the output (C is outer).
- partial:  P -> P         a selection of entries is linear.
Unbatched (C, H, W): the channel rule on dim 0. The spatial dims stay whole: patches overlap (a halo).

`col2im(x[N, C*kh*kw, L])` (F.fold, im2col's adjoint) -> [N, C, H, W]: each patch added back at its place.
- batch:    S(0) -> S(0)   patches never cross samples.
- channels: S(1) -> S(1)   a channel's image sums only its own kh*kw rows (C is outer), so whole channels split.
- partial:  P -> P         a sum of entries is linear.
Unbatched (C*kh*kw, L): the channel rule on dim 0. Neither the patches' dim L nor the image's dims split:
overlapping patches sum into the same pixels, and a shard of places is no shard of rows.
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


@rule("im2col")
def im2col_rules(node: Node, graph: Graph) -> list[OpRule]:
    channel = graph[node.inputs[0]].rank - 3
    rules = [replicate(node), OpRule("partial", (PARTIAL,), PARTIAL), OpRule("channels", (channel,), channel)]
    return rules + ([OpRule("batch", (0,), 0)] if channel == 1 else [])


@rule("col2im")
def col2im_rules(node: Node, graph: Graph) -> list[OpRule]:
    channel = graph[node.inputs[0]].rank - 2
    rules = [replicate(node), OpRule("partial", (PARTIAL,), PARTIAL), OpRule("channels", (channel,), channel)]
    return rules + ([OpRule("batch", (0,), 0)] if channel == 1 else [])
