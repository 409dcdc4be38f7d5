"""Batch-norm rules (engine/theory/batchnorm.py): whole channels only, so statistics stay exact."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds


def _bn(shape: tuple[int, ...], weight: bool = True, bias: bool = True):
    c = shape[1]
    operands = [shape] + [(c,)] * (int(weight) + int(bias))
    return one_op("batch_norm", operands, {"eps": 1e-5, "has_weight": weight, "has_bias": bias})


@SETTINGS
@given(n=st.integers(2, 5), c=st.integers(1, 6), spatial=st.lists(st.integers(1, 4), max_size=3),
       weight=st.booleans(), bias=st.booleans(), ratios=ratios_st, seed=seeds)
def test_batch_norm_rules_hold(n, c, spatial, weight, bias, ratios, seed) -> None:
    node, g = _bn((n, c) + tuple(spatial), weight, bias)
    check_all(node, g, ratios, seed)
    assert all(r[0] in (FULL, 1) for r, _ in rule_set(node, g)), "only whole channels are ever split"


def test_batch_norm_rule_forms() -> None:
    node, g = _bn((8, 4, 3, 3))
    assert rule_set(node, g) == {((FULL, FULL, FULL), FULL), ((1, 0, 0), 1)}
    node, g = _bn((8, 4), weight=False, bias=False)
    assert rule_set(node, g) == {((FULL,), FULL), ((1,), 1)}


def test_checker_rejects_batch_sharded_batch_norm() -> None:
    """Normalising each device's samples with their own statistics is not the global batch norm."""
    node, g = _bn((8, 4, 3, 3))
    assert check_rule(node, g, OpRule("batch", (0, FULL, FULL), 0), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("rows", (2, FULL, FULL), 2), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("partial", (PARTIAL, FULL, FULL), PARTIAL), UNEVEN).ok is False
