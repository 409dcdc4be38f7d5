"""Every plan the runner tests execute passes the validator (issue 17): programs forced onto each
collective and two-segment programs with resplits, so the Hoare-logic replay accepts all of them."""
from __future__ import annotations

import json

import pytest
from runner_plans import FORCEABLE, cluster, forced_plan, segmented_plan

from engine.spmd.validate import validate_plan


@pytest.mark.parametrize("collective", FORCEABLE)
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_a_program_forced_onto_one_collective_is_valid(model, collective):
    plan = forced_plan(model, 3, collective)
    assert validate_plan(json.loads(plan.to_json()), cluster(3)) == []


@pytest.mark.parametrize("data_parallel", [True, False])
def test_a_two_segment_program_with_resplits_is_valid(data_parallel):
    plan = segmented_plan("gpt", 3, data_parallel, layers=2)
    assert any(ins.rule == "resplit" for ins in plan.program)
    assert validate_plan(json.loads(plan.to_json()), cluster(3)) == []
