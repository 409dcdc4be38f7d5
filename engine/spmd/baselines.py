"""Data parallelism inside HAP's search space: the baselines and the seeds of the Q<->B loop.

The data-parallel baselines are programs of the same search space as HAP's (parameters Full,
inputs sharded on the batch dim, no other communication), so they seed the search as incumbents:
a HAP plan is never predicted slower than them. They are priced as PyTorch DDP runs them, gradient
buckets overlapped with backward (`BASELINE_OVERLAP`). When even and proportional splits overflow a
small device, data parallelism at the LP's memory-respecting ratios is the seed instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from engine import limits
from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError
from engine.model.graph import Graph, Node
from engine.options import DEFAULT_BEAM_WIDTH, PlanOptions
from engine.spmd.balance import balance, gib
from engine.spmd.cost import STATE_BYTES_PER_PARAM_BYTE, CostModel, evaluate, replay
from engine.spmd.program import Instruction
from engine.spmd.segments import Segmentation
from engine.spmd.synthesis import SearchResult, SearchSpace, synthesize
from engine.spmd.zero import StateSharding
from engine.theory.core import FULL

BASELINES = ("ddp", "dp-even", "dp-proportional")
"""`ddp`: data parallelism as PyTorch DDP runs it (even shares, 25 MiB gradient buckets overlapped
with backward); `dp-even` / `dp-proportional`: even / flops-proportional shares, priced the same way.
`ddp` and `dp-even` are the same program at the same shares: `ddp` is the name users look for."""
BASELINE_OVERLAP = "ddp"
"""How every baseline is priced: what users compare against is DDP as it runs."""


@dataclass
class Candidate:
    """A program Q with its ratios B (one row per segment), priced in one overlap mode."""

    program: tuple[Instruction, ...]
    ratios: list[list[float]]
    """One row per segment."""
    cost: float
    segmentation: Segmentation
    overlap: str = "none"
    """The overlap mode `cost` is priced in."""
    recompute: frozenset[int] = frozenset()
    """The layers recomputed in backward (`engine.spmd.recompute`) that `cost` is priced with."""
    states: StateSharding | None = None
    """Stages and shares of the Full weights' states (`engine.spmd.zero`); None: none sharded."""


def proportional_ratios(cluster: Cluster) -> list[float]:
    """Shares proportional to each device's FLOP/s: HAP's B(0) (§3.1) and dp-proportional's split."""
    total = sum(cluster.flops)
    return [f / total for f in cluster.flops]


def even_ratios(cluster: Cluster) -> list[float]:
    return [1.0 / cluster.num_devices] * cluster.num_devices


def memory_ratios(cluster: Cluster) -> list[float]:
    """Ratios proportional to each device's memory: the split under which data parallelism fits best."""
    total = sum(d.memory_bytes_per_gpu * d.num_gpus for d in cluster.devices)
    return [d.memory_bytes_per_gpu * d.num_gpus / total for d in cluster.devices]


def baseline_ratios(cluster: Cluster, strategy: str) -> list[float]:
    """The shares of a baseline: even for `ddp` and `dp-even`, proportional to flops for `dp-proportional`."""
    return proportional_ratios(cluster) if strategy == "dp-proportional" else even_ratios(cluster)


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


def replicated_space() -> SearchSpace:
    """Every leaf Full and nothing communicated: each device runs the whole single-device model
    (on one device, that model as it is, for any batch size, 1 included)."""
    return SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f == FULL,
                       collectives=frozenset())


_SEARCHED: dict[tuple, tuple[Graph, Cluster, SearchResult]] = {}
"""The last data-parallel searches of this process by (graph, cluster, ratios, options, overlap, recompute):
a plan seeds its loop with the baselines, then the CLI and the Compare page price the same baselines
again; each is searched once (a gathering search on a 2,700-node Mamba takes seconds)."""
SEARCHES_KEPT = 16


