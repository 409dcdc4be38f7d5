"""Activation recomputation per layer (issue 26): which layers drop their activations after forward
and recompute them in backward, what that costs, and how `recompute=auto` chooses them.

A layer is a `Node.segment` id of the graph (the layer a node came from; capture numbers them by
the module path, e.g. `blocks.3`). The runner wraps each recomputed layer's instructions in
`torch.utils.checkpoint` (`runner.recompute`); the cost model (`CostModel(..., recompute=)`) prices it:

- time: a recomputed node's forward work (flops, roofline bytes, weight bytes) is added to its
  backward work, and each forward collective of the layer (a collective belongs to the layer of the
  compute that follows it, as the runner groups them) runs again in backward: one more backward
  stage opened by that collective (`replay_terms`, the search's `_after_compute`);
- memory: a recomputed node keeps its output only when a node of another layer consumes it (the
  layer's outputs: the next checkpoint's inputs, which autograd keeps); during a recomputed layer's
  backward its activations are live again, so the peak adds the largest recomputed layer's
  activations, per device class (`transient_peak`). `evaluate` adds it; the LP has one memory row
  per recomputed layer (`transient_limits`); the search prunes with a lower bound of it (every
  activation sharded, `search_reserve`): sound, and exact for the usual all-sharded layers.

Choice (`PlanOptions.recompute`): `none` recomputes nothing; `all` every layer; `auto` plans without
recomputation first and keeps that plan when it fits (existing plans are unchanged byte for byte).
When it does not fit (or nothing fits), it plans with every layer recomputed; if that fits, the
layers are ranked greedily by activation bytes saved per second of recomputation (a fractional
knapsack's order: the fewest, cheapest layers first), the shortest prefix of that ranking under
which the all-layers plan's program still fits (the LP's memory rows, a binary search: LPs only) is
found, and the model is planned again with that prefix; the faster of that plan and the all-layers
plan's program rebalanced with the prefix (which fits by construction) is kept (when neither fits at
whole shard units, the program rebalanced with one more layer at a time). Three Q<->B loops at most.
Greedy rather than an integer program: layers of one model are nearly alike, so the ratio order is
the knapsack's optimum in practice, and every candidate set costs one Q<->B loop.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.spmd.breakdown import MEM_ZERO, Mem
from engine.spmd.program import COMPUTE, Instruction
from engine.spmd.segments import instruction_segments

CostModel = Any
"""`engine.spmd.cost.CostModel` (which imports this module, so it is not imported here)."""
Plan = Any
"""`engine.spmd.plan.Plan` (which imports this module)."""


def layers(graph: Graph) -> list[int]:
    """The layer ids of the graph's computed nodes, in order."""
    return sorted({n.segment for n in graph.nodes if not n.is_leaf})


def chosen(graph: Graph, mode: str) -> frozenset[int]:
    """The layers a fixed mode recomputes: `all` every layer, `none` (and `auto` before it chooses) none."""
    return frozenset(layers(graph)) if mode == "all" else frozenset()


def recomputed_nodes(graph: Graph, recompute: frozenset[int]) -> list[bool]:
    """Whether each node is computed in a recomputed layer (leaves never are)."""
    return [not n.is_leaf and n.segment in recompute for n in graph.nodes]


def layer_outputs(graph: Graph) -> list[bool]:
    """Whether a node's output is consumed by a node of another layer (or is the loss): what a
    recomputed layer still keeps, as the next layer's checkpoint saves its inputs."""
    out = [False] * len(graph)
    for n in graph.nodes:
        for i in n.inputs:
            if graph[i].segment != n.segment:
                out[i] = True
    out[graph.loss] = True
    return out


def instruction_layers(program: Sequence[Instruction], graph: Graph) -> list[int]:
    """The layer each instruction runs in: a compute its node's; a collective or a load the layer of
    the next compute (the runner checkpoints a collective with the layer that consumes it)."""
    out = [0] * len(program)
    nxt = graph[program[-1].node].segment if program else 0
    for i in range(len(program) - 1, -1, -1):
        if program[i].kind == COMPUTE:
            nxt = graph[program[i].node].segment
        out[i] = nxt
    return out


def layer_names(graph: Graph) -> dict[int, str]:
    """A readable name per layer where capture recorded module paths (`blocks.3`): the path up to
    the first numbered component of the layer's first node that has one."""
    names: dict[int, str] = {}
    for n in graph.nodes:
        if n.is_leaf or n.segment in names:
            continue
        path = n.source.split(" ", 1)[0] if n.source else ""
        m = re.match(r"^(.*?(?:^|\.)\d+)(?:\.|$)", path)
        if m:
            names[n.segment] = m.group(1)
    return names


