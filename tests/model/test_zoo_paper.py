"""BERT-Base and BERT-MoE at the paper's sizes (HAP §7, Table 1), and uneven experts (§7.6).

On the paper's 64-GPU testbed both beat data parallelism (even and proportional); BERT-MoE shards
its experts by whole experts. On `a100x2_p100x2` the experts split over the 4 devices in any count
(no padding to a multiple of 4), the predicted time grows smoothly with the number of experts,
and the faster A100s get more experts when the experts' compute outweighs their all-to-alls.
"""
from __future__ import annotations

import functools

import pytest
from conftest import sample_path

import engine
from engine.spmd.plan import Plan


@functools.cache
def paper_plan(model: str) -> Plan:
    """Planned with DDP's gradient buckets, as the baselines are priced (the paper's setting; duplex is
    searched in tests/spmd/test_overlap.py): the claims below are about the program and the ratios."""
    return engine.plan(engine.load_model(f"zoo:{model}"), sample_path("hap_paper_testbed"), overlap="ddp")


def expert_sizes(plan: Plan) -> list[list[int]]:
    return [sizes for key, sizes in plan.shard_sizes.items() if key.endswith("ffn_w1:0")]


@pytest.mark.parametrize("model", ["bert", "bert_moe"])
def test_paper_size_model_beats_both_baselines_on_the_paper_testbed(model: str) -> None:
    plan = paper_plan(model)
    cfg = plan.graph.origin["config"]
    assert (cfg["hidden"], cfg["layers"], cfg["heads"], cfg["vocab"]) == (768, 12, 12, 30522)
    baselines = plan.search["baselines_s"]
    assert set(baselines) == set(engine.BASELINES)
    for name, t in baselines.items():
        assert t is not None and plan.predicted_time_s < t * 0.99, f"{model}: {plan.predicted_time_s:.3f} s vs {name} {t:.3f} s"


def test_paper_size_bert_splits_its_vocabulary_sized_weights() -> None:
    """The 23M-parameter word table and decoder are not all-reduced whole over the 10 Gbps network."""
    plan = paper_plan("bert")
    held = {key.rsplit(":", 1)[0] for key in plan.shard_sizes}
    assert {"p_word_weight", "p_decoder_weight"} <= held


def test_paper_size_bert_moe_places_whole_experts() -> None:
    plan = paper_plan("bert_moe")
    sizes = expert_sizes(plan)
    assert len(sizes) == 6, "every MoE layer (every second block) shards its experts"
    assert all(sum(s) == 8 and all(x == int(x) for x in s) for s in sizes)


def _moe_on_a100x2_p100x2(**knobs) -> Plan:
    return engine.plan(engine.load_model("zoo:bert_moe", **knobs), sample_path("a100x2_p100x2"), overlap="ddp")


def test_bert_moe_gives_the_faster_devices_more_experts_when_experts_dominate() -> None:
    # one MoE layer at paper widths whose experts are compute-heavy (ffn 16 x hidden): the A100s
    # (devices 0, 1, 19.5 TFLOP/s) get more experts than the P100s (9.3 TFLOP/s)
    plan = _moe_on_a100x2_p100x2(layers=2, experts=8, batch=128, ffn=12288)
    [sizes] = expert_sizes(plan)
    assert sum(sizes) == 8 and min(sizes[:2]) > max(sizes[2:]), sizes


def test_bert_moe_time_grows_smoothly_with_the_number_of_experts() -> None:
    """Tokens proportional to experts (as in §7.6): every expert costs time (no padding to a multiple
    of the 4 devices, which would make 5..8 cost the same) and the 9th costs far less than the four
    before it (padding 9 to 12 would cost like 4 more). The plan prices whole experts, so the steps
    differ with which device takes the extra one."""
    knobs = dict(layers=2, hidden=256, heads=4, ffn=1024, vocab=8000, seq_len=64, predictions=8)
    times = {}
    for e in range(4, 10):
        plan = _moe_on_a100x2_p100x2(experts=e, batch=8 * e, **knobs)
        sizes = expert_sizes(plan)
        assert sizes and all(sum(s) == e for s in sizes), f"experts sharded, never padded: {sizes}"
        times[e] = plan.predicted_time_s
    steps = [times[e + 1] - times[e] for e in range(4, 9)]
    assert all(s > 0 for s in steps), times
    assert times[9] - times[8] < 0.6 * (times[8] - times[4]), times
