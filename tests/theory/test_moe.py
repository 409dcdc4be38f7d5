"""MoE gating and index rules (engine/theory/moe.py, index.py, opaque.py, comparisons in
pointwise.py), and every rule of a whole BERT-MoE layer on uneven expert splits."""
from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.model.graph import Graph
from engine.model.ops import run_node
from engine.theory import op_rules
from engine.theory.check import check_node, check_rule, describe

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


@SETTINGS
@given(shape=shapes(1, 3, min_side=2), data=st.data(), ratios=ratios_st, seed=seeds)
def test_topk_rules_hold(shape, data, ratios, seed) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(1, shape[dim]))
    for part in ("values", "indices"):
        out = shape[:dim] + (k,) + shape[dim + 1:]
        node, g = one_op(f"topk_{part}", [shape], {"k": k, "dim": dim, "largest": True, "sorted": True}, out_shape=out)
        check_all(node, g, ratios, seed)
        assert all(r.inputs[0] != dim for r in op_rules(node, g)), "the selected dim is never split"


@SETTINGS
@given(ids=shapes(1, 3), classes=st.integers(1, 6), ratios=ratios_st, seed=seeds)
def test_one_hot_rules_hold(ids, classes, ratios, seed) -> None:
    node, g = one_op("one_hot", [(ids, "int64")], {"num_classes": classes}, dtype="int64")
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(1, 3), data=st.data(), integer=st.booleans(), ratios=ratios_st, seed=seeds)
def test_cumsum_rules_hold(shape, data, integer, ratios, seed) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    node, g = one_op("cumsum", [(shape, "int64" if integer else "float64")], {"dim": dim}, dtype="int64" if integer else "float64")
    check_all(node, g, ratios, seed)
    assert ((PARTIAL,), PARTIAL) in rule_set(node, g)


@SETTINGS
@given(shape=shapes(1, 3), op=st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne", "pow"]), scalar=st.booleans(),
       ratios=ratios_st, seed=seeds)
def test_comparison_and_pow_rules_hold(shape, op, scalar, ratios, seed) -> None:
    if scalar or op == "pow":  # a tensor power of negative bases is NaN: pow is checked with an integer exponent
        node, g = one_op(op, [shape], {"scalar": 2 if op == "pow" else 0.25, "scalar_first": False})
    else:
        node, g = one_op(op, [shape, shape[-1:]])
    check_all(node, g, ratios, seed)
    assert all(PARTIAL not in r.inputs for r in op_rules(node, g)), "not linear: no Partial rule"


@SETTINGS
@given(rows=st.integers(1, 5), src=st.integers(1, 5), picks=st.integers(1, 5), ratios=ratios_st, seed=seeds)
def test_gather_rules_hold(rows, src, picks, ratios, seed) -> None:
    node, g = one_op("gather", [((rows, src), "float64"), ((rows, picks), "int64")], {"dim": 1})
    check_all(node, g, ratios, seed)


def test_arange_is_built_whole_and_opaque_ops_only_replicate() -> None:
    node, g = one_op("arange", [], {"start": 2, "end": 9, "step": 2}, dtype="int64")
    assert rule_set(node, g) == {((), FULL)} and run_node(node, g, [], node.shape).tolist() == [2, 4, 6, 8]
    attrs = {"target": "aten::flip.default", "args": [{"tensor": 0}, [1]], "kwargs": {}, "output_index": None}
    flip, g = one_op("opaque", [(3, 4)], attrs, out_shape=(3, 4))
    assert rule_set(flip, g) == {((FULL,), FULL)}
    check_all(flip, g, UNEVEN)


