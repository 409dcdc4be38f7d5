"""Normalisation rules (engine/theory/norm.py): `layer_norm` (with/without affine), `softmax`, `log_softmax`."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory import op_rules
from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


def _layer_norm(shape: tuple[int, ...], k: int, weight: bool, bias: bool):
    norm = list(shape[len(shape) - k:])
    operands = [shape] + [tuple(norm)] * (int(weight) + int(bias))
    attrs = {"normalized_shape": norm, "eps": 1e-5, "has_weight": weight, "has_bias": bias}
    return one_op("layer_norm", operands, attrs)


@SETTINGS
@given(shape=shapes(1, 4), data=st.data(), weight=st.booleans(), bias=st.booleans(), ratios=ratios_st, seed=seeds)
def test_layer_norm_rules_hold(shape: tuple[int, ...], data: st.DataObject, weight: bool, bias: bool,
                               ratios: list[float], seed: int) -> None:
    k = data.draw(st.integers(1, len(shape)))
    node, g = _layer_norm(shape, k, weight, bias)
    check_all(node, g, ratios, seed)
    free = len(shape) - k
    assert all(f < free for r in op_rules(node, g) for f in r.inputs[:1] if f >= 0), "normalised dims must stay whole"
    assert all(f == FULL for r in op_rules(node, g) for f in r.inputs[1:]), "weight and bias stay Full"


@SETTINGS
@given(op=st.sampled_from(["softmax", "log_softmax"]), shape=shapes(1, 4), data=st.data(), ratios=ratios_st, seed=seeds)
def test_softmax_rules_hold(op: str, shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    node, g = one_op(op, [shape], {"dim": dim})
    check_all(node, g, ratios, seed)
    assert dim not in {r.inputs[0] for r in op_rules(node, g)}, "softmax never shards its own dim"
    assert all(r.inputs[0] != PARTIAL for r in op_rules(node, g))


def test_layer_norm_rule_forms() -> None:
    node, g = _layer_norm((4, 5, 6), 1, True, True)
    assert rule_set(node, g) == {((FULL, FULL, FULL), FULL), ((0, FULL, FULL), 0), ((1, FULL, FULL), 1)}
    node, g = _layer_norm((4, 5, 6), 2, False, False)
    assert rule_set(node, g) == {((FULL,), FULL), ((0,), 0)}


def test_checker_rejects_wrong_norm_rules() -> None:
    sm, g = one_op("softmax", [(4, 6)], {"dim": 1})
    assert check_rule(sm, g, OpRule("own-dim", (1,), 1), UNEVEN).ok is False
    lsm, g = one_op("log_softmax", [(4, 6)], {"dim": 0})
    assert check_rule(lsm, g, OpRule("own-dim", (0,), 0), UNEVEN).ok is False
    ln, g = _layer_norm((4, 6), 1, True, True)
    # (a shard of a normalised dim cannot even run: F.layer_norm checks the normalised shape)
    assert check_rule(ln, g, OpRule("partial", (PARTIAL, FULL, FULL), PARTIAL), UNEVEN).ok is False
