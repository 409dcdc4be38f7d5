"""Distributed training of zoo `vgg19` and `vit` plans equals single-device training (issue 5; fp32, relative 1e-4).

Small configs (dropout off), 2-4 gloo processes with uneven ratios, 3 optimizer steps. Besides the
engine's own plans, two forced programs make sure the model-parallel rules run for real: VGG19
with every convolution split by channels (output channels, or input channels giving Partial) and
batch norm on whole channels; ViT (reshape + linear patch embedding, fused qkv chunked in three)
with attention split by heads.
"""
from __future__ import annotations

from functools import lru_cache

import pytest
from runner_plans import RATIOS, cluster
from test_runner_equivalence import check_equivalence

import engine
from engine.model.graph import Graph
from engine.options import PlanOptions
from engine.spmd.cost import CostModel
from engine.spmd.iteration import plan_of
from engine.spmd.synthesis import SearchSpace, synthesize

STEPS = 3
VGG = dict(batch=5, image_size=32, width=0.0625, hidden=12, classes=5, pool_size=1)
VIT = dict(batch=5, image_size=8, patch=4, hidden=12, layers=1, heads=3, mlp=20, classes=4)


@lru_cache(maxsize=None)
def vision_graph(name: str, extra: tuple = ()) -> Graph:
    knobs = {**(VGG if name == "vgg19" else VIT), **dict(extra)}
    return engine.load_model(f"zoo:{name}", **knobs)


def forced(g: Graph, world: int, banned: dict[str, set[str]]):
    """The cheapest program at RATIOS[world] that uses none of the `banned` rules (op -> rule names)."""
    space = SearchSpace(rule_filter=lambda nid, r: r.name not in banned.get(g[nid].op, set()))
    res = synthesize(g, CostModel(g, cluster(world), RATIOS[world], PlanOptions(optimizer="sgd")), space=space)
    return plan_of(res.program, g, cluster(world), RATIOS[world], options=PlanOptions(optimizer="sgd"))


def rules_of(plan, op: str) -> set[str]:
    return {i.rule for i in plan.program if i.kind == "compute" and plan.graph[i.node].op == op}


def test_vgg19_bn_engine_plan_trains_like_one_device(tmp_path) -> None:
    plan = engine.plan(vision_graph("vgg19", (("batch_norm", True),)), cluster(3), optimizer="sgd")
    assert rules_of(plan, "batch_norm") <= {"channels", "replicate"}
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_vgg19_bn_channel_parallel_convolutions_train_like_one_device(tmp_path) -> None:
    g = vision_graph("vgg19", (("batch_norm", True),))
    plan = forced(g, 4, {"conv": {"batch", "replicate"}, "batch_norm": {"replicate"}})
    assert rules_of(plan, "conv") >= {"out_channels"} and rules_of(plan, "batch_norm") == {"channels"}
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


@pytest.mark.parametrize("world", [4])
def test_vit_engine_plan_trains_like_one_device(world: int, tmp_path) -> None:
    plan = engine.plan(vision_graph("vit", (("batch", 10),)), cluster(world), optimizer="sgd")
    assert len(set(plan.ratios["0"])) == world  # 10 samples: whole units leave every rank its own share
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_vit_head_parallel_attention_with_fused_qkv_trains_like_one_device(tmp_path) -> None:
    g = vision_graph("vit", (("patch_embed", "linear"), ("qkv_fused", True)))
    plan = forced(g, 3, {"sdpa": {"batch", "replicate"}, "cat": {"replicate"}})
    assert rules_of(plan, "sdpa") == {"heads"} and "narrow" in {n.op for n in g.nodes}
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)