def data_parallel(graph: Graph, cm: CostModel, deadline: float | None = None) -> SearchResult:
    """The data-parallel program under `cm`: plain when every operator splits on the batch, else
    with all-gathers before the operators that cannot, else every device running the whole model
    (a program whenever every operator has its all-Full rule, as opaque ones do and memory allows).
    The gathering space is searched with a beam: exactly, it has as many programs as ways to place
    the gathers (BART-base-sized graphs took minutes). InfeasibleError says why there is none;
    each search stops at `deadline` (time.perf_counter) with the best program it has. A search
    without a deadline is kept for the process (`_SEARCHED`)."""
    if cm.states is not None:  # the seeds and baselines keep every state replicated
        return _search_data_parallel(graph, cm, deadline)
    key = (id(graph), id(cm.cluster), tuple(map(tuple, cm.ratios)), cm.options, cm.overlap, cm.recompute,
           cm.segmentation)
    kept = _SEARCHED.get(key)
    if kept is not None and kept[0] is graph and kept[1] is cm.cluster:
        return kept[2]
    res = _search_data_parallel(graph, cm, deadline)
    if deadline is None:
        if len(_SEARCHED) >= SEARCHES_KEPT:
            del _SEARCHED[next(iter(_SEARCHED))]
        _SEARCHED[key] = (graph, cm.cluster, res)
    return res


def _search_data_parallel(graph: Graph, cm: CostModel, deadline: float | None) -> SearchResult:
    """`data_parallel`'s searches, from the plainest space to the widest."""
    try:
        return synthesize(graph, cm, space=data_parallel_space(graph), time_budget_s=left_s(deadline))
    except InfeasibleError:
        pass
    try:
        return synthesize(graph, cm, space=data_parallel_space(graph, gather=True), beam_width=DEFAULT_BEAM_WIDTH,
                          time_budget_s=left_s(deadline))
    except InfeasibleError:
        return synthesize(graph, cm, space=replicated_space(), time_budget_s=left_s(deadline))


def unsplittable_input(graph: Graph) -> Node | None:
    """The first input whose dim 0 cannot be split (size below 2, or a scalar): data parallelism has no program then."""
    return next((n for n in graph.placeholders if not n.shape or n.shape[0] < 2), None)


def baseline_candidate(graph: Graph, cluster: Cluster, ratios: list[float], options: PlanOptions,
                       deadline: float | None = None, recompute: frozenset[int] = frozenset()) -> Candidate | None:
    """A data-parallel baseline at `ratios`, priced as DDP runs (`BASELINE_OVERLAP`); None when it
    does not fit or no input can be split on the batch (the everything-replicated program is no
    data parallelism: the memory-fitted seed still offers it to the search)."""
    if unsplittable_input(graph) is not None:
        return None
    cm = CostModel(graph, cluster, ratios, options, overlap=BASELINE_OVERLAP, recompute=recompute)
    try:
        res = data_parallel(graph, cm, deadline)
    except InfeasibleError:
        return None
    return Candidate(res.program, [ratios], res.cost, Segmentation.single(graph), BASELINE_OVERLAP, recompute)


def baselines(graph: Graph, cluster: Cluster, options: PlanOptions, deadline: float | None,
              recompute: frozenset[int] = frozenset()) -> dict[str, Candidate | None]:
    """The data-parallel baselines priced as DDP runs (recomputing the layers `recompute`); `ddp` is
    `dp-even` (same program, shares and pricing)."""
    even = baseline_candidate(graph, cluster, even_ratios(cluster), options, deadline, recompute)
    return {"ddp": even, "dp-even": even,
            "dp-proportional": baseline_candidate(graph, cluster, proportional_ratios(cluster), options, deadline,
                                                  recompute)}


def memory_fitted_baseline(graph: Graph, cluster: Cluster, options: PlanOptions, overlap: str,
                           deadline: float | None = None, recompute: frozenset[int] = frozenset()) -> Candidate | None:
    """Data parallelism at the LP's ratios, which respect every device's memory: the plan that
    exists whenever the model fits data-parallel at all, e.g. when even and proportional splits
    overflow a small device. None when no ratios fit."""
    try:
        cm = CostModel(graph, unlimited(cluster), proportional_ratios(cluster), options, overlap=overlap, recompute=recompute)
        program = data_parallel(graph, cm, deadline).program
        ratios = balance(program, graph, cluster, options=options, time_limit_s=left_s(deadline) or 30.0,
                         overlap=overlap, recompute=recompute).by_segment
    except InfeasibleError:
        return None
    cost = evaluate(program, CostModel(graph, cluster, ratios, options, overlap=overlap, recompute=recompute)).total_s
    return Candidate(program, ratios, cost, Segmentation.single(graph), overlap, recompute)


