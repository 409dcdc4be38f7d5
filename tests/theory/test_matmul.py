"""Matrix-product rules (engine/theory/matmul.py): `linear` (x @ w^T) and batched `matmul`."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import (FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, dim_size, one_op, ratios_st, rule_set,
                       rules_named, seeds, shapes)


@SETTINGS
@given(lead=shapes(0, 3), k=dim_size, n=dim_size, ratios=ratios_st, seed=seeds)
def test_linear_rules_hold(lead: tuple[int, ...], k: int, n: int, ratios: list[float], seed: int) -> None:
    node, g = one_op("linear", [lead + (k,), (n, k)])
    assert node.shape == lead + (n,)
    check_all(node, g, ratios, seed)


@st.composite
def batched_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Operands (..., n, k) and (..., k, p) whose batch dims broadcast (missing dims or size-1 dims)."""
    batch = draw(shapes(0, 2, max_side=4))
    n, k, p = draw(dim_size), draw(dim_size), draw(dim_size)
    sides = []
    for _ in range(2):
        rank = draw(st.integers(0, len(batch)))
        tail = batch[len(batch) - rank:]
        sides.append(tuple(1 if draw(st.booleans()) and draw(st.booleans()) else s for s in tail))
    return sides[0] + (n, k), sides[1] + (k, p)


@SETTINGS
@given(pair=batched_pair(), ratios=ratios_st, seed=seeds)
def test_matmul_rules_hold(pair: tuple, ratios: list[float], seed: int) -> None:
    a, b = pair
    node, g = one_op("matmul", [a, b])
    check_all(node, g, ratios, seed)


def test_linear_rule_names_and_forms() -> None:
    node, g = one_op("linear", [(4, 5, 6), (3, 6)])
    rules = rule_set(node, g)
    [row] = rules_named(node, g, "row")
    assert (row.inputs, row.output) == ((2, 1), PARTIAL)
    [column] = rules_named(node, g, "column")
    assert (column.inputs, column.output) == ((FULL, 0), 2)
    assert {((0, FULL), 0), ((1, FULL), 1)} <= rules  # batch rules on every leading dim
    assert ((FULL, FULL), FULL) in rules and ((PARTIAL, FULL), PARTIAL) in rules
    assert len(rules) == 6


def test_matmul_broadcast_batch_keeps_broadcast_operand_full() -> None:
    node, g = one_op("matmul", [(2, 1, 3, 4), (5, 4, 6)])
    assert node.shape == (2, 5, 3, 6)
    rules = rule_set(node, g)
    assert ((0, FULL), 0) in rules  # b has no dim 0: it stays Full
    assert ((FULL, 0), 1) in rules  # a is broadcast (size 1) along dim 1
    assert ((2, FULL), 2) in rules and ((FULL, 2), 3) in rules and ((3, 1), PARTIAL) in rules
    check_all(node, g, UNEVEN)


def test_checker_rejects_wrong_matmul_rules() -> None:
    node, g = one_op("linear", [(4, 6), (5, 6)])
    assert check_rule(node, g, OpRule("row-as-full", (1, 1), FULL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("both-partial", (PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False
    mm, g = one_op("matmul", [(2, 4, 6), (2, 6, 3)])
    assert check_rule(mm, g, OpRule("contract-as-shard", (2, 1), 2), UNEVEN).ok is False
