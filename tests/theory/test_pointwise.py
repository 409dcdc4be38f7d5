"""Elementwise rules (engine/theory/pointwise.py): unary maps, broadcasting binary ops, scalar operands."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.theory import op_rules
from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes

UNARY_SHOWN = ["relu", "gelu", "neg", "identity", "tanh", "sigmoid", "silu", "exp", "cos", "sin", "logical_not"]  # RoPE tables, masks


@SETTINGS
@given(op=st.sampled_from(UNARY_SHOWN), shape=shapes(), ratios=ratios_st, seed=seeds)
def test_unary_rules_hold(op: str, shape: tuple[int, ...], ratios: list[float], seed: int) -> None:
    node, g = one_op(op, [shape])
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(), ratios=ratios_st, seed=seeds, approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_approximations_hold(shape: tuple[int, ...], ratios: list[float], seed: int, approximate: str) -> None:
    node, g = one_op("gelu", [shape], {"approximate": approximate})
    check_all(node, g, ratios, seed)


@pytest.mark.parametrize("op", ["sqrt", "rsqrt"])
def test_domain_restricted_unary_rules_hold(op: str) -> None:
    """sqrt/rsqrt are registered and their rules are elementwise, so every rule must check out."""
    node, g = one_op(op, [(4, 6)])
    check_all(node, g, UNEVEN)


def test_dropout_in_eval_mode_holds() -> None:
    node, g = one_op("dropout", [(4, 6)], {"p": 0.5, "train": False})
    check_all(node, g, UNEVEN)


@SETTINGS
@given(shape=shapes(), ratios=ratios_st, seed=seeds, p=st.sampled_from([0.1, 0.5, 0.9]))
def test_training_dropout_rules_hold(shape: tuple[int, ...], ratios: list[float], seed: int, p: float) -> None:
    """With site-keyed masks (engine/model/dropout.py) a shard's dropout is the shard of the whole's."""
    node, g = one_op("dropout", [shape], {"p": p, "train": True, "rng_site": seed % 7}, out_shape=shape)
    check_all(node, g, ratios, seed)
    assert all(PARTIAL not in r.inputs for r in op_rules(node, g))


def test_identity_cast_to_int_has_no_wrong_partial_rule() -> None:
    """`x.long()` is captured as identity{dtype: int64}; truncation does not distribute over addends."""
    node, g = one_op("identity", [(4, 6)], {"dtype": "int64"}, out_shape=(4, 6), dtype="int64")
    check_all(node, g, UNEVEN)


def test_unary_rule_shapes() -> None:
    relu, g = one_op("relu", [(4, 1, 3)])
    assert rule_set(relu, g) == {((FULL,), FULL), ((0,), 0), ((2,), 2)}  # the size-1 dim is never sharded
    neg, g = one_op("neg", [(4, 3)])
    assert ((PARTIAL,), PARTIAL) in rule_set(neg, g)
    for nonlinear in ("relu", "gelu", "exp", "tanh", "sigmoid", "silu"):
        n, g = one_op(nonlinear, [(4, 3)])
        assert all(PARTIAL not in r.inputs for r in op_rules(n, g)), nonlinear


# --- binary ops with broadcasting -------------------------------------------------------------


@st.composite
def broadcast_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out = draw(shapes(1, 4))
    operands = []
    for _ in range(2):
        rank = draw(st.integers(0, len(out)))
        tail = out[len(out) - rank:]
        operands.append(tuple(1 if draw(st.booleans()) and draw(st.booleans()) else s for s in tail))
    return operands[0], operands[1]


@SETTINGS
@given(op=st.sampled_from(["add", "sub", "mul", "div"]), pair=broadcast_pair(), ratios=ratios_st, seed=seeds)
def test_binary_broadcast_rules_hold(op: str, pair: tuple, ratios: list[float], seed: int) -> None:
    a, b = pair
    node, g = one_op(op, [a, b])
    check_all(node, g, ratios, seed)


@SETTINGS
@given(op=st.sampled_from(["add", "sub", "mul", "div"]), shape=shapes(), scalar=st.floats(0.5, 3.0),
       first=st.booleans(), ratios=ratios_st, seed=seeds)
def test_binary_scalar_rules_hold(op: str, shape: tuple[int, ...], scalar: float, first: bool, ratios: list[float], seed: int) -> None:
    node, g = one_op(op, [shape], {"scalar": scalar, "scalar_first": first})
    check_all(node, g, ratios, seed)


def test_binary_rule_shapes() -> None:
    add, g = one_op("add", [(4, 3), (3,)])
    rules = rule_set(add, g)
    assert ((0, FULL), 0) in rules  # the broadcast operand stays Full along dim 0
    assert ((1, 0), 1) in rules
    assert ((PARTIAL, PARTIAL), PARTIAL) in rules
    mul, g = one_op("mul", [(4, 3), (4, 3)])
    assert {((PARTIAL, FULL), PARTIAL), ((FULL, PARTIAL), PARTIAL)} <= rule_set(mul, g)
    assert ((PARTIAL, PARTIAL), PARTIAL) not in rule_set(mul, g)  # (a1+a2)(b1+b2) != a1 b1 + a2 b2
    div, g = one_op("div", [(4, 3), (4, 3)])
    assert ((FULL, PARTIAL), PARTIAL) not in rule_set(div, g)
    # scalars: x*s and x/s keep Partial; x+s, s-x and s/x do not
    for op, first, keeps in [("mul", False, True), ("mul", True, True), ("div", False, True), ("div", True, False),
                             ("add", False, False), ("sub", True, False), ("sub", False, False)]:
        n, g = one_op(op, [(4, 3)], {"scalar": 2.0, "scalar_first": first})
        assert (((PARTIAL,), PARTIAL) in rule_set(n, g)) is keeps, (op, first)


def test_checker_rejects_wrong_pointwise_rules() -> None:
    add_s, g = one_op("add", [(4, 6)], {"scalar": 2.0, "scalar_first": False})
    assert check_rule(add_s, g, OpRule("bogus", (PARTIAL,), PARTIAL), UNEVEN).ok is False  # adds 2.0 m times
    rdiv, g = one_op("div", [(4, 6)], {"scalar": 2.0, "scalar_first": True})
    assert check_rule(rdiv, g, OpRule("bogus", (PARTIAL,), PARTIAL), UNEVEN).ok is False
    relu, g = one_op("relu", [(4, 6)])
    assert check_rule(relu, g, OpRule("bogus", (PARTIAL,), PARTIAL), UNEVEN).ok is False
    mul, g = one_op("mul", [(4, 6), (4, 6)])
    assert check_rule(mul, g, OpRule("bogus", (PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False
    sub, g = one_op("sub", [(4, 6), (4, 6)])
    assert check_rule(sub, g, OpRule("bogus", (PARTIAL, FULL), PARTIAL), UNEVEN).ok is False  # subtracts y m times
    add, g = one_op("add", [(4, 6), (6,)])
    assert check_rule(add, g, OpRule("bogus", (0, FULL), PARTIAL), UNEVEN).ok is False  # slices are not addends


def test_cos_and_sin_are_not_linear() -> None:
    """RoPE's cos/sin tables: elementwise (any dim shards) but no Partial rule."""
    for op in ("cos", "sin"):
        node, g = one_op(op, [(3, 4)])
        assert all(PARTIAL not in r.inputs for r in op_rules(node, g))
        assert check_rule(node, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is False


@SETTINGS
@given(shape=shapes(1, 3), form=st.sampled_from(["tensors", "x-number", "y-number", "zero"]), ratios=ratios_st, seed=seeds)
def test_where_rules_hold(shape, form, ratios, seed) -> None:
    """where(cond, x, y) and masked_fill (a number for x): elementwise; Partial only with 0 or tensors."""
    numbers = {"tensors": (None, None), "x-number": (-1e9, None), "y-number": (None, 2.5), "zero": (0.0, None)}[form]
    tensors = [shape for v in numbers if v is None]
    node, g = one_op("where", [(shape[-1:], "bool")] + tensors, {"x": numbers[0], "y": numbers[1]}, out_shape=shape)
    check_all(node, g, ratios, seed)
    has_partial = any(r.output == PARTIAL for r in op_rules(node, g))
    assert has_partial == (form in ("tensors", "zero") and len(tensors) > 0)


def test_where_with_a_nonzero_number_is_not_partial() -> None:
    node, g = one_op("where", [((4, 3), "bool"), (4, 3)], {"x": -1e9, "y": None}, out_shape=(4, 3))
    assert check_rule(node, g, OpRule("partial", (FULL, PARTIAL), PARTIAL), UNEVEN).ok is False
