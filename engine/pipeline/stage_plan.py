"""HAP inside every pipeline stage (HAPT §5 with HAP §3-5 per stage): each stage's program and ratios.

The partitioner (`engine.pipeline.partition`) chooses the stages, their device groups and the microbatch
count B, pricing every stage as data parallelism on its group (`DataParallelPricer`) or, with
`HapLayerPricer`, also by its layers' HAP plans. This module then plans each chosen
stage as HAP plans a whole model: program synthesis (A*) and the LP, iterated, on the stage's own
graph at one microbatch's size, over the stage's devices only (which may differ in speed: the LP
gives them uneven shares). A stage's graph (`StageGraph.subgraph`) starts from the tensors the
previous stage sends and ends in the tensors it sends on, each in its *boundary form*: the form the
collective-free data-parallel program computes it in (rows of the batch, or whole). Fixing those
forms is what lets stages be planned one by one, and lets the runner re-slice a boundary tensor
between two groups with different shares by sending each receiver exactly its rows.

The stage times, gradient syncs and memory then come from the stage plans (`stage_price`) and the
schedules are simulated again. A stage keeps HAP's plan or its data-parallel program, whichever
costs the pipeline less (`pipeline_cost`), so it is never predicted slower than data parallelism at
the same whole-sample shares; it may be predicted slower than the partitioner's estimate, which
splits a microbatch at fractional shares (`search["data_parallel_stages_s"]` keeps that estimate).

The microbatch graph is the model captured again at batch / B (`engine.spmd.halves.capture_at`): a
model file or graph JSON fixes its batch, so its stages stay data-parallel
(`PipelinePlan.search["hap_stages_skipped"]` says why).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError, PlanError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.pipeline.partition import layer_signatures
from engine.pipeline.plan import PipelinePlan, PipelineStage, ScheduleResult, timeline_boxes
from engine.pipeline.schedule import SCHEDULES, Pipeline, StageTimes, closed_form_s, run_schedule
from engine.pipeline.stage_cost import DataParallelPricer, StagePrice, device_signature, group_cluster
from engine.pipeline.stages import StageGraph, batch_of
from engine.spmd.baselines import proportional_ratios
from engine.spmd.cost import CostModel, evaluate, replay_terms
from engine.spmd.halves import capture_at
from engine.spmd.iteration import plan_of, plan_spmd
from engine.spmd.plan import Plan
from engine.spmd.program import COMPUTE, Instruction
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL


def data_parallel_program(graph: Graph) -> tuple[Instruction, ...]:
    """The graph's data-parallel program with no collective at all: parameters Full, each input split
    on the batch or loaded whole, only the loss Partial (a sum over the batch such as the count of
    kept targets is computed whole from whole inputs instead of all-reduced, which a pipeline stage,
    seeing one microbatch at a time, could not do). Its forms do not depend on the number of devices,
    so two made-up equal devices find it."""
    devices = [{"name": f"d{j}", "gpu_model": "any", "machine": "m", "flops_per_gpu": 1e12,
                "memory_bytes_per_gpu": 1 << 40} for j in range(2)]
    cluster = Cluster.from_dict({"schema_version": 1, "name": "pipeline-stage", "description": "runner", "sources": [],
                                 "devices": devices, "network": {"latency_s": 0.0, "bandwidth_Bps": {"intra_machine": 1e12}}})
    loss = graph.loss
    space = SearchSpace(param_forms=lambda n, f: f == FULL, placeholder_forms=lambda n, f: f in (FULL, 0),
                        collectives=frozenset({"slice"}),
                        rule_filter=lambda n, r: (r.output >= FULL or n == loss) and all(f >= FULL for f in r.inputs))
    try:
        return synthesize(graph, CostModel(graph, cluster, [0.5, 0.5], PlanOptions(optimizer="sgd")), space=space).program
    except InfeasibleError:
        raise PlanError(f"pipeline: {graph.name} has no data-parallel program without collectives (an operator "
                        "with no batch rule); it cannot run as a pipeline yet") from None


def boundary_forms(graph: Graph) -> dict[int, int]:
    """The form every computed tensor crosses a cut in: the one the collective-free data-parallel
    program computes it in (Shard(d) on the batch dim, or Full)."""
    forms: dict[int, int] = {}
    for ins in data_parallel_program(graph):
        if ins.kind == COMPUTE:
            forms.setdefault(ins.node, ins.post)
    return forms


def microbatch_graph(graph: Graph, microbatches: int) -> Graph:
    """The model captured at one microbatch's batch size; PlanError when it cannot be (a model file or a
    graph JSON fixes its batch) or its graph changes with the batch."""
    batch = batch_of(graph)
    if microbatches < 1 or batch % microbatches:
        raise PlanError(f"{microbatches} microbatches do not divide the batch of {batch}")
    if microbatches == 1:
        return graph
    origin = graph.origin
    if "zoo" not in origin and "hf" not in origin:
        raise PlanError("the model's batch is fixed by its file or graph JSON, so it cannot be captured at a "
                        "microbatch's size; its stages run data-parallel")
    return capture_at(graph, batch // microbatches)


STAGE_SPACE = SearchSpace(collectives=frozenset(c for c in SearchSpace().collectives if not c.endswith(".hier")))
"""A stage's search: the whole theory but hierarchical collectives, whose machine sub-groups the runner
makes over the whole world, not inside one stage's process group."""

