"""The planner: one entry for every kind of plan, the baselines, and one loader for both kinds.

`plan(model, cluster, ...)` builds one `PlanOptions` and dispatches on `options.parallelism`:
`spmd` (default) is HAP's Q<->B iteration (`engine.spmd.iteration.plan_spmd`); `pipeline` is
HAPT's stage partitioning with HAP inside every stage (`engine.pipeline.hapt.plan_pipeline`); `auto`
plans both and keeps the faster prediction (SPMD on a tie). When the pipeline it keeps leaves devices
idle, `auto` also prices SPMD on each sub-cluster the pipeline uses and on its own devices
(`spmd_alternatives`), so the pipeline's speed-up is against the best SPMD plan on the same hardware. Both kinds implement `AnyPlan`, and
`load_plan` reads either back, validated.

The baselines (`ddp`, `dp-even`, `dp-proportional`, `evaluate`) are data parallelism priced as
PyTorch DDP runs it, by the same cost model (`engine.spmd.baselines`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from engine.cluster.spec import Cluster, load_cluster
from engine.errors import InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import PARALLELISMS, PlanOptions, options_of
from engine.pipeline.hapt import plan_pipeline
from engine.pipeline.plan import PIPELINE_PLAN_KIND, PipelinePlan, pipeline_plan_from_dict
from engine.pipeline.stage_cost import group_cluster, sub_clusters
from engine.spmd.baselines import (BASELINE_OVERLAP, BASELINES, Candidate, baseline_ratios, data_parallel, oom_message,
                                   unsplittable_input)
from engine.spmd.cost import CostModel
from engine.spmd.iteration import Progress, make_plan, plan_spmd
from engine.spmd.plan import PLAN_KIND, Plan, read_plan_json
from engine.spmd.precision import check_rates
from engine.spmd.segments import Segmentation
from engine.spmd.utilisation import DeviceUse, Utilisation, name_runs
from engine.spmd.validate import _shown, plan_from_dict

__all__ = ["AnyPlan", "plan", "evaluate", "load_plan", "spmd_alternatives", "SpmdAlternative", "BASELINES",
           "PARALLELISMS", "PARALLELISM_MEANING", "OVERLAP_MEANING"]

PARALLELISM_MEANING = {"spmd": "every device runs every layer on its share of the batch (HAP)",
                       "pipeline": "layers in stages on device groups, microbatches through them (HAPT)"}
"""One line per kind of plan, for reports."""
OVERLAP_MEANING = {"none": "gradients all-reduced after backward", "ddp": "gradient buckets all-reduced during backward",
                   "duplex": "two half-batches, one's communication overlapped with the other's computation (HiDup)"}
"""One line per overlap mode, for reports."""


class AnyPlan(Protocol):
    """What every kind of plan offers (`engine.spmd.plan.Plan`, `engine.pipeline.plan.PipelinePlan`):
    the CLI, the runner's entry, the bundle and the workbench use this and branch on `parallelism`
    only where the behaviour really differs."""

    parallelism: str
    """"spmd" or "pipeline"."""
    search: dict[str, Any]
    """What the planner recorded: the options it was made with, predictions of the kinds and modes it tried."""
    graph: Graph
    """The captured model the plan was made for (embedded in its JSON)."""
    device_names: Any
    cluster_name: str
    cluster_fingerprint: str

    @property
    def predicted_time_s(self) -> float: ...

    @property
    def world_size(self) -> int: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def options(self) -> PlanOptions: ...

    peak_flops: float | None
    """Summed FLOP/s of the plan's devices in its precision (None in plans written before it was recorded)."""

    @property
    def utilisation(self) -> Utilisation: ...

    @property
    def device_use(self) -> DeviceUse:
        """The devices the plan runs work on and those it leaves idle."""
        ...

    @property
    def compute_bound_s(self) -> float | None: ...

    @property
    def mfu(self) -> float | None: ...

    def to_dict(self) -> dict[str, Any]: ...

    def to_json(self, indent: int | None = 1) -> str: ...

    def save(self, path: str | Path) -> None: ...

    def listing(self) -> str: ...

    def summary(self) -> str: ...


def load_plan(source: str | Path | dict[str, Any]) -> Plan | PipelinePlan:
    """A plan of either kind from a file path, its JSON text or its dict, validated (the schema, and
    the program replayed against the theory); PlanError naming the first problem."""
    d = source if isinstance(source, dict) else read_plan_json(source)
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == PIPELINE_PLAN_KIND:
        return pipeline_plan_from_dict(d)
    if kind == PLAN_KIND:
        return plan_from_dict(d)
    raise PlanError(f"not a plan: \"kind\" is {_shown(kind)}, expected \"{PLAN_KIND}\" or \"{PIPELINE_PLAN_KIND}\" "
                    "(make one with `hap plan`)")


