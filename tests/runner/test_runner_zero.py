"""Sharded states (ZeRO 1-3, uneven shares) train exactly as one device does (issue 26 item 3).

Three gloo ranks run a data-parallel and the engine's own plan of the small MLP with every weight at
stage 1, 2 and 3 and uneven shares, with Adam, and the test compares losses and final weights with
single-device training (runner.verify's fp32 tolerance), as tests/runner/test_runner_equivalence.py does.
"""
from __future__ import annotations

import dataclasses

import pytest
from runner_plans import dp_even_plan, engine_plan
from test_runner_equivalence import check_equivalence

from engine.spmd.zero import StateSharding, all_params_at, to_record

SHARES = (0.5, 0.3, 0.2)


def staged(plan, stage: int, shares=SHARES):
    """`plan` with every Full weight at `stage` and the given state shares."""
    record = to_record(plan.graph, plan.program, StateSharding(all_params_at(plan.graph, stage), shares))
    assert record["stages"], "the plan keeps some weight Full"
    return dataclasses.replace(plan, shard_states=record)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_data_parallel_with_sharded_states_trains_like_one_device(stage, tmp_path):
    plan = staged(dp_even_plan("mlp", 3), stage)
    assert len(set(sum(plan.shard_states["sizes"].values(), []))) > 1, "uneven sizes"
    check_equivalence(plan, tmp_path, "adam")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engines_plan_with_sharded_states_trains_like_one_device(stage, tmp_path):
    check_equivalence(staged(engine_plan("mlp", 3), stage), tmp_path, "adam")
