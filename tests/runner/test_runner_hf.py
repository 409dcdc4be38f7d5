"""transformers models built from a config train identically distributed and on one device.

`hf_bert` (BertForMaskedLM: buffers, position-id slicing, the attention-mask arithmetic) plans
with rules only; so does `hf_gpt2`, whose mask code (diff, advanced indexing, new_ones, cumsum)
and exact mean cross-entropy (the count of kept targets, all-reduced) run as captured nodes. 3 steps, uneven ratios, rel 1e-4. transformers initialises
biases to zero, and the attention key bias has a true gradient of exactly zero (softmax ignores a
shift common to all keys): it stays at rounding noise, so it is compared absolutely (< 1e-6).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from runner_plans import engine_plan  # noqa: E402
from test_runner_equivalence import check_equivalence  # noqa: E402


def test_hf_bert_trains_like_one_device(tmp_path):
    plan = engine_plan("hf_bert", 3)
    assert any(n.op == "buffer" for n in plan.graph.nodes)
    check_equivalence(plan, tmp_path, "sgd", steps=3, near_zero=1e-6)


def test_hf_gpt2_mask_code_trains_like_one_device(tmp_path):
    plan = engine_plan("hf_gpt2", 3)
    ops = {plan.graph[ins.node].op for ins in plan.program if ins.kind == "compute"}
    assert "opaque" not in ops and {"index", "full", "cross_entropy"} <= ops
    check_equivalence(plan, tmp_path, "sgd", steps=3, near_zero=1e-6)


def test_hf_llama_rope_gqa_and_its_own_loss_train_like_one_device(tmp_path):
    """RoPE tables, repeat_kv, the padding/causal mask and the -100-padded shifted labels, sharded."""
    plan = engine_plan("hf_llama", 3)
    ops = {plan.graph[ins.node].op for ins in plan.program if ins.kind == "compute"}
    assert "opaque" not in ops and {"cos", "sin", "expand", "pad", "cross_entropy"} <= ops
    check_equivalence(plan, tmp_path, "sgd", steps=3, near_zero=1e-6)