def coerce(model: Any, cluster: Any) -> tuple[Graph, Cluster]:
    """The graph of `model` (a Graph, or anything `engine.load_model` takes) and the cluster of `cluster`."""
    from engine.model.source import load_model  # torch is imported on first use: checking options must not wait

    return (model if isinstance(model, Graph) else load_model(model)), load_cluster(cluster)


def plan(model: Any, cluster: Any, time_budget_s: float | None = None, progress: Progress | None = None, *,
         options: PlanOptions | None = None, **option_values: Any) -> Plan | PipelinePlan:
    """Plan `model` on `cluster`. The options are `options` (a `PlanOptions`) with any of its fields
    given by keyword on top (`overlap="ddp"`, `parallelism="auto"`, `microbatches=4`, ...); a bad one
    raises one `PlanError` line naming it and its allowed values, before any work.

    `spmd` returns the SPMD `Plan`; `pipeline` the `PipelinePlan` with HAP's plan inside every stage;
    `auto` both, returning the faster prediction (SPMD on a tie). The pipeline DP has no deadline;
    the stages' searches share the budget (half of it under `auto`, which runs the pipeline first and
    gives the SPMD search what is left, at least 0.05 s). The returned plan records the options in
    `search["options"]`, every kind planned and its predicted time in `search["parallelism_s"]`, and
    why a kind has no plan in `search["parallelism_skipped"]` (e.g. no pipeline fits memory)."""
    if time_budget_s is not None:
        option_values["time_budget_s"] = time_budget_s
    opts = options_of(options, **option_values)
    graph, cluster = coerce(model, cluster)
    check_rates(cluster, opts.precision)  # before any search: a device with no rate in the plan's dtype
    if opts.parallelism == "spmd":
        return plan_spmd(graph, cluster, opts, progress)
    if opts.shard_states in (1, 2, 3):
        raise PlanError(f"shard_states {opts.shard_states} applies to SPMD plans; use parallelism='spmd' (a pipeline's "
                        "stages keep their weights' states whole; shard_states 'auto' plans them at stage 0)")
    start = time.perf_counter()
    if opts.parallelism == "pipeline":
        pipe = plan_pipeline(graph, cluster, opts)
        return _with_search(pipe, graph, cluster, opts, {
            "parallelism_request": "pipeline", "parallelism_s": {"pipeline": pipe.predicted_s},
            "parallelism_skipped": {"spmd": "parallelism='pipeline' plans a pipeline only; 'auto' compares it with SPMD"}})
    return _plan_auto(graph, cluster, opts, progress, start)


def _plan_auto(graph: Graph, cluster: Cluster, options: PlanOptions, progress: Progress | None,
               start: float) -> Plan | PipelinePlan:
    """The faster of the best pipeline and the best SPMD plan; the pipeline DP first (no deadline),
    then the SPMD search in what is left of the budget. Either kind may have no plan (InfeasibleError):
    the other is returned with the reason recorded; with neither, the SPMD error is raised. A pipeline that
    leaves devices idle is also measured against SPMD on the hardware it uses (`SPMD_ON`): the time left is
    shared among those searches."""
    skipped: dict[str, str] = {}
    budget = options.time_budget_s
    try:
        pipe = plan_pipeline(graph, cluster, options.with_budget(None if budget is None else budget / 2))
    except InfeasibleError as e:
        pipe, skipped["pipeline"] = None, str(e)
    idle_sets = _pipeline_device_sets(cluster, pipe) if pipe is not None else []
    left = _left(budget, start, 2 if idle_sets else 1)
    try:
        spmd = plan_spmd(graph, cluster, replace(options, time_budget_s=left, microbatches=None), progress)
    except InfeasibleError as e:
        if pipe is None:
            raise
        spmd, skipped["spmd"] = None, str(e)
    times = {k: p.predicted_time_s for k, p in (("spmd", spmd), ("pipeline", pipe)) if p is not None}
    stats = {"parallelism_request": "auto", "parallelism_s": times, "parallelism_skipped": skipped}
    if spmd is not None and (pipe is None or spmd.predicted_time_s <= pipe.predicted_s):
        spmd.search.update({**stats, "options": options.to_dict(), "parallelism_elapsed_s": time.perf_counter() - start})
        return spmd
    assert pipe is not None
    stats[SPMD_ON] = [_spmd_on(graph, cluster, devices, replace(options, time_budget_s=_left(budget, start, len(idle_sets) - k),
                                                                microbatches=None))
                      for k, devices in enumerate(idle_sets)]
    return _with_search(pipe, graph, cluster, options, {**stats, "parallelism_elapsed_s": time.perf_counter() - start})


SPMD_ON = "spmd_on_devices"
"""Key of `search` where `auto` records SPMD priced on the hardware a pipeline uses, when the pipeline leaves
devices idle: a list of {"devices": [names], "predicted_time_s": seconds} or {"devices", "skipped": why}."""


