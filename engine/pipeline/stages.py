"""Pipeline stages of a captured graph (HAPT §5.1): cut points at layer boundaries, and what a stage holds.

The computed nodes, in the graph's topological order, change layer (`Node.segment`) at the
boundaries `engine.spmd.segments` already cuts at; those positions are the candidate cut points. The
graph is topologically ordered, so every tensor that crosses a cut goes forward: the tensors
computed before it and used after it are the activations sent to the next stage, and those that
require grad have a gradient of the same size sent back. Leaves are not sent: a stage loads the
inputs and buffers it reads itself, and holds the parameters its nodes use (a parameter used on
both sides of a cut, a tied weight, is held by both stages: `Cut.shared_parameters`; summing its
two gradients is not modelled yet).

A stage is the run of layers between two cuts, `Stage(start, end)` in cut indices (0 is the
model's start, `len(layers)` its end, which holds the loss). Its flops, parameter bytes and
activations kept for backward come from prefix sums, so the partitioner asks for any of the
O(L^2) stages in constant time. Flops use the cost model's rules (`engine.spmd.cost`): a node's
forward flops as captured, and about one forward per operand that needs a gradient backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from engine.errors import PlanError
from engine.model.graph import Graph, Node
from engine.spmd.cost import _attention_probs_bytes, _backward_flops
from engine.spmd.saved import requires_grad, saves_by_node
from engine.spmd.segments import _layer_cuts


@dataclass(frozen=True)
class Cut:
    """A candidate cut point between two layers, and what crosses it per iteration (whole batch)."""

    index: int
    """1 .. L-1: the cut sits before layer `index`."""
    position: int
    """Computed nodes (in topological order) before the cut."""
    tensors: tuple[int, ...]
    """Ids of the tensors computed before the cut and used after it."""
    forward_bytes: int
    """Bytes of those tensors (the activations sent forward)."""
    backward_bytes: int
    """Bytes of those that require grad (the gradients sent back)."""
    shared_parameters: tuple[int, ...] = ()
    """Parameters used on both sides (tied weights)."""


@dataclass(frozen=True)
class Stage:
    """Layers [start, end) of a graph, with what they cost per iteration (whole batch)."""

    start: int
    end: int
    nodes: tuple[int, ...]
    """Computed node ids, in topological order."""
    parameters: tuple[int, ...]
    """Parameter ids the stage's nodes use."""
    forward_flops: float
    backward_flops: float
    parameter_bytes: int
    activation_bytes: float
    """Bytes its forward keeps for its backward."""
    input_bytes: int
    """Bytes received from the previous stage (0 for the first)."""
    output_bytes: int
    """Bytes sent to the next stage (0 for the last)."""


