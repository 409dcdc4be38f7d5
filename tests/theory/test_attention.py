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
        assert all(f < len(lead) for f in r.inputs + (r.output,)), f"sdpa shards a non-leading dim: {r}"
        assert len(set(r.inputs)) == 1, f"q, k, v must share one form: {r}"


def test_sdpa_rule_forms() -> None:
    node, g = _sdpa((2, 4), 8, 8, 8, 8, True, None)
    assert rule_set(node, g) == {((FULL,) * 3, FULL), ((0, 0, 0), 0), ((1, 1, 1), 1)}
    assert {r.name for r in op_rules(node, g)} == {"replicate", "batch", "heads"}


def test_checker_rejects_wrong_sdpa_rules() -> None:
    for causal in (False, True):
        node, g = _sdpa((2,), 6, 6, 4, 4, causal, None)
        assert check_rule(node, g, OpRule("sequence", (1, 1, 1), 1), UNEVEN).ok is False  # keys of other shards lost
        assert check_rule(node, g, OpRule("head-dim", (2, 2, 2), 2), UNEVEN).ok is False
        # queries split over devices, keys/values whole: right without a mask, wrong with the (local) causal mask
        assert check_rule(node, g, OpRule("queries", (1, FULL, FULL), 1), UNEVEN).ok is (not causal)