def _left(budget: float | None, start: float, searches: int) -> float | None:
    """A fair share of what is left of the time budget for the next of `searches` searches (at least 0.05 s)."""
    return None if budget is None else max(0.05, (budget - (time.perf_counter() - start)) / max(1, searches))


def _pipeline_device_sets(cluster: Cluster, pipe: PipelinePlan) -> list[tuple[int, ...]]:
    """When `pipe` leaves devices idle: each sub-cluster its stages use, and the devices it uses, as rank tuples
    (each once, the whole cluster left out: SPMD on it is priced anyway). Empty when it uses every device."""
    used = tuple(sorted({j for s in pipe.stages for j in s.devices}))
    if len(used) == cluster.num_devices:
        return []
    names = {s.sub_cluster for s in pipe.stages}
    sets = [sub.devices for sub in sub_clusters(cluster) if sub.name in names] + [used]
    return [d for d in dict.fromkeys(sets) if len(d) < cluster.num_devices]


def _spmd_on(graph: Graph, cluster: Cluster, devices: tuple[int, ...], options: PlanOptions) -> dict[str, Any]:
    """SPMD (HAP) on `devices` of the cluster alone: its predicted time, or why no plan fits there."""
    names = [cluster.devices[j].name for j in devices]
    try:
        return {"devices": names, "predicted_time_s": plan_spmd(graph, group_cluster(cluster, devices), options).predicted_time_s}
    except InfeasibleError as e:
        return {"devices": names, "skipped": str(e)}


@dataclass(frozen=True)
class SpmdAlternative:
    """An SPMD plan priced on some of the plan's hardware: what a pipeline's speed-up is measured against."""

    devices: tuple[str, ...]
    predicted_time_s: float
    whole_cluster: bool

    @property
    def label(self) -> str:
        """'SPMD on all 16 devices' or 'SPMD on a100-0 to a100-7 alone (8 devices)'."""
        if self.whole_cluster:
            return f"SPMD on all {len(self.devices)} devices"
        return f"SPMD on {name_runs(self.devices)} alone ({len(self.devices)} device{'s' if len(self.devices) > 1 else ''})"


def spmd_alternatives(plan: Any) -> list[SpmdAlternative]:
    """The SPMD plans `parallelism="auto"` priced beside a pipeline plan, fastest first: on the whole cluster and,
    when the pipeline leaves devices idle, on each sub-cluster it uses and on its own devices. Empty for a plan
    made without `auto`."""
    out = []
    whole = plan.search.get("parallelism_s", {}).get("spmd")
    if whole is not None:
        out.append(SpmdAlternative(tuple(plan.device_names), whole, True))
    out += [SpmdAlternative(tuple(r["devices"]), r["predicted_time_s"], False)
            for r in plan.search.get(SPMD_ON, []) if "predicted_time_s" in r]
    return sorted(out, key=lambda a: a.predicted_time_s)


def _with_search(pipe: PipelinePlan, graph: Graph, cluster: Cluster, options: PlanOptions,
                 stats: dict[str, Any]) -> PipelinePlan:
    """The pipeline plan with the planner's records (the options too), and the model and cluster it was
    made for (fingerprints, as `Plan` holds them: the app tells a stale plan by them)."""
    return replace(pipe, search={**pipe.search, **stats, "optimizer": options.optimizer, "options": options.to_dict(),
                                 "model_name": graph.name, "model_fingerprint": graph.fingerprint(),
                                 "cluster_name": cluster.name, "cluster_fingerprint": cluster.fingerprint(),
                                 "device_names": [d.name for d in cluster.devices]})


def evaluate(model: Any, cluster: Any, strategy: str, *, options: PlanOptions | None = None,
             **option_values: Any) -> Plan:
    """A baseline plan (`ddp`, `dp-even` or `dp-proportional`) under the same cost model as HAP,
    gradient buckets overlapped with backward as DDP runs them."""
    opts = options_of(options, **option_values)
    if strategy not in BASELINES:
        raise PlanError(f"unknown strategy '{strategy}' (choose one of: {', '.join(BASELINES)})")
    graph, cluster = coerce(model, cluster)
    unsplittable = unsplittable_input(graph)
    if unsplittable is not None:
        raise InfeasibleError(f"{strategy} splits every input on dim 0, but input '{unsplittable.name}' has shape "
                              f"{tuple(unsplittable.shape)}: data parallelism needs a batch of at least 2 "
                              "(engine.plan may still shard other dims)")
    ratios = baseline_ratios(cluster, strategy)
    cm = CostModel(graph, cluster, ratios, opts, overlap=BASELINE_OVERLAP)
    try:
        res = data_parallel(graph, cm)
    except InfeasibleError:
        raise InfeasibleError(oom_message(graph, cluster, opts, strategy, ratios)) from None
    cand = Candidate(res.program, [ratios], res.cost, Segmentation.single(graph), BASELINE_OVERLAP)
    return make_plan(strategy, graph, cluster, cand, opts, [], {"expanded": res.expanded, "elapsed_s": res.elapsed_s})
