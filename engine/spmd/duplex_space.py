"""The programs duplex can run: the search space of a duplex plan, forced or under `auto`.

The runner trains a duplex plan as two half-batch streams (runner/duplex.py): the model is
captured again at each half's batch and the plan's program runs on it with the same weights. So a
program is duplex's only when

- no parameter's shard changes with the batch: linked dims split into the same pieces
  (`engine.spmd.sizes`), so a rule that links a dim whose size follows the batch with one whose
  size does not would tie the two (a weight's shard would then differ between the halves, which
  share the weights). Such rules are left out; every class of linked dims is then either wholly
  batch-sized (recomputed per half) or wholly batch-free (kept as the plan has it, see
  `engine.spmd.halves.half_sizes`), and a parameter's class is batch-free;
- it uses no hierarchical collective: their machine sub-groups would be shared by both streams,
  which each need their own process group.

Searching this space instead of checking the best program afterwards makes a forced duplex a
constraint, not a gamble: it is refused only when no program of the space exists (then for the
model's own reason, `engine.spmd.overlap.duplex_run_problem`, or because nothing fits memory).
"""
from __future__ import annotations

from dataclasses import replace

from engine.model.graph import Graph
from engine.spmd.halves import batch_of, capture_at
from engine.spmd.synthesis import SearchSpace
from engine.theory.core import OpRule

__all__ = ["HIERARCHICAL_SUFFIX", "batch_sized_dims", "links_batch_to_fixed", "duplex_space"]

HIERARCHICAL_SUFFIX = ".hier"
"""Collective keys ending so run on per-machine sub-groups, which the two half streams cannot share."""

Dim = tuple[int, int]
"""(tensor, dim) of the graph."""


def batch_sized_dims(graph: Graph) -> frozenset[Dim]:
    """The (tensor, dim)s whose size changes when the model is captured at half its batch; raises
    `PlanError` when it cannot be captured there or its graph changes with the batch."""
    half = capture_at(graph, batch_of(graph) // 2)
    return frozenset((node.id, d) for node, other in zip(graph.nodes, half.nodes)
                     for d, (a, b) in enumerate(zip(node.shape, other.shape)) if a != b)


def links_batch_to_fixed(graph: Graph, batch_dims: frozenset[Dim], node: int, rule: OpRule) -> bool:
    """Whether `rule` on `node` links a sharded dim whose size follows the batch with one whose size does not."""
    linked = [(t, f) for t, f in zip(graph[node].inputs, rule.inputs) if f >= 0]
    if rule.output >= 0:
        linked.append((node, rule.output))
    kinds = {dim in batch_dims for dim in linked}
    return len(kinds) == 2


def duplex_space(graph: Graph, space: SearchSpace) -> SearchSpace:
    """`space` narrowed to the programs duplex can run on `graph` (see the module's docstring)."""
    batch_dims = batch_sized_dims(graph)
    allowed = space.rule_filter

    def rule_filter(node: int, rule: OpRule) -> bool:
        return allowed(node, rule) and not links_batch_to_fixed(graph, batch_dims, node, rule)

    return replace(space, rule_filter=rule_filter,
                   collectives=frozenset(c for c in space.collectives if not c.endswith(HIERARCHICAL_SUFFIX)))