def test_checker_rejects_wrong_gating_rules() -> None:
    node, g = one_op("cumsum", [(6, 3)], {"dim": 0})
    assert check_rule(node, g, OpRule("scan-dim-split", (0,), 0), UNEVEN).ok is False  # needs each device's prefix
    node, g = one_op("topk_values", [(3, 6)], {"k": 2, "dim": 1, "largest": True, "sorted": True}, out_shape=(3, 2))
    assert check_rule(node, g, OpRule("selected-dim-split", (1,), 1), UNEVEN).ok is False
    node, g = one_op("one_hot", [((4, 3), "int64")], {"num_classes": 5}, dtype="int64")
    assert check_rule(node, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is False
    node, g = one_op("lt", [(4, 3)], {"scalar": 0.0, "scalar_first": False})
    assert check_rule(node, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is False


MOE_SMALL = dict(layers=2, hidden=8, heads=2, ffn=12, vocab=20, seq_len=6, predictions=2, batch=4, experts=5)


@functools.cache
def moe_graph() -> Graph:
    return engine.load_model("zoo:bert_moe", **MOE_SMALL)


@settings(max_examples=4, deadline=None)  # a whole layer's rules per example: a few uneven splits suffice
@given(ratios=ratios_st, seed=seeds)
def test_every_rule_of_a_bert_moe_layer_holds_on_uneven_expert_splits(ratios, seed) -> None:
    g = moe_graph()
    moe = [n for n in g.nodes if not n.is_leaf and "ffn" in n.source and n.segment == 1]
    assert {"einsum", "topk_values", "one_hot", "cumsum"} <= {n.op for n in moe}
    results = [r for n in moe for r in check_node(n, g, ratios, seed)]
    assert all(r.ok for r in results), describe(results)


def test_expert_weights_can_be_split_by_whole_experts() -> None:
    g = moe_graph()
    w1 = next(n for n in g.parameters if n.attrs["target"].endswith("ffn.w1"))
    first = next(n for n in g.nodes if w1.id in n.inputs)
    assert first.op == "einsum" and ((0, 0), 0) in rule_set(first, g)


@SETTINGS
@given(rows=st.integers(1, 5), cols=st.integers(1, 4), picks=st.integers(1, 5), op=st.sampled_from(["index_add", "scatter_add"]),
       ratios=ratios_st, seed=seeds)
def test_combine_rules_hold(rows, cols, picks, op, ratios, seed) -> None:
    """Expert outputs summed back into their tokens: index_add over dim 0, scatter_add over dim 1."""
    if op == "index_add":
        node, g = one_op(op, [(rows, cols), ((picks,), "int64"), (picks, cols)], {"dim": 0})
    else:
        node, g = one_op(op, [(rows, cols + 1), ((rows, cols), "int64"), (rows, cols)], {"dim": 1})
    check_all(node, g, ratios, seed, min_rules=2)
    assert ((PARTIAL, FULL, PARTIAL), PARTIAL) in rule_set(node, g)


def test_combine_never_splits_the_summed_dim() -> None:
    node, g = one_op("index_add", [(6, 3), ((4,), "int64"), (4, 3)], {"dim": 0})
    assert rule_set(node, g) == {((FULL,) * 3, FULL), ((PARTIAL, FULL, PARTIAL), PARTIAL), ((1, FULL, 1), 1)}
    assert check_rule(node, g, OpRule("summed-dim", (0, FULL, 0), 0), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("index-partial", (PARTIAL, PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False


@SETTINGS
@given(shape=shapes(1, 3), bins=st.integers(1, 6), ratios=ratios_st, seed=seeds)
def test_histc_rules_hold(shape, bins, ratios, seed) -> None:
    node, g = one_op("histc", [shape], {"bins": bins, "min": -1.0, "max": 1.0}, out_shape=(bins,))
    check_all(node, g, ratios, seed)


def test_histc_of_a_data_range_is_replicated_only() -> None:
    node, g = one_op("histc", [(6, 2)], {"bins": 4, "min": 0.0, "max": 0.0}, out_shape=(4,))
    assert rule_set(node, g) == {((FULL,), FULL)}
    assert check_rule(node, g, OpRule("counts", (0,), PARTIAL), UNEVEN).ok is False
    fixed, g = one_op("histc", [(6, 2)], {"bins": 4, "min": -1.0, "max": 1.0}, out_shape=(4,))
    assert check_rule(fixed, g, OpRule("counts-as-full", (0,), FULL), UNEVEN).ok is False
