"""transformers models built from a config train identically distributed and on one device.

`hf_bert` (BertForMaskedLM: buffers, position-id slicing, the attention-mask arithmetic) plans
with rules only; `hf_gpt2` needs the replicate fallback for its mask's index ops, so its ranks run
opaque ATen ops on whole inputs. 3 steps, uneven ratios, rel 1e-4. transformers initialises
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


def test_hf_gpt2_with_opaque_ops_trains_like_one_device(tmp_path):
    plan = engine_plan("hf_gpt2", 2)
    opaque = [ins for ins in plan.program if ins.kind == "compute" and plan.graph[ins.node].op == "opaque"]
    assert opaque and all(ins.rule == "replicate" for ins in opaque)
    check_equivalence(plan, tmp_path, "sgd", steps=3, near_zero=1e-6)