StagePlanner = Callable[[Graph, Cluster, PlanOptions, int], Plan]
"""Plans one stage: (its graph, the cluster of its devices alone, the stage's options (`stage_options`),
microbatches) -> its Plan."""


def stage_options(options: PlanOptions, time_budget_s: float | None) -> PlanOptions:
    """The options one stage's search runs with: the plan's, with the stage's share of the budget, one
    segment and no overlap (a stage's gradient sync runs after the pipeline drains)."""
    return replace(options, time_budget_s=time_budget_s, overlap="none", parallelism="spmd", microbatches=None,
                   segments=1)


def plan_stage(sub: Graph, group: Cluster, options: PlanOptions, microbatches: int) -> Plan:
    """HAP's plan of one stage's graph on its devices (no overlap: a stage's gradient sync runs after the
    pipeline drains; no hierarchical collectives, `STAGE_SPACE`), or its data-parallel program at
    FLOP/s-proportional shares when that costs the pipeline less (`pipeline_cost`). HAP's search
    prices one microbatch with its once-an-iteration work (the gradient sync, the optimizer update),
    so with many microbatches it may trade microbatch time for sync time the pipeline pays B times."""
    hap = plan_spmd(sub, group, options, space=STAGE_SPACE)
    dp = plan_of(data_parallel_program(sub), sub, group, proportional_ratios(group), options=options,
                 recompute=frozenset(hap.recompute))  # the layers HAP's stage plan recomputes
    return min((hap, dp), key=lambda p: pipeline_cost(stage_price(p, group, options), microbatches))


def pipeline_cost(price: StagePrice, microbatches: int) -> float:
    """What a stage adds to an iteration of B microbatches, roughly (HAPT Eq. 13 with the sync): B (t_f + t_b) + u."""
    return microbatches * price.total_s + price.sync_s


def stage_price(plan: Plan, group: Cluster, options: PlanOptions) -> StagePrice:
    """Per-microbatch forward and backward, the sync after the drain, and per-device state and activation
    bytes, from the stage's plan. The sync is what runs once an iteration, not once a microbatch: the
    gradient all-reduce stage and every stage's per-parameter-byte work (the optimizer update and
    the gradient copies, `engine.spmd.cost.class_work`), as `engine.pipeline.stage_cost.DataParallelPricer` has it."""
    cm = CostModel(plan.graph, group, plan.ratio_rows, options, plan.segmentation, overlap="none",
                   recompute=frozenset(plan.recompute))
    b = evaluate(plan.program, cm)
    times = {"forward": 0.0, "backward": 0.0, "sync": 0.0}
    for stage, comm in zip(b.stages, b.stage_comm_s):
        s, r, ss, rs, ts, tr, ops = stage.work
        per_microbatch = max(cm.device_times((s, r, 0.0, 0.0, ts, tr, ops), stage.segment))
        per_iteration = max(cm.device_times((0.0, 0.0, ss, rs, 0.0, 0.0, 0.0), stage.segment))
        if stage.comm == "grad_all_reduce":
            times["sync"] += comm + per_microbatch + per_iteration
        else:
            times[stage.direction] += comm + per_microbatch
            times["sync"] += per_iteration
    mems = replay_terms(plan.program, cm).mems
    state = cm.class_memory([(m[0], m[1], 0.0, 0.0, m[4]) for m in mems])
    acts = cm.class_memory([(0.0, 0.0, m[2], m[3], 0.0) for m in mems])
    by_device = {j: k for k, c in enumerate(cm.classes) for j in c.devices}
    order = [by_device[j] for j in range(group.num_devices)]
    return StagePrice(times["forward"], times["backward"], times["sync"], tuple(state[k] for k in order),
                      tuple(acts[k] for k in order), tuple(float(cm.classes[k].memory_bytes) for k in order))


