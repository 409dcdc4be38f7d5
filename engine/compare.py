"""Comparisons under one cost model: baselines, the ablations of HAP Fig. 15, and what-if clusters.

Every figure here comes from the same `engine.cost` model the planner optimises, so rows are
comparable with each other and with `Plan.predicted_time_s`:

- `dp-even`, `dp-proportional`: data parallelism with even / flops-proportional ratios (§7.1);
- ablations (§7.4, Fig. 15), each adding one of HAP's components to the previous one:
  `Q`     program synthesis alone, ratios proportional to flops, no LP, no communication optimisation;
  `Q+B`   the Q<->B alternation with the load balancer's LP ratios (§3.1, §5), still without it;
  `Q+B+C` the full planner, with communication optimisation: the grouped-broadcast all-gather
          (§2.5.1) and sufficient-factor broadcasting, i.e. the all-Full rule of matrix products (§2.5.2).
- what-if: the same model on a cluster with one GPU model's flops or one link level's bandwidth
  scaled; the old plan's program and ratios evaluated there, and a fresh plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .balance import balance
from .cluster import Cluster, nominal_collectives
from .cost import CostModel, evaluate as evaluate_program
from .errors import ClusterError, InfeasibleError
from .graph import Graph
from .plan import Plan
from .segments import Segmentation
from .planner import DEFAULT_BEAM_WIDTH, evaluate, plan, proportional_ratios
from .program import Instruction
from .synthesis import SearchSpace, synthesize

MATMUL_OPS = ("linear", "matmul")
ABLATIONS = ("Q", "Q+B", "Q+B+C")


@dataclass(frozen=True)
class Row:
    """One strategy of a comparison and its predicted iteration time (None: does not fit in memory)."""

    name: str
    description: str
    predicted_time_s: float | None
    ratios: list[float] | None = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.predicted_time_s is not None


@dataclass
class Comparison:
    """A plan against the baselines and the ablations, all predicted by the same cost model."""

    plan_time_s: float
    rows: list[Row]

    def speedup(self, row: Row) -> float | None:
        """How many times faster the plan is than `row` (None when `row` does not fit)."""
        return None if row.predicted_time_s is None else row.predicted_time_s / self.plan_time_s

    def table(self) -> list[dict[str, Any]]:
        """Rows as plain dicts for a table: strategy, what it is, time in ms, speed-up of the plan."""
        out = []
        for r in self.rows:
            speed = self.speedup(r)
            out.append({"strategy": r.name, "what": r.description,
                        "predicted_ms": None if r.predicted_time_s is None else r.predicted_time_s * 1e3,
                        "plan_speedup": speed, "note": r.note})
        return out


def without_comm_optimisation(graph: Graph) -> SearchSpace:
    """The search space of Fig. 15's "Q" and "Q+B": padded all-gather only, and no sufficient-factor
    broadcasting (matrix products may not run replicated on Full operands, §4.4)."""
    matmuls = frozenset(n.id for n in graph.nodes if n.op in MATMUL_OPS)
    return SearchSpace(collectives=SearchSpace().collectives - {"all_gather.grouped"},
                       rule_filter=lambda nid, r: not (nid in matmuls and r.name == "replicate"))


def predict(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, ratios: list[float] | list[list[float]],
            optimizer: str = "adam", segmentation: Segmentation | None = None) -> float:
    """Predicted iteration time of a fixed program and ratios (one row per segment) on `cluster` (HAP §3.2)."""
    return evaluate_program(program, CostModel(graph, cluster, ratios, optimizer, segmentation)).total_s


def _search(graph: Graph, cluster: Cluster, ratios: list[float], space: SearchSpace, optimizer: str,
            budget: float | None) -> tuple[tuple[Instruction, ...], float]:
    res = synthesize(graph, CostModel(graph, cluster, ratios, optimizer), space=space, time_budget_s=budget,
                     beam_width=DEFAULT_BEAM_WIDTH)
    return res.program, res.cost


def ablation_q(graph: Graph, cluster: Cluster, *, optimizer: str = "adam", time_budget_s: float | None = None) -> Row:
    """Fig. 15 "Q": the synthesizer alone, at flops-proportional ratios, without communication optimisation."""
    ratios = proportional_ratios(cluster)
    try:
        _, cost = _search(graph, cluster, ratios, without_comm_optimisation(graph), optimizer, time_budget_s)
    except InfeasibleError:
        return Row("Q", "program synthesis, proportional ratios", None, ratios, "does not fit in memory")
    return Row("Q", "program synthesis, proportional ratios", cost, ratios)


def ablation_qb(graph: Graph, cluster: Cluster, *, optimizer: str = "adam", time_budget_s: float | None = None,
                max_iterations: int = 6) -> Row:
    """Fig. 15 "Q+B": alternate synthesis and the LP (§3.1) without communication optimisation."""
    space, ratios = without_comm_optimisation(graph), proportional_ratios(cluster)
    best_s, best_ratios = math.inf, None
    seen: set[tuple[Instruction, ...]] = set()
    budget = None if time_budget_s is None else time_budget_s / max_iterations
    for _ in range(max_iterations):
        try:
            program, cost = _search(graph, cluster, ratios, space, optimizer, budget)
        except InfeasibleError:
            break
        if cost < best_s:
            best_s, best_ratios = cost, ratios
        if program in seen:
            break
        seen.add(program)
        try:
            ratios = balance(program, graph, cluster, optimizer=optimizer).ratios
        except InfeasibleError:
            break
        cost = predict(program, graph, cluster, ratios, optimizer)
        if cost < best_s:
            best_s, best_ratios = cost, ratios
    if best_ratios is None:
        return Row("Q+B", "synthesis + LP ratios", None, None, "does not fit in memory")
    return Row("Q+B", "synthesis + LP ratios", best_s, best_ratios)


def baseline_row(graph: Graph, cluster: Cluster, strategy: str, optimizer: str = "adam") -> Row:
    """`dp-even` or `dp-proportional` under the same cost model (None time when out of memory)."""
    what = {"dp-even": "data parallel, even ratios", "dp-proportional": "data parallel, ratios ~ flops"}[strategy]
    try:
        p = evaluate(graph, cluster, strategy, optimizer=optimizer)
    except InfeasibleError as e:
        return Row(strategy, what, None, None, str(e))
    return Row(strategy, what, p.predicted_time_s, p.ratios["0"])


def compare(the_plan: Plan, cluster: Cluster, *, time_budget_s: float | None = None) -> Comparison:
    """The plan against dp-even, dp-proportional and the ablations of Fig. 15 on `cluster`."""
    graph, optimizer = the_plan.graph, the_plan.search.get("optimizer", "adam")
    share = None if time_budget_s is None else time_budget_s / 2
    rows = [baseline_row(graph, cluster, "dp-even", optimizer), baseline_row(graph, cluster, "dp-proportional", optimizer),
            ablation_q(graph, cluster, optimizer=optimizer, time_budget_s=share),
            ablation_qb(graph, cluster, optimizer=optimizer, time_budget_s=share),
            Row("Q+B+C", "the plan: + communication optimisation", the_plan.predicted_time_s, the_plan.ratios.get("0"))]
    return Comparison(the_plan.predicted_time_s, rows)


# ----------------------------------------------------------------------------- what-if


def scale_link(cluster: Cluster, level: str, factor: float) -> Cluster:
    """New cluster with one link level's bandwidth scaled; nominal collective fits follow it, fits
    that were given explicitly (e.g. profiled) are kept as they are."""
    levels = cluster.network.bandwidth_Bps
    if level not in levels:
        raise ClusterError(f"link level {level!r}: not in cluster {cluster.name!r} (it has {', '.join(sorted(levels)) or 'none'})")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ClusterError(f"bandwidth scale of {level!r}: must be a positive number, got {factor!r}")
    nominal = nominal_collectives(cluster.num_devices, cluster.network.latency_s, cluster.bottleneck_bandwidth_Bps)
    d = cluster.to_dict()
    d["network"]["bandwidth_Bps"] = {**levels, level: levels[level] * factor}
    d["network"]["collectives"] = {k: f.to_dict() for k, f in cluster.collectives.items() if f != nominal[k]}
    return Cluster.from_dict(d)


@dataclass
class WhatIf:
    """The plan on a changed cluster: kept as it is, and planned again."""

    cluster: Cluster
    before_s: float
    """The plan's predicted time on the original cluster."""
    same_plan_s: float
    """The same program and ratios, predicted on the changed cluster."""
    replanned: Plan
    changes: list[str] = field(default_factory=list)

    @property
    def replanned_s(self) -> float:
        return self.replanned.predicted_time_s


def what_if(the_plan: Plan, cluster: Cluster, *, flops_scale: dict[str, float] | None = None,
            link_scale: tuple[str, float] | None = None, time_budget_s: float | None = None) -> WhatIf:
    """Scale one GPU model's flops and/or one link level's bandwidth, then predict and re-plan."""
    changed = cluster.scaled(flops_scale=flops_scale)
    changes = [f"{m} flops x{f:g}" for m, f in (flops_scale or {}).items() if f != 1.0]
    if link_scale is not None and link_scale[1] != 1.0:
        changed = scale_link(changed, *link_scale)
        changes.append(f"{link_scale[0]} bandwidth x{link_scale[1]:g}")
    optimizer = the_plan.search.get("optimizer", "adam")
    same = predict(the_plan.program, the_plan.graph, changed, the_plan.ratio_rows, optimizer, the_plan.segmentation)
    fresh = plan(the_plan.graph, changed, time_budget_s=time_budget_s, optimizer=optimizer)
    return WhatIf(changed, the_plan.predicted_time_s, same, fresh, changes)
