"""Comparisons under one cost model: baselines, the ablations of HAP Fig. 15, what-if clusters, and
how much communication a timeline hides.

Every figure here comes from the same `engine.spmd.cost` model the planner optimises, so rows are
comparable with each other and with `Plan.predicted_time_s`:

- `ddp`, `dp-even`, `dp-proportional`: data parallelism with even / even / flops-proportional
  ratios (§7.1), priced as PyTorch DDP runs (gradient buckets overlapped with backward);
- ablations (§7.4, Fig. 15), each adding one of HAP's components to the previous one, priced
  with DDP's overlap (`ddp`):
  `Q`     program synthesis alone, ratios proportional to flops, no LP, no communication optimisation;
  `Q+B`   the Q<->B alternation with the load balancer's LP ratios (§3.1, §5), still without it;
  `Q+B+C` the full planner without duplex, with communication optimisation: the grouped-broadcast
          all-gather (§2.5.1) and sufficient-factor broadcasting, i.e. the all-Full rule of matrix
          products (§2.5.2);
  `Q+B+C+D` the same search with duplex (HiDup's two half-batches, `engine.spmd.overlap`).
- what-if: the same model on a cluster with one GPU model's flops or one link level's bandwidth
  scaled; the old plan's program and ratios evaluated there, and a fresh plan.
- lanes: per device, how long its compute and network lanes are busy and how much of it
  overlaps (HiDup Table 4's overlapping ratio), for a predicted or a measured timeline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from engine.cluster.spec import Cluster, nominal_collectives
from engine.errors import ClusterError, InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import DEFAULT_BEAM_WIDTH, PlanOptions
from engine.planner import BASELINES, evaluate, plan
from engine.spmd.balance import balance
from engine.spmd.baselines import BASELINE_OVERLAP, proportional_ratios
from engine.spmd.cost import CostModel
from engine.spmd.cost import evaluate as evaluate_program
from engine.spmd.iteration import breakdown_of
from engine.spmd.plan import Plan
from engine.spmd.program import Instruction
from engine.spmd.segments import Segmentation
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.spmd.utilisation import Utilisation, model_flops, peak_flops
from engine.timeline import Schedule, simulate

MATMUL_OPS = ("linear", "matmul")
ABLATIONS = ("Q", "Q+B", "Q+B+C", "Q+B+C+D")
PLAN_ROWS = {"ddp": "Q+B+C", "duplex": "Q+B+C+D"}
"""The ablation row of a full plan in each overlap mode."""


@dataclass(frozen=True)
class Row:
    """One strategy of a comparison and its predicted iteration time (None: does not fit in memory)."""

    name: str
    description: str
    predicted_time_s: float | None
    ratios: list[float] | None = None
    note: str = ""
    is_plan: bool = False
    """The row of the plan being compared."""

    @property
    def fits(self) -> bool:
        return self.predicted_time_s is not None


@dataclass
class Comparison:
    """A plan against the baselines and the ablations, all predicted by the same cost model."""

    plan_time_s: float
    rows: list[Row]
    compute_bound_s: float | None = None
    """The model's FLOPs at the cluster's summed peak (`engine.spmd.utilisation`): every row's MFU is it
    over the row's time (the same model on the same devices in the same precision)."""

    def speedup(self, row: Row) -> float | None:
        """How many times faster the plan is than `row` (None when `row` does not fit)."""
        return None if row.predicted_time_s is None else row.predicted_time_s / self.plan_time_s

    @property
    def best_baseline(self) -> Row | None:
        """The fastest baseline that fits: what the plan's speed-up is claimed against."""
        fitting = [r for r in self.rows if r.name in BASELINES and r.fits]
        return min(fitting, key=lambda r: r.predicted_time_s, default=None)

    def mfu(self, row: Row) -> float | None:
        """The row's model FLOPs utilisation: compute bound / its time (None when it does not fit or
        the bound is unknown)."""
        if row.predicted_time_s is None or not row.predicted_time_s > 0 or self.compute_bound_s is None:
            return None
        return self.compute_bound_s / row.predicted_time_s

    def table(self) -> list[dict[str, Any]]:
        """Rows as plain dicts for a table: strategy, what it is, time in ms, speed-up of the plan, MFU."""
        out = []
        for r in self.rows:
            speed = self.speedup(r)
            out.append({"strategy": r.name, "what": r.description,
                        "predicted_ms": None if r.predicted_time_s is None else r.predicted_time_s * 1e3,
                        "plan_speedup": speed, "mfu": self.mfu(r), "plan": r.is_plan, "note": r.note})
        return out