class HapLayerPricer:
    """A `StagePricer` for the partitioner that sees what HAP does inside a stage (HAPT §5.1 with HAP):
    a stage on several devices costs the less (by `pipeline_cost`) of its data-parallel price and the
    sum of its layers' HAP plans on those devices, each layer planned alone at one microbatch's size
    with its boundary tensors in their boundary forms. That sum is a valid program for the whole stage,
    so it bounds the stage's own HAP plan from above, as the data-parallel price does. Identical layers
    on identical groups are planned once (`engine.pipeline.partition.layer_signatures`). The model is captured
    once per microbatch count asked for (PlanError when it cannot be)."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions = PlanOptions()) -> None:
        """`options.time_budget_s` is what each layer's search may take."""
        self.graph, self.cluster = graph, cluster
        self.options = stage_options(options, options.time_budget_s)
        self.data_parallel = DataParallelPricer(cluster, options)
        self._graphs: dict[int, tuple[StageGraph, dict[int, int], list[int]]] = {}
        self._layer: dict[tuple, StagePrice] = {}

    def __call__(self, stages: StageGraph, start: int, end: int, devices: tuple[int, ...],
                 microbatches: int) -> StagePrice:
        dp = self.data_parallel(stages, start, end, devices, microbatches)
        if len(devices) == 1:
            return dp
        hap = sum_prices([self.layer(k, devices, microbatches) for k in range(start, end)])
        return min((dp, hap), key=lambda p: pipeline_cost(p, microbatches))

    def layers_at(self, microbatches: int) -> tuple[StageGraph, dict[int, int], list[int]]:
        """The model's layers at one microbatch's size, their boundary forms and layer signatures."""
        if microbatches not in self._graphs:
            mb = microbatch_graph(self.graph, microbatches)
            sg = StageGraph(mb)
            if sg.num_layers != StageGraph(self.graph).num_layers:
                raise PlanError("the model's layers change with the batch size; its stages are priced data-parallel")
            self._graphs[microbatches] = (sg, boundary_forms(mb), layer_signatures(sg))
        return self._graphs[microbatches]

    def layer(self, k: int, devices: tuple[int, ...], microbatches: int) -> StagePrice:
        """Layer k's HAP plan on `devices`, priced (shared by identical layers on identical groups)."""
        sg, forms, signature = self.layers_at(microbatches)
        key = (signature[k], device_signature(self.cluster, devices), microbatches)
        if key not in self._layer:
            group = group_cluster(self.cluster, devices)
            plan = plan_stage(sg.subgraph(k, k + 1, forms), group, self.options, microbatches)
            self._layer[key] = stage_price(plan, group, self.options)
        return self._layer[key]


def sum_prices(prices: list[StagePrice]) -> StagePrice:
    """The price of consecutive layers run one after another on the same devices."""
    first = prices[0]
    add = lambda xs: tuple(map(sum, zip(*xs)))  # noqa: E731
    return StagePrice(sum(p.forward_s for p in prices), sum(p.backward_s for p in prices),
                      sum(p.sync_s for p in prices), add(p.state_bytes for p in prices),
                      add(p.activation_bytes for p in prices), first.capacity_bytes)


