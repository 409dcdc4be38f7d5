"""The Q<->B iteration (HAP §3.1, Eq. 1-2): alternate program synthesis and load balancing.

    B(0) = argmin_B t(Q_seed, B)      (the LP's ratios for the best data-parallel seed; HAP: flops-proportional)
    Q(s) = argmin_Q t(Q, B(s-1))      (A*, `engine.spmd.synthesis`)
    B(s) = argmin_B t(Q(s), B)        (LP, `engine.spmd.balance`)

until Q repeats (convergence or oscillation) or B does not move (the next search would run at the
same ratios); the best (Q, B) pair seen is kept. Where B moves, the next search first runs with a
narrow beam (`CONFIRM_BEAM`) and the previous Q as its incumbent: if it finds nothing better, the
loop stops there; if it does, a full search follows at the same ratios (issue 28, item 2). The data-parallel baselines
(`engine.spmd.baselines`) seed the search as incumbents, so a HAP plan is never predicted slower
than them. Starting from the seed's balance rather than HAP's flops-proportional B(0) puts the
first search at the loop's fixed point in most plans: on the paper's GPT at 12 layers, ddp and
duplex stop after one search instead of two, with the same plans (issue 28, item 2).

Overlap (`engine.spmd.overlap`): the loop runs with the cost model and the LP of one overlap mode.
`overlap="auto"` runs it in `ddp` (gradient buckets during backward), in `duplex` (HiDup's two
half-batches) and in `none`, each with its share of the time budget, and keeps the fastest
prediction (`engine.spmd.auto_modes`: the best of the three separate searches); duplex and none
win only where they predict a gain. The ddp plan is also priced with one bucket after backward
(`none`): every bucket pays a latency, so where backward is too short to hide them, not
overlapping is faster, and auto keeps that where the none search found nothing faster.

With `segments=g > 1` (§5.2) the model is cut into g segments at layer boundaries, B becomes one
ratio vector per segment, and tensors crossing a boundary are re-split by all-to-alls. The
one-segment baselines stay candidates, so segments are used only where they pay.

Pipeline stages plan their own graphs with `plan_spmd` too (`engine.pipeline.stage_plan`), which is
why the loop lives here and not in the top-level planner.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.spmd.auto_modes import AUTO_MODES, AUTO_MODES_WITHOUT_DUPLEX, best_of_none
from engine.spmd.balance import balance
from engine.spmd.baselines import (Candidate, baselines, check_total_memory, data_parallel, left_s,
                                   memory_fitted_baseline, memory_parts, memory_ratios, oom_message, priced_in,
                                   proportional_ratios, unlimited)
from engine.spmd.breakdown import Breakdown
from engine.spmd.cost import STATE_BYTES_PER_PARAM_BYTE, CostModel, evaluate
from engine.spmd.duplex_space import duplex_space
from engine.spmd.halves import halves_problem
from engine.spmd.overlap import duplex_run_problem
from engine.spmd.plan import Plan, stage_records
from engine.spmd.program import Instruction
from engine.spmd.recompute import layers as every_layer
from engine.spmd.recompute import fits, plan_recomputing, ranked_layers
from engine.spmd.segments import Segmentation, segment_graph, with_resplits
from engine.spmd.side_by_side import can_fork, run_side_by_side
from engine.spmd.sizes import realized_ratios, shard_key, shard_sizes
from engine.spmd.synthesis import SearchProgress, SearchSpace, synthesize
from engine.spmd.utilisation import peak_flops
from engine.spmd.zero import StateSharding, all_params_at, choose_stages, memory_proportional_shares, to_record

CONFIRM_BEAM = 2
"""The beam of the search that confirms a moved B (`Loop.run`). On the paper's GPT the search after
the first LP found the same program at every depth (6 to 48 layers): a full beam spent a whole
search to confirm it, a beam of 2 expands about a seventh as many states (1257 against 8914 at 24
layers). Where the narrow search finds a better program, the full search runs too, so a loop only
stops early on a program no nearby one beats."""

Progress = Callable[[SearchProgress], None]
"""Called every `options.report_every` expansions of each search (the workbench's live frontier)."""


def plan_spmd(graph: Graph, cluster: Cluster, options: PlanOptions, progress: Progress | None = None, *,
              space: SearchSpace | None = None) -> Plan:
    """Plan `graph` on `cluster` (`plan_layers`), recomputing the layers `options.recompute` chooses:
    none, all, or under `auto` the fewest that make the plan fit (`engine.spmd.recompute`)."""
    return plan_recomputing(graph, cluster, options,
                            lambda layers: plan_layers(graph, cluster, options, progress, space=space, recompute=layers),
                            lambda made, layers: _program_fits(made, cluster, options, layers),
                            lambda made, layers: _rebalanced(made, cluster, options, layers),
                            lambda: ranked_layers(CostModel(graph, cluster, [1.0 / cluster.num_devices] * cluster.num_devices,
                                                            options, recompute=frozenset(every_layer(graph)))))


def _program_fits(made: Plan, cluster: Cluster, options: PlanOptions, layers: frozenset[int]) -> bool:
    """Whether the LP finds ratios under which `made`'s program fits memory with `layers` recomputed."""
    try:
        balance(made.program, made.graph, cluster, options=options, segmentation=made.segmentation,
                overlap=made.overlap, recompute=layers, states=made.states)
    except InfeasibleError:
        return False
    return True


def _rebalanced(made: Plan, cluster: Cluster, options: PlanOptions, layers: frozenset[int]) -> Plan | None:
    """`made`'s program at the LP's ratios with `layers` recomputed (None when no ratios fit it)."""
    try:
        ratios = balance(made.program, made.graph, cluster, options=options, segmentation=made.segmentation,
                         overlap=made.overlap, recompute=layers,
                         states=made.states).by_segment
    except InfeasibleError:
        return None
    cm = CostModel(made.graph, cluster, ratios, options, made.segmentation, overlap=made.overlap, recompute=layers,
                   states=made.states)
    cand = Candidate(made.program, ratios, evaluate(made.program, cm).total_s, made.segmentation, made.overlap, layers,
                     made.states)
    return make_plan(made.strategy, made.graph, cluster, cand, options, made.history, dict(made.search))


def plan_layers(graph: Graph, cluster: Cluster, options: PlanOptions, progress: Progress | None = None, *,
                space: SearchSpace | None = None, recompute: frozenset[int] = frozenset()) -> Plan:
    """Plan `graph` on `cluster` with the layers `recompute` recomputed in backward and the Full
    weights' states sharded as `options.shard_states` says (`engine.spmd.zero`): 0 none; 1, 2 or 3 every weight at that stage; `auto` none when the plan
    fits, else the stages `choose_stages` picks (a restricted search, a pipeline stage's, stays at 0).
    The Q<->B loop itself is `plan_with_states`."""
    stage = options.shard_states
    if stage == 0:
        return plan_with_states(graph, cluster, options, progress, space=space, recompute=recompute)
    if stage != "auto":
        return plan_with_states(graph, cluster, options, progress, space=space, recompute=recompute,
                                 states=StateSharding(all_params_at(graph, stage), _memory_shares(cluster)))
    try:
        made = plan_with_states(graph, cluster, options, progress, space=space, recompute=recompute)
        if space is not None or fits(made, cluster):
            return made
    except InfeasibleError as e:
        if space is not None:
            raise
        made, why = None, e
    for stages in _auto_ladder(graph, cluster, options, recompute):
        try:
            made = plan_with_states(graph, cluster, options, progress, space=space, recompute=recompute,
                                    states=StateSharding(stages, _memory_shares(cluster)))
        except InfeasibleError as e:
            why = e
            continue
        if fits(made, cluster):
            return made
    if made is None:
        raise why
    return made  # nothing fits whole: the least overflowing plan found, as an unsharded search returns it


def _auto_ladder(graph: Graph, cluster: Cluster, options: PlanOptions,
                 recompute: frozenset[int] = frozenset()) -> list[dict[int, int]]:
    """The stages `auto` tries in turn when the unsharded plan does not fit: those `auto_stages` picks,
    then every weight at stage 3 (HAP's own sharding may make it fit where data parallelism does not)."""
    chosen = auto_stages(graph, cluster, options, recompute)
    last = all_params_at(graph, 3)
    return [chosen, last] if chosen and chosen != last else [last]


def _memory_shares(cluster: Cluster) -> tuple[float, ...]:
    return memory_proportional_shares([d.memory_bytes_per_gpu * d.num_gpus for d in cluster.devices])


def auto_stages(graph: Graph, cluster: Cluster, options: PlanOptions,
                recompute: frozenset[int] = frozenset()) -> dict[int, int] | None:
    """`shard_states=auto`'s stages: the lowest per weight, largest first, that make data parallelism
    at memory-proportional ratios fit (`engine.spmd.zero.choose_stages`); HAP's own sharding only
    lowers the memory of the plan found with them. None when nothing fits even at stage 3."""
    ratios = memory_ratios(cluster)
    try:
        program = data_parallel(graph, CostModel(graph, unlimited(cluster), ratios, options, recompute=recompute)).program
    except InfeasibleError:
        return None
    need = [sum(part) for part in memory_parts(program, CostModel(graph, cluster, ratios, options, recompute=recompute))]
    stages = choose_stages(graph, need, [d.memory_bytes_per_gpu for d in cluster.devices],
                           STATE_BYTES_PER_PARAM_BYTE[options.optimizer], _memory_shares(cluster))
    return stages if stages else None


def plan_with_states(graph: Graph, cluster: Cluster, options: PlanOptions, progress: Progress | None = None, *,
                      space: SearchSpace | None = None, states: StateSharding | None = None,
                      recompute: frozenset[int] = frozenset()) -> Plan:
    """Plan `graph` on `cluster`: the Q<->B iteration of HAP §3.1, returning the best plan found,
    with the Full weights' states kept as `states` says (None: replicated) and the layers `recompute`
    recomputed in backward.

    `options.overlap` is the overlap mode to plan in (`none`, `ddp`, `duplex`), or `auto`: plan in
    ddp, duplex and none (each with an equal share of what is left of the budget), price the ddp plan
    in none too, and keep the fastest; the plan's search stats record every mode's predicted time
    (`overlap_s`) and why one was skipped (`overlap_skipped`). `options.segments` > 1 then iterates
    again with that many runs of layers, each with its own ratios (§5.2), starting from the
    one-segment plan; the faster of the two is returned. `space` restricts the search (e.g. no
    hierarchical collectives inside a pipeline stage); the data-parallel seeds are searched in
    their own spaces."""
    modes, skipped = overlap_modes(graph, options.overlap)
    if states is not None and 3 in states.stages.values():
        modes, skipped = _without_duplex(modes, skipped, options.overlap)
    seg = segment_graph(graph, options.segments)
    start = time.perf_counter()
    deadline = None if options.time_budget_s is None else start + options.time_budget_s
    check_total_memory(graph, cluster, options)
    seeds = baselines(graph, cluster, options, deadline, recompute)
    stats: dict[str, Any] = {
        "expanded": 0, "generated": 0, "optimal": True, "iterations": 0,
        "overlap_request": options.overlap, "overlap_s": {}, "overlap_skipped": skipped}
    loop = Loop(graph, cluster, options, progress, deadline, stats=stats, space=space or SearchSpace(), recompute=recompute,
                states=states)
    stats["baselines_s"] = {k: None if c is None else loop.rank(c)[1] for k, c in seeds.items()}
    base = loop.space
    searched = [(k, mode, space) for k, mode in enumerate(modes)
                if (space := mode_space(graph, base, mode, options.overlap, skipped)) is not None]
    parallel = loop.states is None and can_fork(len(graph.nodes), len(searched))  # a ZeRO loop carries its shares on
    jobs = [partial(_mode_search, loop, mode, space, seg, list(seeds.values()), deadline,
                    None if parallel else len(modes) - k, parallel and j > 0) for j, (k, mode, space) in enumerate(searched)]
    found: dict[str, Candidate] = {}
    for j, ((_, mode, _), (cand, record)) in enumerate(zip(searched, run_side_by_side(jobs, parallel))):
        if parallel and j > 0:
            record.merge_into(loop)  # it ran in a child: its loop's records come back here
        if cand is not None:
            found[mode] = cand
            stats["overlap_s"][mode] = loop.rank(cand)[1]
    if not found:
        raise InfeasibleError(oom_message(graph, cluster, options, deadline=deadline))
    if options.overlap == "auto" and "ddp" in found:
        found["none"] = best_of_none(found.get("none"), priced_in(found["ddp"], graph, cluster, options, "none"),
                                     loop.rank)
        stats["overlap_s"]["none"] = loop.rank(found["none"])[1]
    # modes in order (ddp, duplex, none): a tie keeps the earlier, so duplex or none is chosen only for a predicted gain
    while True:
        best = min(found.values(), key=loop.rank)
        if loop.rank(best)[0] and options.recompute == "none" and options.shard_states == 0:
            raise InfeasibleError(oom_message(graph, cluster, options, deadline=deadline))  # nothing else may help
        stats["elapsed_s"] = time.perf_counter() - start
        stats["segments"] = best.segmentation.count
        made = make_plan("hap", graph, cluster, best, options, loop.history, stats)
        problem = halves_problem(made) if made.overlap == "duplex" else None
        if problem is None:
            return made
        if options.overlap == "duplex" or len(found) == 1:
            raise PlanError(f"model '{graph.name}': {problem}")
        del found["duplex"]  # its halves cannot run this program: keep the best of the other modes
        stats["overlap_skipped"]["duplex"] = problem


STAGE3_DUPLEX = ("duplex runs two half-batch streams over the same weights; ZeRO-3 gathers each weight on use, "
                 "which the runner does in one stream only")


def _without_duplex(modes: list[str], skipped: dict[str, str], overlap: str) -> tuple[list[str], dict[str, str]]:
    """The overlap modes left when some weight is at ZeRO stage 3 (no duplex)."""
    if overlap == "duplex":
        raise PlanError(f"overlap 'duplex' with shard_states 3: {STAGE3_DUPLEX}; use overlap ddp, none or auto, "
                        "or shard_states 1 or 2")
    return [m for m in modes if m != "duplex"], {**skipped, "duplex": STAGE3_DUPLEX} if "duplex" in modes else skipped


def mode_space(graph: Graph, space: SearchSpace, mode: str, overlap: str,
               skipped: dict[str, str]) -> SearchSpace | None:
    """The search space of one overlap mode: `space`, narrowed in duplex to the programs its half
    streams can run (`engine.spmd.duplex_space`; it captures the model at half the batch, in
    duplex's share of the budget). Where duplex has none, `auto` records why in `skipped` and gets
    None; a forced duplex is refused with the reason."""
    if mode != "duplex":
        return space
    try:
        return duplex_space(graph, space)
    except PlanError as e:
        if overlap == "duplex":
            raise PlanError(f"model '{graph.name}': {e}") from None
        skipped["duplex"] = str(e)
        return None


def overlap_modes(graph: Graph, overlap: str) -> tuple[list[str], dict[str, str]]:
    """The overlap modes to plan in for `overlap`, and the modes `auto` skips with the reason
    (duplex for a model whose half batches would not compute the same, e.g. training-mode BatchNorm)."""
    problem = duplex_run_problem(graph) if overlap in ("auto", "duplex") else None
    if overlap == "duplex" and problem:
        raise PlanError(f"model '{graph.name}': {problem}")
    if overlap == "auto":
        return (list(AUTO_MODES_WITHOUT_DUPLEX), {"duplex": problem}) if problem else (list(AUTO_MODES), {})
    return [overlap], {}


@dataclass
class ModeRecord:
    """What one mode's search added to its loop's records, to merge into the parent's loop when it ran in a
    child process (`engine.spmd.side_by_side`): renumbered as if it had run after the modes before it."""

    start_iteration: int
    history: list[dict[str, Any]]
    iterations: int
    expanded: int
    generated: int
    optimal: bool
    frontier: list[dict[str, Any]]

    @staticmethod
    def since(loop: "Loop", iteration: int, history: int, expanded: int, generated: int, frontier: int) -> "ModeRecord":
        s = loop.stats
        return ModeRecord(iteration, loop.history[history:], s["iterations"] - iteration, s["expanded"] - expanded,
                          s["generated"] - generated, s["optimal"], s.get("frontier", [])[frontier:])

    def merge_into(self, loop: "Loop") -> None:
        shift = loop.stats["iterations"] - self.start_iteration
        loop.history.extend({**h, "iteration": h["iteration"] + shift} for h in self.history)
        s = loop.stats
        s["iterations"] += self.iterations
        s["expanded"] += self.expanded
        s["generated"] += self.generated
        s["optimal"] = s["optimal"] and self.optimal
        s.setdefault("frontier", []).extend(self.frontier)


def _mode_search(loop: "Loop", mode: str, space: SearchSpace, seg: Segmentation, seeds: list[Candidate | None],
                 deadline: float | None, modes_left: int | None, in_child: bool) -> tuple[Candidate | None, ModeRecord]:
    """One overlap mode's best plan (`_plan_in`) in `space`, with `modes_left` modes (this one included) left
    to share the budget when they run in turn; side by side (`modes_left` None) each has all of it, and one
    `in_child` reports no progress (the parent's mode does)."""
    s = loop.stats
    marks = (s["iterations"], len(loop.history), s["expanded"], s["generated"], len(s.get("frontier", [])))
    loop.space = space
    if in_child:
        loop.progress = None
    share = deadline
    if deadline is not None and modes_left is not None:
        share = time.perf_counter() + (deadline - time.perf_counter()) / modes_left
    cand = _plan_in(mode, loop, seg, seeds, share)
    return cand, ModeRecord.since(loop, *marks)


def _plan_in(mode: str, loop: "Loop", seg: Segmentation, seeds: list[Candidate | None],
             deadline: float | None) -> Candidate | None:
    """The best plan of the Q<->B loop in one overlap mode, seeded with the baselines priced in it;
    asked for segments, the one-segment loop gets half of `deadline`'s time, so the segmented one still runs."""
    graph, cluster, options = loop.graph, loop.cluster, loop.options
    unique = {id(c): c for c in seeds if c is not None}.values()
    priced = [priced_in(replace(c, states=loop.states), graph, cluster, options, mode) for c in unique]
    if not priced:
        priced = [c for c in [memory_fitted_baseline(graph, cluster, options, mode, deadline, loop.recompute)]
                  if c is not None]
    best = min(priced, key=lambda c: c.cost, default=None)
    now = time.perf_counter()
    loop.overlap = mode
    loop.deadline = deadline if seg.count == 1 or deadline is None else now + (deadline - now) / 2
    best = loop.run(Segmentation.single(graph), first_ratios(loop, best), best)
    if seg.count > 1 and best is not None:
        loop.deadline = deadline
        best = loop.run(seg, [best.ratios[0]] * seg.count, best, with_resplits(best.program, seg, graph))
    if best is None:
        return None
    if loop.rank(best)[0]:
        best = _refit(loop, best) or best
    return min([best, *priced], key=loop.rank)  # whole units may reorder them


def first_ratios(loop: "Loop", seed: Candidate | None) -> list[list[float]]:
    """B(0) of the loop: the LP's ratios for the best seed program, where they fit (HAP §3.1 starts from
    ratios proportional to the devices' flops; starting from the seed's balance instead, the first
    search is usually at the loop's fixed point already, which the loop then stops at)."""
    if seed is not None:
        ratios = loop.memory_feasible_ratios(seed.program, Segmentation.single(loop.graph))
        if ratios is not None:
            return ratios
    return [proportional_ratios(loop.cluster)]


def _refit(loop: "Loop", cand: Candidate) -> Candidate | None:
    """`cand`'s program at the LP's memory-respecting ratios, for a candidate that overflows a device
    at its own ratios (the search bounds memory per rule, the replay counts it per instruction, and
    whole units round the ratios): None when no ratios fit it or they still overflow."""
    ratios = loop.memory_feasible_ratios(cand.program, cand.segmentation)
    if ratios is None:
        return None
    cost = evaluate(cand.program, loop.cost_model(ratios, cand.segmentation)).total_s
    moved = replace(cand, ratios=ratios, cost=cost, states=loop.states)
    return None if loop.rank(moved)[0] else moved


@dataclass
class Loop:
    """The Q<->B iteration for one segmentation, recording history and search statistics."""

    graph: Graph
    cluster: Cluster
    options: PlanOptions
    progress: Progress | None
    deadline: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    overlap: str = "none"
    """The overlap mode the cost model and the LP price in."""
    space: SearchSpace = SearchSpace()
    """What the search may use (all of the theory, unless a caller restricts it)."""
    recompute: frozenset[int] = frozenset()
    """The layers recomputed in backward (`engine.spmd.recompute`)."""

    states: StateSharding | None = None
    """Stages of the Full weights' states and the shares of the last LP (`engine.spmd.zero`); None: stage 0."""
    ranks: dict[int, tuple[Candidate, tuple[bool, float]]] = field(default_factory=dict)
    """`rank`'s answers by candidate (kept with it, so its id stays its own)."""

    def rank(self, cand: Candidate) -> tuple[bool, float]:
        """`realized_rank` of `cand`, computed once: the modes' candidates are compared several times each."""
        if id(cand) not in self.ranks:
            self.ranks[id(cand)] = cand, realized_rank(self.graph, self.cluster, cand, self.options)
        return self.ranks[id(cand)][1]

    def cost_model(self, ratios: list[list[float]], seg: Segmentation) -> CostModel:
        return CostModel(self.graph, self.cluster, ratios, self.options, seg, overlap=self.overlap,
                         recompute=self.recompute, states=self.states)

    def run(self, seg: Segmentation, ratios: list[list[float]], best: Candidate | None,
            incumbent: tuple[Instruction, ...] | None = None) -> Candidate | None:
        incumbent = incumbent or (best.program if best is not None and best.segmentation.count == 1 else None)
        seen: set = set()
        rebalanced = False
        full = self.options.beam_width
        width = full  # the next search's beam: the options' own, or CONFIRM_BEAM to confirm a moved B
        iterations = 0  # full searches: `max_iterations` bounds them
        while iterations < self.options.max_iterations:
            if best is not None and self.deadline is not None and time.perf_counter() > self.deadline:
                break  # the budget is spent: no new Q<->B iteration, keep the best found
            it = self.stats["iterations"]  # searches so far, over every mode and segmentation: tags stay 0, 1, 2, ...
            report = None if self.progress is None else (lambda p, it=it: self.progress(_tag(p, it)))
            try:
                res = synthesize(self.graph, self.cost_model(ratios, seg), space=self.space,
                                 time_budget_s=left_s(self.deadline), progress=report,
                                 beam_width=width, incumbent=incumbent,
                                 report_every=self.options.report_every)
            except InfeasibleError:  # nothing fits under these ratios: let the LP (memory constraints) move them once
                moved = None if incumbent is None or rebalanced else self.memory_feasible_ratios(incumbent, seg)
                if moved is None:
                    break  # keep the best found (or explain in plan())
                ratios, rebalanced, width = moved, True, full
                iterations += 1
                continue
            _accumulate(self.stats, res)
            self._record(it, "Q", res.cost, ratios, seg, expanded=res.expanded, beam_width=width)
            best = _better(best, Candidate(res.program, ratios, res.cost, seg, self.overlap, self.recompute, self.states))
            key = tuple(res.program)
            if width != full:
                if incumbent is not None and key == tuple(incumbent):
                    break  # confirmed: no nearby program beats the incumbent at the moved ratios
                width, incumbent = full, res.program  # a better one is near: search here in full
                continue
            iterations += 1
            if key in seen:
                break
            seen.add(key)
            moved = self.memory_feasible_ratios(res.program, seg)
            if moved is None:
                break  # this program cannot fit under any ratios; keep the best found
            cost = evaluate(res.program, self.cost_model(moved, seg)).total_s
            self._record(it, "B", cost, moved, seg)
            best = _better(best, Candidate(res.program, moved, cost, seg, self.overlap, self.recompute, self.states))
            if same_ratios(moved, ratios):
                break  # B did not move: the next search would run at the same ratios (the loop's fixed point, issue 28)
            ratios, incumbent = moved, res.program
            if full is not None and full > CONFIRM_BEAM:
                width = CONFIRM_BEAM
        return best

    def memory_feasible_ratios(self, program: tuple[Instruction, ...], seg: Segmentation) -> list[list[float]] | None:
        """The LP's ratios for `program` (Eq. 2), which respect every device's memory; None if none do."""
        try:
            res = balance(program, self.graph, self.cluster, options=self.options, segmentation=seg,
                          time_limit_s=left_s(self.deadline) or 30.0, overlap=self.overlap,
                          recompute=self.recompute, states=self.states)
        except InfeasibleError:
            return None
        if self.states is not None:
            self.states = self.states.with_shares(res.shares)
        return res.by_segment

    def _record(self, it: int, step: str, cost: float, ratios: list[list[float]], seg: Segmentation,
                **extra: Any) -> None:
        """One history record (a Q step also records the states its search expanded and its beam: how
        much each Q<->B iteration costs, and which searches were confirmations, issue 28)."""
        self.history.append({"iteration": it, "step": step, "predicted_time_s": cost, "ratios": ratios,
                             "segments": seg.count, "overlap": self.overlap, **extra})


def same_ratios(a: list[list[float]], b: list[list[float]], rel: float = 1e-9) -> bool:
    """Whether two ratio tables are the same up to the LP's rounding (`rel` of the larger share)."""
    return len(a) == len(b) and all(len(x) == len(y) and all(abs(p - q) <= rel * max(abs(p), abs(q), 1e-12)
                                                            for p, q in zip(x, y)) for x, y in zip(a, b))


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
            *, options: PlanOptions = PlanOptions(), segmentation: Segmentation | None = None, strategy: str = "hap",
            overlap: str = "none", recompute: frozenset[int] = frozenset()) -> Plan:
    """The Plan of a given program and ratios (one flat list, or one row per segment) priced in
    `overlap` with the layers `recompute` recomputed: for programs made by hand or by a restricted
    search, e.g. in tests and ablations."""
    seg = segmentation or Segmentation.single(graph)
    cm = CostModel(graph, cluster, ratios, options, seg, overlap=overlap, recompute=frozenset(recompute))
    cand = Candidate(program, cm.ratios, evaluate(program, cm).total_s, seg, overlap, frozenset(recompute))
    return make_plan(strategy, graph, cluster, cand, options, [], {})


