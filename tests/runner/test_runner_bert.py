"""BERT and BERT-MoE train identically distributed and on one device (issue 5 acceptance, rel 1e-4).

Small configs, dropout off, 3 steps, uneven ratios. BERT-MoE has 5 experts, split by whole
experts at ratios 0.5/0.3/0.2 and 0.4/0.3/0.2/0.1 (a rank may hold no expert at all), never padded
to a multiple of the world size. At these tiny sizes data parallelism is cheapest (one bucketed
gradient all-reduce), so the expert-parallel programs are the cheapest ones whose expert weights
are split on the expert dim.
"""
from __future__ import annotations

import pytest
from runner_plans import engine_plan
from test_runner_equivalence import check_equivalence

from engine.options import PlanOptions

STEPS = 3


def expert_sizes(plan) -> list[list[int]]:
    return [v for k, v in plan.shard_sizes.items() if k.endswith("ffn_w1:0")]


def test_bert_trains_like_one_device(tmp_path):
    plan = engine_plan("bert", 3)
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def forced_plan(model: str, world: int, split: dict[str, int]):
    """The cheapest program with the parameters named in `split` (by target suffix) in the given form."""
    from runner_plans import RATIOS, cluster, graph

    from engine.spmd.cost import CostModel
    from engine.spmd.iteration import plan_of
    from engine.spmd.synthesis import SearchSpace, synthesize

    g, c, ratios = graph(model), cluster(world), RATIOS[world]
    forced = {n.id: f for n in g.parameters for suffix, f in split.items() if n.attrs["target"].endswith(suffix)}
    space = SearchSpace(param_forms=lambda n, f: f == forced[n] if n in forced else True)
    res = synthesize(g, CostModel(g, c, ratios, PlanOptions(optimizer="sgd")), space=space)
    return plan_of(res.program, g, c, ratios, options=PlanOptions(optimizer="sgd"))


@pytest.mark.parametrize("world", [3, 4])
def test_bert_moe_with_experts_not_dividing_the_world_trains_like_one_device(world, tmp_path):
    plan = forced_plan("bert_moe", world, {"ffn.w1": 0, "ffn.w2": 0, "ffn.b1": 0, "ffn.b2": 0})
    sizes = expert_sizes(plan)
    assert sizes and all(sum(s) == 5 and len(set(s)) > 1 for s in sizes), f"experts should split unevenly: {sizes}"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_vocabulary_parallel_embedding_trains_like_one_device(tmp_path):
    """BERT's program with the word table forced to split on its vocabulary rows (S(0))."""
    plan = forced_plan("bert", 3, {"word.weight": 0})
    word = next(n.id for n in plan.graph.parameters if n.attrs["target"] == "word.weight")
    lookups = [ins for ins in plan.program if ins.kind == "compute" and plan.graph[ins.node].op == "embedding"
               and ins.pre[0] == (word, 0)]
    assert lookups and lookups[0].post == -2, "the lookup on vocabulary rows gives addends (Partial)"
    assert len(set(plan.shard_sizes[f"{plan.graph[word].name}:0"])) == 3, "uneven row ranges"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)
