"""Model segments with their own sharding ratios (HAP §5.2).

The computed nodes, in the order the search visits them, are cut into `g` contiguous segments at
layer boundaries (`Node.segment` is the layer a node came from), balancing their flops. Every
segment gets its own ratios B_k; a tensor sharded across a boundary is re-split by an all-to-all
(the `resplit` collective), so every stage lies inside one segment and the LP keeps one ratio
vector per segment. A leaf belongs to the segment of its first consumer.

With `g = 1` (the default) the whole model is one segment and nothing here changes the program.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine import limits
from engine.errors import PlanError
from engine.model.graph import Graph
from engine.spmd.program import COMM, COMPUTE, Instruction

RESPLIT = "resplit"
"""Collective key of the all-to-all that moves a Shard(d) tensor from one segment's sizes to the next's."""


@dataclass(frozen=True)
class Segmentation:
    """Which segment every node of a graph belongs to."""

    of_node: tuple[int, ...]
    count: int

    @staticmethod
    def single(graph: Graph) -> "Segmentation":
        return Segmentation(tuple(0 for _ in graph.nodes), 1)


def segment_graph(graph: Graph, segments: int) -> Segmentation:
    """Cut the computed nodes into at most `segments` contiguous runs of whole layers with balanced flops."""
    if not isinstance(segments, int) or isinstance(segments, bool) or not 1 <= segments <= limits.MAX_SEGMENTS:
        raise PlanError(f"segments must be a positive integer up to {limits.MAX_SEGMENTS}, got {segments!r}")
    order = [n for n in graph.nodes if not n.is_leaf]
    cuts = _layer_cuts(graph, order)
    chosen = _balanced_cuts(order, cuts, segments)
    of_node = [0] * len(graph.nodes)
    seg, bounds = 0, set(chosen)
    for k, n in enumerate(order):
        if k in bounds:
            seg += 1
        of_node[n.id] = seg
    for n in graph.nodes:  # leaves take the segment of their first consumer
        if n.is_leaf:
            of_node[n.id] = _first_consumer_segment(graph, n.id, of_node, order)
    return Segmentation(tuple(of_node), seg + 1)


def _layer_cuts(graph: Graph, order: list) -> list[int]:
    """Positions k where the layer changes between order[k-1] and order[k]."""
    return [k for k in range(1, len(order)) if order[k].segment != order[k - 1].segment]


def _balanced_cuts(order: list, cuts: list[int], segments: int) -> list[int]:
    """Pick up to segments-1 layer cuts closest to equal shares of the total flops."""
    total = sum(n.flops for n in order) or 1.0
    prefix, acc = [], 0.0
    for n in order:
        prefix.append(acc)
        acc += n.flops
    chosen: list[int] = []
    for i in range(1, segments):
        target = total * i / segments
        best = min((k for k in cuts if not chosen or k > chosen[-1]), key=lambda k: abs(prefix[k] - target), default=None)
        if best is not None:
            chosen.append(best)
    return chosen


def _first_consumer_segment(graph: Graph, leaf: int, of_node: list[int], order: list) -> int:
    for n in order:
        if leaf in n.inputs:
            return of_node[n.id]
    return 0


def instruction_segments(program: tuple[Instruction, ...], seg: Segmentation) -> list[int]:
    """The segment each instruction runs in: a collective or load runs in the segment of the next compute."""
    out = [0] * len(program)
    nxt = seg.of_node[program[-1].node] if program else 0
    for i in range(len(program) - 1, -1, -1):
        ins = program[i]
        if ins.kind == COMPUTE:
            nxt = seg.of_node[ins.node]
        out[i] = nxt
    return out


def source_segments(program: tuple[Instruction, ...], seg: Segmentation) -> list[int]:
    """The segment whose sizes each instruction's operands have: the previous compute's for a resplit
    (it moves its tensor out of that segment), the instruction's own segment otherwise."""
    own = instruction_segments(program, seg)
    out, prev = list(own), own[0] if own else 0
    for i, ins in enumerate(program):
        if ins.kind == COMPUTE:
            prev = own[i]
        elif ins.rule == RESPLIT:
            out[i] = prev
    return out


def with_resplits(program: tuple[Instruction, ...], seg: Segmentation, graph: Graph) -> tuple[Instruction, ...]:
    """A one-segment program made valid for `seg`: at every boundary, re-split each sharded tensor
    that a later instruction still uses (how the planner seeds a segmented search)."""
    out: list[Instruction] = []
    have: set[tuple[int, int]] = set()
    for i, ins in enumerate(program):
        out.append(ins)
        if ins.post >= 0:
            have.add((ins.node, ins.post))
        if ins.kind == COMPUTE and _next_compute_segment(program, i, seg) not in (None, seg.of_node[ins.node]):
            later = {p for nxt in program[i + 1:] for p in nxt.pre}
            out += [Instruction(COMM, t, RESPLIT, ((t, d),), d) for t, d in sorted(have & later)]
    return tuple(out)


def _next_compute_segment(program: tuple[Instruction, ...], i: int, seg: Segmentation) -> int | None:
    for ins in program[i + 1:]:
        if ins.kind == COMPUTE:
            return seg.of_node[ins.node]
    return None
