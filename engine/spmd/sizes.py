"""Integer shard sizes (HAP §5.1): how the ratios B become whole units on every device.

Linked dims (a rule's sharded operands and result) split into the same number of pieces, so each
linked class of (tensor, dim, segment) shares one unit count; `split_sizes` rounds the ratios into
those units so that they sum exactly to the dim. The plan stores the result, the validator
recomputes it, and the runner slices by it.
"""
from __future__ import annotations

import math

from engine.model.graph import Graph
from engine.spmd.program import COMPUTE, Instruction
from engine.spmd.segments import Segmentation, instruction_segments, source_segments
from engine.theory.core import split_sizes

__all__ = ["ShardKey", "split_sizes", "shard_units", "shard_classes", "shard_sizes", "realized_ratios", "shard_key"]


ShardKey = tuple[int, int, int]
"""(tensor, dim, segment): a sharded dim as seen inside one segment (§5.2: segments have their own sizes)."""


def shard_units(program: tuple[Instruction, ...], graph: Graph, seg: Segmentation | None = None) -> dict[ShardKey, int]:
    """For every sharded (tensor, dim, segment) of the program, its number of units.

    A rule links the dims it shards (a view's shard on C=768 and on heads=12, a linear's output
    features and its weight rows). Linked dims must split into the same number of pieces, so each
    linked class shares `units = gcd(sizes)`; a dim of size s then moves in steps of s / units.
    A collective links nothing: its result is a new layout (a resplit's in the next segment).
    """
    units: dict[ShardKey, int] = {}
    for members in shard_classes(program, graph, seg):
        g = math.gcd(*[graph[t].shape[d] for t, d, _ in members])
        units.update({m: g for m in members})
    return units


def shard_classes(program: tuple[Instruction, ...], graph: Graph, seg: Segmentation | None = None) -> list[list[ShardKey]]:
    """The sharded (tensor, dim, segment)s of the program grouped into classes of linked dims (see `shard_units`)."""
    seg = seg or Segmentation.single(graph)
    parent: dict[ShardKey, ShardKey] = {}

    def find(x: ShardKey) -> ShardKey:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for ins, k, src in zip(program, instruction_segments(program, seg), source_segments(program, seg)):
        dims = [(t, f, src) for t, f in ins.pre if f >= 0]
        if ins.post >= 0:
            dims.append((ins.node, ins.post, k))
        linked = dims if ins.kind == COMPUTE else dims[-1:]
        for d in linked:
            find(d)
        for a, b in zip(linked, linked[1:]):
            parent[find(a)] = find(b)
    classes: dict[ShardKey, list[ShardKey]] = {}
    for d in list(parent):
        classes.setdefault(find(d), []).append(d)
    return list(classes.values())


def shard_sizes(program: tuple[Instruction, ...], graph: Graph, ratios: list[list[float]],
                seg: Segmentation | None = None) -> dict[ShardKey, list[int]]:
    """Integer size of every sharded (tensor, dim, segment) on every device; linked dims split alike."""
    out = {}
    for (t, d, k), units in shard_units(program, graph, seg).items():
        step = graph[t].shape[d] // units
        out[(t, d, k)] = [u * step for u in split_sizes(units, ratios[k])]
    return out


def realized_ratios(graph: Graph, sizes: dict[ShardKey, list[int]], ratios: list[list[float]]) -> list[list[float]]:
    """Each device's share of the work as the integer sizes split it, per segment: its size over the
    dim's size, averaged over the segment's sharded tensors weighted by their bytes (whole units
    round the LP's ratios, e.g. 16 samples at 0.654/0.346 become 10/6). A segment with no sharded
    tensor keeps its ratios."""
    out = []
    for k, row in enumerate(ratios):
        shares, weight = [0.0] * len(row), 0.0
        for (t, d, seg), split in sizes.items():
            if seg == k:
                w = float(graph[t].nbytes)
                shares = [a + w * s / graph[t].shape[d] for a, s in zip(shares, split)]
                weight += w
        out.append([a / weight for a in shares] if weight > 0 else list(row))
    return out


def shard_key(graph: Graph, seg: Segmentation, tensor: int, dim: int, segment: int) -> str:
    """The plan JSON key of a sharded dim: `name:dim` in the tensor's own segment, `name:dim@k` after a resplit into k."""
    base = f"{graph[tensor].name}:{dim}"
    return base if segment == seg.of_node[tensor] else f"{base}@{segment}"
