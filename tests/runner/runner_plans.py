"""Plans for the runner tests: the engine's own, dp-even, and programs forced to use one collective."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from conftest import cluster_dict

import engine
from engine.cluster.spec import Cluster
from engine.errors import InfeasibleError
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.pipeline.stage_plan import STAGE_SPACE, with_hap_stages
from engine.spmd.baselines import data_parallel_space, proportional_ratios
from engine.spmd.cost import CostModel
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.segments import segment_graph
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL

MODELS = {
    "mlp": dict(layers=2, in_features=8, hidden=24, classes=6, batch=20),
    "gpt": dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=10),
    "bert": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, predictions=3, batch=10),
    "bert_moe": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, predictions=3, batch=10, experts=5),
    "hf_bert": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, batch=10),
    "hf_gpt2": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, batch=10),
    "hf_llama": dict(layers=2, hidden=16, heads=4, ffn=32, vocab=40, seq_len=8, batch=10),
}
"""Small zoo configs (dropout off); batch and widths split unevenly on every world size; 5 experts
divide no world size of the tests."""
RATIOS = {2: [0.6, 0.4], 3: [0.5, 0.3, 0.2], 4: [0.4, 0.3, 0.2, 0.1]}
FORCEABLE = ("all_gather.padded", "all_gather.grouped", "reduce_scatter", "all_reduce", "all_to_all")
"""Collective keys a program can be restricted to (with the free `slice`)."""


NEEDS_FALLBACK: set[str] = set()
"""Zoo models with operators that have no rule (captured with fallback="replicate"): none since
GPT-2's mask code (diff, index, new_ones) has rules."""


@lru_cache(maxsize=None)
def graph(model: str) -> Graph:
    fallback = "replicate" if model in NEEDS_FALLBACK else None
    return engine.load_model(f"zoo:{model}", fallback=fallback, **MODELS[model])


def cluster(world: int) -> Cluster:
    """One CPU device per rank with FLOP/s in the proportions of RATIOS[world]."""
    flops = [1e10 * r / max(RATIOS[world]) for r in RATIOS[world]]
    return engine.load_cluster(cluster_dict(flops, name=f"cpu_{world}_uneven"))


def engine_plan(model: str, world: int) -> Plan:
    return engine.plan(graph(model), cluster(world), optimizer="sgd")


def dp_even_plan(model: str, world: int) -> Plan:
    return engine.evaluate(graph(model), cluster(world), "dp-even", optimizer="sgd")


def forced_plan(model: str, world: int, collective: str, on: Cluster | None = None) -> Plan:
    """A cheapest program whose only communication is `collective` (and free slices), at RATIOS[world],
    on cluster `on` (default: `cluster(world)`, one machine).

    With gradients all-reduced in one bucket, plain data parallelism is cheapest on these small
    models, so one weight matrix is kept from being Full: the first (in graph order) for which
    the cheapest such program uses `collective`.
    """
    g, c, ratios = graph(model), on or cluster(world), RATIOS[world]
    cm = CostModel(g, c, ratios, PlanOptions(optimizer="sgd"))
    for weight in (n.id for n in g.parameters if n.rank >= 2):
        space = SearchSpace(collectives=frozenset({collective, "slice"}),
                            param_forms=lambda n, f, weight=weight: n != weight or f != FULL)
        try:
            res = synthesize(g, cm, space=space)
        except InfeasibleError:
            continue
        if any(i.rule == collective for i in res.program):
            return plan_of(res.program, g, c, ratios, options=PlanOptions(optimizer="sgd"))
    raise AssertionError(f"no program of {model} on {world} ranks uses {collective}")


def segmented_plan(model: str, world: int, data_parallel: bool, **knobs) -> Plan:
    """A two-segment program whose segments have different ratios (RATIOS[world] and its reverse), so
    sharded tensors crossing the boundary really move (HAP §5.2)."""
    g = engine.load_model(f"zoo:{model}", **{**MODELS[model], **knobs})
    c, seg = cluster(world), segment_graph(g, 2)
    assert seg.count == 2, "the model needs two layers to make two segments"
    rows = [RATIOS[world], RATIOS[world][::-1]]
    space = data_parallel_space(g) if data_parallel else None
    res = synthesize(g, CostModel(g, c, rows, PlanOptions(optimizer="sgd"), seg), space=space)
    return plan_of(res.program, g, c, rows, options=PlanOptions(optimizer="sgd"), segmentation=seg)


def collectives_of(plan: Plan) -> set[str]:
    return {ins.rule for ins in plan.program if ins.kind == "comm"}


def sharded_stage_planner(sub: Graph, group: Cluster, options: PlanOptions, microbatches: int) -> Plan:
    """A pipeline stage's plan (engine.pipeline.stage_plan.StagePlanner) that keeps every weight matrix from being
    Full, at the group's FLOP/s shares: tensor parallelism inside the stage, which plain HAP would not
    choose on these small models."""
    space = replace(STAGE_SPACE, param_forms=lambda n, f: f != FULL or sub[n].rank < 2)
    ratios = proportional_ratios(group)
    res = synthesize(sub, CostModel(sub, group, ratios, options), space=space)
    return plan_of(res.program, sub, group, ratios, options=options)


def with_sharded_stages(pipe, on: Cluster):
    """`pipe` with every stage running a `sharded_stage_planner` plan."""
    out = with_hap_stages(pipe, on, PlanOptions(optimizer="sgd"), plan_one=sharded_stage_planner)
    assert all(s.plan is not None for s in out.stages), out.search.get("hap_stages_skipped")
    return out
