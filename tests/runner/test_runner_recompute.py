"""Activation recomputation in the runner (issue 26, item 2): the plan's recomputed layers run under
`torch.utils.checkpoint` and training still equals single-device training (the verify tolerance).

Zoo BERT with dropout on, both layers recomputed, on 3 uneven gloo ranks; a program with an
all-gather inside a recomputed layer (the collective runs again in backward on every rank); the
same under ddp buckets and duplex half-batches; in-process, the recomputed dropout masks are the
forward's and the gradients equal the program without recomputation's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import ROOT
from runner_plans import MODELS, cluster, forced_plan
from test_runner_equivalence import check_equivalence
from test_runner_overlap import check_overlap_trains_the_same

import engine
from engine.model import dropout
from engine.spmd.recompute import layers
from runner.profile import one_device_plan
from runner.train import make_batch, program_args, setup_rank

STEPS = 3


def bert_with_dropout(world: int, **options):
    g = engine.load_model("zoo:bert", **{**MODELS["bert"], "dropout": 0.1})
    return engine.plan(g, cluster(world), optimizer="sgd", recompute="all", **options)


def test_bert_with_dropout_recomputing_two_layers_trains_like_one_device(tmp_path):
    plan = bert_with_dropout(3, overlap="none")
    assert plan.recompute == [0, 1] and len(set(plan.ratios["0"])) == 3
    check_equivalence(plan, tmp_path, "sgd", steps=STEPS)


def test_collectives_inside_a_recomputed_layer_run_again_in_backward(tmp_path):
    plan = forced_plan("bert", 3, "all_gather.padded")
    gathered = {plan.graph[ins.node].segment for ins in plan.program if ins.rule == "all_gather.padded"}
    plan = dataclasses.replace(plan, recompute=sorted(gathered))
    check_equivalence(plan, tmp_path, "sgd", steps=2)


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_recomputation_under_overlap_trains_like_no_overlap_and_one_device(mode, tmp_path):
    check_overlap_trains_the_same(bert_with_dropout(3, overlap="ddp"), mode, tmp_path)


def test_recomputed_dropout_masks_are_the_forwards_and_gradients_do_not_change(monkeypatch):
    plan = one_device_plan("bert", {**MODELS["bert"], "dropout": 0.3})
    again = dataclasses.replace(plan, recompute=layers(plan.graph))
    drawn: list[tuple[int, torch.Tensor]] = []
    keep_mask = dropout.keep_mask

    def recording(p, key, site, *rest):
        mask = keep_mask(p, key, site, *rest)
        drawn.append((site, mask))
        return mask
    monkeypatch.setattr(dropout, "keep_mask", recording)
    grads = []
    for p in (plan, again):
        st = setup_rank(p, 0, seed=3)
        drawn.clear()
        loss = st.program.module(*program_args(p, st, 0, make_batch(p, 0, 3), 1))
        forward = len(drawn)
        loss.backward()
        grads.append([q.grad for q in st.params])
    assert "layer_1" in st.program.module.code, "the last program built recomputes its layers"
    assert forward == 1 + 2 * MODELS["bert"]["layers"] and len(drawn) == 2 * forward, "backward draws every mask again"
    first = dict(drawn[:forward])
    assert all(torch.equal(first[site], mask) for site, mask in drawn[forward:])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_llama_tiny_example_recomputing_every_layer_trains_like_one_device(tmp_path):
    pytest.importorskip("transformers")
    g = engine.load_model(str(ROOT / "examples" / "llama_tiny.py"))
    plan = engine.plan(g, cluster(3), optimizer="sgd", recompute="all", overlap="none")
    assert plan.recompute == layers(g) and len(plan.recompute) >= 2
    check_equivalence(plan, tmp_path, "sgd", steps=2)


def test_pipeline_stages_recomputing_their_layers_match_microbatch_accumulation(tmp_path):
    """Two stages of two uneven ranks, each a sharded SPMD stage plan whose layer (all-gathers and
    reduce-scatters on the stage's process group inside) is recomputed in backward."""
    import json

    from dist_harness import run_ranks
    from test_runner_pipeline import _compare, _train, hap_stage_plan

    plan = hap_stage_plan("gpt", "1f1b")
    stages = [dataclasses.replace(s, plan=dataclasses.replace(s.plan, recompute=layers(s.plan.graph)))
              for s in plan.stages]
    plan = dataclasses.replace(plan, stages=stages)
    assert all(s.plan.recompute for s in plan.stages)
    results = run_ranks(_train, 4, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert result.ok(1e-4), result.render()
