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

Which dims follow the batch is read off the rules themselves (`propagated_batch_dims`): a rule that splits
a batch-sized operand dim into pieces makes its output the matching pieces, so the output dim it splits follows
the batch too. Where the rules cannot tell (an input dim no rule splits, a rule that ties a batch-sized dim to
a fixed one, a dim an operator makes from its arguments alone), the model is captured at half its batch
instead, which takes seconds. Either way the runner captures the halves again and the planner checks the
chosen duplex plan on them (`engine.spmd.halves.halves_problem`).

Searching this space instead of checking the best program afterwards makes a forced duplex a
constraint, not a gamble: it is refused only when no program of the space exists (then for the
model's own reason, `engine.spmd.overlap.duplex_run_problem`, or because nothing fits memory).
"""
from __future__ import annotations

from dataclasses import replace

from engine.model.graph import Graph
from engine.spmd.halves import batch_of, capture_at
from engine.spmd.synthesis import SearchSpace
from engine.theory.core import OpRule, op_rules

__all__ = ["HIERARCHICAL_SUFFIX", "batch_sized_dims", "propagated_batch_dims", "links_batch_to_fixed", "duplex_space"]

HIERARCHICAL_SUFFIX = ".hier"
"""Collective keys ending so run on per-machine sub-groups, which the two half streams cannot share."""

Dim = tuple[int, int]
"""(tensor, dim) of the graph."""


def batch_sized_dims(graph: Graph) -> frozenset[Dim]:
    """The (tensor, dim)s whose size changes when the model is captured at half its batch: propagated
    through the rules where they tell, else from a capture there (which raises `PlanError` when the
    model cannot be captured at half its batch or its graph changes with the batch)."""
    propagated = propagated_batch_dims(graph)
    return propagated if propagated is not None else captured_batch_dims(graph)


def captured_batch_dims(graph: Graph) -> frozenset[Dim]:
    """The (tensor, dim)s whose size differs in the model captured at half its batch."""
    half = capture_at(graph, batch_of(graph) // 2)
    return frozenset((node.id, d) for node, other in zip(graph.nodes, half.nodes)
                     for d, (a, b) in enumerate(zip(node.shape, other.shape)) if a != b)


def propagated_batch_dims(graph: Graph) -> frozenset[Dim] | None:
    """The batch-sized (tensor, dim)s read off the rules; None where they cannot tell.

    Every rule links the dims it splits (its sharded operand dims and its output dim): they are split
    into the same pieces, so in the graph at half the batch either all of them follow the batch or none
    does. The linked dims form classes; a class follows the batch when it holds an input's leading dim
    (the runner splits every input's samples on dim 0), and not when it holds a weight's dim, another
    input dim or a dim of size 1. The rules cannot tell when a class holds both kinds (a rule ties the
    batch to a fixed dim), a class holds neither (say a dim `expand` makes from an argument and no rule
    links onward), or an operator has a batch-sized operand dim that none of its rules splits (it may
    fold it into an output dim, as a view merging it below another dim does)."""
    batch = batch_of(graph)
    if batch < 2:
        return None
    classes = _Classes()
    for node in graph.nodes:
        if node.op == "placeholder":
            if "form" in node.attrs or not node.shape or node.shape[0] != batch:
                return None  # a pipeline stage's input, or an input not laid out batch-first
        for d, size in enumerate(node.shape):
            if node.op == "placeholder" and d == 0:
                classes.seed((node.id, d), True)
            elif node.is_leaf or size < 2:
                classes.seed((node.id, d), False)
    split: dict[int, set[Dim]] = {}
    made: set[Dim] = set()  # output dims a rule splits with every operand whole
    for node in graph.nodes:
        if node.is_leaf:
            continue
        split[node.id] = set()
        for r in op_rules(node, graph):
            linked = [(t, f) for t, f in zip(node.inputs, r.inputs) if f >= 0]
            split[node.id].update(linked)
            if r.output >= 0 and not linked:
                made.add((node.id, r.output))
            for dim in linked[1:] + ([(node.id, r.output)] if r.output >= 0 else []):
                classes.join(linked[0] if linked else (node.id, r.output), dim)
    follows = classes.kinds([(n.id, d) for n in graph.nodes for d in range(n.rank)], made)
    if follows is None:
        return None
    if any(follows[(t, f)] and (t, f) not in split[node.id] for node in graph.nodes if not node.is_leaf
           for t in node.inputs for f in range(graph[t].rank)):
        return None  # a batch-sized operand dim that no rule splits
    return frozenset(dim for dim, yes in follows.items() if yes)


class _Classes:
    """Union-find over dims, each class seeded with whether it follows the batch."""

    def __init__(self) -> None:
        self.parent: dict[Dim, Dim] = {}
        self.seeds: dict[Dim, set[bool]] = {}

    def find(self, x: Dim) -> Dim:
        root = self.parent.setdefault(x, x)
        while root != self.parent[root]:
            root = self.parent[root]
        while x != root:
            x, self.parent[x] = self.parent[x], root
        return root

    def join(self, a: Dim, b: Dim) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.seeds.setdefault(ra, set()).update(self.seeds.pop(rb, set()))

    def seed(self, x: Dim, batch: bool) -> None:
        self.seeds.setdefault(self.find(x), set()).add(batch)

    def kinds(self, dims: list[Dim], made: set[Dim]) -> dict[Dim, bool] | None:
        """Whether each dim follows the batch: its class's seed, and not for an unseeded class (its dims were
        sized by the operators, e.g. a view's minor factors) unless it holds a dim of `made` (its size may
        be an argument that follows the batch); None when some class has both seeds or is such an unseeded one."""
        unknown = {self.find(dim) for dim in made}
        out = {}
        for dim in dims:
            root = self.find(dim)
            seeds = self.seeds.get(root, set())
            if len(seeds) == 2 or not seeds and root in unknown:
                return None
            out[dim] = True in seeds
        return out


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