def breakdown_of(the_plan: Plan, cluster: Cluster) -> Breakdown:
    """The cost model's breakdown of a plan on `cluster` at the plan's ratios and in its overlap
    mode: per stage and device, the buckets and the tail (what the Timeline page draws)."""
    cm = CostModel(the_plan.graph, cluster, the_plan.ratio_rows, the_plan.options, the_plan.segmentation,
                   overlap=the_plan.overlap, recompute=frozenset(the_plan.recompute), states=the_plan.states)
    return evaluate(the_plan.program, cm)


def realized(graph: Graph, cluster: Cluster, cand: Candidate, options: PlanOptions):
    """(integer shard sizes, realized ratios, cost-model breakdown at them) of a candidate: what the
    runner will execute, so the plan predicts the time of its whole units, not of the LP's fractions."""
    seg = cand.segmentation
    sizes = shard_sizes(cand.program, graph, cand.ratios, seg)
    ratios = realized_ratios(graph, sizes, cand.ratios)
    return sizes, ratios, evaluate(cand.program, CostModel(graph, cluster, ratios, options, seg, overlap=cand.overlap,
                                                           recompute=cand.recompute, states=cand.states))


def realized_rank(graph: Graph, cluster: Cluster, cand: Candidate, options: PlanOptions) -> tuple[bool, float]:
    """(overflows a device at whole units, predicted time): rounding the LP's ratios to whole units
    can push a device past its memory, so a candidate that still fits comes first."""
    b = realized(graph, cluster, cand, options)[2]
    over = any(m > d.memory_bytes_per_gpu for m, d in zip(b.memory_bytes, cluster.devices))
    return over, b.total_s


