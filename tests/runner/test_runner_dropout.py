"""Dropout on: distributed training still equals single-device training (issue 13, item 3; rel 1e-4).

Each rank derives the dropout mask of its block from the global index, the seed, the step and
the site (engine/model/dropout.py); the single-device reference draws the same masks through
`engine.model.dropout.SiteKeyedDropout`. Zoo BERT (nn.Dropout after the embeddings, attention and
feed-forward) on 3 uneven ranks, and Hugging Face BERT, whose attention calls
`scaled_dot_product_attention` with `dropout_p > 0`, on 3 uneven ranks; VGG19 with its FC layers
column-parallel, so dropout runs on unevenly split hidden units (Shard(1)); 3 steps each. Stochastic
depth (`torch.rand` and `bernoulli_` per sample, issue 29) draws site-keyed numbers too: a model
file with two drop paths, each rank drawing its own rows.
"""
from __future__ import annotations

import pytest
import torch
from conftest import ROOT
from runner_plans import MODELS, RATIOS, cluster
from test_runner_equivalence import check_equivalence

import engine
from engine.model.dropout import RngKey, SiteKeyedDropout
from engine.options import PlanOptions
from engine.spmd.plan import Plan
from runner.profile import one_device_plan
from runner.train import build_module, make_batch, program_args, setup_rank

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


def test_the_rank_program_takes_the_step_key_and_draws_the_reference_masks():
    """In-process, one device: the rank program's first argument is the step's key, and its loss is
    the loss of the eager model under SiteKeyedDropout for that step (another step, other masks)."""
    plan = one_device_plan("bert", {**MODELS["bert"], "dropout": 0.3})
    st = setup_rank(plan, 0, seed=3)
    assert st.program.uses_rng and "rng" in st.program.module.code
    batch, module = make_batch(plan, 0, 3), build_module(plan, 3)
    losses = []
    for step in (0, 1):
        loss = st.program.module(*program_args(plan, st, 0, batch, step))
        with SiteKeyedDropout(RngKey(3, step)) as mode:
            want = module(*batch)
        assert mode.sites == 1 + 2 * MODELS["bert"]["layers"]
        torch.testing.assert_close(loss, want)
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) > 1e-4, "each step draws its own masks"


def test_hf_bert_with_attention_dropout_trains_like_one_device(tmp_path):
    pytest.importorskip("transformers")
    plan = dropout_plan("hf_bert", 3)
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    assert len(sites(plan, "sdpa")) == MODELS["hf_bert"]["layers"], "attention dropout is kept in the sdpa node"
    # the key bias's true gradient is exactly zero (softmax ignores a shift common to all keys, with
    # or without dropout after it): compared absolutely, as in test_runner_hf
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS, near_zero=1e-6)


def test_vgg19_with_dropout_on_hidden_units_split_unevenly_trains_like_one_device(tmp_path):
    """Column-parallel FC layers: each rank holds 6, 4 or 2 of the 12 hidden units, so its dropout
    draws the mask of those columns (Shard(1)), not of a batch slice."""
    from engine.spmd.cost import CostModel
    from engine.spmd.iteration import plan_of
    from engine.spmd.synthesis import SearchSpace, synthesize

    g = engine.load_model("zoo:vgg19", batch=5, image_size=32, width=0.0625, hidden=12, classes=5, pool_size=1, dropout=0.2)
    fc = {n.id for n in g.parameters if n.rank == 2 and n.shape[0] == 12}
    space = SearchSpace(param_forms=lambda n, f: f == 0 if n in fc else True)
    c = cluster(3)
    plan = plan_of(synthesize(g, CostModel(g, c, RATIOS[3], PlanOptions(optimizer="sgd")), space=space).program, g, c, RATIOS[3], options=PlanOptions(optimizer="sgd"))
    drops = [i for i in plan.program if i.kind == "compute" and g[i.node].op == "dropout"]
    assert len(drops) == 2 and all(i.post == 1 for i in drops)
    assert all(plan.shard_sizes[f"{g[i.node].name}:1"] == [6, 4, 2] for i in drops)
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_drop_path_by_rand_and_bernoulli_trains_like_one_device_on_3_uneven_ranks(tmp_path):
    """Each rank draws the per-sample keep numbers of its own rows of the batch (rand sharded on dim 0)."""
    g = engine.load_model(str(ROOT / "tests" / "fixtures" / "model_files" / "drop_path_mlp.py"))
    plan = engine.plan(g, cluster(3), optimizer="sgd")
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    draws = [i for i in plan.program if i.kind == "compute" and g[i.node].op == "rand"]
    assert sorted(g[i.node].attrs["rng_site"] for i in draws) == [0, 1] and all(i.post == 0 for i in draws)
    check_equivalence(plan, tmp_path, "sgd", steps=2)


def test_swin_with_its_default_drop_path_rate_trains_like_one_device_on_3_uneven_ranks(tmp_path):
    """transformers' Swin from its default config (drop_path_rate 0.1) shrunk to 2 layers: its drop path
    (`torch.rand`, floor, div, mul) is planned and every rank's numbers are the single device's."""
    pytest.importorskip("transformers")
    sizes = dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3)
    g = engine.load_model("hf:SwinForImageClassification", config=sizes, batch=6)
    assert g.origin["config"]["drop_path_rate"] == 0.1 and sum(n.op == "rand" for n in g.nodes) == 1
    plan = engine.plan(g, cluster(3), optimizer="sgd")
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    check_equivalence(plan, tmp_path, "sgd", steps=2, near_zero=1e-6)  # the key biases' true gradient is 0 (hf_bert's note)


def test_normal_noise_and_a_random_projection_train_like_one_device_on_3_uneven_ranks(tmp_path):
    """`randn_like` noise and a whole `randn` projection (LSH attention's rotations): each rank draws its block of
    the site's normal numbers (the noise's rows of its batch share), the projection whole or as the plan splits it."""
    g = engine.load_model(str(ROOT / "tests" / "fixtures" / "model_files" / "normal_noise_mlp.py"))
    plan = engine.plan(g, cluster(3), optimizer="sgd")
    assert len(set(plan.ratios["0"])) == 3, "the ratios should be uneven"
    draws = [i for i in plan.program if i.kind == "compute" and g[i.node].op == "rand"]
    assert sorted(g[i.node].attrs["rng_site"] for i in draws) == [0, 1] and all(g[i.node].attrs["normal"] for i in draws)
    check_equivalence(plan, tmp_path, "sgd", steps=2)
