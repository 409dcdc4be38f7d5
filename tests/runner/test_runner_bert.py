"""BERT and BERT-MoE train identically distributed and on one device (issue 5 acceptance, rel 1e-4).

Small configs, dropout off, 3 steps, uneven ratios. BERT-MoE has 5 experts: on 3 ranks the
engine's plan splits them 3/1/1 and on 4 ranks 2/2/1/0 (a rank may hold no expert at all), never
padded to a multiple of the world size.
"""
from __future__ import annotations

import pytest

from runner_plans import engine_plan
from test_runner_equivalence import check_equivalence

STEPS = 3


def expert_sizes(plan) -> list[list[int]]:
    return [v for k, v in plan.shard_sizes.items() if k.endswith("ffn_w1:0")]


def test_bert_trains_like_one_device(tmp_path):
    plan = engine_plan("bert", 3)
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


@pytest.mark.parametrize("world", [3, 4])
def test_bert_moe_with_experts_not_dividing_the_world_trains_like_one_device(world, tmp_path):
    plan = engine_plan("bert_moe", world)
    sizes = expert_sizes(plan)
    assert sizes and all(sum(s) == 5 and len(set(s)) > 1 for s in sizes), f"experts should split unevenly: {sizes}"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def vocab_parallel_plan():
    """BERT's program with the word table forced to split on its vocabulary rows (S(0))."""
    from engine.cost import CostModel
    from engine.planner import Candidate, _make_plan
    from engine.synthesis import SearchSpace, synthesize
    from runner_plans import RATIOS, cluster, graph

    g, c, ratios = graph("bert"), cluster(3), RATIOS[3]
    word = next(n.id for n in g.parameters if n.attrs["target"] == "word.weight")
    space = SearchSpace(param_forms=lambda n, f: f == 0 if n == word else True)
    res = synthesize(g, CostModel(g, c, ratios, "sgd"), space=space)
    return _make_plan("hap", g, c, Candidate(res.program, ratios, res.cost), "sgd", [], {}), word


def test_vocabulary_parallel_embedding_trains_like_one_device(tmp_path):
    plan, word = vocab_parallel_plan()
    lookups = [ins for ins in plan.program if ins.kind == "compute" and plan.graph[ins.node].op == "embedding"
               and ins.pre[0] == (word, 0)]
    assert lookups and lookups[0].post == -2, "the lookup on vocabulary rows gives addends (Partial)"
    assert len(set(plan.shard_sizes[f"{plan.graph[word].name}:0"])) == 3, "uneven row ranges"
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)