def make_plan(strategy: str, graph: Graph, cluster: Cluster, cand: Candidate, options: PlanOptions,
              history: list[dict[str, Any]], stats: dict[str, Any]) -> Plan:
    """The Plan of a candidate at whole units, recording the options it was planned with."""
    seg = cand.segmentation
    int_sizes, ratios, b = realized(graph, cluster, cand, options)
    sizes = {shard_key(graph, seg, t, d, k): s for (t, d, k), s in int_sizes.items()}
    return Plan(strategy=strategy, graph=graph, cluster_name=cluster.name, cluster_fingerprint=cluster.fingerprint(),
                device_names=[d.name for d in cluster.devices], machines=[d.machine for d in cluster.devices],
                program=cand.program,
                ratios={str(k): list(r) for k, r in enumerate(ratios)}, shard_sizes=sizes, predicted_time_s=b.total_s,
                stages=stage_records(b, graph), memory_bytes=b.memory_bytes, history=history,
                search={**stats, "optimizer": options.optimizer, "options": options.to_dict()},
                segment_of=list(seg.of_node) if seg.count > 1 else [], overlap=cand.overlap,
                peak_flops=peak_flops(cluster, options.precision),
                recompute=sorted(cand.recompute),
                shard_states=to_record(graph, cand.program, cand.states))
