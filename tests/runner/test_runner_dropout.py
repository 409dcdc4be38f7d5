"""Dropout on: distributed training still equals single-device training (issue 13, item 3; rel 1e-4).

Each rank derives the dropout mask of its block from the global index, the seed, the step and
the site (engine/dropout.py); the single-device reference draws the same masks through
`engine.dropout.SiteKeyedDropout`. Zoo BERT (nn.Dropout after the embeddings, attention and
feed-forward) on 3 uneven ranks, and Hugging Face BERT, whose attention calls
`scaled_dot_product_attention` with `dropout_p > 0`, on 2 uneven ranks; 3 steps each.
"""
from __future__ import annotations

import engine
from engine.plan import Plan
from runner_plans import MODELS, RATIOS, cluster
from test_runner_equivalence import check_equivalence

STEPS = 3


def dropout_plan(model: str, world: int, p: float = 0.1) -> Plan:
    g = engine.load_model(f"zoo:{model}", **{**MODELS[model], "dropout": p})
    return engine.plan(g, cluster(world), optimizer="sgd")


def sites(plan: Plan, op: str) -> list[int]:
    return [n.attrs["rng_site"] for n in plan.graph.nodes if n.op == op and "rng_site" in n.attrs]


def test_bert_with_dropout_trains_like_one_device(tmp_path):
    plan = dropout_plan("bert", 3)
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    assert len(sites(plan, "dropout")) == 1 + 2 * MODELS["bert"]["layers"]
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_hf_bert_with_attention_dropout_trains_like_one_device(tmp_path):
    plan = dropout_plan("hf_bert", 2)
    assert len(set(plan.ratios["0"])) == 2 and RATIOS[2][0] != RATIOS[2][1]
    assert len(sites(plan, "sdpa")) == MODELS["hf_bert"]["layers"], "attention dropout is kept in the sdpa node"
    # the key bias's true gradient is exactly zero (softmax ignores a shift common to all keys, with
    # or without dropout after it): compared absolutely, as in test_runner_hf
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS, near_zero=1e-6)
