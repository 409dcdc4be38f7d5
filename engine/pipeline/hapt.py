"""The pipeline planner (HAPT §5 with HAP inside every stage): partition, then plan each stage.

HAPT's DP (`engine.pipeline.partition.best_pipeline`) first prices every stage as data parallelism
on its group. The best partitions are then searched again with stages priced by their layers' HAP
plans (`HapLayerPricer`: it finds the groups that sharding inside a stage pays for), at that
partition's microbatch count B and the smaller ones (more samples per microbatch allow larger
groups), while a quarter of the time budget lasts (`PIPELINE_BUDGET_S` without a budget). The two
best partitions get HAP's plan inside every stage (`with_hap_stages`) and the faster is returned;
the stages' searches share what is left of the budget.
"""
from __future__ import annotations

import time

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.pipeline.partition import best_pipeline
from engine.pipeline.plan import PipelinePlan
from engine.pipeline.stage_plan import HapLayerPricer, with_hap_stages
from engine.pipeline.stages import microbatch_candidates

PIPELINE_BUDGET_S = 30.0
"""Seconds the pipeline planner's HAP searches (of layers and of stages) take at most when the options
give no time budget."""


def plan_pipeline(graph: Graph, cluster: Cluster, options: PlanOptions) -> PipelinePlan:
    """The best pipeline of `graph` on `cluster` with HAP inside its stages, `options.microbatches`
    fixing B (else it is searched). InfeasibleError when no partition fits memory."""
    start = time.perf_counter()
    budget = PIPELINE_BUDGET_S if options.time_budget_s is None else options.time_budget_s
    quarter = budget / 4
    pipe = best_pipeline(graph, cluster, options.microbatches, options=options)
    candidates = {_layout(pipe): pipe}
    pricer = HapLayerPricer(graph, cluster, options.with_budget(quarter / 8))
    counts = [options.microbatches] if options.microbatches else \
        [b for b in microbatch_candidates(graph) if b <= pipe.microbatches]
    for B in sorted(counts, reverse=True):
        if time.perf_counter() - start > quarter:
            break
        try:
            other = best_pipeline(graph, cluster, B, pricer=pricer, options=options)
        except (PlanError, InfeasibleError):
            continue  # nothing fits at B, or the model cannot be captured at its size: data-parallel stages
        candidates.setdefault(_layout(other), other)
    best = sorted(candidates.values(), key=lambda p: p.predicted_s)[:2]
    left = max(0.05, budget - (time.perf_counter() - start))
    return min((with_hap_stages(p, cluster, options.with_budget(left / len(best))) for p in best),
               key=lambda p: p.predicted_s)


def _layout(pipe: PipelinePlan) -> tuple:
    """What tells two partitions apart: the microbatch count, each stage's layers and devices."""
    return (pipe.microbatches, *((s.layers, s.devices) for s in pipe.stages))