def with_hap_stages(pipe: PipelinePlan, cluster: Cluster, options: PlanOptions = PlanOptions(),
                    plan_one: StagePlanner = plan_stage) -> PipelinePlan:
    """`pipe` with every stage planned by HAP (`PipelineStage.plan`), re-priced and simulated again;
    `pipe` itself, with the reason in `search["hap_stages_skipped"]`, when its model cannot be captured
    at a microbatch's size or the stage plans do not fit memory under the schedule."""
    start = time.perf_counter()
    try:
        stages, prices = hap_stage_plans(pipe, cluster, options, plan_one)
    except (PlanError, InfeasibleError) as e:
        return replace(pipe, search={**pipe.search, "hap_stages_skipped": str(e)})
    hap = repriced(pipe, stages, prices, pipe.planning_s + time.perf_counter() - start)
    if not hap.schedules[hap.schedule].fits:
        return replace(pipe, search={**pipe.search, "hap_stages_skipped": "the stages' HAP plans do not fit memory "
                                     "with the schedule's microbatches in flight"})
    return replace(hap, search={**pipe.search, "data_parallel_stages_s": pipe.predicted_s})


def hap_stage_plans(pipe: PipelinePlan, cluster: Cluster, options: PlanOptions,
                    plan_one: StagePlanner = plan_stage) -> tuple[list[PipelineStage], list[StagePrice]]:
    """Each stage of `pipe` with its plan by `plan_one` (HAP's, by default), and that plan's price (the
    options' time budget split evenly)."""
    assert pipe.graph is not None, "a pipeline plan made by best_pipeline or fixed_pipeline embeds its graph"
    mb = microbatch_graph(pipe.graph, pipe.microbatches)
    sg, forms = StageGraph(mb), boundary_forms(mb)
    if sg.num_layers != StageGraph(pipe.graph).num_layers:
        raise PlanError("the model's layers change with the batch size; its stages run data-parallel")
    stages, prices = [], []
    for i, s in enumerate(pipe.stages):
        budget = None if options.time_budget_s is None else options.time_budget_s / len(pipe.stages)
        sub = sg.subgraph(s.layers[0], s.layers[1], forms)
        group = group_cluster(cluster, s.devices)
        plan = plan_one(sub, group, stage_options(options, budget), pipe.microbatches)
        plan = replace(plan, history=[], search={k: plan.search[k] for k in ("optimizer", "options", "expanded", "optimal")
                                                 if k in plan.search})  # keep the pipeline plan's JSON small
        prices.append(stage_price(plan, group, options))
        stages.append(replace(s, ratios=tuple(plan.ratio_rows[0]), plan=plan))
    return stages, prices


def repriced(pipe: PipelinePlan, stages: list[PipelineStage], prices: list[StagePrice],
             planning_s: float) -> PipelinePlan:
    """The pipeline with other stage prices: every schedule simulated again, H-1F1B's warm-up for the new
    t_max, peak memory per stage."""
    transfers = tuple(b.transfer_s for b in pipe.boundaries)
    view = Pipeline(tuple(StageTimes(p.forward_s, p.backward_s, max(p.activation_bytes), p.sync_s) for p in prices),
                    transfers, pipe.microbatches)
    results, runs = {}, {}
    for name in SCHEDULES:
        run = runs[name] = run_schedule(view, name)
        peaks = tuple(p.memory_bytes(h) for p, h in zip(prices, run.in_flight))
        results[name] = ScheduleResult(run.iteration_s, run.warmup, peaks,
                                       all(h <= p.max_held for p, h in zip(prices, run.in_flight)))
    run = runs[pipe.schedule]
    new_stages = tuple(replace(s, warmup=w, forward_s=p.forward_s, backward_s=p.backward_s, sync_s=p.sync_s,
                               peak_memory_bytes=m)
                       for s, p, w, m in zip(stages, prices, run.warmup, results[pipe.schedule].peak_memory_bytes))
    closed = closed_form_s(view) if all(c <= view.t_max for c in transfers) else None
    return replace(pipe, stages=new_stages, predicted_s=run.iteration_s, t_max_s=view.t_max, closed_form_s=closed,
                   schedules=results, planning_s=planning_s, timeline=timeline_boxes(run.timeline))