def without_comm_optimisation(graph: Graph) -> SearchSpace:
    """The search space of Fig. 15's "Q" and "Q+B": padded all-gather only, and no sufficient-factor
    broadcasting (matrix products may not run replicated on Full operands, §4.4)."""
    matmuls = frozenset(n.id for n in graph.nodes if n.op in MATMUL_OPS)
    return SearchSpace(collectives=SearchSpace().collectives - {"all_gather.grouped"},
                       rule_filter=lambda nid, r: not (nid in matmuls and r.name == "replicate"))


def predict(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, ratios: list[float] | list[list[float]],
            options: PlanOptions = PlanOptions(), segmentation: Segmentation | None = None, overlap: str = "none") -> float:
    """Predicted iteration time of a fixed program and ratios (one row per segment) on `cluster`
    (HAP §3.2) in overlap mode `overlap`."""
    return evaluate_program(program, CostModel(graph, cluster, ratios, options, segmentation, overlap=overlap)).total_s


def _search(graph: Graph, cluster: Cluster, ratios: list[float], space: SearchSpace, options: PlanOptions,
            budget: float | None) -> tuple[tuple[Instruction, ...], float]:
    cm = CostModel(graph, cluster, ratios, options, overlap=BASELINE_OVERLAP)
    res = synthesize(graph, cm, space=space, time_budget_s=budget, beam_width=DEFAULT_BEAM_WIDTH)
    return res.program, res.cost


def ablation_q(graph: Graph, cluster: Cluster, *, options: PlanOptions = PlanOptions(),
               time_budget_s: float | None = None) -> Row:
    """Fig. 15 "Q": the synthesizer alone, at flops-proportional ratios, without communication optimisation."""
    ratios = proportional_ratios(cluster)
    try:
        _, cost = _search(graph, cluster, ratios, without_comm_optimisation(graph), options, time_budget_s)
    except InfeasibleError:
        return Row("Q", "program synthesis, proportional ratios", None, ratios, "does not fit in memory")
    return Row("Q", "program synthesis, proportional ratios", cost, ratios)


def ablation_qb(graph: Graph, cluster: Cluster, *, options: PlanOptions = PlanOptions(),
                time_budget_s: float | None = None) -> Row:
    """Fig. 15 "Q+B": alternate synthesis and the LP (§3.1) without communication optimisation."""
    space, ratios = without_comm_optimisation(graph), proportional_ratios(cluster)
    best_s, best_ratios = math.inf, None
    seen: set[tuple[Instruction, ...]] = set()
    budget = None if time_budget_s is None else time_budget_s / options.max_iterations
    for _ in range(options.max_iterations):
        try:
            program, cost = _search(graph, cluster, ratios, space, options, budget)
        except InfeasibleError:
            break
        if cost < best_s:
            best_s, best_ratios = cost, ratios
        if program in seen:
            break
        seen.add(program)
        try:
            ratios = balance(program, graph, cluster, options=options, overlap=BASELINE_OVERLAP).ratios
        except InfeasibleError:
            break
        cost = predict(program, graph, cluster, ratios, options, overlap=BASELINE_OVERLAP)
        if cost < best_s:
            best_s, best_ratios = cost, ratios
    if best_ratios is None:
        return Row("Q+B", "synthesis + LP ratios", None, None, "does not fit in memory")
    return Row("Q+B", "synthesis + LP ratios", best_s, best_ratios)


BASELINE_WHAT = {"ddp": "PyTorch DDP: even shares, gradient buckets overlapped with backward",
                 "dp-even": "data parallel, even ratios", "dp-proportional": "data parallel, ratios ~ flops"}
PLAN_WHAT = {"Q+B+C": "+ communication optimisation: HAP without duplex (overlap ddp)",
             "Q+B+C+D": "+ duplex: two half-batches overlap communication (HiDup)"}


def baseline_row(graph: Graph, cluster: Cluster, strategy: str, options: PlanOptions = PlanOptions()) -> Row:
    """A baseline of `BASELINES` under the same cost model (None time when out of memory)."""
    try:
        p = evaluate(graph, cluster, strategy, options=options)
    except InfeasibleError as e:
        return Row(strategy, BASELINE_WHAT[strategy], None, None, str(e))
    return Row(strategy, BASELINE_WHAT[strategy], p.predicted_time_s, p.ratios["0"])


def spmd_options(the_plan: Plan) -> PlanOptions:
    """The options `the_plan` was made with, for the SPMD searches a comparison runs (no pipeline)."""
    return replace(the_plan.options, parallelism="spmd", microbatches=None)


