"""The planner: alternate program synthesis and load balancing (HAP §3.1, Eq. 1-2), plus baselines.

    B(0) = ratios proportional to device flops
    Q(s) = argmin_Q t(Q, B(s-1))      (A*, `engine.synthesis`)
    B(s) = argmin_B t(Q(s), B)        (LP, `engine.balance`)

until Q repeats (convergence or oscillation); the best (Q, B) pair seen is kept. The data-parallel
baselines are programs of the same search space (parameters Full, inputs sharded on the batch
dim, no other communication), so they seed the search as incumbents: a HAP plan is never
predicted slower than them.

Overlap (`engine.overlap`): the loop runs with the cost model and the LP of one overlap mode.
`overlap="auto"` runs it in `ddp` (gradient buckets during backward) and in `duplex` (HiDup's two
half-batches), each with its share of the time budget, and keeps the faster prediction; duplex
wins only where it predicts a gain. The ddp plan is also priced with one bucket after backward
(`none`): every bucket pays a latency, so where backward is too short to hide them, not
overlapping is faster, and auto keeps that. The baselines (`ddp`, `dp-even`, `dp-proportional`) are
priced as PyTorch DDP runs: gradient buckets overlapped with backward.

Parallelism (`plan(..., parallelism=)`): `spmd` (default) is the loop above; `pipeline` is HAPT's
stage partitioning (`engine.partition.best_pipeline`: stages on device groups, H-1F1B schedule)
with this loop inside every stage (`engine.stage_plan`);
`auto` plans both and keeps the faster prediction (SPMD on a tie). `plan` then returns a `Plan` or
an `engine.partition.PipelinePlan`; both have `parallelism` ("spmd" / "pipeline"),
`predicted_time_s` and `search` (with `parallelism_s`: every kind planned and its predicted time).

With `segments=g > 1` (§5.2) the model is cut into g segments at layer boundaries, B becomes one
ratio vector per segment, and tensors crossing a boundary are re-split by all-to-alls. The
one-segment baselines stay candidates, so segments are used only where they pay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from .balance import balance, gib
from .cluster import Cluster, load_cluster
from .cost import Breakdown, CostModel, evaluate as evaluate_program
from . import limits
from .errors import InfeasibleError, PlanError
from .graph import Graph, Node
from .halves import halves_problem
from .overlap import OVERLAP_MODES, duplex_run_problem
from .partition import PipelinePlan, best_pipeline, microbatch_candidates
from .plan import Plan, realized_ratios, shard_key, shard_sizes, stage_records
from .segments import Segmentation, segment_graph, with_resplits
from .stage_plan import HapLayerPricer, with_hap_stages
from .program import Instruction
from .synthesis import SearchProgress, SearchResult, SearchSpace, synthesize
from .theory.core import FULL

DEFAULT_BEAM_WIDTH = 16
BASELINES = ("ddp", "dp-even", "dp-proportional")
"""`ddp`: data parallelism as PyTorch DDP runs it (even shares, 25 MiB gradient buckets overlapped
with backward); `dp-even` / `dp-proportional`: even / flops-proportional shares, priced the same way.
`ddp` and `dp-even` are the same program at the same shares: `ddp` is the name users look for."""
BASELINE_OVERLAP = "ddp"
"""How every baseline is priced: what users compare against is DDP as it runs."""
PARALLELISMS = ("spmd", "pipeline", "auto")
PIPELINE_BUDGET_S = 30.0
"""Seconds the pipeline planner's HAP searches (of layers and of stages, `_pipeline`) take at most when
no time budget is given."""
"""What `plan(..., parallelism=)` accepts: `auto` plans an SPMD and a pipeline plan and keeps the faster."""
PARALLELISM_MEANING = {"spmd": "every device runs every layer on its share of the batch (HAP)",
                       "pipeline": "layers in stages on device groups, microbatches through them (HAPT)"}
"""One line per kind of plan, for reports."""
PLAN_OVERLAPS = ("auto", *OVERLAP_MODES)
"""What `plan(..., overlap=)` accepts: `auto` plans in ddp and in duplex and keeps the faster."""
OVERLAP_MEANING = {"none": "gradients all-reduced after backward", "ddp": "gradient buckets all-reduced during backward",
                   "duplex": "two half-batches, one's communication overlapped with the other's computation (HiDup)"}
"""One line per overlap mode, for reports."""


@dataclass
class Candidate:
    program: tuple[Instruction, ...]
    ratios: list[list[float]]
    """One row per segment."""
    cost: float
    segmentation: Segmentation
    overlap: str = "none"
    """The overlap mode `cost` is priced in."""


def proportional_ratios(cluster: Cluster) -> list[float]:
    total = sum(cluster.flops)
    return [f / total for f in cluster.flops]


def even_ratios(cluster: Cluster) -> list[float]:
    return [1.0 / cluster.num_devices] * cluster.num_devices


def data_parallel_space(graph: Graph, *, gather: bool = False) -> SearchSpace:
    """Parameters Full (gradients all-reduced), inputs split on dim 0; the only activation collective
    is all-reduce: with parameters Full and inputs split by samples, a value becomes Partial only as
    a sum over the batch, e.g. the mean loss's count of targets that are not ignored (a scalar).

    With `gather`: data parallelism with the fallback. An operator with no batch rule (an opaque
    op, batch norm's exact statistics) runs replicated on all-gathered operands (inputs may load
    whole) and its result is sliced back to the batch shards for free."""
    if gather:  # only the batch dim (0) is ever split: slicing a gathered tensor on another dim would
        # open sequence- and head-parallel branches that multiply the programs to search
        return SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f in (FULL, 0),
                           collectives=frozenset({"all_reduce", "all_gather.padded", "all_gather.grouped", "slice"}),
                           rule_filter=lambda n, r: r.output <= 0 and all(f <= 0 for f in r.inputs))
    return SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f == 0,
                       collectives=frozenset({"all_reduce"}))


def data_parallel(graph: Graph, cm: CostModel, deadline: float | None = None) -> SearchResult:
    """The data-parallel program under `cm`: plain when every operator splits on the batch, else
    with all-gathers before the operators that cannot, else every device running the whole model
    (a program whenever every operator has its all-Full rule, as opaque ones do and memory allows).
    The gathering space is searched with a beam: exactly, it has as many programs as ways to place
    the gathers (BART-base-sized graphs took minutes). InfeasibleError says why there is none;
    each search stops at `deadline` (time.perf_counter) with the best program it has."""
    try:
        return synthesize(graph, cm, space=data_parallel_space(graph), time_budget_s=_left(deadline))
    except InfeasibleError:
        pass
    try:
        return synthesize(graph, cm, space=data_parallel_space(graph, gather=True), beam_width=DEFAULT_BEAM_WIDTH,
                          time_budget_s=_left(deadline))
    except InfeasibleError:
        return synthesize(graph, cm, space=replicated_space(), time_budget_s=_left(deadline))


def unsplittable_input(graph: Graph) -> Node | None:
    """The first input whose dim 0 cannot be split (size below 2, or a scalar): data parallelism has no program then."""
    return next((n for n in graph.placeholders if not n.shape or n.shape[0] < 2), None)


def replicated_space() -> SearchSpace:
    """Every leaf Full and nothing communicated: each device runs the whole single-device model
    (on one device, that model as it is, for any batch size, 1 included)."""
    return SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f == FULL,
                       collectives=frozenset())


def _coerce(model: Any, cluster: Any) -> tuple[Graph, Cluster]:
    from .source import load_model

    return (model if isinstance(model, Graph) else load_model(model)), load_cluster(cluster)


def evaluate(model: Any, cluster: Any, strategy: str, *, optimizer: str = "adam") -> Plan:
    """A baseline plan (`ddp`, `dp-even` or `dp-proportional`) under the same cost model as HAP,
    gradient buckets overlapped with backward as DDP runs them."""
    _check_arguments(None, optimizer)
    graph, cluster = _coerce(model, cluster)
    if strategy not in BASELINES:
        raise PlanError(f"unknown strategy '{strategy}' (choose one of: {', '.join(BASELINES)})")
    unsplittable = unsplittable_input(graph)
    if unsplittable is not None:
        raise InfeasibleError(f"{strategy} splits every input on dim 0, but input '{unsplittable.name}' has shape "
                              f"{tuple(unsplittable.shape)}: data parallelism needs a batch of at least 2 "
                              "(engine.plan may still shard other dims)")
    ratios = baseline_ratios(cluster, strategy)
    cm = CostModel(graph, cluster, ratios, optimizer, overlap=BASELINE_OVERLAP)
    try:
        res = data_parallel(graph, cm)
    except InfeasibleError:
        raise InfeasibleError(_oom_message(graph, cluster, optimizer, strategy, ratios)) from None
    cand = Candidate(res.program, [ratios], res.cost, Segmentation.single(graph), BASELINE_OVERLAP)
    return _make_plan(strategy, graph, cluster, cand, optimizer, [], {"expanded": res.expanded, "elapsed_s": res.elapsed_s})


def baseline_ratios(cluster: Cluster, strategy: str) -> list[float]:
    """The shares of a baseline: even for `ddp` and `dp-even`, proportional to flops for `dp-proportional`."""
    return proportional_ratios(cluster) if strategy == "dp-proportional" else even_ratios(cluster)


def _baseline_candidate(graph: Graph, cluster: Cluster, ratios: list[float], optimizer: str,
                        deadline: float | None = None) -> Candidate | None:
    """A data-parallel baseline at `ratios`, priced as DDP runs (`BASELINE_OVERLAP`); None when it
    does not fit or no input can be split on the batch (the everything-replicated program is no
    data parallelism: the memory-fitted seed still offers it to the search)."""
    if unsplittable_input(graph) is not None:
        return None
    cm = CostModel(graph, cluster, ratios, optimizer, overlap=BASELINE_OVERLAP)
    try:
        res = data_parallel(graph, cm, deadline)
    except InfeasibleError:
        return None
    return Candidate(res.program, [ratios], res.cost, Segmentation.single(graph), BASELINE_OVERLAP)


def _memory_fitted_baseline(graph: Graph, cluster: Cluster, optimizer: str, overlap: str,
                            deadline: float | None = None) -> Candidate | None:
    """Data parallelism at the LP's ratios, which respect every device's memory: the plan that
    exists whenever the model fits data-parallel at all, e.g. when even and proportional splits
    overflow a small device. None when no ratios fit."""
    try:
        cm = CostModel(graph, _unlimited(cluster), proportional_ratios(cluster), optimizer, overlap=overlap)
        program = data_parallel(graph, cm, deadline).program
        ratios = balance(program, graph, cluster, optimizer=optimizer, time_limit_s=_left(deadline) or 30.0,
                         overlap=overlap).by_segment
    except InfeasibleError:
        return None
    cost = evaluate_program(program, CostModel(graph, cluster, ratios, optimizer, overlap=overlap)).total_s
    return Candidate(program, ratios, cost, Segmentation.single(graph), overlap)


def _priced_in(cand: Candidate, graph: Graph, cluster: Cluster, optimizer: str, overlap: str) -> Candidate:
    """The same program and ratios priced in another overlap mode (a baseline seeding that mode's search)."""
    cm = CostModel(graph, cluster, cand.ratios, optimizer, cand.segmentation, overlap=overlap)
    return Candidate(cand.program, cand.ratios, evaluate_program(cand.program, cm).total_s, cand.segmentation, overlap)


def _unlimited(cluster: Cluster) -> Cluster:
    """The cluster with (practically) unlimited memory per GPU: to find a program memory rules out."""
    return Cluster.from_dict({**cluster.to_dict(), "devices": [
        {**d.to_dict(), "memory_bytes_per_gpu": limits.MAX_MEMORY_BYTES} for d in cluster.devices]})


def plan(model: Any, cluster: Any, time_budget_s: float | None = None,
         progress: Callable[[SearchProgress], None] | None = None, *, optimizer: str = "adam",
         beam_width: int | None = DEFAULT_BEAM_WIDTH, max_iterations: int = 6, segments: int = 1,
         report_every: int = 500, overlap: str = "auto", parallelism: str = "spmd",
         microbatches: int | None = None) -> "Plan | PipelinePlan":
    """Plan `model` on `cluster` as `parallelism` says: `spmd` (default) returns the SPMD `Plan` of
    `plan_spmd`; `pipeline` the `PipelinePlan` of `best_pipeline` (`microbatches` fixes B, else it
    is searched) with HAP's plan inside every stage; `auto` both, returning the faster prediction
    (SPMD on a tie). The pipeline DP has no deadline; the stages' searches share `time_budget_s`
    (half of it under `auto`, which runs the pipeline first and gives the SPMD search what is left,
    at least 0.05 s), so a DP slower than the budget overruns it by its own time.
    The returned plan's `search["parallelism_s"]` holds every kind planned and its predicted time;
    `search["parallelism_skipped"]` why a kind has no plan (e.g. no pipeline fits memory)."""
    _check_parallelism(parallelism, microbatches)
    spmd_args = dict(progress=progress, optimizer=optimizer, beam_width=beam_width, max_iterations=max_iterations,
                     segments=segments, report_every=report_every, overlap=overlap)
    if parallelism == "spmd":
        return plan_spmd(model, cluster, time_budget_s, **spmd_args)
    _check_arguments(time_budget_s, optimizer, overlap)
    graph, cluster = _coerce(model, cluster)
    start = time.perf_counter()
    if parallelism == "pipeline":
        pipe = _pipeline(graph, cluster, microbatches, optimizer, time_budget_s)
        return _with_search(pipe, graph, cluster, optimizer, {
            "parallelism_request": parallelism, "parallelism_s": {"pipeline": pipe.predicted_s},
            "parallelism_skipped": {"spmd": "parallelism='pipeline' plans a pipeline only; 'auto' compares it with SPMD"}})
    return _plan_auto(graph, cluster, time_budget_s, start, microbatches, spmd_args)


def _plan_auto(graph: Graph, cluster: Cluster, time_budget_s: float | None, start: float, microbatches: int | None,
               spmd_args: dict[str, Any]) -> "Plan | PipelinePlan":
    """The faster of the best pipeline and the best SPMD plan; the pipeline DP first (no deadline),
    then the SPMD search in what is left of the budget. Either kind may have no plan (InfeasibleError):
    the other is returned with the reason recorded; with neither, the SPMD error is raised."""
    skipped: dict[str, str] = {}
    try:
        pipe = _pipeline(graph, cluster, microbatches, spmd_args["optimizer"],
                         None if time_budget_s is None else time_budget_s / 2)
    except InfeasibleError as e:
        pipe, skipped["pipeline"] = None, str(e)
    left = None if time_budget_s is None else max(0.05, time_budget_s - (time.perf_counter() - start))
    try:
        spmd = plan_spmd(graph, cluster, left, **spmd_args)
    except InfeasibleError as e:
        if pipe is None:
            raise
        spmd, skipped["spmd"] = None, str(e)
    times = {k: p.predicted_time_s for k, p in (("spmd", spmd), ("pipeline", pipe)) if p is not None}
    stats = {"parallelism_request": "auto", "parallelism_s": times, "parallelism_skipped": skipped,
             "parallelism_elapsed_s": time.perf_counter() - start}
    if spmd is not None and (pipe is None or spmd.predicted_time_s <= pipe.predicted_s):
        spmd.search.update(stats)
        return spmd
    return _with_search(pipe, graph, cluster, spmd_args["optimizer"], stats)


def _pipeline(graph: Graph, cluster: Cluster, microbatches: int | None, optimizer: str,
              time_budget_s: float | None) -> PipelinePlan:
    """HAPT's best partition (`best_pipeline`) with stages priced data-parallel; the best partitions
    again with stages priced by their layers' HAP plans (`HapLayerPricer`: it finds the groups that
    sharding inside a stage pays for), at that partition's microbatch count B and the smaller ones
    (more samples per microbatch allow larger groups), while a quarter of `time_budget_s` lasts
    (`PIPELINE_BUDGET_S` without a budget); HAP's plan inside every stage of the two best; the faster.
    The stages' searches share what is left of the budget."""
    start = time.perf_counter()
    time_budget_s = PIPELINE_BUDGET_S if time_budget_s is None else time_budget_s
    quarter = time_budget_s / 4
    pipe = best_pipeline(graph, cluster, microbatches, optimizer=optimizer)
    candidates = {_layout(pipe): pipe}
    pricer = HapLayerPricer(graph, cluster, optimizer, quarter / 8)
    counts = [microbatches] if microbatches else [b for b in microbatch_candidates(graph) if b <= pipe.microbatches]
    for B in sorted(counts, reverse=True):
        if time.perf_counter() - start > quarter:
            break
        try:
            other = best_pipeline(graph, cluster, B, pricer=pricer, optimizer=optimizer)
        except (PlanError, InfeasibleError):
            continue  # nothing fits at B, or the model cannot be captured at its size: data-parallel stages
        candidates.setdefault(_layout(other), other)
    best = sorted(candidates.values(), key=lambda p: p.predicted_s)[:2]
    left = max(0.05, time_budget_s - (time.perf_counter() - start))
    return min((with_hap_stages(p, cluster, optimizer, left / len(best)) for p in best), key=lambda p: p.predicted_s)


def _layout(pipe: PipelinePlan) -> tuple:
    """What tells two partitions apart: the microbatch count, each stage's layers and devices."""
    return (pipe.microbatches, *((s.layers, s.devices) for s in pipe.stages))


def _with_search(pipe: PipelinePlan, graph: Graph, cluster: Cluster, optimizer: str,
                 stats: dict[str, Any]) -> PipelinePlan:
    """The pipeline plan with the planner's records, and the model and cluster it was made for
    (fingerprints, as `Plan` holds them: the app tells a stale plan by them)."""
    return replace(pipe, search={**pipe.search, **stats, "optimizer": optimizer, "model_name": graph.name,
                                 "model_fingerprint": graph.fingerprint(), "cluster_name": cluster.name,
                                 "cluster_fingerprint": cluster.fingerprint(),
                                 "device_names": [d.name for d in cluster.devices]})


def _check_parallelism(parallelism: Any, microbatches: Any) -> None:
    """Refuse an unknown parallelism, a bad microbatch count, or a count where no pipeline is planned."""
    if not isinstance(parallelism, str) or parallelism not in PARALLELISMS:
        raise PlanError(f"parallelism {parallelism!r} is not known (choose one of: {', '.join(PARALLELISMS)})")
    if microbatches is None:
        return
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches = {microbatches!r}; give a positive integer (or None to search)")
    if parallelism == "spmd":
        raise PlanError("microbatches applies to pipeline plans; use parallelism='pipeline' or 'auto' "
                        "(an SPMD plan runs the whole batch at once)")


def plan_spmd(model: Any, cluster: Any, time_budget_s: float | None = None,
              progress: Callable[[SearchProgress], None] | None = None, *, optimizer: str = "adam",
              beam_width: int | None = DEFAULT_BEAM_WIDTH, max_iterations: int = 6, segments: int = 1,
              report_every: int = 500, overlap: str = "auto", space: SearchSpace | None = None) -> Plan:
    """Plan `model` on `cluster`: the Q<->B iteration of HAP §3.1, returning the best plan found.

    `overlap` is the overlap mode to plan in (`none`, `ddp`, `duplex`), or `auto`: plan in ddp
    and in duplex (each with an equal share of what is left of the budget), price the ddp plan
    in none too, and keep the fastest;
    the plan's search stats record every mode's predicted time (`overlap_s`) and why one was
    skipped (`overlap_skipped`). `segments` > 1 then iterates again with that many runs of
    layers, each with its own ratios (§5.2), starting from the one-segment plan; the faster of
    the two is returned. `progress` is called every `report_every` expansions of each search (the
    UI's live frontier). `space` restricts the search (e.g. no hierarchical collectives inside a
    pipeline stage); the data-parallel seeds are searched in their own spaces."""
    _check_arguments(time_budget_s, optimizer, overlap)
    graph, cluster = _coerce(model, cluster)
    modes, skipped = overlap_modes(graph, overlap)
    seg = segment_graph(graph, segments)
    start = time.perf_counter()
    deadline = None if time_budget_s is None else start + time_budget_s
    check_total_memory(graph, cluster, optimizer)
    baselines = _baselines(graph, cluster, optimizer, deadline)
    history: list[dict[str, Any]] = []
    stats = {"expanded": 0, "generated": 0, "optimal": True, "iterations": 0,
             "baselines_s": {k: None if c is None else _realized_rank(graph, cluster, c, optimizer)[1]
                             for k, c in baselines.items()},
             "overlap_request": overlap, "overlap_s": {}, "overlap_skipped": skipped}
    loop = _Loop(graph, cluster, optimizer, beam_width, max_iterations, progress, report_every, deadline, history, stats,
                 space=space or SearchSpace())
    found: dict[str, Candidate] = {}
    for k, mode in enumerate(modes):
        share = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / (len(modes) - k)
        cand = _plan_in(mode, loop, seg, list(baselines.values()), share)
        if cand is not None:
            found[mode] = cand
            stats["overlap_s"][mode] = _realized_rank(graph, cluster, cand, optimizer)[1]
    if not found:
        raise InfeasibleError(_oom_message(graph, cluster, optimizer, deadline=deadline))
    if overlap == "auto" and "ddp" in found:
        found["none"] = _priced_in(found["ddp"], graph, cluster, optimizer, "none")
        stats["overlap_s"]["none"] = _realized_rank(graph, cluster, found["none"], optimizer)[1]
    # modes in order (ddp, duplex, none): a tie keeps the earlier, so duplex or none is chosen only for a predicted gain
    while True:
        best = min(found.values(), key=lambda c: _realized_rank(graph, cluster, c, optimizer))
        stats["elapsed_s"] = time.perf_counter() - start
        stats["segments"] = best.segmentation.count
        made = _make_plan("hap", graph, cluster, best, optimizer, history, stats)
        problem = halves_problem(made) if made.overlap == "duplex" else None
        if problem is None:
            return made
        if overlap == "duplex" or len(found) == 1:
            raise PlanError(f"model '{graph.name}': {problem}")
        del found["duplex"]  # its halves cannot run this program: keep the best of the other modes
        stats["overlap_skipped"]["duplex"] = problem


def overlap_modes(graph: Graph, overlap: str) -> tuple[list[str], dict[str, str]]:
    """The overlap modes to plan in for `overlap`, and the modes `auto` skips with the reason
    (duplex for a model whose half batches would not compute the same, e.g. training-mode BatchNorm)."""
    problem = duplex_run_problem(graph) if overlap in ("auto", "duplex") else None
    if overlap == "duplex" and problem:
        raise PlanError(f"model '{graph.name}': {problem}")
    if overlap == "auto":
        return (["ddp"], {"duplex": problem}) if problem else (["ddp", "duplex"], {})
    return [overlap], {}


def _baselines(graph: Graph, cluster: Cluster, optimizer: str, deadline: float | None) -> dict[str, Candidate | None]:
    """The data-parallel baselines priced as DDP runs; `ddp` is `dp-even` (same program, shares and pricing)."""
    even = _baseline_candidate(graph, cluster, even_ratios(cluster), optimizer, deadline)
    return {"ddp": even, "dp-even": even,
            "dp-proportional": _baseline_candidate(graph, cluster, proportional_ratios(cluster), optimizer, deadline)}


def _plan_in(mode: str, loop: "_Loop", seg: Segmentation, baselines: list[Candidate | None],
             deadline: float | None) -> Candidate | None:
    """The best plan of the Q<->B loop in one overlap mode, seeded with the baselines priced in it;
    asked for segments, the one-segment loop gets half of `deadline`'s time, so the segmented one still runs."""
    graph, cluster, optimizer = loop.graph, loop.cluster, loop.optimizer
    unique = {id(c): c for c in baselines if c is not None}.values()
    seeds = [_priced_in(c, graph, cluster, optimizer, mode) for c in unique]
    if not seeds:
        seeds = [c for c in [_memory_fitted_baseline(graph, cluster, optimizer, mode, deadline)] if c is not None]
    best = min(seeds, key=lambda c: c.cost, default=None)
    now = time.perf_counter()
    loop.overlap = mode
    loop.deadline = deadline if seg.count == 1 or deadline is None else now + (deadline - now) / 2
    best = loop.run(Segmentation.single(graph), [proportional_ratios(cluster)], best)
    if seg.count > 1 and best is not None:
        loop.deadline = deadline
        best = loop.run(seg, [best.ratios[0]] * seg.count, best, with_resplits(best.program, seg, graph))
    if best is None:
        return None
    return min([best, *seeds], key=lambda c: _realized_rank(graph, cluster, c, optimizer))  # whole units may reorder them


@dataclass
class _Loop:
    """The Q<->B iteration for one segmentation, recording history and search statistics."""

    graph: Graph
    cluster: Cluster
    optimizer: str
    beam_width: int | None
    max_iterations: int
    progress: Callable[[SearchProgress], None] | None
    report_every: int
    deadline: float | None
    history: list[dict[str, Any]]
    stats: dict[str, Any]
    overlap: str = "none"
    """The overlap mode the cost model and the LP price in."""
    space: SearchSpace = SearchSpace()
    """What the search may use (all of the theory, unless a caller restricts it)."""

    def run(self, seg: Segmentation, ratios: list[list[float]], best: Candidate | None,
            incumbent: tuple[Instruction, ...] | None = None) -> Candidate | None:
        graph, cluster, optimizer = self.graph, self.cluster, self.optimizer
        incumbent = incumbent or (best.program if best is not None and best.segmentation.count == 1 else None)
        seen: set = set()
        rebalanced = False
        for _ in range(self.max_iterations):
            if best is not None and self.deadline is not None and time.perf_counter() > self.deadline:
                break  # the budget is spent: no new Q<->B iteration, keep the best found
            it = self.stats["iterations"]  # searches so far, over every mode and segmentation: tags stay 0, 1, 2, ...
            left = _left(self.deadline)
            cm = CostModel(graph, cluster, ratios, optimizer, seg, overlap=self.overlap)
            report = None if self.progress is None else (lambda p, it=it: self.progress(_tag(p, it)))
            try:
                res = synthesize(graph, cm, space=self.space, time_budget_s=left, progress=report, beam_width=self.beam_width,
                                 incumbent=incumbent, report_every=self.report_every)
            except InfeasibleError:  # nothing fits under these ratios: let the LP (memory constraints) move them once
                moved = None if incumbent is None or rebalanced else self.memory_feasible_ratios(incumbent, seg)
                if moved is None:
                    break  # keep the best found (or explain in plan())
                ratios, rebalanced = moved, True
                continue
            _accumulate(self.stats, res)
            self.history.append({"iteration": it, "step": "Q", "predicted_time_s": res.cost, "ratios": ratios,
                                 "segments": seg.count, "overlap": self.overlap})
            best = _better(best, Candidate(res.program, ratios, res.cost, seg, self.overlap))
            key = tuple(res.program)
            if key in seen:
                break
            seen.add(key)
            try:
                bal = balance(res.program, graph, cluster, optimizer=optimizer, segmentation=seg,
                              time_limit_s=_left(self.deadline) or 30.0, overlap=self.overlap)
            except InfeasibleError:
                break  # this program cannot fit under any ratios; keep the best found
            cm = CostModel(graph, cluster, bal.by_segment, optimizer, seg, overlap=self.overlap)
            cost = evaluate_program(res.program, cm).total_s
            self.history.append({"iteration": it, "step": "B", "predicted_time_s": cost, "ratios": bal.by_segment,
                                 "segments": seg.count, "overlap": self.overlap})
            best = _better(best, Candidate(res.program, bal.by_segment, cost, seg, self.overlap))
            ratios, incumbent = bal.by_segment, res.program
        return best

    def memory_feasible_ratios(self, program: tuple[Instruction, ...], seg: Segmentation) -> list[list[float]] | None:
        """The LP's ratios for `program` (e.g. a baseline), which respect every device's memory; None if none do."""
        try:
            return balance(program, self.graph, self.cluster, optimizer=self.optimizer, segmentation=seg,
                           time_limit_s=_left(self.deadline) or 30.0, overlap=self.overlap).by_segment
        except InfeasibleError:
            return None


def _check_arguments(time_budget_s: Any, optimizer: Any, overlap: Any = "auto") -> None:
    """Refuse an unusable time budget, an unknown optimizer or overlap mode by name, before any work."""
    from .cost import STATE_BYTES_PER_PARAM_BYTE

    problem = limits.time_budget_problem(time_budget_s, "time_budget_s")
    if problem:
        raise PlanError(problem)
    if optimizer not in STATE_BYTES_PER_PARAM_BYTE:
        raise PlanError(f"optimizer {optimizer!r} is not known (choose one of: {', '.join(STATE_BYTES_PER_PARAM_BYTE)})")
    if not isinstance(overlap, str) or overlap not in PLAN_OVERLAPS:
        raise PlanError(f"overlap {overlap!r} is not known (choose one of: {', '.join(PLAN_OVERLAPS)})")


def _left(deadline: float | None) -> float | None:
    """Seconds left before the deadline (at least 0.05, so a late step still returns its best), or None."""
    return None if deadline is None else max(0.05, deadline - time.perf_counter())


def _tag(p: SearchProgress, iteration: int) -> SearchProgress:
    p.iteration = iteration
    return p


def _accumulate(stats: dict[str, Any], res) -> None:
    stats["expanded"] += res.expanded
    stats["generated"] += res.generated
    stats["optimal"] = stats["optimal"] and res.optimal
    stats["iterations"] += 1
    stats.setdefault("frontier", []).extend(
        {"expanded": p.expanded, "queue_size": p.queue_size, "best_cost": p.best_cost,
         "lowest_open_score": p.lowest_open_score, "elapsed_s": p.elapsed_s} for p in res.frontier)


def _better(a: Candidate | None, b: Candidate) -> Candidate:
    return b if a is None or b.cost < a.cost * (1 - 1e-12) else a


def plan_of(program: tuple[Instruction, ...], graph: Graph, cluster: Cluster, ratios: list[float] | list[list[float]],
            *, optimizer: str = "adam", segmentation: Segmentation | None = None, strategy: str = "hap",
            overlap: str = "none") -> Plan:
    """The Plan of a given program and ratios (one flat list, or one row per segment) priced in
    `overlap`: for programs made by hand or by a restricted search, e.g. in tests and ablations."""
    seg = segmentation or Segmentation.single(graph)
    cm = CostModel(graph, cluster, ratios, optimizer, seg, overlap=overlap)
    cand = Candidate(program, cm.ratios, evaluate_program(program, cm).total_s, seg, overlap)
    return _make_plan(strategy, graph, cluster, cand, optimizer, [], {})


def breakdown_of(the_plan: Plan, cluster: Cluster) -> Breakdown:
    """The cost model's breakdown of a plan on `cluster` at the plan's ratios and in its overlap
    mode: per stage and device, the buckets and the tail (what the Timeline page draws)."""
    cm = CostModel(the_plan.graph, cluster, the_plan.ratio_rows, the_plan.search.get("optimizer", "adam"),
                   the_plan.segmentation, overlap=the_plan.overlap)
    return evaluate_program(the_plan.program, cm)


def _realized(graph: Graph, cluster: Cluster, cand: Candidate, optimizer: str):
    """(integer shard sizes, realized ratios, cost-model breakdown at them) of a candidate: what the
    runner will execute, so the plan predicts the time of its whole units, not of the LP's fractions."""
    seg = cand.segmentation
    sizes = shard_sizes(cand.program, graph, cand.ratios, seg)
    ratios = realized_ratios(graph, sizes, cand.ratios)
    return sizes, ratios, evaluate_program(cand.program, CostModel(graph, cluster, ratios, optimizer, seg,
                                                                   overlap=cand.overlap))


def _realized_rank(graph: Graph, cluster: Cluster, cand: Candidate, optimizer: str) -> tuple[bool, float]:
    """(overflows a device at whole units, predicted time): rounding the LP's ratios to whole units
    can push a device past its memory, so a candidate that still fits comes first."""
    b = _realized(graph, cluster, cand, optimizer)[2]
    over = any(m > d.memory_bytes_per_gpu for m, d in zip(b.memory_bytes, cluster.devices))
    return over, b.total_s


def _make_plan(strategy: str, graph: Graph, cluster: Cluster, cand: Candidate, optimizer: str,
               history: list[dict[str, Any]], stats: dict[str, Any]) -> Plan:
    seg = cand.segmentation
    int_sizes, ratios, b = _realized(graph, cluster, cand, optimizer)
    sizes = {shard_key(graph, seg, t, d, k): s for (t, d, k), s in int_sizes.items()}
    return Plan(strategy=strategy, graph=graph, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint(),
                device_names=[d.name for d in cluster.devices], machines=[d.machine for d in cluster.devices],
                program=cand.program,
                ratios={str(k): list(r) for k, r in enumerate(ratios)}, shard_sizes=sizes, predicted_time_s=b.total_s,
                stages=stage_records(b, graph), memory_bytes=b.memory_bytes, history=history,
                search={**stats, "optimizer": optimizer}, segment_of=list(seg.of_node) if seg.count > 1 else [],
                overlap=cand.overlap)


def check_total_memory(graph: Graph, cluster: Cluster, optimizer: str) -> None:
    """Fail fast when even a perfect split of all state and activations cannot fit the cluster."""
    from .cost import STATE_BYTES_PER_PARAM_BYTE

    state = sum(n.nbytes for n in graph.parameters) * STATE_BYTES_PER_PARAM_BYTE[optimizer]
    capacity = sum(d.memory_bytes_per_gpu * d.num_gpus for d in cluster.devices)
    if state > capacity:
        raise InfeasibleError(f"out of memory: the model's parameters, gradients and {optimizer} state need "
                              f"{gib(state)} but the whole cluster has {gib(capacity)}; "
                              "add devices or shrink the model")


def _oom_message(graph: Graph, cluster: Cluster, optimizer: str, strategy: str | None = None,
                 ratios: list[float] | None = None, *, deadline: float | None = None) -> str:
    """Why nothing fits: the node data parallelism cannot run and why, or the device whose memory
    even data parallelism overflows most, with its bytes needed and held and what they are."""
    what = "no program" if strategy is None else f"no {strategy} program"
    split = "in proportion to device memory" if ratios is None else f"as {strategy} does"
    ratios = ratios or memory_ratios(cluster)
    try:
        res = data_parallel(graph, CostModel(graph, _unlimited(cluster), ratios, optimizer), deadline)
    except InfeasibleError as e:
        return f"{what}: {e}"
    cm = CostModel(graph, cluster, ratios, optimizer)
    parts = memory_parts(res.program, cm)
    j = max(range(len(parts)), key=lambda i: sum(parts[i]) - cluster.devices[i].memory_bytes_per_gpu)
    state, act = parts[j]
    return (f"out of memory: device '{cluster.devices[j].name}' needs {gib(state + act)} but has "
            f"{gib(cluster.devices[j].memory_bytes_per_gpu)} even data-parallel with the batch split {split} "
            f"(parameters, gradients and {optimizer} state {gib(state)}, activations {gib(act)}); "
            "use a smaller batch, more or larger devices, or optimizer='sgd'")


def memory_ratios(cluster: Cluster) -> list[float]:
    """Ratios proportional to each device's memory: the split under which data parallelism fits best."""
    total = sum(d.memory_bytes_per_gpu * d.num_gpus for d in cluster.devices)
    return [d.memory_bytes_per_gpu * d.num_gpus / total for d in cluster.devices]


def memory_parts(program: tuple[Instruction, ...], cm: CostModel) -> list[tuple[float, float]]:
    """Per device, the predicted peak bytes per GPU split into (parameters, gradients and optimizer
    state; activations kept for backward): the two terms of `CostModel.memory_by_class`."""
    from .cost import replay

    out = [(0.0, 0.0)] * cm.cluster.num_devices
    _, mems = replay(program, cm)
    for c in cm.classes:
        state = sum(s * c.ratios[k] + r for k, (s, r, _, _) in enumerate(mems))
        act = sum((sa * c.ratios[k] + ra) / c.num_gpus for k, (_, _, sa, ra) in enumerate(mems))
        for j in c.devices:
            out[j] = (state, act)
    return out
