"""FFT rules (engine/theory/fft.py): `fft` over some dims of a real tensor or of a (re, im) pair, into a pair."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ._helpers import FULL, PARTIAL, SETTINGS, check_all, one_op, ratios_st, rule_set, seeds, shapes


@SETTINGS
@given(shape=shapes(1, 3, min_side=2), data=st.data(), ratios=ratios_st, seed=seeds)
def test_fft_rules_hold_on_real_and_pair_operands(shape: tuple[int, ...], data: st.DataObject, ratios: list[float],
                                                  seed: int) -> None:
    dims = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    pair, norm = data.draw(st.booleans()), data.draw(st.sampled_from(["backward", "ortho", "forward"]))
    attrs = {"dims": dims, "norm": norm, "inverse": data.draw(st.booleans()), "pair": pair}
    node, g = one_op("fft", [shape + (2,) if pair else shape], attrs)
    assert node.shape == shape + (2,)
    check_all(node, g, ratios, seed, min_rules=2)
    assert all(ins[0] not in dims and ins[0] < len(shape) for ins, _ in rule_set(node, g) if ins[0] >= 0)


def test_fft_rule_forms() -> None:
    """Every dim but the transformed ones and the (re, im) dim keeps its shards."""
    node, g = one_op("fft", [(4, 5, 6, 2)], {"dims": [1], "norm": "backward", "inverse": False, "pair": True})
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0), ((2,), 2)}
    node, g = one_op("fft", [(4, 5, 6)], {"dims": [1, 2], "norm": "ortho", "inverse": True, "pair": False})
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0)}
