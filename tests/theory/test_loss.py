"""Loss rules (engine/theory/loss.py): mean `cross_entropy` and `mse_loss` give Partial on sharded samples."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, dim_size, one_op, ratios_st, rule_set, seeds, shapes


def _ce(n: int, v: int):
    return one_op("cross_entropy", [((n, v), "float64"), ((n,), "int64")], {"count": n})


def _mse(shape: tuple[int, ...]):
    return one_op("mse_loss", [shape, shape], {"count": math.prod(shape)})


@SETTINGS
@given(n=dim_size, v=st.integers(2, 6), ratios=ratios_st, seed=seeds)
def test_cross_entropy_rules_hold(n: int, v: int, ratios: list[float], seed: int) -> None:
    node, g = _ce(n, v)
    assert node.shape == ()
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(1, 4), ratios=ratios_st, seed=seeds)
def test_mse_rules_hold(shape: tuple[int, ...], ratios: list[float], seed: int) -> None:
    node, g = _mse(shape)
    assert node.shape == ()
    check_all(node, g, ratios, seed)


def test_loss_rule_forms() -> None:
    node, g = _ce(8, 5)
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, 0), PARTIAL)}
    node, g = _mse((4, 1, 3))
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, 0), PARTIAL), ((2, 2), PARTIAL)}


def test_checker_rejects_wrong_loss_rules() -> None:
    node, g = _ce(8, 5)
    assert check_rule(node, g, OpRule("samples-as-full", (0, 0), FULL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("full-as-partial", (FULL, FULL), PARTIAL), UNEVEN).ok is False  # m copies
    node, g = _mse((4, 6))
    assert check_rule(node, g, OpRule("partial-inputs", (PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False