def describe(graph: Graph, recompute: Sequence[int]) -> str:
    """"layers 3-7 (5 of 32)": the recomputed layers as ranges, with their names when known."""
    ids = sorted(recompute)
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    spans = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    names = layer_names(graph)
    known = [names[i] for i in ids if i in names]
    shown = f": {known[0]} .. {known[-1]}" if len(known) > 1 else f": {known[0]}" if known else ""
    return f"layer{'s' if len(ids) != 1 else ''} {spans} ({len(ids)} of {len(layers(graph))}){shown}"


# --- memory terms -----------------------------------------------------------------------------

def transient_mems(program: Sequence[Instruction], cm: CostModel) -> list[list[Mem]]:
    """Per recomputed layer, per segment: the activation terms of its nodes (live again while its
    backward runs), sharded or replicated as the program computes them."""
    if not cm.recompute:
        return []
    segs = instruction_segments(tuple(program), cm.segmentation)
    per: dict[int, list[list[float]]] = {}
    for ins, k in zip(program, segs):
        if ins.kind != COMPUTE or not cm.recomputed[ins.node] or cm.kept[ins.node]:
            continue  # a kept output is in the program's own memory terms already
        rows = per.setdefault(cm.graph[ins.node].segment, [[0.0, 0.0] for _ in range(cm.segmentation.count)])
        sharded = ins.post >= 0 or any(f >= 0 for _, f in ins.pre)  # as `engine.spmd.cost.is_sharded`
        rows[k][0 if sharded else 1] += cm.full_activation[ins.node]
    return [[(0.0, 0.0, sa, ra, 0.0) for sa, ra in rows] for _, rows in sorted(per.items())]


def transient_peak(program: Sequence[Instruction], cm: CostModel) -> tuple[float, ...]:
    """Per device class, the largest recomputed layer's activations (zero without recomputation)."""
    peak = (0.0,) * len(cm.classes)
    for mems in transient_mems(program, cm):
        peak = tuple(max(a, b) for a, b in zip(peak, cm.class_memory(mems)))
    return peak


def search_reserve(cm: CostModel) -> tuple[float, ...]:
    """Per device class, a lower bound of `transient_peak` for any program: every recomputed
    activation sharded (a device's share of a sharded tensor is never more than the whole)."""
    if not cm.recompute:
        return (0.0,) * len(cm.classes)
    per: dict[int, list[float]] = {}
    for n in cm.graph.nodes:
        if cm.recomputed[n.id] and not cm.kept[n.id]:
            per.setdefault(n.segment, [0.0] * cm.segmentation.count)[cm.segmentation.of_node[n.id]] += \
                cm.full_activation[n.id]
    return tuple(max((sum(b * c.ratios[k] for k, b in enumerate(row)) / c.num_gpus for row in per.values()),
                     default=0.0) for c in cm.classes)


def transient_limits(prob: Any, classes, B, mems: list[Mem], transients: list[list[Mem]], z: list | None = None,
                     transient: float = 0.0) -> None:
    """The LP's memory rows with recomputation: for every recomputed layer, the kept terms plus that
    layer's activations fit every class (the peak is the largest of them, so all must fit); `z` and
    `transient`: the state shares and staged weights' transient bytes (`engine.spmd.zero`), as in the plain rows."""
    import pulp

    for layer, extra in enumerate(transients):
        for c, cls in enumerate(classes):
            merged = [_plus(m, x) for m, x in zip(mems, extra)]
            need = pulp.lpSum(s * row[c] + r + (sa * row[c] + ra) / cls.num_gpus for row, (s, r, sa, ra, _) in zip(B, merged))
            if z is not None:
                need = need + pulp.lpSum(m[4] for m in mems) * z[c] + transient
            prob += need <= cls.memory_bytes, f"memory_recompute_{layer}_class_{c}"


def _plus(a: Mem, b: Mem) -> Mem:
    return tuple(x + y for x, y in zip(a, b))  # type: ignore[return-value]


# --- the choice of `auto` ---------------------------------------------------------------------