def compare(the_plan: Plan, cluster: Cluster, *, time_budget_s: float | None = None) -> Comparison:
    """The plan against the baselines, the ablations of Fig. 15 and the plan with and without
    duplex on `cluster`. The full plan in the mode the plan did not run is the same search
    (`engine.plan`) forced to that mode, unless the plan's own search already priced it."""
    graph, options = the_plan.graph, spmd_options(the_plan)
    share = None if time_budget_s is None else time_budget_s / 3
    rows = [baseline_row(graph, cluster, name, options) for name in BASELINES]
    rows += [ablation_q(graph, cluster, options=options, time_budget_s=share),
             ablation_qb(graph, cluster, options=options, time_budget_s=share)]
    rows += [full_plan_row(the_plan, cluster, mode, time_budget_s=share) for mode in PLAN_ROWS]
    if the_plan.overlap not in PLAN_ROWS:  # forced to another mode, e.g. none: its own row
        rows.append(Row("plan", f"the plan (overlap {the_plan.overlap})", the_plan.predicted_time_s,
                        the_plan.ratios.get("0"), is_plan=True))
    bound = Utilisation(model_flops(graph), peak_flops(cluster, options.precision), the_plan.predicted_time_s)
    return Comparison(the_plan.predicted_time_s, rows, bound.compute_bound_s)


def full_plan_row(the_plan: Plan, cluster: Cluster, mode: str, *, time_budget_s: float | None = None) -> Row:
    """`Q+B+C` (mode ddp) or `Q+B+C+D` (duplex): the plan itself when it runs in `mode`, else the
    same search forced to `mode` (the figure the plan's own `auto` search recorded, when it did)."""
    name, what = PLAN_ROWS[mode], PLAN_WHAT[PLAN_ROWS[mode]]
    if the_plan.overlap == mode:
        return Row(name, what, the_plan.predicted_time_s, the_plan.ratios.get("0"), "the plan", is_plan=True)
    skipped = the_plan.search.get("overlap_skipped", {}).get(mode)
    if skipped:
        return Row(name, what, None, None, f"not planned: {skipped}")
    recorded = the_plan.search.get("overlap_s", {}).get(mode)
    if recorded is not None:
        return Row(name, what, recorded, None, "priced by the plan's search")
    try:
        other = plan(the_plan.graph, cluster, options=replace(spmd_options(the_plan), time_budget_s=time_budget_s,
                                                              overlap=mode))
    except (InfeasibleError, PlanError) as e:
        return Row(name, what, None, None, str(e))
    return Row(name, what, other.predicted_time_s, other.ratios.get("0"))


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
    options = spmd_options(the_plan)
    same = predict(the_plan.program, the_plan.graph, changed, the_plan.ratio_rows, options, the_plan.segmentation,
                   the_plan.overlap)
    fresh = plan(the_plan.graph, changed, options=replace(options, time_budget_s=time_budget_s,
                                                          overlap=the_plan.search.get("overlap_request", the_plan.overlap)))
    return WhatIf(changed, the_plan.predicted_time_s, same, fresh, changes)


# ----------------------------------------------------------------------------- lanes: what overlaps


LANES = ("compute", "network", "buckets")
"""A device's lanes in a timeline: its computation, its activation collectives, and (ddp) its
gradient buckets, which the cost model lets run beside the activation collectives."""
COMM_LANES = ("network", "buckets")


@dataclass(frozen=True)
class LaneFigures:
    """Where one device's iteration goes: how long it computes and communicates (its `network` and
    `buckets` lanes together), and for how long both at once (communication hidden behind computation)."""

    device: str
    compute_s: float
    network_s: float
    overlapped_s: float
    span_s: float
    """The whole timeline, first start to last end over all devices (a device idles the rest)."""

    @property
    def idle_s(self) -> float:
        return self.span_s - (self.compute_s + self.network_s - self.overlapped_s)

    @property
    def hidden_share(self) -> float:
        """The share of communication hidden behind computation (0 without communication)."""
        return self.overlapped_s / self.network_s if self.network_s > 0 else 0.0

    @property
    def overlap_ratio(self) -> float:
        """HiDup's overlapping ratio (Table 4): overlapped time over the smaller of computation and communication."""
        smaller = min(self.compute_s, self.network_s)
        return self.overlapped_s / smaller if smaller > 0 else 0.0


def lane_figures(spans: list[tuple[str, str, float, float]]) -> list[LaneFigures]:
    """Per device (in order of first appearance), the figures of `spans` = (device, lane, start,
    end) with a lane of `LANES`; spans may overlap each other (e.g. two half-batch streams, or
    buckets beside activation collectives): their union is what counts."""
    if not spans:
        return []
    first, last = min(s[2] for s in spans), max(s[3] for s in spans)
    by_device: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for device, lane, start, end in spans:
        if lane not in LANES:
            raise PlanError(f"timeline lane {lane!r}: expected one of {', '.join(LANES)}")
        by_device.setdefault(device, {k: [] for k in LANES})[lane].append((start, end))
    out = []
    for device, lanes in by_device.items():
        compute = _union(lanes["compute"])
        network = _union([span for lane in COMM_LANES for span in lanes[lane]])
        out.append(LaneFigures(device, _length(compute), _length(network), _length(_intersection(compute, network)),
                               last - first))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time two disjoint sorted interval lists share (a merge walk)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def predicted_schedule(the_plan: Plan, cluster: Cluster) -> Schedule:
    """The plan's predicted iteration as a simulated timeline: per device the lanes
    `compute:<device>`, `network:<device>` and in ddp `buckets:<device>` (`engine.spmd.overlap.predicted_timeline`),
    in the plan's overlap mode; its makespan is the plan's predicted time on `cluster`."""
    from engine.spmd.overlap import predicted_timeline

    return simulate(predicted_timeline(breakdown_of(the_plan, cluster), the_plan.graph))


