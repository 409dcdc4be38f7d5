"""Convolution rules (engine/theory/conv.py): batch, output channels, input channels -> Partial."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds


def _conv(n: int, cin: int, cout: int, size: int, spatial: int, kernel: int, stride: int, padding: int,
          dilation: int = 1, groups: int = 1):
    x = (n, cin) + (size,) * spatial
    w = (cout, cin // groups) + (kernel,) * spatial
    attrs = {"stride": [stride] * spatial, "padding": [padding] * spatial, "dilation": [dilation] * spatial, "groups": groups}
    return one_op("conv", [x, w], attrs)


@SETTINGS
@given(n=st.integers(1, 4), cin=st.integers(1, 5), cout=st.integers(1, 5), spatial=st.integers(1, 3),
       kernel=st.integers(1, 3), stride=st.integers(1, 2), padding=st.integers(0, 1), dilation=st.integers(1, 2),
       ratios=ratios_st, seed=seeds)
def test_conv_rules_hold(n, cin, cout, spatial, kernel, stride, padding, dilation, ratios, seed) -> None:
    size = dilation * (kernel - 1) + 1 + 2  # room for at least one window
    node, g = _conv(n, cin, cout, size, spatial, kernel, stride, padding, dilation)
    check_all(node, g, ratios, seed)


@pytest.mark.parametrize("groups, per", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_grouped_conv_rules_hold(groups: int, per: int) -> None:
    node, g = _conv(4, groups * per, groups * 2, 5, 2, 3, 1, 1, groups=groups)
    check_all(node, g, UNEVEN)
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, FULL), 0), ((PARTIAL, FULL), PARTIAL)}


def test_conv_rule_forms() -> None:
    node, g = _conv(4, 3, 8, 6, 2, 3, 1, 1)
    assert node.shape == (4, 8, 6, 6)
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, FULL), 0), ((FULL, 0), 1), ((1, 1), PARTIAL),
                                 ((PARTIAL, FULL), PARTIAL)}


def test_checker_rejects_wrong_conv_rules() -> None:
    node, g = _conv(4, 10, 10, 10, 2, 3, 1, 1)  # equal sizes: linked dims split into 10 units
    for wrong in [OpRule("rows", (2, FULL), 2), OpRule("cols", (3, FULL), 3),  # windows cross shard borders
                  OpRule("in-as-full", (1, 1), FULL), OpRule("out-from-x", (1, FULL), 1)]:
        assert check_rule(node, g, wrong, UNEVEN).ok is False, wrong