def ranked_layers(cm: CostModel) -> list[int]:
    """Layers by activation bytes saved per second of recomputation, best first (ties: lower id):
    the greedy knapsack's order. `cm` recomputes every layer; seconds are a layer's forward work at
    the cluster's mean rates."""
    graph, cluster = cm.graph, cm.cluster
    flops = sum(d.flops for d in cluster.devices) / cluster.num_devices
    bw = [d.activation_bandwidth_Bps for d in cluster.devices if d.activation_bandwidth_Bps]
    bandwidth = sum(bw) / len(bw) if bw else 0.0
    saved: dict[int, float] = {}
    seconds: dict[int, float] = {}
    for n in graph.nodes:
        if n.is_leaf:
            continue
        if not cm.kept[n.id]:
            saved[n.segment] = saved.get(n.segment, 0.0) + cm.full_activation[n.id]
        bytes_moved = cm.traffic[n.id] + cm.weight_traffic[n.id]
        seconds[n.segment] = seconds.get(n.segment, 0.0) + cm.fwd_flops[n.id] / flops + \
            (bytes_moved / bandwidth if bandwidth else 0.0)
    return sorted(layers(graph), key=lambda i: (-saved.get(i, 0.0) / max(seconds.get(i, 0.0), 1e-30), i))


def fits(plan: Plan, cluster: Cluster) -> bool:
    """Whether the plan's predicted memory fits every device."""
    return all(m <= d.memory_bytes_per_gpu for m, d in zip(plan.memory_bytes, cluster.devices))


PlanFn = Callable[[frozenset[int]], Plan]
"""Plans the model with a given set of recomputed layers (the Q<->B loop, `engine.spmd.iteration`)."""
FitsFn = Callable[[Plan, frozenset[int]], bool]
"""Whether a plan's program fits memory at the LP's ratios with a given set of recomputed layers."""
RebalanceFn = Callable[[Plan, frozenset[int]], "Plan | None"]
"""A plan's program at the LP's ratios with a given set of recomputed layers (None when none fit)."""


def plan_recomputing(graph: Graph, cluster: Cluster, options: PlanOptions, plan_fn: PlanFn, program_fits: FitsFn,
                     rebalance: RebalanceFn, ranking: Callable[[], list[int]]) -> Plan:
    """The plan of `options.recompute` (module docstring): `none` and `all` plan once; `auto` keeps
    the plan without recomputation when it fits, else recomputes the fewest, cheapest layers that
    make it fit, in the order `ranking` gives (`ranked_layers`). Without any plan that fits, the error
    (or the plan) of planning without recomputation stands, so `none`'s message is what an unfixable
    model reports."""
    if options.recompute != "auto" or not layers(graph):
        return plan_fn(chosen(graph, options.recompute))
    start = time.perf_counter()
    error: InfeasibleError | None = None
    try:
        plain = plan_fn(frozenset())
        if fits(plain, cluster):
            return plain
    except InfeasibleError as e:
        if "out of memory" not in str(e):
            raise  # no program for another reason (an operator without a rule): recomputing cannot help
        plain, error = None, e
    tried: list[list[int]] = [[]]
    everything = frozenset(layers(graph))
    try:
        tried.append(sorted(everything))
        full = plan_fn(everything)
    except InfeasibleError:
        full = None
    if full is None or not fits(full, cluster):
        if error is not None:
            raise error
        return plain  # type: ignore[return-value]
    order = ranking()
    k = _fewest(order, lambda n: program_fits(full, frozenset(order[:n])))
    fewest = frozenset(order[:k])
    tried.append(sorted(fewest))
    try:
        made = plan_fn(fewest)
    except InfeasibleError:
        made = None
    fitting = [p for p in (made, rebalance(full, fewest)) if p is not None and fits(p, cluster)]
    if fitting:
        return _noted(min(fitting, key=lambda p: p.predicted_time_s), tried, start)
    for n in range(k + 1, len(order)):  # whole shard units may overflow what the LP's fractions fit
        witness = rebalance(full, frozenset(order[:n]))
        if witness is not None and fits(witness, cluster):
            return _noted(witness, tried, start)
    return _noted(full, tried, start)


def _noted(made: Plan, tried: list[list[int]], start: float) -> Plan:
    """The plan `auto` chose, with what it tried (`search["recompute_auto"]`: the layer sets planned, in
    order, and the seconds all of it took)."""
    made.search["recompute_auto"] = {"tried": tried, "elapsed_s": time.perf_counter() - start}
    return made


def _fewest(order: list[int], ok: Callable[[int], bool]) -> int:
    """The smallest n in 1..len(order) with ok(n) (ok is monotone: more layers, less memory), by bisection."""
    lo, hi = 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