def priced_in(cand: Candidate, graph: Graph, cluster: Cluster, options: PlanOptions, overlap: str) -> Candidate:
    """The same program and ratios priced in another overlap mode (a baseline seeding that mode's search)."""
    cm = CostModel(graph, cluster, cand.ratios, options, cand.segmentation, overlap=overlap, recompute=cand.recompute,
                   states=cand.states)
    return replace(cand, cost=evaluate(cand.program, cm).total_s, overlap=overlap)


def unlimited(cluster: Cluster) -> Cluster:
    """The cluster with (practically) unlimited memory per GPU: to find a program memory rules out."""
    return Cluster.from_dict({**cluster.to_dict(), "devices": [
        {**d.to_dict(), "memory_bytes_per_gpu": limits.MAX_MEMORY_BYTES} for d in cluster.devices]})


def left_s(deadline: float | None) -> float | None:
    """Seconds left before the deadline (at least 0.05, so a late step still returns its best), or None."""
    return None if deadline is None else max(0.05, deadline - time.perf_counter())


def check_total_memory(graph: Graph, cluster: Cluster, options: PlanOptions) -> None:
    """Fail fast when even a perfect split of all state and activations cannot fit the cluster."""
    state = sum(n.nbytes for n in graph.parameters) * STATE_BYTES_PER_PARAM_BYTE[options.optimizer]
    capacity = sum(d.memory_bytes_per_gpu * d.num_gpus for d in cluster.devices)
    if state > capacity:
        raise InfeasibleError(f"out of memory: the model's parameters, gradients and {options.optimizer} state need "
                              f"{gib(state)} but the whole cluster has {gib(capacity)}; "
                              "add devices or shrink the model")


def oom_message(graph: Graph, cluster: Cluster, options: PlanOptions, strategy: str | None = None,
                ratios: list[float] | None = None, *, deadline: float | None = None) -> str:
    """Why nothing fits: the node data parallelism cannot run and why, or the device whose memory
    even data parallelism overflows most, with its bytes needed and held and what they are."""
    what = "no program" if strategy is None else f"no {strategy} program"
    split = "in proportion to device memory" if ratios is None else f"as {strategy} does"
    ratios = ratios or memory_ratios(cluster)
    try:
        res = data_parallel(graph, CostModel(graph, unlimited(cluster), ratios, options), deadline)
    except InfeasibleError as e:
        return f"{what}: {e}"
    cm = CostModel(graph, cluster, ratios, options)
    parts = memory_parts(res.program, cm)
    j = max(range(len(parts)), key=lambda i: sum(parts[i]) - cluster.devices[i].memory_bytes_per_gpu)
    state, act = parts[j]
    return (f"out of memory: device '{cluster.devices[j].name}' needs {gib(state + act)} but has "
            f"{gib(cluster.devices[j].memory_bytes_per_gpu)} even data-parallel with the batch split {split} "
            f"(parameters, gradients and {options.optimizer} state {gib(state)}, activations {gib(act)}); "
            f"use a smaller batch, more or larger devices, or optimizer='sgd'{_memory_options_hint(options)}")


def _memory_options_hint(options: PlanOptions) -> str:
    """The memory-saving options the plan was kept from using (issue 26), as a hint's tail."""
    off = [f"{name}='auto'" for name, value, idle in (("recompute", options.recompute, "none"),
                                                       ("shard_states", options.shard_states, 0)) if value == idle]
    return f", or {' and '.join(off)} (recompute activations, shard optimizer states)" if off else ""


def memory_parts(program: tuple[Instruction, ...], cm: CostModel) -> list[tuple[float, float]]:
    """Per device, the predicted peak bytes per GPU split into (parameters, gradients and optimizer
    state; activations kept for backward): the two terms of `CostModel.memory_by_class`."""
    out = [(0.0, 0.0)] * cm.cluster.num_devices
    _, mems = replay(program, cm)
    for c, z in zip(cm.classes, cm.shares):
        state = sum(s * c.ratios[k] + r + zs * z for k, (s, r, _, _, zs) in enumerate(mems)) + cm.transient_bytes
        act = sum((sa * c.ratios[k] + ra) / c.num_gpus for k, (_, _, sa, ra, _) in enumerate(mems))
        for j in c.devices:
            out[j] = (state, act)
    return out
