"""Attention rules (engine/theory/attention.py): `sdpa(q, k, v)` shards only its leading dims."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory import op_rules
from engine.theory.check import check_rule

from ._helpers import FULL, SETTINGS, UNEVEN, OpRule, check_all, dim_size, one_op, ratios_st, rule_set, seeds, shapes


def _sdpa(lead: tuple[int, ...], tq: int, tk: int, hs: int, hv: int, causal: bool, scale: float | None):
    return one_op("sdpa", [lead + (tq, hs), lead + (tk, hs), lead + (tk, hv)], {"is_causal": causal, "scale": scale})


@SETTINGS
@given(lead=shapes(1, 2), tq=dim_size, tk=dim_size, hs=dim_size, hv=dim_size, causal=st.booleans(),
       scale=st.sampled_from([None, 0.5]), ratios=ratios_st, seed=seeds)
def test_sdpa_rules_hold(lead: tuple[int, ...], tq: int, tk: int, hs: int, hv: int, causal: bool, scale: float | None,
                         ratios: list[float], seed: int) -> None:
    node, g = _sdpa(lead, tq, tk, hs, hv, causal, scale)
    assert node.shape == lead + (tq, hv)
    check_all(node, g, ratios, seed)
    for r in op_rules(node, g):
        if r.name == "queries":  # query rows split, keys and values whole: only without a causal mask
            assert not causal and r.inputs == (len(lead), FULL, FULL) and r.output == len(lead), str(r)
            continue
        assert all(f < len(lead) for f in r.inputs + (r.output,)), f"sdpa shards a non-leading dim: {r}"
        assert len(set(r.inputs)) == 1, f"q, k, v must share one form: {r}"


@SETTINGS
@given(batch=st.integers(1, 5), heads=st.integers(1, 4), t=dim_size, hs=dim_size, mask_batch=st.booleans(),
       mask_heads=st.booleans(), boolean=st.booleans(), ratios=ratios_st, seed=seeds)
def test_sdpa_with_a_mask_rules_hold(batch, heads, t, hs, mask_batch, mask_heads, boolean, ratios, seed) -> None:
    """A mask broadcast (size 1) along a dim stays Full when that dim is split; otherwise it is split too."""
    mask = ((batch if mask_batch else 1, heads if mask_heads else 1, t, t), "bool" if boolean else "float64")
    lead = (batch, heads)
    node, g = one_op("sdpa", [lead + (t, hs)] * 3 + [mask], {"is_causal": False, "scale": None},
                     out_shape=lead + (t, hs))
    results = check_all(node, g, ratios, seed)
    assert any("queries" in r.rule for r in results) or t < 2


def test_sdpa_rule_forms() -> None:
    node, g = _sdpa((2, 4), 8, 8, 8, 8, True, None)
    assert rule_set(node, g) == {((FULL,) * 3, FULL), ((0, 0, 0), 0), ((1, 1, 1), 1)}
    assert {r.name for r in op_rules(node, g)} == {"replicate", "batch", "heads"}
    bidirectional, g = _sdpa((2, 4), 8, 8, 8, 8, False, None)
    assert rule_set(bidirectional, g) == rule_set(node, g) | {((2, FULL, FULL), 2)}


def test_sdpa_mask_follows_the_split_dim_or_stays_full_where_broadcast() -> None:
    node, g = one_op("sdpa", [(4, 2, 6, 3)] * 3 + [((4, 1, 6, 6), "bool")], {"is_causal": False, "scale": None},
                     out_shape=(4, 2, 6, 3))
    assert rule_set(node, g) == {((FULL,) * 4, FULL), ((0, 0, 0, 0), 0), ((1, 1, 1, FULL), 1), ((2, FULL, FULL, 2), 2)}
    assert check_rule(node, g, OpRule("mask-full-on-batch", (0, 0, 0, FULL), 0), UNEVEN).ok is False


def test_checker_rejects_wrong_sdpa_rules() -> None:
    for causal in (False, True):
        node, g = _sdpa((2,), 6, 6, 4, 4, causal, None)
        assert check_rule(node, g, OpRule("sequence", (1, 1, 1), 1), UNEVEN).ok is False  # keys of other shards lost
        assert check_rule(node, g, OpRule("head-dim", (2, 2, 2), 2), UNEVEN).ok is False
        # queries split over devices, keys/values whole: right without a mask, wrong with the (local) causal mask
        assert check_rule(node, g, OpRule("queries", (1, FULL, FULL), 1), UNEVEN).ok is (not causal)