def schedule_spans(schedule: Schedule) -> list[tuple[str, str, float, float]]:
    """(device, lane, start, end) of every task of a predicted schedule on a resource
    `<lane>:<device>` (other resources, e.g. zero-length phase barriers, are no device's lane)."""
    out = []
    for s in schedule.spans:
        lane, _, device = s.task.resource.partition(":")
        if lane in LANES and device:
            out.append((device, lane, s.start_s, s.end_s))
    return out


SHAPE_TOLERANCE = 0.2
"""How close (as a share of the spread between even and FLOP/s-proportional ratios) ratios must be to one
of the two to be called by its name."""


@dataclass(frozen=True)
class RatioReason:
    """Why an SPMD plan's ratios look as they do, read off its own figures: how far they are from even and from
    FLOP/s-proportional shares, and how much of the predicted iteration is communication no computation hides."""

    ratios: tuple[float, ...]
    """The plan's shares (its first segment), in device order."""
    proportional: tuple[float, ...]
    """Shares proportional to each device's FLOP/s in the plan's precision."""
    communication_share: float
    """Communication not hidden behind computation over the predicted iteration, on the device with most of it."""

    @property
    def shape(self) -> str:
        """"even", "proportional" (to FLOP/s), "alike" (the devices compute alike: both are even) or "between"."""
        n = len(self.ratios)
        spread = max(abs(p - 1 / n) for p in self.proportional)
        if spread < 1e-6:
            return "alike"
        to_even = max(abs(r - 1 / n) for r in self.ratios) / spread
        to_prop = max(abs(r - p) for r, p in zip(self.ratios, self.proportional)) / spread
        return "even" if to_even <= SHAPE_TOLERANCE else "proportional" if to_prop <= SHAPE_TOLERANCE else "between"

    @property
    def bound(self) -> str:
        """"communication" when exposed communication is at least half the iteration, else "compute"."""
        return "communication" if self.communication_share >= 0.5 else "compute"

    def sentence(self) -> str:
        """One or two sentences for the first screen, e.g. 'Communication-bound: ratios even. ...'."""
        part = "under 1%" if self.communication_share < 0.005 else f"{self.communication_share:.0%}"
        share = f"{part} of the predicted iteration is communication that computation does not hide"
        low, high = min(self.ratios), max(self.ratios)
        span = f"{low:.3g} each" if high - low < 5e-4 else f"{low:.3g} to {high:.3g}"
        flops = f"{min(self.proportional):.3g} to {max(self.proportional):.3g}"
        head = f"{self.bound.capitalize()}-bound: "
        if self.shape == "alike":
            return f"{head}ratios even ({span}): the devices compute alike, so each takes the same share; {share}."
        if self.shape == "even":
            return (f"{head}ratios even ({span}) although the devices' FLOP/s would give {flops}: {share}, and that "
                    "costs every device the same, so moving work to the faster ones would save little.")
        if self.shape == "proportional":
            return (f"{head}ratios follow the devices' FLOP/s ({span}), so every device finishes its computation at "
                    f"the same time; {share}.")
        return (f"{head}ratios {span}, between even and the devices' FLOP/s ({flops}): the load balancer (HAP §5.1) "
                f"weighs the faster devices' computation against what each share costs to communicate; {share}.")


def ratio_reason(the_plan: Plan, cluster: Cluster) -> RatioReason:
    """Why `the_plan`'s ratios look as they do on `cluster` (the one it was made for; devices joined by name)."""
    by_name = {d.name: d for d in cluster.devices}
    precision = the_plan.options.precision
    flops = [d.num_gpus * (d.flops_per_gpu_in(precision) or d.flops_per_gpu)
             for d in (by_name[n] for n in the_plan.device_names)]
    figures = lane_figures(schedule_spans(predicted_schedule(the_plan, cluster)))
    exposed = max(((f.network_s - f.overlapped_s) / f.span_s for f in figures if f.span_s > 0), default=0.0)
    return RatioReason(tuple(the_plan.ratio_rows[0]), tuple(f / sum(flops) for f in flops), exposed)
