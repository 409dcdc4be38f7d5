"""Mask, position and label arithmetic (engine/theory/index.py): `full`, `constant`, `index`, `pad`."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.model.ops import run_node
from engine.theory import op_rules
from engine.theory.check import check_rule
from engine.theory.index import index_out_dim

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


def test_full_and_constant_are_built_whole() -> None:
    node, g = one_op("full", [], {"value": True, "shape": [2, 3]}, out_shape=(2, 3), dtype="bool")
    assert rule_set(node, g) == {((), FULL)} and run_node(node, g, [], node.shape).all()
    attrs = {"value": [[1, 2], [3, 4]], "shape": [2, 2], "target": "inner.lifted_tensor_0"}
    node, g = one_op("constant", [], attrs, out_shape=(2, 2), dtype="int64")
    assert rule_set(node, g) == {((), FULL)}
    assert run_node(node, g, [], node.shape).tolist() == [[1, 2], [3, 4]]
    scalar, g = one_op("constant", [], {"value": 4096, "shape": [], "target": "c"}, out_shape=(), dtype="int64")
    assert run_node(scalar, g, [], ()).item() == 4096


@SETTINGS
@given(x=shapes(2, 4, min_side=1), data=st.data(), ratios=ratios_st, seed=seeds)
def test_index_rules_hold(x, data, ratios, seed) -> None:
    """x[i0, i1, ...] with any pattern of indexed and whole dims, broadcasting index tensors."""
    slots = data.draw(st.lists(st.booleans(), min_size=1, max_size=len(x)).filter(any))
    bshape = data.draw(shapes(1, 2, max_side=4))
    idx = [(tuple(bshape[:k] + (1,) * 0 + bshape[k:]), "int64") for k in range(sum(slots))]
    node, g = one_op("index", [(x, "float64")] + idx, {"slots": slots})
    check_all(node, g, ratios, seed, min_rules=2)


def test_index_shards_the_dims_it_does_not_index() -> None:
    # the causal-mask pattern: mask[batch_idx (4,1,1,1), kv_idx (1,1,1,16)] -> (4,1,1,16)
    node, g = one_op("index", [((4, 16), "float64"), ((4, 1, 1, 1), "int64"), ((1, 1, 1, 16), "int64")],
                     {"slots": [True, True]})
    assert rule_set(node, g) == {((FULL, FULL, FULL), FULL), ((PARTIAL, FULL, FULL), PARTIAL)}
    # whole dims before, between and after the indexed ones land where torch puts them
    node, g = one_op("index", [((3, 5, 4, 2), "float64"), ((6,), "int64")], {"slots": [False, True]})
    assert node.shape == (3, 6, 4, 2) and {r.output for r in op_rules(node, g) if r.name == "rows"} == {0, 2, 3}
    node, g = one_op("index", [((3, 5, 4), "float64"), ((6,), "int64"), ((6,), "int64")], {"slots": [True, False, True]})
    assert node.shape == (6, 5) and index_out_dim([True, False, True], 1, 3, 2) == 1
    check_all(node, g, UNEVEN)
    wrong = OpRule("indexed-dim", (0, FULL), 0)
    node, g = one_op("index", [((6, 3), "float64"), ((4,), "int64")], {"slots": [True]})
    assert check_rule(node, g, wrong, UNEVEN).ok is False


@SETTINGS
@given(shape=shapes(1, 3), data=st.data(), ratios=ratios_st, seed=seeds)
def test_pad_rules_hold(shape, data, ratios, seed) -> None:
    n = data.draw(st.integers(1, len(shape)))
    pad = data.draw(st.lists(st.integers(0, 2), min_size=2 * n, max_size=2 * n))
    value = data.draw(st.sampled_from([0, -100, 1.5]))
    node, g = one_op("pad", [shape], {"pad": pad, "value": value})
    check_all(node, g, ratios, seed)
    assert (((PARTIAL,), PARTIAL) in rule_set(node, g)) == (value == 0)


def test_pad_keeps_padded_dims_whole() -> None:
    """The shifted labels of a causal LM: pad (0, 1) with -100 on the positions, then slice."""
    node, g = one_op("pad", [((4, 16), "int64")], {"pad": [0, 1], "value": -100}, dtype="int64")
    assert node.shape == (4, 17) and rule_set(node, g) == {((FULL,), FULL), ((0,), 0)}
    assert check_rule(node, g, OpRule("padded-dim", (1,), 1), UNEVEN).ok is False
    zero, g = one_op("pad", [(4, 6)], {"pad": [1, 1], "value": 0})
    assert check_rule(zero, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is True
    minus, g = one_op("pad", [(4, 6)], {"pad": [1, 1], "value": -100})
    assert check_rule(minus, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is False
