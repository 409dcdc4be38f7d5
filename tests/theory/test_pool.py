"""Pooling rules (engine/theory/pool.py): max, average and adaptive average pooling, 1-3 spatial dims."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds


def _pool(op: str, lead: tuple[int, ...], size: int, spatial: int, kernel: int = 2, stride: int = 2,
          padding: int = 0, ceil_mode: bool = False, out: int = 2):
    x = lead + (size,) * spatial
    if op == "adaptive_avg_pool":
        attrs = {"spatial": spatial, "output_size": [out] * spatial}
    else:
        attrs = {"spatial": spatial, "kernel": [kernel] * spatial, "stride": [stride] * spatial,
                 "padding": [padding] * spatial, "ceil_mode": ceil_mode}
        attrs |= {"dilation": [1] * spatial} if op == "max_pool" else {"count_include_pad": True, "divisor_override": None}
    return one_op(op, [x], attrs)


@SETTINGS
@given(op=st.sampled_from(["max_pool", "avg_pool", "adaptive_avg_pool"]), lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       spatial=st.integers(1, 3), size=st.integers(3, 7), kernel=st.integers(1, 3), stride=st.integers(1, 3),
       ceil_mode=st.booleans(), out=st.integers(1, 3), ratios=ratios_st, seed=seeds)
def test_pool_rules_hold(op, lead, spatial, size, kernel, stride, ceil_mode, out, ratios, seed) -> None:
    node, g = _pool(op, tuple(lead), size, spatial, kernel, stride, kernel // 2, ceil_mode, out)
    check_all(node, g, ratios, seed)
    assert all(f < len(lead) for ins, _ in rule_set(node, g) for f in ins), "spatial dims stay whole"


def test_pool_rule_forms() -> None:
    mx, g = _pool("max_pool", (4, 6), 8, 2)
    assert rule_set(mx, g) == {((FULL,), FULL), ((0,), 0), ((1,), 1)}
    avg, g = _pool("avg_pool", (4, 6), 8, 2)
    assert rule_set(avg, g) == {((FULL,), FULL), ((0,), 0), ((1,), 1), ((PARTIAL,), PARTIAL)}
    ada, g = _pool("adaptive_avg_pool", (4, 6), 7, 2, out=3)
    assert ada.shape == (4, 6, 3, 3)
    assert rule_set(ada, g) == {((FULL,), FULL), ((0,), 0), ((1,), 1), ((PARTIAL,), PARTIAL)}


def test_checker_rejects_wrong_pool_rules() -> None:
    mx, g = _pool("max_pool", (2, 3), 8, 2, kernel=3, stride=2, padding=1)
    assert check_rule(mx, g, OpRule("rows", (2,), 2), UNEVEN).ok is False  # windows cross shard borders
    assert check_rule(mx, g, OpRule("partial", (PARTIAL,), PARTIAL), UNEVEN).ok is False  # max is not linear
    ada, g = _pool("adaptive_avg_pool", (2, 3), 9, 2, out=3)
    assert check_rule(ada, g, OpRule("rows", (2,), 2), UNEVEN).ok is False