class StageGraph:
    """A graph seen as a sequence of layers with cut points between them."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = [n for n in graph.nodes if not n.is_leaf]
        self.positions = [0, *_layer_cuts(graph, self.order), len(self.order)]
        self.requires_grad = requires_grad(graph)
        self.saves = saves_by_node(graph, self.requires_grad)
        self.layers: list[tuple[int, ...]] = [tuple(n.id for n in self.order[a:b])
                                              for a, b in zip(self.positions, self.positions[1:])]
        self.layer_of = {nid: k for k, ids in enumerate(self.layers) for nid in ids}
        self._prefix = _prefix_sums([self._layer_sums(k) for k in range(len(self.layers))])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def cuts(self) -> list[Cut]:
        """The L-1 candidate cut points, in order."""
        return [self._cut(k) for k in range(1, self.num_layers)]

    def cut(self, index: int) -> Cut | None:
        """Cut `index` (None for 0 and L, the model's ends)."""
        return None if index in (0, self.num_layers) else self.cuts[index - 1]

    def tied_at(self, index: int) -> tuple[int, ...]:
        """Parameters a boundary at cut `index` would separate the uses of (tied weights; none at the ends)."""
        info = self.cut(index)
        return () if info is None else info.shared_parameters

    def stage(self, start: int, end: int) -> Stage:
        """Layers [start, end) as a stage."""
        if not 0 <= start < end <= self.num_layers:
            raise PlanError(f"stage [{start}, {end}) is not a run of layers of a graph with {self.num_layers} layers")
        fwd, bwd, act = (hi - lo for hi, lo in zip(self._prefix[end], self._prefix[start]))
        nodes = tuple(i for k in range(start, end) for i in self.layers[k])
        used = sorted({i for n in nodes for i in self.graph[n].inputs if self.graph[i].op == "parameter"})
        cut_in, cut_out = self.cut(start), self.cut(end)
        params = sum(self.graph[i].nbytes for i in used)
        return Stage(start, end, nodes, tuple(used), fwd, bwd, params, act,
                     cut_in.forward_bytes if cut_in else 0, cut_out.forward_bytes if cut_out else 0)

    def subgraph(self, start: int, end: int, forms: dict[int, int]) -> Graph:
        """Layers [start, end) as a graph of their own, for HAP's search on the stage (`engine.pipeline.stage_plan`).

        Its nodes, in the model's order: the stage's computed nodes, the leaves they use, and for every
        tensor received at cut `start` a placeholder (attrs `cut`: the model's node id, `form`: the one
        form it arrives in, `requires_grad`: whether its gradient goes back) followed by an `identity`
        node named `<name>.received` that the stage's nodes use: leaves are never communicated, the
        identity's result may be (e.g. all-gathered rows before a column-parallel linear). A stage
        other than the last ends in a `stage_output` node over the tensors sent at cut `end`, in their
        `forms` (`engine/theory/stage.py`): held so, the search's goal is met. Node names are the
        model's; segments are renumbered from 0; `origin["pipeline_stage"]["model_nodes"]` gives the
        model node of every node (-1 for the identities and the stage_output)."""
        self.stage(start, end)  # checks the range
        g = self.graph
        cut_in, cut_out = self.cut(start), self.cut(end)
        received = set(cut_in.tensors) if cut_in else set()
        computed = {i for k in range(start, end) for i in self.layers[k]}
        leaves = {i for n in computed for i in g[n].inputs if g[i].is_leaf}
        segments = {s: k for k, s in enumerate(sorted({g[i].segment for i in computed | leaves | received}))}
        nodes: list[Node] = []
        model_nodes: list[int] = []
        use: dict[int, int] = {}  # model id -> the subgraph node the stage's nodes read it from

        def add(n: Node, model: int) -> int:
            nodes.append(replace(n, id=len(nodes)))
            model_nodes.append(model)
            return len(nodes) - 1

        for old in sorted(computed | leaves | received):
            n, seg = g[old], segments[g[old].segment]
            if old in received:
                attrs = {"cut": old, "form": forms[old], "requires_grad": bool(self.requires_grad[old])}
                leaf = add(Node(0, n.name, "placeholder", (), n.shape, n.dtype, attrs, 0.0, seg, n.source), old)
                use[old] = add(Node(0, f"{n.name}.received", "identity", (leaf,), n.shape, n.dtype, {}, 0.0, seg,
                                    n.source), -1)
            else:
                use[old] = add(replace(n, inputs=tuple(use[i] for i in n.inputs), segment=seg), old)
        if cut_out is None:
            loss = use[g.loss]
        else:
            sent = cut_out.tensors
            loss = add(Node(0, "stage_output", "stage_output", tuple(use[t] for t in sent), (), "float32",
                            {"forms": [forms[t] for t in sent]}, 0.0, nodes[-1].segment), -1)
        origin = {**g.origin, "pipeline_stage": {"layers": [start, end], "model_nodes": model_nodes}}
        return Graph(tuple(nodes), loss, f"{g.name}[{start}:{end}]", origin)

    def _cut(self, index: int) -> Cut:
        before = {n.id for n in self.order[:self.positions[index]]}
        after = self.order[self.positions[index]:]
        crossing = sorted({i for n in after for i in n.inputs if i in before})
        params_before = {i for n in before for i in self.graph[n].inputs if self.graph[i].op == "parameter"}
        shared = sorted({i for n in after for i in n.inputs if i in params_before})
        fwd = sum(self.graph[i].nbytes for i in crossing)
        bwd = sum(self.graph[i].nbytes for i in crossing if self.requires_grad[i])
        return Cut(index, self.positions[index], tuple(crossing), fwd, bwd, tuple(shared))

    def _layer_sums(self, k: int) -> tuple[float, float, float]:
        """(forward flops, backward flops, activation bytes) of layer k."""
        g, ids = self.graph, self.layers[k]
        fwd = sum(g[i].flops for i in ids)
        bwd = sum(_backward_flops(g, i, self.requires_grad) for i in ids)
        return fwd, bwd, sum(self.kept_bytes(i) for i in ids)

    def kept_bytes(self, node: int) -> float:
        """Bytes node `node` keeps from forward to backward, unsharded (`engine.spmd.saved`)."""
        probs = _attention_probs_bytes(self.graph, node) if self.requires_grad[node] else 0.0
        return float(sum(nbytes for _, nbytes in self.saves[node])) + probs


def _prefix_sums(rows: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    out = [(0.0,) * (len(rows[0]) if rows else 3)]
    for r in rows:
        out.append(tuple(a + b for a, b in zip(out[-1], r)))
    return out


def batch_of(graph) -> int:
    """The batch size: dim 0 of the first input (1 when there is none)."""
    return graph.placeholders[0].shape[0] if graph.placeholders and graph.placeholders[0].shape else 1


def microbatch_candidates(graph) -> list[int]:
    """Powers of two that divide the batch, up to 64."""
    batch = batch_of(graph)
    return [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= batch and batch % b == 0]
