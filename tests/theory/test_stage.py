"""The end of a pipeline stage (engine/theory/stage.py): `stage_output` asks its operands' boundary forms."""
from __future__ import annotations

import pytest
from hypothesis import given

from engine.errors import ModelError
from engine.theory import op_rules

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, check_all, one_op, ratios_st, seeds


def _sink(forms: list[int]):
    return one_op("stage_output", [(6, 4), (6,), (3, 5)], {"forms": forms}, out_shape=())


@SETTINGS
@given(ratios=ratios_st, seed=seeds)
def test_the_one_rule_holds_and_asks_exactly_the_boundary_forms(ratios: list[float], seed: int) -> None:
    node, g = _sink([0, FULL, 1])
    rules = op_rules(node, g)
    assert [(r.inputs, r.output) for r in rules] == [((0, FULL, 1), PARTIAL)]
    check_all(node, g, ratios, seed)


def test_forms_that_do_not_match_the_operands_are_a_malformed_graph() -> None:
    node, g = _sink([0, FULL])
    with pytest.raises(ModelError, match="stage_output"):
        op_rules(node, g)
    check_all(*_sink([FULL, 0, FULL]), UNEVEN)
